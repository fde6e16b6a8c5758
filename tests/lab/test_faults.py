"""Fault injection on lab hosts: crashes, a cut network, a killed controller, detached jobs.

Every test also checks that a second job on the same hosts (a bystander, started detached)
survives, and that the job under test leaves no process behind on any host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddpfab.launch.hangwatch import EXIT_HUNG
from ddpfab.planning import render
from ddpfab.planning.plan import Plan

from .helpers import ddpfab, link_up, reports, start_ddpfab, wait_no_processes

REPORT = "tests/lab/scripts/report.py"
NL = "\n"
pytestmark = pytest.mark.usefixtures("no_leftovers")


def _run_ids(runs) -> list[str]:
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


def _ps(inventory) -> dict[str, dict]:
    res = ddpfab("ps", "-i", str(inventory), "--json")
    assert res.returncode == 0, res.stderr
    listing = json.loads(res.stdout)
    assert listing["ok"] and listing["problems"] == [], listing
    return {r["run_id"]: r for r in listing["runs"]}


@pytest.fixture
def bystander(lab, inventory2, tmp_path):
    """A detached job on the same hosts that must outlive whatever the test does to its own job."""
    runs = tmp_path / "bystander-runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=600",
                 REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = _run_ids(runs)[0]
    pids = {n: {p for p, _ in lab.processes(n)} for n in ("node1", "node2")}
    yield run_id
    ps = _ps(inventory2)
    assert ps[run_id]["state"] == "running", f"the bystander job was touched: {ps[run_id]}"
    assert all(pids[n] <= {p for p, _ in lab.processes(n)} for n in pids), "bystander processes vanished"
    stop = ddpfab("stop", "--runs-dir", str(runs), run_id)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_no_processes(lab, timeout=5)


def _job_pids(lab, run_id: str) -> set[tuple[str, int]]:
    """Processes of one run on every host: the supervisor's cmdline names the run id, and every
    job process descends from it, so walk the tree from there."""
    found = set()
    for name in ("node1", "node2", "node3"):
        procs = dict(lab.processes(name))
        roots = [p for p, cmd in procs.items() if run_id in cmd]
        children: dict[int, list[int]] = {}
        for p in procs:
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(p)
        todo = list(roots)
        while todo:
            p = todo.pop()
            found.add((name, p))
            todo.extend(children.get(p, []))
    return found


def _wait_job_gone(lab, run_id: str, timeout: float) -> float:
    start = time.monotonic()
    while _job_pids(lab, run_id):
        assert time.monotonic() - start < timeout, f"job {run_id} still has {_job_pids(lab, run_id)}"
        time.sleep(0.02)
    return time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_rank_process(lab, node: str, rank: int, timeout: float) -> int:
    """The pid of the process of global rank *rank* on *node* (found by its RANK in environ)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid, cmd in lab.processes(node):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"REPORT_FAIL_RANK=3" in environ and "report.py" in cmd:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} process on {node}")


def _read_until(proc, marker: str, count: int, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while sum(marker in ln for ln in lines) < count:
        assert time.monotonic() < deadline, "never saw enough " + marker + ":\n" + "".join(lines)
        line = proc.stdout.readline()
        assert line, "ddpfab ended early:\n" + "".join(lines)
        lines.append(line)
    return lines


def test_rank_crash_ends_the_job_everywhere_within_2s(lab, inventory2, tmp_path, bystander):
    runs = tmp_path / "runs"
    proc = start_ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--runs-dir", str(runs),
                        "--env", "REPORT_FAIL_RANK=3", "--env", "REPORT_FAIL_AFTER=6", REPORT)
    try:
        rank3 = _wait_for_rank_process(lab, "node2", 3, timeout=90)
        run_id = _run_ids(runs)[0]
        while _alive(rank3):  # the crash: the moment rank 3's process is gone
            time.sleep(0.005)
        crashed = time.monotonic()
        _wait_job_gone(lab, run_id, timeout=10)
        gone = time.monotonic() - crashed
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0
    print(f"crash -> last job process gone on every host: {gone:.2f} s")
    assert gone < 2.0, f"teardown took {gone:.2f} s"
    manifest = json.loads((runs / run_id / "manifest.json").read_text())
    assert manifest["first_failure"] == "node2"
    assert manifest["nodes"]["node1"]["stopped_reason"] == "stopped by ddpfab: another node failed"


