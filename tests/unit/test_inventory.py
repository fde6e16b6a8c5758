"""Inventory loading through Ansible's API: formats, groups, ranges, vars, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpfab.hosts.inventory import InventoryError, load, parse_ssh_args
from ddpfab.planning.plan import Facts, RunOptions, make_plan

YAML = """
all:
  vars:
    ansible_user: trainer
    ddpfab_python: /opt/venv/bin/python
  children:
    gpus:
      hosts:
        gpu[1:3]:
      vars:
        ddpfab_nproc_per_node: 4
        ddpfab_workdir: "/home/{{ ansible_user }}/code"
    cpus:
      hosts:
        cpu1:
          ansible_host: 10.1.0.9
"""

INI = """
[gpus]
gpu[1:3]

[gpus:vars]
ddpfab_nproc_per_node=4
ddpfab_workdir=/home/{{ ansible_user }}/code

[cpus]
cpu1 ansible_host=10.1.0.9

[all:vars]
ansible_user=trainer
ddpfab_python=/opt/venv/bin/python
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_ini_with_groups_and_ranges_give_the_same_plan(tmp_path):
    y = load(write(tmp_path, "inv.yml", YAML), "gpus")
    i = load(write(tmp_path, "inv.ini", INI), "gpus")
    assert [n.name for n in y.nodes] == ["gpu1", "gpu2", "gpu3"]
    assert [(n.name, n.user, n.nproc, n.workdir, n.python) for n in y.nodes] == \
           [(n.name, n.user, n.nproc, n.workdir, n.python) for n in i.nodes]
    assert y.nodes[0].workdir == "/home/trainer/code"  # templated by Ansible
    facts = Facts(addresses={"gpu1": "10.0.0.1", "gpu2": "10.0.0.2", "gpu3": "10.0.0.3"}, master_port=29500,
                  cwd="/x")
    opts = RunOptions("train.py", run_id="same")
    py, pi = make_plan(y, opts, facts).to_dict(), make_plan(i, opts, facts).to_dict()
    py["inventory"] = pi["inventory"] = None
    assert py == pi


def test_all_group_is_every_host_in_inventory_order(tmp_path):
    c = load(write(tmp_path, "inv.yml", YAML))
    assert [n.name for n in c.nodes] == ["gpu1", "gpu2", "gpu3", "cpu1"]
    assert c.node("cpu1").host == "10.1.0.9" and c.node("cpu1").nproc is None
    assert c.node("gpu1").host == "gpu1"


def test_connection_vars_and_ssh_options(tmp_path):
    inv = write(tmp_path, "inv.yml", """
all:
  hosts:
    n1:
      ansible_host: 192.168.1.5
      ansible_port: 2222
      ansible_ssh_private_key_file: ~/.ssh/lab
      ansible_ssh_common_args: "-o UserKnownHostsFile=/etc/lab_known -o StrictHostKeyChecking=yes -F /etc/cfg"
      ddpfab_data_addr: 10.10.0.5
      ddpfab_master: "yes"
      ddpfab_gpus: 8
""")
    n = load(inv).nodes[0]
    assert (n.host, n.port, n.data_addr, n.master, n.gpus) == ("192.168.1.5", 2222, "10.10.0.5", True, 8)
    assert n.key_file.endswith("/.ssh/lab") and not n.key_file.startswith("~")
    assert n.ssh_options["userknownhostsfile"] == "/etc/lab_known"
    assert n.ssh_options["stricthostkeychecking"] == "yes"
    assert n.ssh_options["configfile"] == "/etc/cfg"


def test_parse_ssh_args_forms():
    assert parse_ssh_args("-oConnectTimeout=3 -o 'ProxyJump bastion' -p 2200") == {
        "connecttimeout": "3", "proxyjump": "bastion", "port": "2200"}
    with pytest.raises(InventoryError):
        parse_ssh_args("-o 'unclosed")


@pytest.mark.parametrize("text, message", [
    ("all:\n  hosts:\n    n1:\n      ddpfab_nproc_per_node: two\n", "must be an integer"),
    ("all:\n  hosts:\n    n1:\n      ddpfab_nproc_per_node: 0\n", "must be >= 1"),
    ("all:\n  hosts:\n    n1:\n      ansible_port: 99999\n", "1-65535"),
    ("all:\n  hosts:\n    n1:\n      ansible_port: abc\n", "must be an integer"),
    ("all:\n  hosts:\n    n1:\n      ddpfab_workdir: relative/dir\n", "absolute path"),
    ("all:\n  hosts:\n    n1:\n      ddpfab_data_addr: '$(reboot)'\n", "neither an IP"),
    ("all:\n  hosts:\n    n1:\n      ddpfab_master: true\n    n2:\n      ddpfab_master: true\n", "several hosts"),
    ("all:\n  hosts:\n    n1: {\n", "cannot be parsed"),
    ("", "has no hosts"),
])
def test_bad_inventories_raise_clear_errors(tmp_path, text, message):
    with pytest.raises(InventoryError, match=message) as info:
        load(write(tmp_path, "inv.yml", text))
    assert "inv.yml" in str(info.value) or "host n" in str(info.value)


