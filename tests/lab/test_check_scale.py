"""`ddpfab check` at 32 hosts on a loaded machine: right (a healthy lab passes, every time) and
readable (one node whose firewall drops the members is named, alone, in a line or two).

The load is real: a CPU hog per core on the controller's machine, which every lab host shares. The
lab is this module's own (32 hosts, a subnet of its own inside the session's /16)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

from ddpfab import lab as labmod

from .conftest import extra_subnet
from .helpers import assert_no_leftovers, ddpfab

HOSTS = 32
SUBNET = os.environ.get("DDPFAB_SCALE_SUBNET", extra_subnet(140))


@pytest.fixture(scope="module")
def lab32(tmp_path_factory):
    lab_dir = tmp_path_factory.mktemp("lab32")
    the_lab, _ = labmod.up(lab_dir, hosts=HOSTS, subnet=SUBNET)
    try:
        (lab_dir / "inventory32.yml").write_text(labmod.render_inventory(the_lab, sys.executable))
        yield the_lab
    finally:
        labmod.down(lab_dir)


@contextmanager
def cpu_hog():
    """One busy process per core for the duration (ended by its own pid)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@contextmanager
def drop_members(lab, host: str):
    """INPUT drops TCP from the lab's members (ssh and loopback still accepted): the faulty node."""
    rules = [["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
             ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
             ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
             ["-A", "INPUT", "-s", lab.subnet, "-p", "tcp", "-j", "DROP"]]
    for r in rules:
        lab.netns_exec(host, ["iptables", *r], check=True)
    try:
        yield
    finally:
        lab.netns_exec(host, ["iptables", "-F", "INPUT"], check=True)


def test_check_passes_on_a_healthy_32_host_lab_three_times_under_load(lab32):
    inv = str(lab32.dir / "inventory32.yml")
    with cpu_hog():
        for attempt in range(3):
            res = ddpfab("check", "-i", inv, "--fast", timeout=300)
            assert res.returncode == 0, f"check {attempt + 1} of 3 failed on a healthy lab:\n{res.stdout}{res.stderr}"
            assert "all checks passed on 32 nodes" in res.stdout
            assert "992 of 992 pairs probed (exhaustive" in res.stdout
    assert_no_leftovers(lab32)


def test_one_firewalled_node_is_named_alone_in_a_short_grouped_message(lab32):
    inv = str(lab32.dir / "inventory32.yml")
    with cpu_hog(), drop_members(lab32, "node17"):
        res = ddpfab("check", "-i", inv, "--fast", timeout=300)
    print(res.stdout)
    assert res.returncode == 1, res.stdout + res.stderr
    fails = [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, fails
    assert fails[0].startswith("FAIL host node17: mesh: unreachable from 31 peers (timed out)")
    assert "firewall" in fails[0]
    others = [f"node{i}" for i in range(1, HOSTS + 1) if i != 17]
    assert not any(name in fails[0].replace("node17", "") for name in others)
    # the table folds identical rows: the whole output stays a screenful at 32 nodes
    assert len(res.stdout.splitlines()) <= 10, res.stdout
    assert_no_leftovers(lab32)


def test_stop_and_logs_answer_32_nodes_in_a_line_per_distinct_answer(lab32, tmp_path):
    """`stop` of a run every node has a record of (its supervisor gone), and `logs` of it (a run
    dir, no output): 32 identical answers are one line naming node[1-32], not 32 lines (up to 16
    nodes each keeps its own line). A stop, or logs, of a run no node knows is one error line."""
    inv = str(lab32.dir / "inventory32.yml")
    run_id = "20260101-000000-abcdef"
    stop = ddpfab("stop", run_id, "-i", inv, "--runs-dir", str(tmp_path / "runs"), timeout=300)
    assert stop.returncode == 2 and not stop.stdout and len(stop.stderr.splitlines()) == 1, stop.stdout + stop.stderr
    assert stop.stderr.startswith(f"ddpfab: error: no run {run_id}: "), stop.stderr
    known = "20260101-000000-fedcba"  # a record on every node whose supervisor (pid 1: the host's init) is not it
    record = f'{{"run_id": "{known}", "agent_pid": 1, "started": 1.0}}'
    assert ddpfab("exec", "-i", inv, "--", f"mkdir -p ~/.ddpfab/runs/{known} && "
                  f"echo '{record}' > ~/.ddpfab/runs/{known}/agent.json", timeout=300).returncode == 0
    stop = ddpfab("stop", known, "-i", inv, "--runs-dir", str(tmp_path / "runs"), timeout=300)
    assert stop.returncode == 0 and stop.stdout == "node[1-32] (32 nodes): not running\n", stop.stdout + stop.stderr
    # logs of the unknown run: no run, said once; of the known one (a run dir, no output): one folded line
    logs = ddpfab("logs", run_id, "-i", inv, "--runs-dir", str(tmp_path / "runs"), timeout=300)
    assert logs.returncode == 2 and not logs.stdout and len(logs.stderr.splitlines()) == 1, logs.stdout + logs.stderr
    assert logs.stderr.startswith(f"ddpfab: error: no run {run_id}: "), logs.stderr
    logs = ddpfab("logs", known, "-i", inv, "--runs-dir", str(tmp_path / "runs"), timeout=300)
    assert logs.returncode == 1 and not logs.stdout, logs.stdout + logs.stderr
    errors = logs.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("ddpfab: error: host node[1-32] (32 nodes): "), logs.stderr
    assert f"no output of run {known} there" in errors[0]  # the answer itself is kept: which run's output is missing
    assert_no_leftovers(lab32)