def test_network_cut_names_the_lost_node_and_stops_everything(lab, inventory2, tmp_path, bystander):
    """node2's link goes down mid-run: ddpfab declares it lost within its keepalive bound (5 s +
    1 s heartbeat), stops node1, and node2's own supervisor ends its job once ddpfab falls silent
    (10 s), even though no message can reach it."""
    from ddpfab.launch.execute import LOST_AFTER_S, SILENCE_S, STOP_GRACE_S

    runs = tmp_path / "runs"
    proc = start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--env", "REPORT_HANG=600", REPORT)
    veth = lab.host("node2").veth
    try:
        _read_until(proc, "READY", 2, timeout=90)
        run_id = _run_ids(runs)[0]
        cut = time.monotonic()
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        out, _ = proc.communicate(timeout=40)
        detected = time.monotonic() - cut
        assert proc.returncode != 0
        assert "node2" in out and "lost" in out, out
        assert detected <= LOST_AFTER_S + 3, f"took {detected:.1f} s to notice"
        node1_left = [p for p in _job_pids(lab, run_id) if p[0] == "node1"]
        assert not node1_left, node1_left
        _wait_job_gone(lab, run_id, timeout=SILENCE_S + STOP_GRACE_S + 5 - (time.monotonic() - cut))
        print(f"cut -> ddpfab exit {detected:.1f} s; cut -> all gone {time.monotonic() - cut:.1f} s")
    finally:
        proc.kill()
        link_up(lab, "node2")
    manifest = json.loads((runs / run_id / "manifest.json").read_text())
    assert manifest["first_failure"] == "node2"
    assert "lost" in manifest["nodes"]["node2"]["error"]
    # the link is back: the bystander must still be reachable and running (checked by its fixture)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ddpfab("ps", "-i", str(inventory2)).returncode != 0:
        time.sleep(0.5)


def test_sigkill_of_ddpfab_ends_the_job_but_not_the_bystander(lab, inventory2, tmp_path, bystander):
    runs = tmp_path / "runs"
    proc = start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--env", "REPORT_HANG=600", REPORT)
    try:
        _read_until(proc, "READY", 2, timeout=90)
        run_id = _run_ids(runs)[0]
        killed = time.monotonic()
        proc.kill()
        proc.wait(timeout=5)
        took = _wait_job_gone(lab, run_id, timeout=8)
    finally:
        proc.kill()
    print(f"SIGKILL -> all gone {time.monotonic() - killed:.2f} s")
    assert took < 8


def test_sigint_ends_the_job_but_not_the_bystander(lab, inventory2, tmp_path, bystander):
    runs = tmp_path / "runs"
    proc = start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--env", "REPORT_HANG=600", REPORT)
    try:
        _read_until(proc, "READY", 2, timeout=90)
        run_id = _run_ids(runs)[0]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
        took = _wait_job_gone(lab, run_id, timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 130
    print(f"SIGINT -> all gone {took:.2f} s after ddpfab exited")


def test_two_jobs_on_the_same_hosts_get_different_ports(lab, inventory2, tmp_path, bystander):
    other = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(other), REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    bystander_port = json.loads(next((tmp_path / "bystander-runs").glob("*/manifest.json")).read_text())["plan"][
        "master_port"]
    assert {r["master_port"] for r in reports(res.stdout)} != {bystander_port}


def test_detached_job_survives_the_controller_and_attach_logs_ps_stop_work(lab, inventory2, tmp_path):
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=6",
                 REPORT, "detached arg")
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = _run_ids(runs)[0]
    assert _ps(inventory2)[run_id]["state"] == "running"
    # an attach that is SIGKILLed leaves the job (and no follower) behind
    att = start_ddpfab("attach", "--runs-dir", str(runs), run_id)
    _read_until(att, "REPORT", 1, timeout=60)
    att.kill()
    att.wait()
    assert _ps(inventory2)[run_id]["state"] == "running"
    # a second attach follows it to the end and returns the job's exit code
    att = ddpfab("attach", "--runs-dir", str(runs), run_id, timeout=60)
    assert att.returncode == 0, att.stdout + att.stderr
    got = reports(att.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1] and all(r["argv"] == ["detached arg"] for r in got)
    ps = _ps(inventory2)[run_id]
    assert ps["state"] == "exited" and {s["exit_code"] for s in ps["nodes"].values()} == {0}
    logs = ddpfab("logs", "--runs-dir", str(runs), run_id)
    assert logs.returncode == 0, logs.stderr
    said = logs.stdout.splitlines()  # where each node's output went, with its lines; then a closing line
    for i, node in enumerate(("node1", "node2")):
        path = runs / run_id / f"{node}.remote.log"
        text = path.read_text()
        assert "REPORT" in text
        assert said[i] == f"{node}: {path} ({text.count(NL)} lines)", logs.stdout
    assert said[2:] == [f"logs of run {run_id}: 2 of 2 nodes' output in {runs / run_id}"], logs.stdout
    wait_no_processes(lab, timeout=5)


