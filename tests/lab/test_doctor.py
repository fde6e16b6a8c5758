"""A live hang explained (issue 25, section 2), on a real 4-node lab, 2 gloo ranks a node.

- One rank stopped with SIGSTOP mid-training: ``ddpfab run --hang-timeout 20 --on-hang stop`` prints,
  within 60 s of the stop, a verdict naming that host and rank as stopped and the other 7 ranks as
  waiting in all_reduce, with their stacks (py-spy), and ends the job (exit 124), nothing left.
- The same on a detached job, by ``ddpfab doctor RUN_ID``; its record saved in the run's dir.
- One rank calling broadcast while the others all_reduce: named as the odd one out.
- ``ddpfab attach`` reports a node whose ranks finished and then aborted at exit as run does.
- On the session's lab, 2 ranks (2 hosts x 1 process): rank 1 sleeps in its own code while rank 0
  waits for it in all_reduce. ``ddpfab doctor`` exits 1 naming rank 1 (node, global and local rank,
  its frame); ``run --hang-timeout 10 --on-hang stop`` ends 124, its closing line naming rank 1, the
  stacks printed once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod
from ddpfab.launch.hangwatch import EXIT_HUNG

from .conftest import extra_subnet, own_lab
from .helpers import assert_no_leftovers, ddpfab, host_sh, start_ddpfab

SCRIPT = "tests/lab/scripts/hang_train.py"
DRILL = "tests/lab/scripts/exit_abort_drill.py"


@pytest.fixture(scope="module")
def lab4(tmp_path_factory):
    with own_lab(tmp_path_factory, "doctor4", hosts=4, subnet=extra_subnet(170)) as the_lab:
        yield the_lab


@pytest.fixture
def inventory4(lab4, tmp_path) -> Path:
    path = tmp_path / "inventory4.yml"
    path.write_text(labmod.render_inventory(lab4, sys.executable))
    yield path
    assert_no_leftovers(lab4)


class Lines:
    """A running ddpfab's output, line by line, each with the time it came."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n" + self.text()[-4000:])

    def when(self, needle: str) -> float:
        return next(t for t, line in self.lines if needle in line)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


#: One or more call sites of the script in a verdict: "(hang_train.py:24)", "(hang_train.py:24, hang_train.py:29)".
SITES = r"\(hang_train\.py:\d+(, hang_train\.py:\d+)*\)"


def waiting_groups(out: str) -> dict[str, set[int]]:
    """node -> its ranks, over every printed stack group in all_reduce ("-- N ranks in all_reduce
    (hang_train.py:L): node1 ranks 0, 1; node3 rank 4")."""
    found: dict[str, set[int]] = {}
    for m in re.finditer(r"-- \d+ ranks? in all_reduce \(hang_train\.py:\d+\): (.*)$", out, re.M):
        for part in m.group(1).split("; "):
            node, _, ranks = part.partition(" rank")
            found.setdefault(node, set()).update(int(r) for r in ranks.lstrip("s ").split(", "))
    return found


def start_run(inventory: Path, tmp_path: Path, *args: str) -> Lines:
    return Lines(start_ddpfab("run", "-i", str(inventory), "--nproc-per-node", "2", "--no-sync", "--no-check",
                              "--runs-dir", str(tmp_path / "runs"), *args))


def test_a_stopped_rank_is_named_by_the_run_and_the_job_ends(lab4, inventory4, tmp_path):
    run = start_run(inventory4, tmp_path, "--hang-timeout", "20", "--on-hang", "stop", SCRIPT, "--every", "5")
    pid = int(run.wait_for(r"rank 5 pid (\d+) ready", 240).group(1))
    run.wait_for(r"rank 5 step 20 ", 120)  # training, every rank in step
    res = host_sh(lab4, "node3", f"kill -STOP {pid}")
    stopped = time.monotonic()
    assert res.returncode == 0, res.stderr
    assert run.proc.wait(timeout=240) == EXIT_HUNG, run.text()[-4000:]
    run.thread.join(timeout=10)
    out = run.text()
    verdict = f"node3 rank 5 (pid {pid}) is stopped (SIGSTOP, state T)"
    assert f"ddpfab: hang: {verdict}" in out, out[-4000:]
    # a ring all_reduce lets some ranks through to the loop's next all_reduce before the stop bites:
    # the waiters may be at either call site, and are waiting, not odd ones out
    assert re.search(rf"ddpfab: hang: the other 7 ranks wait in all_reduce {SITES}\n", out), out[-4000:]
    took = run.when(verdict) - stopped
    assert took < 60, f"the verdict came {took:.0f} s after the stop"
    # the stacks: the 7 waiting ranks' group, innermost first, with the script's frame. Those of the
    # report with the verdict: at a high load an earlier quiet spell (before the stop) may have had
    # the doctor look already, and find all 8 ranks in all_reduce and no hang
    report = out[out.index(f"ddpfab: hang: {verdict}"):]
    assert waiting_groups(report) == {"node1": {0, 1}, "node2": {2, 3}, "node3": {4}, "node4": {6, 7}}, out[-4000:]
    assert re.search(r"all_reduce \(.*torch/distributed/distributed_c10d\.py:\d+\)", out)
    assert "--on-hang stop: stopping the job on every node" in out
    assert f"hung: {verdict}" in out  # the closing line
    run_dir = next((tmp_path / "runs").iterdir())
    # one record per doctor pass, oldest first: an earlier pass under load found no hang; the one
    # that found it is the last (--on-hang stop ends the job there)
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("doctor-*.json"))]
    assert [r["hung"] for r in records][-1:] == [True] and not any(r["hung"] for r in records[:-1]), records
    assert records[-1]["odd"][0]["node"] == "node3" and records[-1]["odd"][0]["rank"] == 5, records[-1]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["exit_code"] == EXIT_HUNG and manifest["plan"]["on_hang"] == "stop"
    # each node's record says why ddpfab stopped it (it said "another node failed")
    assert {n["stopped_reason"] for n in manifest["nodes"].values()} == \
        {"stopped by ddpfab: the job hung (--on-hang stop)"}, manifest["nodes"]


