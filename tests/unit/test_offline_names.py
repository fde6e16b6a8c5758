"""Host names work everywhere IPs do (issue 24): `run --dry-run --offline` and `plan --offline
--emit` of a host list, a hostfile and an INI range of names resolve them as the real run will
(ssh_config HostName, then the controller's resolver) and keep, marked, the ones they could not;
the real run's rule (an IP literal every peer reaches) is unchanged.

Names under ``.invalid`` never resolve (RFC 6761), whatever the machine's resolver knows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpfab import cli
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.planning.plan import Facts, Plan, PlanError, RunOptions, make_plan


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DDPFAB_INVENTORY", raising=False)
    monkeypatch.setenv("DDPFAB_CONFIG", "")
    monkeypatch.chdir(tmp_path)
    # the script the plans name: a dry run refuses a missing one, as the real run would
    (tmp_path / "t.py").write_text("print('train')\n")


def nodes(*names: str) -> tuple[Node, ...]:
    return tuple(Node(name=n, host=n, data_addr=n) for n in names)


def test_an_offline_plan_keeps_an_unresolved_master_as_a_marked_name_the_real_rule_refuses_it():
    cluster = Inventory("a.invalid,b.invalid,", "all", nodes("a.invalid", "b.invalid"))
    addresses = {"a.invalid": "a.invalid", "b.invalid": "10.0.0.2"}
    plan = make_plan(cluster, RunOptions("t.py"), Facts(addresses, 29500, "/w", unresolved=("a.invalid",)))
    assert (plan.master_addr, plan.unresolved) == ("a.invalid", ("a.invalid",))
    assert "the master address 'a.invalid' is a name each node resolves itself" in plan.unresolved_note()
    assert Plan.from_json(plan.to_json()) == plan  # recorded and read back as data
    # the real run's facts never mark a name: then it is refused as before
    with pytest.raises(PlanError, match="master address 'a.invalid' is not an IP literal"):
        make_plan(cluster, RunOptions("t.py"), Facts(addresses, 29500, "/w"))
    # a resolved master is an IP literal, and a plan without names says nothing about them
    resolved = make_plan(cluster, RunOptions("t.py"), Facts({"a.invalid": "10.0.0.1", "b.invalid": "10.0.0.2"},
                                                            29500, "/w"))
    assert (resolved.master_addr, resolved.unresolved, resolved.unresolved_note()) == ("10.0.0.1", (), "")
    assert "unresolved" not in resolved.to_dict()  # a real run's plan and manifest are as before
    # marked or not, a word that is no address at all never reaches torchrun's command line
    with pytest.raises(PlanError, match="not an IP literal"):
        make_plan(cluster, RunOptions("t.py"), Facts({**addresses, "a.invalid": "-oProxy=x"}, 29500, "/w",
                                                     unresolved=("a.invalid",)))


def _inventories(tmp_path: Path) -> dict[str, str]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu01.invalid slots=2\ngpu02.invalid slots=2\n")
    ini = tmp_path / "hosts.ini"
    ini.write_text("[gpus]\ngpu[01:03].invalid\n")
    return {"host list": "node1.invalid,node2.invalid,", "hostfile": str(hostfile), "INI range": str(ini)}


@pytest.mark.parametrize("kind", ["host list", "hostfile", "INI range"])
def test_run_dry_run_offline_of_names_succeeds_and_says_which_did_not_resolve(tmp_path, capsys, kind):
    source = _inventories(tmp_path)[kind]
    assert cli.main(["run", "-i", source, "--dry-run", "--offline", "--json", "t.py"]) == 0
    plan = json.loads(capsys.readouterr().out)
    names = [n["name"] for n in plan["nodes"]]
    assert plan["unresolved"] == names and plan["master_addr"] == names[0]
    assert [n["data_addr"] for n in plan["nodes"]] == names
    assert cli.main(["run", "-i", source, "--dry-run", "--offline", "t.py"]) == 0
    out = capsys.readouterr().out
    assert f"# unresolved: {', '.join(names)} did not resolve on this controller" in out
    assert f"--master-addr={names[0]} " in out


@pytest.mark.parametrize("kind", ["host list", "hostfile", "INI range"])
def test_plan_offline_emit_of_names_writes_scripts_that_say_so(tmp_path, capsys, kind):
    source = _inventories(tmp_path)[kind]
    out_dir = tmp_path / "emitted"
    assert cli.main(["plan", "-i", source, "--offline", "--emit", str(out_dir), "t.py"]) == 0
    readme = (out_dir / "README.txt").read_text()
    assert "unresolved:" in readme and "kept as names" in readme
    scripts = sorted(out_dir.glob("rank*.sh"))
    assert len(scripts) == {"host list": 2, "hostfile": 2, "INI range": 3}[kind]
    first = scripts[0].read_text()
    master = first.split("--master-addr=")[1].split()[0]
    assert master.endswith(".invalid") and "# unresolved:" in first
    assert all(f"--master-addr={master} " in s.read_text() for s in scripts)


def test_ssh_config_hostname_decides_a_names_address_offline_as_online(tmp_path, capsys):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu01.invalid\n  HostName 10.9.9.1\nHost gpu02.invalid\n  HostName localhost\n")
    ini = _inventories(tmp_path)["INI range"]
    assert cli.main(["run", "-i", ini, "--ssh-config", str(cfg), "--dry-run", "--offline", "--json", "t.py"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # HostName an IP: that IP; HostName a name: the controller's resolver on it; no HostName: kept, marked
    assert [n["data_addr"] for n in plan["nodes"]] == ["10.9.9.1", "127.0.0.1", "gpu03.invalid"]
    assert plan["master_addr"] == "10.9.9.1" and plan["unresolved"] == ["gpu03.invalid"]
    # an explicit ddpfab_data_addr is the user's word, not replaced by the ssh route
    assert cli.main(["run", "-i", ini, "--ssh-config", str(cfg), "-e", "ddpfab_data_addr=10.7.7.7",
                     "--dry-run", "--offline", "--json", "t.py"]) == 0
    assert json.loads(capsys.readouterr().out)["master_addr"] == "10.7.7.7"


def test_a_loopback_master_from_a_resolved_name_is_still_refused(tmp_path, capsys):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu01.invalid\n  HostName localhost\n")
    assert cli.main(["run", "-i", _inventories(tmp_path)["INI range"], "--ssh-config", str(cfg),
                     "--dry-run", "--offline", "t.py"]) == 2
    assert "a loopback address the other nodes cannot reach" in capsys.readouterr().err