def test_stop_ends_a_detached_job_on_every_node(lab, inventory2, tmp_path):
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=600",
                 REPORT)
    assert res.returncode == 0, res.stderr
    run_id = _run_ids(runs)[0]
    assert _job_pids(lab, run_id)
    stop = ddpfab("stop", "--runs-dir", str(runs), run_id)
    assert stop.returncode == 0 and stop.stdout.count("stopped") == 2, stop.stdout + stop.stderr
    wait_no_processes(lab, timeout=3)
    # ps says stopped, as the nodes' records do (it said exited, each node exited(143))
    ps = _ps(inventory2)[run_id]
    assert ps["state"] == "stopped" and {s["state"] for s in ps["nodes"].values()} == {"stopped"}, ps
    row = next(line for line in ddpfab("ps", "-i", str(inventory2)).stdout.splitlines() if line.startswith(run_id))
    assert row.split()[1] == "stopped" and row.endswith("node1:stopped node2:stopped"), row
    # the doctor says the job has ended and how (exit 0; it named each node's end as odd, exit 1), also
    # without the local record (the nodes' records say it); a run no node knows is no run (2)
    ended = "the job has ended on every node: node1, node2 stopped (signal 15)"
    doc = ddpfab("doctor", "--runs-dir", str(runs), run_id)
    assert doc.returncode == 0 and doc.stdout.splitlines()[0] == ended, doc.stdout + doc.stderr
    elsewhere = str(tmp_path / "other-runs")
    doc = ddpfab("doctor", "-i", str(inventory2), "--runs-dir", elsewhere, run_id)
    assert doc.returncode == 0 and doc.stdout.splitlines()[0] == ended, doc.stdout + doc.stderr
    doc = ddpfab("doctor", "-i", str(inventory2), "--runs-dir", elsewhere, "20200101-000000-abcdef")
    assert doc.returncode == 2 and "no run 20200101-000000-abcdef" in doc.stderr, doc.stdout + doc.stderr
    assert "Traceback" not in doc.stderr
    # a stop of it is no success either (it said "absent" on every node, exit 0); of the real run
    # without the local record, the nodes' records find it: "not running", exit 0
    stop = ddpfab("stop", "-i", str(inventory2), "--runs-dir", elsewhere, "20200101-000000-abcdef")
    assert stop.returncode == 2 and "no run 20200101-000000-abcdef" in stop.stderr, stop.stdout + stop.stderr
    assert "nothing was stopped" in stop.stderr and "Traceback" not in stop.stderr
    # nor logs of it: one line, 2 (it said "no output of run ... there" per node, and exit 1)
    logs = ddpfab("logs", "-i", str(inventory2), "--runs-dir", elsewhere, "20200101-000000-abcdef")
    assert logs.returncode == 2 and logs.stderr.count("no run 20200101-000000-abcdef") == 1, logs.stdout + logs.stderr
    assert "no output of run" not in logs.stderr and "Traceback" not in logs.stderr
    stop = ddpfab("stop", "-i", str(inventory2), "--runs-dir", elsewhere, run_id)
    assert stop.returncode == 0 and stop.stdout.count("not running") == 2, stop.stdout + stop.stderr


def _stopped_while_followed(follower: subprocess.Popen, runs, reports: int, run_id=None) -> tuple[int, str, str]:
    """``ddpfab stop`` from another process once *follower* (a run, an attach) shows *reports*
    REPORT lines; (its exit code, the rest of its output, the run id)."""
    try:
        _read_until(follower, "REPORT", reports, timeout=90)
        run_id = run_id or _run_ids(runs)[0]
        stop = ddpfab("stop", "--runs-dir", str(runs), run_id)
        assert stop.returncode == 0 and stop.stdout.count("stopped") == 2, stop.stdout + stop.stderr
        out = follower.stdout.read()
        return follower.wait(timeout=60), out, run_id
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


