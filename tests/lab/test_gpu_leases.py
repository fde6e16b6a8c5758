"""GPU leases on real lab hosts (issue 27): each host has a stand-in nvidia-smi reporting 4 GPUs
(``ddpfab lab up --gpus 4``; no GPU is there, the jobs run on gloo), the leases are real lease names
(abstract sockets) held by each node's supervisor in the host's network namespace.

- four launches at the same instant on the same nodes, no --master-port: each trains with only
  its own ranks and all four hold disjoint GPUs at the same time (seen on the node's lease table);
- a held GPU refuses a second job before anything starts, naming the holder (dry run too);
- SIGKILL of a job's supervisor releases its lease: the next job gets the GPUs;
- a GPU used by a process without a lease (nvidia-smi's compute apps) counts as busy and is named.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import SCRIPTS, ddpfab, host_sh, reports, start_ddpfab, wait_no_processes

SCRIPT = str(SCRIPTS / "lease_report.py")
NODES = ("node1", "node2")


@pytest.fixture(scope="module")
def glab(tmp_path_factory):
    """Two lab hosts with four stand-in GPUs each, for this module."""
    with own_lab(tmp_path_factory, "gpulab", hosts=2, subnet=extra_subnet(160), gpus=4) as the_lab:
        yield the_lab


@pytest.fixture
def inv(glab, tmp_path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(glab, sys.executable))
    return path


def leases_on(glab, name: str) -> dict[str, str]:
    """GPU -> the run id holding its lease on host *name* ("" when free), by the node program's
    own ``leases`` operation run there (what ps, check and the probe read)."""
    code = ("import json,sys; sys.path.insert(0, %r); from ddpfab.node import leases; "
            "print(json.dumps(leases.lease_state()))" % str(Path(__file__).resolve().parents[2]))
    res = host_sh(glab, name, f"{sys.executable} -c {json.dumps(code)}")
    assert res.returncode == 0, res.stderr
    return {g["gpu"]: (g["holder"] or {}).get("run_id", "?") if g["state"] == "leased" else "" for g in json.loads(res.stdout)}


def wait_leases_free(glab, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while any(run for n in NODES for run in leases_on(glab, n).values()):
        assert time.monotonic() < deadline, {n: leases_on(glab, n) for n in NODES}
        time.sleep(0.2)


def test_four_launches_at_once_get_disjoint_gpus_and_only_their_own_ranks(glab, inv, tmp_path):
    """Four jobs of one GPU per node started at the same instant, no --master-port: every job
    trains with world size 2 and the sum of its own two ranks; at a moment when all four hold
    their leases (each rank waits to see its node's four GPUs leased), the leases are four
    different GPUs held by the four jobs, and each job's CUDA_VISIBLE_DEVICES is its own lease."""
    procs = [start_ddpfab("run", "-i", str(inv), "--runs-dir", str(tmp_path / f"runs{i}"), "--run-id", f"four-{i}",
                          "--gpus-per-node", "1", "--env", "LEASE_MEET=4", "--env", "LEASE_HOLD=1", SCRIPT)
             for i in range(4)]
    outs = [p.communicate(timeout=500)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"job {i}:\n{out}"
    got = [reports(out) for out in outs]
    for i, rows in enumerate(got):
        assert sorted(r["rank"] for r in rows) == [0, 1], outs[i]
        assert {(r["world_size"], r["sum"], r["run_id"]) for r in rows} == {(2, 3.0, f"four-{i}")}, outs[i]
    assert len({rows[0]["master_port"] for rows in got}) == 4, "two jobs shared a master port"
    for host in NODES:
        mine = [r for rows in got for r in rows if r["hostname"] == host]
        assert sorted(r["cuda"] for r in mine) == ["0", "1", "2", "3"], mine  # one GPU each, all different
        for r in mine:
            # seen by this rank on its node while it held its lease: all four jobs at once
            assert r["met"] is not None, (f"{host}: four leases never held at once: {r}; every rank's "
                                          f"(run, host, started, met, ended): {[(r['run_id'], r['hostname'], r['start'], r['met_at'], r['end']) for rows in got for r in rows]}")
            assert sorted(r["met"].values()) == [f"four-{i}" for i in range(4)], r
            assert r["met"][r["cuda"]] == r["run_id"], r  # the GPU it was given is the one it holds
    wait_leases_free(glab)


def test_a_held_gpu_refuses_a_second_job_naming_the_holder(glab, inv, tmp_path):
    """A job holding 3 of 4 GPUs per node: a second job asking for 2 is refused before anything
    starts (its dry run too), naming node, GPUs and the holding run; one asking for 1 gets GPU 3."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--run-id", "holder", "--detach",
                 "--gpus-per-node", "3", "--env", "LEASE_HOLD=600", SCRIPT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        deadline = time.monotonic() + 90
        while any(sorted(leases_on(glab, n).values()) != ["", "holder", "holder", "holder"] for n in NODES):
            assert time.monotonic() < deadline, {n: leases_on(glab, n) for n in NODES}
            time.sleep(0.2)
        for dry in ((), ("--dry-run",)):
            res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--gpus-per-node", "2", *dry, SCRIPT,
                         timeout=300)
            assert res.returncode != 0, res.stdout
            for node in NODES:
                assert f"host {node}: 2 GPUs wanted, 1 free: GPU 0 leased by run holder (user root" in res.stderr, \
                    res.stderr
            assert "nothing was started" in res.stderr
        # check shows each node's leases (every user's), and does not judge them
        res = ddpfab("check", "-i", str(inv), "--fast", "--json", timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        shown = {r["node"]: r for r in json.loads(res.stdout)["results"] if r["check"] == "gpu_leases"}
        assert set(shown) == set(NODES), shown
        for node, r in shown.items():
            assert r["status"] == "pass" and r["found"].startswith("1 of 4 GPUs free; GPU 0 leased by run holder "
                                                                   "(user root"), r
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--gpus-per-node", "1", SCRIPT, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert {r["cuda"] for r in reports(res.stdout)} == {"3"}
    finally:
        ddpfab("stop", "-i", str(inv), "--runs-dir", str(runs), "holder", timeout=120)
    wait_leases_free(glab)


def test_sigkill_of_a_supervisor_releases_its_lease(glab, inv, tmp_path):
    """SIGKILL of a job's supervisors (nothing of ddpfab's runs after it to clean up): the kernel
    releases the flocks, and a job asking for all four GPUs starts at once."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--run-id", "victim", "--detach",
                 "--gpus-per-node", "4", "--env", "LEASE_HOLD=600", SCRIPT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        deadline = time.monotonic() + 90
        while any(set(leases_on(glab, n).values()) != {"victim"} for n in NODES):
            assert time.monotonic() < deadline, {n: leases_on(glab, n) for n in NODES}
            time.sleep(0.2)
        for node in NODES:
            kill = host_sh(glab, node, "kill -9 $(python3 -c \"import json; print(json.load(open("
                                       "'/root/.ddpfab/runs/victim/agent.json'))['agent_pid'])\")")
            assert kill.returncode == 0, kill.stderr
        for node in NODES:
            assert set(leases_on(glab, node).values()) == {""}, "a lease outlived its supervisor"
    finally:
        ddpfab("stop", "-i", str(inv), "--runs-dir", str(runs), "victim", timeout=120)  # its orphaned job
    wait_no_processes(glab, 30, names=NODES)
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--gpus-per-node", "4", "--nproc-per-node", "1",
                 SCRIPT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert {r["cuda"] for r in reports(res.stdout)} == {"0,1,2,3"}


def test_a_gpu_used_without_a_lease_is_busy_and_named(glab, inv, tmp_path):
    """A process nvidia-smi lists on GPU 0 of node1 (the stand-in's compute apps), no lease: a job
    wanting 4 GPUs is refused naming that pid; one wanting 3 gets GPUs 1-3 there."""
    start = host_sh(glab, "node1", "sleep 300 >/dev/null 2>&1 & echo $!")
    pid = int(start.stdout.strip())
    apps = f"{labmod.STAND_IN_CONF}/compute-apps"
    try:
        assert host_sh(glab, "node1", f"echo '0 {pid} other-tool' > {apps}").returncode == 0
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(tmp_path / "runs"), "--gpus-per-node", "4", SCRIPT,
                     timeout=300)
        assert res.returncode != 0
        assert f"host node1: 4 GPUs wanted, 3 free: GPU 0 busy without a lease: pid {pid} (other-tool)" in res.stderr, \
            res.stderr
        assert "host node2" not in res.stderr
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(tmp_path / "runs"), "--gpus-per-node", "3", SCRIPT,
                     timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert {r["hostname"]: r["cuda"] for r in reports(res.stdout)}["node1"] == "1,2,3"
    finally:
        host_sh(glab, "node1", f"rm -f {apps}; kill {pid}")