def test_unknown_group_lists_the_groups(tmp_path):
    with pytest.raises(InventoryError, match=r"no group 'tpu' \(groups: .*gpus"):
        load(write(tmp_path, "inv.yml", YAML), "tpu")


def test_a_mistyped_inventory_file_name_is_matched_against_its_directory(tmp_path):
    """``-i inv.yaml`` beside an ``inv.yml`` was told to write ``inv.yaml,`` for a single host."""
    (tmp_path / "inv.yml").write_text("all:\n  hosts:\n    a:\n")
    with pytest.raises(InventoryError) as exc:
        load(str(tmp_path / "inv.yaml"))
    assert str(exc.value).endswith("inv.yaml: no such file or directory (did you mean 'inv.yml'?)"), exc.value
    assert "single host" not in str(exc.value)


def test_a_bare_host_name_keeps_the_single_host_hint_beside_a_file_like_it(tmp_path, monkeypatch):
    """``-i node1`` beside a node.py: a host, not a mistyped file (a review found the hint lost)."""
    (tmp_path / "node.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InventoryError) as exc:
        load("node1")
    assert "for a single host write node1," in str(exc.value) and "did you mean" not in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(InventoryError, match="no such file"):
        load(tmp_path / "absent.yml")


def test_documented_example_inventory_loads():
    example = Path(__file__).resolve().parents[2] / "inventory" / "example.yml"
    c = load(example, "gpus")
    assert [n.name for n in c.nodes] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert c.nodes[0].data_addr == "10.50.0.11" and c.nodes[0].host == "192.168.10.11"
    assert {n.nproc for n in c.nodes} == {8}


def test_a_mistyped_ddpfab_variable_is_named_with_what_it_likely_meant_and_nothing_else_is(tmp_path, capsys):
    inv = write(tmp_path, "inv.yml", """
all:
  vars:
    ddpfab_pyhton: /opt/venv/bin/python
    ddpfab_firewall_ports: [29500]
  hosts:
    n1: {ddpfab_firewall_prots: [1], ddpfab_workdir: /w}
    n2: {}
""")
    cluster = load(str(inv))
    assert [n.unknown_vars for n in cluster.nodes] == [("ddpfab_firewall_prots", "ddpfab_pyhton"), ("ddpfab_pyhton",)]
    assert cluster.nodes[0].python == "python3"  # the typo has no effect: the warning says so
    assert cluster.warnings == [
        f"inventory {inv}: ddpfab_firewall_prots (set for n1) is not a variable ddpfab or its roles read "
        "(did you mean ddpfab_firewall_ports?); it has no effect",
        f"inventory {inv}: ddpfab_pyhton (set for n1, n2) is not a variable ddpfab or its roles read "
        "(did you mean ddpfab_python?); it has no effect"]
    assert load(str(inv)).warnings == cluster.warnings  # the cached load keeps them
    # ddpfab's own variables, the roles' (a role option, a playbook's) and other names: no warning
    quiet = write(tmp_path, "quiet.yml", """
all:
  vars: {ddpfab_python_venv: /opt/v, ddpfab_gpu_required: true, ddpfab_timesync_servers: [t], my_var: 1}
  hosts:
    n1: {ddpfab_python: /opt/v/bin/python, ddpfab_env: {A: "1"}}
""")
    assert load(str(quiet)).warnings == []
    # the command line shows them as warnings and goes ahead
    from ddpfab import cli
    assert cli.main(["plan", "-i", str(inv), "--master-port", "29500", "--offline", "t.py"]) in (0, 2)
    err = capsys.readouterr().err
    assert "ddpfab: warning: inventory" in err and "did you mean ddpfab_python?" in err


def test_a_parse_error_names_the_file_and_line_even_inside_a_directory(tmp_path):
    """An inventory directory with one broken file: the error named the directory alone."""
    (tmp_path / "inv").mkdir()
    write(tmp_path, "inv/good.yml", "all:\n  hosts:\n    n1: {}\n")
    write(tmp_path, "inv/bad.yml", "all:\n  hosts:\n    n2: {ansible_host: [\n")
    with pytest.raises(InventoryError, match=r"cannot be parsed.*at .*inv/bad\.yml line \d+"):
        load(tmp_path / "inv")