def test_the_doctor_names_a_stopped_rank_of_a_detached_job(lab4, inventory4, tmp_path):
    runs = str(tmp_path / "runs")
    res = ddpfab("run", "-i", str(inventory4), "--nproc-per-node", "2", "--no-sync", "--no-check", "--runs-dir", runs,
                 "--detach", "--run-id", "doc-detached", SCRIPT, "--every", "5", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    log = "/root/.ddpfab/runs/doc-detached/output.log"
    pid = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        text = host_sh(lab4, "node2", f"cat {log} 2>/dev/null").stdout
        m = re.search(r"rank 2 pid (\d+) ready", text)
        if m and "rank 2 step 20 " in text:
            pid = int(m.group(1))
            break
        time.sleep(1)
    assert pid, "the detached job did not start training on node2"
    try:
        assert host_sh(lab4, "node2", f"kill -STOP {pid}").returncode == 0
        time.sleep(3)  # the others reach the collective rank 2 never joins
        res = ddpfab("doctor", "doc-detached", "--runs-dir", runs, timeout=180)
        out = res.stdout + res.stderr
        assert res.returncode == 1, out
        lines = res.stdout.splitlines()
        assert lines[0] == f"node2 rank 2 (pid {pid}) is stopped (SIGSTOP, state T)", out
        assert re.fullmatch(rf"the other 7 ranks wait in all_reduce {SITES}", lines[1]), out
        assert waiting_groups(out) == {"node1": {0, 1}, "node2": {3}, "node3": {4, 5}, "node4": {6, 7}}, out
        assert "record: " in out
        res = ddpfab("doctor", "doc-detached", "--runs-dir", runs, "--json", timeout=180)
        record = json.loads(res.stdout)
        assert record["kind"] == "ddpfab-doctor" and record["hung"]
        assert [(o["node"], o["rank"], o["state"]) for o in record["odd"]] == [("node2", 2, "T")]
    finally:
        assert ddpfab("stop", "doc-detached", "--runs-dir", runs, timeout=120).returncode == 0


def test_a_rank_in_another_collective_is_the_odd_one_out(lab4, inventory4, tmp_path):
    run = start_run(inventory4, tmp_path, "--hang-timeout", "15", "--on-hang", "stop", SCRIPT, "--every", "5",
                    "--odd-rank", "6", "--odd-at", "30")
    try:
        code = run.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        run.proc.terminate()  # ddpfab stops the job on every node
        run.proc.wait(timeout=60)
        code = None
    run.thread.join(timeout=10)
    out = run.text()
    assert code == EXIT_HUNG, out[-4000:]
    assert re.search(r"ddpfab: hang: node4 rank 6 \(pid \d+\) is in broadcast \(hang_train\.py:\d+\), not in "
                     r"all_reduce like the others", out), out[-4000:]
    assert re.search(r"the other 7 ranks wait in all_reduce \(hang_train\.py:\d+\)", out)
    assert re.search(r"-- 1 rank in broadcast \(hang_train\.py:\d+\): node4 rank 6", out)


def test_attach_reports_a_rank_that_aborted_after_finishing_as_run_does(lab4, inventory4, tmp_path):
    runs = str(tmp_path / "runs")
    res = ddpfab("run", "-i", str(inventory4), "--nproc-per-node", "2", "--no-sync", "--no-check", "--runs-dir", runs,
                 "--detach", "--run-id", "doc-race", "--exit-guard", "record", "--env", "DRILL_EXIT_ABORT_RANK=3",
                 DRILL, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    res = ddpfab("attach", "doc-race", "--runs-dir", runs, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    # unguarded, another rank may hit the real race too: it is then named beside rank 3, the same way
    closing = re.search(r"run doc-race ended: all ranks finished their work; (.*) \(known upstream race\)", out)
    named = {"rank 3 (node2) aborted at exit (signal 6)",
             "rank 3 (node2) aborted at exit (its exit status was reaped before it was seen)"}
    assert closing and named & set(closing[1].split(", ")), out[-3000:]
    assert "ddpfab: warning: a rank aborted" in out and "run doc-race ended: failed on" not in out


# -- two ranks: one sleeps in its own code, the other waits for it in all_reduce ------------------
#: hang_train.py's stall(): the line the sleeping rank sleeps at, as the doctor names it.
STALL = r"stall \(hang_train\.py:\d+\)"


def test_the_doctor_names_the_rank_outside_any_collective_of_two(lab, inventory2, tmp_path):
    """2 ranks (node1 and node2, one process each): rank 1 sleeps in its own code (no collective)
    while rank 0 waits for it in all_reduce. No majority to go by: the doctor names rank 1, the one
    outside any collective, with where it is, and exits 1 (it printed both stacks and exited 0)."""
    runs = str(tmp_path / "runs")
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "1", "--no-sync", "--no-check", "--runs-dir", runs,
                 "--detach", "--run-id", "doc-two", SCRIPT, "--every", "5", "--sleep-rank", "1", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        log = "/root/.ddpfab/runs/doc-two/output.log"
        pid = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            text = host_sh(lab, "node2", f"cat {log} 2>/dev/null").stdout
            m = re.search(r"rank 1 pid (\d+) ready", text)
            if m and "rank 1 stalls" in text:
                pid = int(m.group(1))
                break
            time.sleep(0.5)
        assert pid, "rank 1 did not reach its stall on node2"
        time.sleep(2)  # rank 0 reaches the all_reduce rank 1 never joins
        res = ddpfab("doctor", "doc-two", "--runs-dir", runs, timeout=60)
        out = res.stdout + res.stderr
        assert res.returncode == 1, out
        lines = res.stdout.splitlines()
        assert re.fullmatch(rf"node2 rank 1 \(local rank 0, pid {pid}\) is outside any collective, in {STALL}",
                            lines[0]), out
        assert re.fullmatch(rf"the other rank waits for it in all_reduce {SITES}", lines[1]), out
        assert "node1" not in lines[0]
        record = json.loads(next((tmp_path / "runs" / "doc-two").glob("doctor-*.json")).read_text())
        assert [(o["node"], o["ranks"], o["place"]) for o in record["odd"]] == [("node2", [1], "outside")], record
    finally:
        assert ddpfab("stop", "doc-two", "--runs-dir", runs, timeout=60).returncode == 0
    assert_no_leftovers(lab)


def test_the_hang_watch_stops_two_ranks_naming_the_sleeping_one_and_shows_the_stacks_once(lab, inventory2, tmp_path):
    """The same 2-rank hang under ``run --hang-timeout 10 --on-hang stop``: exit 124, the closing
    line names rank 1 (never rank 0, which waits for it), and the stacks are printed once (they
    were printed three times, and node1 was blamed)."""
    run = Lines(start_ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "1", "--no-sync", "--no-check",
                             "--runs-dir", str(tmp_path / "runs"), "--hang-timeout", "10", "--on-hang", "stop",
                             SCRIPT, "--every", "5", "--sleep-rank", "1"))
    try:
        code = run.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        run.proc.terminate()  # ddpfab stops the job on every node
        run.proc.wait(timeout=60)
        code = None
    run.thread.join(timeout=10)
    out = run.text()
    assert code == EXIT_HUNG, out[-4000:]
    # the closing line (only the workdir's note may follow it) names rank 1, never rank 0 or node1
    closing = [line for line in out.splitlines() if line.startswith("ddpfab: hung: ")]
    assert len(closing) == 1, out[-4000:]
    assert re.match(rf"ddpfab: hung: node2 rank 1 \(local rank 0, pid \d+\) is outside any collective, in {STALL}; "
                    r"the other rank waits for it in all_reduce", closing[0]), out[-4000:]
    assert "node1" not in closing[0].split(" (manifest: ")[0], closing[0]
    assert out.splitlines().index(closing[0]) >= len(out.splitlines()) - 2, out[-4000:]
    # one look found the hang; a look before it (ranks still importing torch on a loaded machine:
    # no line for 10 s) found none and said so: the stacks are shown once, for the hang
    looks = len(re.findall(r"^ddpfab: hang watch: no rank has printed", out, re.M))
    assert looks == len(re.findall(r"^ddpfab: no hang found", out, re.M)) + 1, out[-4000:]
    assert len(re.findall(r"^ddpfab: hang: node2 rank 1 ", out, re.M)) == 1, out[-4000:]
    assert len(re.findall(rf"^ddpfab: -- 1 rank in {STALL}: node2 rank 1$", out, re.M)) == 1, out[-4000:]
    assert len(re.findall(r"^ddpfab: -- 1 rank in all_reduce \(hang_train\.py:\d+\): node1 rank 0$", out, re.M)) == 1, \
        out[-4000:]
    assert_no_leftovers(lab)