def test_a_stop_from_elsewhere_ends_run_and_attach_as_a_stop_not_a_failure(lab, inventory2, tmp_path):
    """``ddpfab stop`` of a job that a ``run`` (or an ``attach``) still follows is a stop, not a
    failure: both end 143 saying it was stopped from outside, naming no failed node (they said
    ``node2 (node_rank 1) failed (exit code 1)`` and blamed it); the run's record says interrupted."""
    runs = tmp_path / "runs"
    code, out, run_id = _stopped_while_followed(
        start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--env", "REPORT_HANG=600", REPORT), runs, 2)
    closing = next((ln for ln in out.splitlines() if ln.startswith("ddpfab: stopped from outside on ")), "")
    # (a node this run stopped first, after the other's stop came, is this run's stop, not named)
    assert code == 143 and re.match(r"ddpfab: stopped from outside on (node1, node2|node1|node2) \(SIGTERM to "
                                    r"(its|their) supervisors?: `ddpfab stop`, or a kill\)", closing), out[-3000:]
    assert "failed" not in out and "exit code 1" not in out, out[-3000:]
    manifest = json.loads((runs / run_id / "manifest.json").read_text())
    assert manifest["state"] == "interrupted" and manifest["exit_code"] == 143, manifest["summary"]
    wait_no_processes(lab, timeout=5)
    # the same through attach (it said "ended: failed on node1 (exit code 1), node2 (exit code 1)")
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=600",
                 REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    detached = next(r for r in _run_ids(runs) if r != run_id)
    code, out, _ = _stopped_while_followed(start_ddpfab("attach", "--runs-dir", str(runs), detached), runs, 1, detached)
    assert code == 143 and f"run {detached} ended: stopped from outside on node" in out, out[-3000:]
    assert "failed" not in out, out[-3000:]
    wait_no_processes(lab, timeout=5)


def test_attach_of_a_detached_job_ends_it_on_a_hang_as_run_does(lab, inventory2, tmp_path):
    """A detached job's hang watch runs in attach (nobody else watches it): --on-hang stop ends the
    job on every node, and attach exits 124 as run would have (it never stopped it; a stop exited 137)."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--hang-timeout", "2",
                 "--on-hang", "stop", "--env", "REPORT_HANG=600", REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = _run_ids(runs)[0]
    att = ddpfab("attach", "--runs-dir", str(runs), run_id, timeout=120)
    out = att.stdout + att.stderr
    assert att.returncode == EXIT_HUNG, out[-3000:]
    assert "--on-hang stop: stopping the job on every node" in out, out[-3000:]
    assert f"run {run_id} ended: hung: " in out and "the job was stopped on every node (--on-hang stop)" in out
    assert list((runs / run_id).glob("doctor-*.json")), "the doctor's record is kept in the run's dir"
    wait_no_processes(lab, timeout=5)
    assert _ps(inventory2)[run_id]["state"] == "stopped"


def test_max_restarts_are_recorded(lab, inventory2, tmp_path):
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--max-restarts", "1",
                 "--env", "REPORT_FAIL_RANK=1", "--env", "REPORT_FAIL_AFTER=0", REPORT, timeout=120)
    assert res.returncode != 0
    assert res.stdout.count("failing on purpose") >= 2, res.stdout  # first attempt and one restart
    manifest = json.loads(next(runs.glob("*/manifest.json")).read_text())
    plan = Plan.from_dict(manifest["plan"])
    assert plan.max_restarts == 1 and "--max-restarts=1" in render.argv(plan, plan.nodes[0])
    assert manifest["nodes"]["node2"]["restarts"] == 1
    wait_no_processes(lab, timeout=5)


def test_attach_follows_every_node_beyond_the_fanout_window(lab, inventory2, tmp_path):
    """With more nodes than the fan-out window (here the window is 1 for 2 nodes; in the product
    64, for 128 nodes), attach still shows every node's output while the job runs."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=600",
                 REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = _run_ids(runs)[0]
    att = subprocess.Popen([sys.executable, "-c", "import sys; from ddpfab import cli; from ddpfab.remote import ssh; ssh.WINDOW = 1; "
                            "sys.exit(cli.main(sys.argv[1:]))", "attach", "--runs-dir", str(runs), run_id],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "NO_COLOR": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(att.stdout), daemon=True)  # (readline would block)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while len(reports("".join(lines))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {r["hostname"] for r in reports("".join(lines))} == {"node1", "node2"}, "".join(lines)
    finally:
        att.kill()
        att.wait()
        stop = ddpfab("stop", "--runs-dir", str(runs), run_id)
        assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_no_processes(lab, timeout=5)
