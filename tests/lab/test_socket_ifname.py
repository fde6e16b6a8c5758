"""``--socket-ifname IFACE`` on real lab hosts: a name the hosts lack (or have down) is refused by
the run and by its dry run before anything starts, naming every node and the interfaces it has;
the hosts' real interface still runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddpfab import lab as labmod

from .helpers import ddpfab, host_sh, job_processes, reports

REPORT_ENV = "tests/lab/scripts/report_env.py"
NODES = ("node1", "node2", "node3")
pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def inventory3(lab, tmp_path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(lab, sys.executable, names=list(NODES)))
    return path


def real_ifname(lab, name: str) -> str:
    """The interface that holds host *name*'s lab address, as ``ip`` inside the host says."""
    out = host_sh(lab, name, "ip -o -4 addr show").stdout
    (dev,) = [line.split()[1] for line in out.splitlines() if f" {lab.host(name).address}/" in line]
    return dev


def node_records(lab) -> dict[str, set[str]]:
    """The run records on each node (the session lab is shared: other tests' records are there)."""
    return {name: set(host_sh(lab, name, "ls -A ~/.ddpfab/runs 2>/dev/null").stdout.split()) for name in NODES}


def assert_nothing_started(lab, tmp_path: Path, before: dict[str, set[str]]) -> None:
    assert job_processes(lab) == {n: [] for n in NODES}
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert node_records(lab) == before  # no run record on any node either


def test_an_interface_the_nodes_lack_is_refused_before_anything_starts(lab, inventory3, tmp_path):
    before = node_records(lab)
    ifname = real_ifname(lab, "node1")
    runs = ("--runs-dir", str(tmp_path / "runs"))
    res = ddpfab("run", "-i", str(inventory3), *runs, "--socket-ifname", "nosuchif0", REPORT_ENV, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    for name in NODES:
        addr = lab.host(name).address
        assert (f"host {name}: --socket-ifname nosuchif0: no interface nosuchif0; it has lo (127.0.0.1"
                in res.stderr), res.stderr
        assert f"{ifname} ({addr}" in res.stderr.split(f"host {name}: ", 1)[1].splitlines()[0]
    assert f"use --socket-ifname auto (which chooses {ifname}), or name one of its interfaces: {ifname}" in res.stderr
    assert_nothing_started(lab, tmp_path, before)

    dry = ddpfab("run", "-i", str(inventory3), *runs, "--dry-run", "--json", "--socket-ifname", "nosuchif0",
                 REPORT_ENV, timeout=60)
    assert dry.returncode == 2, dry.stdout + dry.stderr
    problems = json.loads(dry.stdout)["problems"]
    assert [(p["node"], p["check"]) for p in problems] == [(n, "socket_ifname") for n in NODES]
    assert all(p["found"].startswith("no interface nosuchif0; it has lo (127.0.0.1") for p in problems)
    assert_nothing_started(lab, tmp_path, before)


def test_an_interface_that_is_down_on_a_node_is_refused_there(lab, inventory3, tmp_path):
    before = node_records(lab)
    add = host_sh(lab, "node2", "ip link add side0 type veth peer name side1")  # a new link is down
    assert add.returncode == 0, add.stderr
    try:
        res = ddpfab("plan", "-i", str(inventory3), "--json", "--socket-ifname", "side0", REPORT_ENV, timeout=60)
    finally:
        host_sh(lab, "node2", "ip link del side0")
    assert res.returncode == 2, res.stdout + res.stderr
    problems = json.loads(res.stdout)["problems"]
    assert [p["node"] for p in problems] == list(NODES)  # in inventory order
    found = {p["node"]: p["found"] for p in problems}
    assert found["node2"].startswith("side0 is down;") and "side0 (down)" in found["node2"]
    assert found["node1"].startswith("no interface side0;")
    assert_nothing_started(lab, tmp_path, before)


def test_the_hosts_real_interface_still_runs(lab, inventory2, tmp_path):
    ifname = real_ifname(lab, "node1")
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), "--socket-ifname", ifname,
                 "--env", "REPORT_ENV_KEYS=GLOO_SOCKET_IFNAME,NCCL_SOCKET_IFNAME", REPORT_ENV, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert len(got) == 2 and {json.dumps(r["env"], sort_keys=True) for r in got} == {
        json.dumps({"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}, sort_keys=True)}