def queue_of(inv: Path) -> dict[str, dict]:
    res = ddpfab("queue", "-i", str(inv), "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return {j["run_id"]: j for j in json.loads(res.stdout)["jobs"]}


def test_wait_queues_in_arrival_order_and_starts_when_the_gpus_are_free(glab, inv, tmp_path):
    """A job holds all GPUs; a 4-GPU job and then a 1-GPU job wait with --wait, each showing its
    place and the holder; ddpfab queue lists all three. A waiting job is cancelled by ddpfab stop.
    When the holder stops, the 4-GPU job (first in line) starts, and the 1-GPU job
    only after it (it never jumped the queue of the larger job)."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--run-id", "hold", "--detach",
                 "--gpus-per-node", "4", "--env", "LEASE_HOLD=600", SCRIPT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    waiting = []
    try:
        for run_id, gpus in (("big", "4"), ("small", "1"), ("cancelled", "1")):
            waiting.append(start_ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--run-id", run_id, "--wait",
                                        "--gpus-per-node", gpus, "--env", "LEASE_HOLD=3", SCRIPT))
            deadline = time.monotonic() + 180
            while queue_of(inv).get(run_id, {}).get("state") != "waiting":
                assert time.monotonic() < deadline, queue_of(inv)
                time.sleep(0.5)
        jobs = queue_of(inv)
        assert jobs["hold"]["state"] == "running" and jobs["hold"]["nodes"] == {n: ["0", "1", "2", "3"] for n in NODES}
        assert jobs["big"]["nodes"] == {n: "place 1, wants 4" for n in NODES}
        assert jobs["small"]["nodes"] == {n: "place 2, wants 1" for n in NODES}
        assert {j["user"] for j in jobs.values()} == {"root"}
        res = ddpfab("stop", "-i", str(inv), "--runs-dir", str(runs), "cancelled", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        out = waiting[2].communicate(timeout=120)[0]
        assert waiting[2].returncode == 143 and "REPORT" not in out, out  # a stop from elsewhere: 128 + SIGTERM
        assert "the job was cancelled while it waited for GPUs (it never started)" in out and "failed" not in out, out
        assert "cancelled" not in queue_of(inv)
        released = time.time()
        res = ddpfab("stop", "-i", str(inv), "--runs-dir", str(runs), "hold", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        outs = [p.communicate(timeout=400)[0] for p in waiting[:2]]
    finally:
        for p in waiting:
            if p.poll() is None:
                p.kill()
    for p, out in zip(waiting, outs):
        assert p.returncode == 0, out
    big, small = reports(outs[0]), reports(outs[1])
    assert "waiting: place 1 in this node's queue; GPU 0 leased by run hold (user root" in outs[0], outs[0]
    assert "waiting: place 2 in this node's queue" in outs[1], outs[1]
    assert {r["cuda"] for r in big} == {"0,1,2,3"} and len(small) == 2
    assert min(r["start"] for r in big) > released  # (how soon: bench/, not a timed test)
    assert min(r["start"] for r in small) > max(r["end"] for r in big) - 0.5, (big, small)
    wait_leases_free(glab)
