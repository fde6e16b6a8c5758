"""A job started by hand from ``plan --emit``'s scripts is a job ddpfab sees (real sshd, torchrun,
py-spy): each script starts the node's supervisor, the run is recorded at emit time, so ``ps`` lists
it, ``doctor`` shows its ranks' stacks and ``stop`` ends it on both nodes; a rank that crashes on
one node ends the other node's job too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod

from .helpers import REPO, ddpfab, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")


def emit(inventory: Path, tmp_path: Path, run_id: str, *args: str) -> Path:
    out = tmp_path / run_id
    res = ddpfab("plan", "-i", str(inventory), "--runs-dir", str(tmp_path / "runs"), "--run-id", run_id,
                 "--emit", str(out), *args, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"ddpfab: run {run_id} recorded" in res.stderr, res.stderr
    assert json.loads((tmp_path / "runs" / run_id / "manifest.json").read_text())["state"] == "detached"
    return out


def start_by_hand(out: Path, tmp_path: Path) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Each node's script over plain ssh, as the README says (output to a file each)."""
    started = {}
    for script in sorted(out.glob("rank*-*.sh")):
        node = script.stem.split("-", 1)[1]
        log = tmp_path / f"{out.name}-{node}.out"
        with script.open() as stdin, log.open("w") as stdout:
            started[node] = (subprocess.Popen(["ssh", "-F", "ssh_config", node, "sh -s"], cwd=out, stdin=stdin,
                                              stdout=stdout, stderr=subprocess.STDOUT), log)
    return started


def wait_for(what, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def test_ps_doctor_and_stop_see_a_job_started_by_hand(lab, inventory2, tmp_path):
    # the whole lab's inventory, limited to node1 and node2: the record keeps the limit, so stop and
    # logs reach those two only (they went to node3 too: "node3: absent", logs exit 1)
    every = tmp_path / "every.yml"
    every.write_text(labmod.render_inventory(lab, sys.executable))
    out = emit(every, tmp_path, "hand-1", "--no-check", "-l", "node1:node2", "tests/lab/scripts/tmux_ranks.py")
    assert "ddpfab ps`, `ddpfab stop hand-1`" in (out / "README.txt").read_text()
    started = start_by_hand(out, tmp_path)
    try:
        wait_for(lambda: all(f"rank {r} on {n} ready" in log.read_text()
                             for r, (n, (_, log)) in enumerate(sorted(started.items()))), 90,
                 "both nodes' ranks started: " + " | ".join(log.read_text()[-500:] for _, log in started.values()))
        common = ["-i", str(inventory2), "--runs-dir", str(tmp_path / "runs")]
        ps = ddpfab("ps", *common, "--json")
        assert ps.returncode == 0, ps.stdout + ps.stderr
        row = next(r for r in json.loads(ps.stdout)["runs"] if r["run_id"] == "hand-1")
        assert row["state"] == "running" and set(row["nodes"]) == {"node1", "node2"}, row
        doctor = ddpfab("doctor", "hand-1", "--runs-dir", str(tmp_path / "runs"), timeout=120)
        # every rank's stack, from the nodes (py-spy): both in the script's sleep
        assert "2 ranks in <module> (tmux_ranks.py:11): node1 rank 0; node2 rank 1" in doctor.stdout, \
            doctor.stdout + doctor.stderr
        logs = ddpfab("logs", "hand-1", "--runs-dir", str(tmp_path / "runs"))
        assert logs.returncode == 0 and "node3" not in logs.stdout + logs.stderr, logs.stdout + logs.stderr
        stop = ddpfab("stop", "hand-1", "--runs-dir", str(tmp_path / "runs"), timeout=60)
        assert stop.returncode == 0 and "node3" not in stop.stdout + stop.stderr, stop.stdout + stop.stderr
        for proc, _ in started.values():  # the scripts end with their jobs
            proc.wait(timeout=30)
    finally:
        for proc, _ in started.values():
            proc.kill()
    wait_no_processes(lab, timeout=10)
    for node, (_, log) in started.items():  # each terminal's last line says what ended it (not torchrun's traceback)
        last = log.read_text().rstrip("\n").splitlines()[-1]
        assert last == ("ddpfab-agent: run hand-1: this node's job was stopped from outside: SIGTERM to its "
                        "supervisor (`ddpfab stop hand-1`, or a kill) (exit 1)"), (node, log.read_text()[-1500:])


def test_a_rank_crash_on_one_node_ends_the_other(lab, inventory2, tmp_path):
    out = emit(inventory2, tmp_path, "hand-2", "--no-check", "--env", "CRASH_RANK=1",
               "tests/lab/scripts/crash_after_collective.py")
    started = start_by_hand(out, tmp_path)
    try:
        codes = {node: proc.wait(timeout=120) for node, (proc, _) in started.items()}
    finally:
        for proc, _ in started.values():
            proc.kill()
    texts = {node: log.read_text() for node, (_, log) in started.items()}
    assert codes["node2"] != 0 and "ValueError: bad batch shape (3, 4) on rank 1" in texts["node2"], texts
    assert texts["node2"].rstrip("\n").splitlines()[-1] == \
        "ddpfab-agent: run hand-2: this node's job failed: rank 1 (local rank 0) ended with exit 1 (exit 1)", texts
    assert codes["node1"] != 0, texts  # its rank lost its peer: node1's job ended too
    wait_no_processes(lab, timeout=10)
    ps = ddpfab("ps", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), "--json")
    row = next(r for r in json.loads(ps.stdout)["runs"] if r["run_id"] == "hand-2")
    assert row["state"] == "exited" and row["nodes"]["node2"]["exit_code"] not in (0, None), row
    assert REPO.exists()


def test_the_job_ends_on_a_node_whose_terminal_went_away(lab, inventory2, tmp_path):
    """A quiet job: node1's ssh is killed (the terminal gone, no output pending); its supervisor
    notices the hang-up and ends node1's job; node2's runs on until ``stop``."""
    out = emit(inventory2, tmp_path, "hand-3", "--no-check", "tests/lab/scripts/tmux_ranks.py")
    started = start_by_hand(out, tmp_path)
    common = ["-i", str(inventory2), "--runs-dir", str(tmp_path / "runs")]

    def states() -> dict:
        ps = ddpfab("ps", *common, "--json")
        row = next((r for r in json.loads(ps.stdout)["runs"] if r["run_id"] == "hand-3"), {"nodes": {}})
        return {n: s["state"] for n, s in row["nodes"].items()}

    try:
        wait_for(lambda: all(f"rank {r} on {n} ready" in log.read_text()
                             for r, (n, (_, log)) in enumerate(sorted(started.items()))), 90, "both ranks started")
        started["node1"][0].kill()
        wait_for(lambda: states().get("node1") not in (None, "running"), 30, "node1's job ended with its terminal")
        assert states()["node2"] == "running"
        assert ddpfab("stop", "hand-3", "--runs-dir", str(tmp_path / "runs"), timeout=60).returncode == 0
        started["node2"][0].wait(timeout=30)
    finally:
        for proc, _ in started.values():
            proc.kill()
    wait_no_processes(lab, timeout=10)
