"""The parsed-inventory cache: Ansible's answer reused only while nothing it read has changed."""

from __future__ import annotations

import stat

import pytest

from ddpfab.hosts import invcache, inventory

INV = """
all:
  hosts:
    a:
      ansible_host: 10.0.0.1
    b:
      ansible_host: 10.0.0.2
  vars:
    ddpfab_nproc_per_node: 2
"""


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DDPFAB_INVENTORY_CACHE", raising=False)
    return tmp_path / "cache" / "ddpfab" / "inventory"


@pytest.fixture
def ansible_calls(monkeypatch):
    """Count the real parses (Ansible's InventoryManager still does them)."""
    calls = []
    real = inventory._load_with_ansible

    def counted(path, group, *selection):
        calls.append(str(path))
        return real(path, group, *selection)

    monkeypatch.setattr(inventory, "_load_with_ansible", counted)
    return calls


def test_second_load_comes_from_the_cache_and_equals_ansibles(tmp_path, cache_home, ansible_calls):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV)
    first = inventory.load(inv)
    second = inventory.load(inv)
    assert first == second and [n.host for n in second.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert second.nodes[0].nproc == 2
    assert len(ansible_calls) == 1
    entries = list(cache_home.glob("*.json"))
    assert len(entries) == 1
    assert stat.S_IMODE(cache_home.stat().st_mode) == 0o700
    assert stat.S_IMODE(entries[0].stat().st_mode) == 0o600


def test_an_edit_of_the_same_size_is_seen(tmp_path, ansible_calls):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV)
    assert inventory.load(inv).nodes[0].host == "10.0.0.1"
    inv.write_text(INV.replace("10.0.0.1", "10.0.0.7"))  # same size, likely the same mtime tick
    assert inventory.load(inv).nodes[0].host == "10.0.0.7"
    assert len(ansible_calls) == 2


def test_group_vars_next_to_the_inventory_are_part_of_the_key(tmp_path, ansible_calls):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV.replace("  vars:\n    ddpfab_nproc_per_node: 2\n", ""))
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text("ddpfab_nproc_per_node: 3\n")
    assert inventory.load(inv).nodes[0].nproc == 3
    (tmp_path / "group_vars" / "all.yml").write_text("ddpfab_nproc_per_node: 5\n")
    assert inventory.load(inv).nodes[0].nproc == 5
    assert inventory.load(inv).nodes[0].nproc == 5
    assert len(ansible_calls) == 2


def test_templated_inventories_are_always_parsed(tmp_path, ansible_calls, monkeypatch):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV.replace("10.0.0.1", "\"{{ lookup('env', 'ADDR') }}\""))
    monkeypatch.setenv("ADDR", "10.9.9.1")
    assert inventory.load(inv).nodes[0].host == "10.9.9.1"
    monkeypatch.setenv("ADDR", "10.9.9.2")  # no file changed, the answer did
    assert inventory.load(inv).nodes[0].host == "10.9.9.2"
    assert len(ansible_calls) == 2
    assert invcache.key(inv, "all") is None


def test_ansible_settings_and_the_switch_change_the_key(tmp_path, monkeypatch):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV)
    plain = invcache.key(inv, "all")
    assert plain is not None and invcache.key(inv, "gpus") != plain
    monkeypatch.setenv("ANSIBLE_INVENTORY_ENABLED", "ini")
    assert invcache.key(inv, "all") != plain
    monkeypatch.setenv("DDPFAB_INVENTORY_CACHE", "0")
    assert invcache.key(inv, "all") is None


def test_errors_are_not_cached(tmp_path, ansible_calls):
    inv = tmp_path / "inv.yml"
    inv.write_text(INV.replace("ddpfab_nproc_per_node: 2", "ddpfab_nproc_per_node: zero"))
    for _ in range(2):
        with pytest.raises(inventory.InventoryError, match="must be an integer"):
            inventory.load(inv)
    assert len(ansible_calls) == 2
