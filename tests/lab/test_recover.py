"""Unattended runs on lab hosts: a lost node is replaced by a spare and the job resumes from its
last checkpoint (real torchrun, gloo, sshd, rsync; the network cut is a real `ip link set down`).

The lab has three hosts: node1 and node2 start the job, node3 is the spare. The script
(tests/lab/scripts/ckpt_steps.py) checkpoints every step with ddpfab.dist's helpers and folds each
step into an order-sensitive float, so its final value proves that no step was lost and none was
applied twice.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod

from .helpers import REPO, ddpfab, link_up, start_ddpfab, wait_no_processes

SCRIPT = "tests/lab/scripts/ckpt_steps.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


def expected_w(steps: int, world: int) -> float:
    w = 0.0
    for step in range(steps):
        w = w * 1.01 + world * (step + 1)
    return w


def recovery_inventory(lab, path: Path, spares: bool = True) -> Path:
    """node1, node2 active, node3 in group `spares` (with *spares*); the code is synced to a
    workdir under /opt that only the nodes have, so the spare gets the code from the sync."""
    names = ["node1", "node2", "node3"] if spares else ["node1", "node2"]
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=names))
    inv["all"]["vars"]["ddpfab_workdir"] = f"/opt/ddpfab-test-recover-{uuid.uuid4().hex[:8]}/code"
    if spares:
        inv["all"]["children"] = {"spares": {"hosts": {"node3": None}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def src(tmp_path, monkeypatch) -> Path:
    """The tree the runs sync: the package and the test script, copied (a checkout being edited
    while a test syncs it would fail the sync's hash check)."""
    root = tmp_path / "src"
    shutil.copytree(REPO / "ddpfab", root / "ddpfab", ignore=shutil.ignore_patterns("__pycache__"))
    (root / Path(SCRIPT).parent).mkdir(parents=True)
    shutil.copy(REPO / SCRIPT, root / SCRIPT)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def shared_ckpt(lab):
    """A checkpoint dir every lab host sees (the lab's shared dir under /srv, standing in for NFS)."""
    path = Path(tempfile.mkdtemp(prefix="test-recover-ckpt-", dir=lab.shared_dir))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Reader:
    """Collects a running ddpfab's output lines in a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(bool(re.search(pattern, ln)) for ln in list(self.lines)) < count:
            assert self.proc.poll() is None or self.thread.is_alive(), "ddpfab ended early:\n" + self.text()
            assert time.monotonic() < deadline, f"never saw {count} x {pattern!r}:\n" + self.text()
            time.sleep(0.05)

    def finish(self, timeout: float) -> str:
        self.proc.wait(timeout=timeout)
        self.thread.join(timeout=10)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


def records(out: str, kind: str) -> list[dict]:
    return [json.loads(ln.split(f"{kind} ", 1)[1]) for ln in out.splitlines() if f"{kind} {{" in ln]


def cut_and_recover(lab, inv: Path, runs: Path, victim: str, env: dict[str, str], steps: int,
                    options: tuple[str, ...] = ("--max-job-restarts", "2", "--spares", "spares"),
                    after_steps: int = 4) -> tuple[str, int]:
    """Start a recovering run, cut *victim*'s link once both ranks are past *after_steps* steps,
    wait for the end; the link is restored once the victim's own supervisor has ended its job
    (silence)."""
    args = ["run", "-i", str(inv), "--runs-dir", str(runs), *options, "--env", f"STEPS={steps}", "--env", "STEP_S=0.3"]
    for k, v in env.items():
        args += ["--env", f"{k}={v}"]
    proc = start_ddpfab(*args, SCRIPT, cwd=Path.cwd())
    reader = Reader(proc)
    veth = lab.host(victim).veth
    try:
        reader.wait_for(r"STEP \{", 2 * after_steps, timeout=180)
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        out = reader.finish(timeout=300)
        wait_no_processes(lab, timeout=30, names=["node1", "node2", "node3"])  # the victim's: silence -> stop
    finally:
        proc.kill()
        link_up(lab, victim)
    return out, proc.returncode


def check_resumed(out: str, steps: int, survivor_hosts: set[str]) -> tuple[int, int]:
    """The step counter went on from the last checkpoint; the final weight is the uninterrupted one."""
    step_lines = records(out, "STEP")
    before = [r["step"] for r in step_lines if r["restart"] == 0]
    after = [r for r in step_lines if r["restart"] == 1]
    last_before = max(before)
    resumed = {r["resumed_from"] for r in records(out, "RESUME") if r["restart"] == 1}
    assert len(resumed) == 1, f"ranks resumed from different steps: {resumed}"
    resumed_from = resumed.pop()
    # every printed step was checkpointed first; at most one more was saved and not yet printed
    assert last_before <= resumed_from <= last_before + 1, (last_before, resumed_from)
    assert min(r["step"] for r in after) == resumed_from + 1
    assert sorted({r["step"] for r in after}) == list(range(resumed_from + 1, steps))
    done = records(out, "DONE")
    assert {d["restart"] for d in done} == {1} and len(done) == 2, done
    assert {d["host"] for d in done} == survivor_hosts
    assert [d["w"] for d in done] == [pytest.approx(expected_w(steps, 2))] * 2, "a step was lost or applied twice"
    return last_before, resumed_from


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def root_manifest(runs: Path) -> dict:
    roots = [json.loads(p.read_text()) for p in runs.glob("*/manifest.json")]
    roots = [m for m in roots if "recovery" in m]
    assert len(roots) == 1, roots
    return roots[0]


def test_lost_node_is_replaced_by_the_spare_and_the_job_resumes(lab, tmp_path, shared_ckpt):
    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    runs, steps = tmp_path / "runs", 24
    out, code = cut_and_recover(lab, inv, runs, "node2", {"CKPT_DIR": str(shared_ckpt), "CKPT_SHARED": "1"}, steps)
    assert code == 0, out
    check_resumed(out, steps, {"node1", "node3"})
    m = root_manifest(runs)
    rec = m["recovery"]
    assert rec["state"] == "succeeded" and rec["exit_code"] == 0
    first, second = rec["attempts"]
    assert first["nodes"] == ["node1", "node2"], "the spare must not be in the first set"
    assert first["failed_nodes"] == ["node2"] and first["failure_kind"] == "node"
    assert "lost" in first["ended_because"], first
    assert second["nodes"] == ["node1", "node3"] and second["replaced"] == {"node2": "node3"}
    assert second["master"] == "node1"  # (its port: found free again, from a random start in the range)
    assert second["run_id"] == f"{m['run_id']}-r1" and second["recovery_s"] > 0
    assert "node2" in rec["failed_nodes"] and "lost" in rec["failed_nodes"]["node2"]
    # the script learnt it was a restart, and of which run
    lineage = {tuple(r["lineage"]) for r in records(out, "RESUME") if r["restart"] == 1}
    assert lineage == {(m["run_id"], f"{m['run_id']}-r1")}
    # the restarted attempt has a manifest of its own, linked to the first
    m2 = json.loads((runs / second["run_id"] / "manifest.json").read_text())
    assert m2["recovery_of"] == m["run_id"] and m2["state"] == "succeeded"
    assert m2["plan"]["nodes"][1]["env"]["DDPFAB_RESTART_COUNT"] == "1"
    # the failed node is reported at the end, with evidence
    tail = out[out.rindex("failed node"):]
    assert "node2" in tail and "lost" in tail, tail


def test_lost_master_gets_a_new_master(lab, tmp_path):
    """node1 (the master, node_rank 0, where the TCP store runs) is cut: node2 becomes the master.
    Checkpoints are node-local here (each node under its own /opt overlay): the spare has none,
    so resume() hands it node2's copy."""
    ckpt = f"/opt/ddpfab-test-recover-ckpt-{uuid.uuid4().hex[:8]}"
    for name in ("node1", "node2", "node3"):  # writes there must land in the host's own overlay
        fs = subprocess.run(["ssh", "-F", str(lab.ssh_config), name, "findmnt", "-n", "-o", "FSTYPE", "--target",
                             "/opt"], capture_output=True, text=True, timeout=30)
        assert fs.stdout.strip() == "overlay", (name, fs.stdout, fs.stderr)
    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    runs, steps = tmp_path / "runs", 24
    out, code = cut_and_recover(lab, inv, runs, "node1", {"CKPT_DIR": ckpt, "CKPT_SHARED": "0"}, steps)
    assert code == 0, out
    check_resumed(out, steps, {"node2", "node3"})
    first, second = root_manifest(runs)["recovery"]["attempts"]
    assert first["master"] == "node1" and first["failed_nodes"] == ["node1"]
    assert second["master"] == "node2" and second["ranks"] == {"node2": 0, "node3": 1}
    assert second["master_addr"] == lab.host("node2").address
    assert second["replaced"] == {"node1": "node3"}


def test_script_error_is_not_retried_unless_asked(lab, tmp_path, shared_ckpt):
    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    common = ["run", "-i", str(inv), "--max-job-restarts", "2", "--spares", "spares", "--env",
              f"CKPT_DIR={shared_ckpt}", "--env", "FAIL_AT=2", "--env", "STEP_S=0"]
    res = ddpfab(*common, "--runs-dir", str(tmp_path / "runs1"), SCRIPT,
                 timeout=300, cwd=Path.cwd())
    assert res.returncode != 0
    assert "RuntimeError: boom on purpose at step 2" in res.stderr and "not retried" in res.stderr, res.stderr
    assert {r["restart"] for r in records(res.stdout, "RESUME")} == {0}
    attempts = root_manifest(tmp_path / "runs1")["recovery"]["attempts"]
    assert [a["failure_kind"] for a in attempts] == ["script"]

    res = ddpfab(*common, "--retry-on", "script", "--runs-dir", str(tmp_path / "runs2"), SCRIPT,
                 timeout=300, cwd=Path.cwd())
    assert res.returncode != 0
    assert "RuntimeError: boom on purpose at step 2" in res.stderr and "no restarts left" in res.stderr, res.stderr
    assert sorted({r["restart"] for r in records(res.stdout, "RESUME")}) == [0, 1, 2]
    rec = root_manifest(tmp_path / "runs2")["recovery"]
    assert [a["failure_kind"] for a in rec["attempts"]] == ["script"] * 3
    assert all(a["nodes"] == ["node1", "node2"] for a in rec["attempts"]), "a script failure replaces no node"
    assert rec["state"] == "failed" and not rec["failed_nodes"]


def test_no_spare_and_no_min_nodes_fails_naming_the_lost_node(lab, tmp_path, shared_ckpt):
    inv = recovery_inventory(lab, tmp_path / "inv.yml", spares=False)
    runs = tmp_path / "runs"
    out, code = cut_and_recover(lab, inv, runs, "node2", {"CKPT_DIR": str(shared_ckpt)}, 200,
                                options=("--max-job-restarts", "2"), after_steps=2)
    assert code != 0
    error = [ln for ln in out.splitlines() if ln.startswith("ddpfab: error:")]
    assert any("lost node2" in ln and "no --min-nodes" in ln for ln in error), out
    rec = root_manifest(runs)["recovery"]
    assert rec["state"] == "failed" and len(rec["attempts"]) == 1 and "node2" in rec["failed_nodes"]


def test_ctrl_c_stops_everything_and_never_restarts(lab, tmp_path, shared_ckpt):
    import signal

    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    runs = tmp_path / "runs"
    proc = start_ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--max-job-restarts", "3", "--spares",
                        "spares", "--retry-on", "node", "--retry-on", "script", "--env", f"CKPT_DIR={shared_ckpt}",
                        "--env", "STEPS=500", "--env", "STEP_S=0.3", SCRIPT, cwd=Path.cwd())
    reader = Reader(proc)
    try:
        reader.wait_for(r"STEP \{", 4, timeout=180)
        proc.send_signal(signal.SIGINT)
        out = reader.finish(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    wait_no_processes(lab, timeout=10)
    rec = root_manifest(runs)["recovery"]
    assert rec["state"] == "interrupted" and len(rec["attempts"]) == 1, rec
    assert {r["restart"] for r in records(out, "RESUME")} == {0}


def test_detached_run_recovers_and_ps_logs_stop_follow_its_attempts(lab, tmp_path, shared_ckpt):
    """--detach with restarts: the command returns at once, a controller-side supervisor replaces the
    lost node; ps names the attempts, logs fetches every attempt, replay picks the last one's nodes."""
    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    runs = tmp_path / "runs"
    steps = 40
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--detach", "--max-job-restarts", "1",
                 "--spares", "spares", "--env", f"CKPT_DIR={shared_ckpt}", "--env", f"STEPS={steps}",
                 "--env", "STEP_S=0.3", SCRIPT, timeout=180, cwd=Path.cwd())
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = re.search(r"run (\S+) started detached", res.stdout).group(1)
    supervisor = json.loads((runs / f"{run_id}.supervisor.json").read_text())["pid"]
    veth = lab.host("node2").veth
    try:
        deadline = time.monotonic() + 180
        while "\"step\": 3" not in (runs / f"{run_id}.supervisor.log").read_text():
            assert time.monotonic() < deadline, (runs / f"{run_id}.supervisor.log").read_text()
            time.sleep(0.2)
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        deadline = time.monotonic() + 240
        while _alive(supervisor):
            assert time.monotonic() < deadline, (runs / f"{run_id}.supervisor.log").read_text()
            time.sleep(0.5)
        wait_no_processes(lab, timeout=30, names=["node2"])
    finally:
        link_up(lab, "node2")
    log = (runs / f"{run_id}.supervisor.log").read_text()
    rec = json.loads((runs / run_id / "manifest.json").read_text())["recovery"]
    assert rec["state"] == "succeeded", log
    assert [a["replaced"] for a in rec["attempts"]] == [{}, {"node2": "node3"}]
    assert [d["w"] for d in records(log, "DONE")] == [pytest.approx(expected_w(steps, 2))] * 2
    # ps: the restarted attempt is named as such (node2 is back: its link is up again)
    deadline = time.monotonic() + 30
    while (ps := ddpfab("ps", "-i", str(inv), "--runs-dir", str(runs), cwd=Path.cwd())).returncode != 0:
        assert time.monotonic() < deadline, ps.stderr
        time.sleep(1)
    assert f"(restart 1 of {run_id})" in ps.stdout and "(2 attempts, run succeeded)" in ps.stdout, ps.stdout
    # logs: both attempts' output, from their own nodes
    logs = ddpfab("logs", "--runs-dir", str(runs), run_id, cwd=Path.cwd())
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert "RESUME" in (runs / run_id / "node2.remote.log").read_text()
    assert "DONE" in (runs / f"{run_id}-r1" / "node3.remote.log").read_text()
    # replay: the last attempt, on its nodes
    dry = ddpfab("replay", "--runs-dir", str(runs), run_id, "--dry-run", "--json", cwd=Path.cwd())
    assert dry.returncode == 0, dry.stderr
    assert [n["name"] for n in json.loads(dry.stdout)["nodes"]] == ["node1", "node3"]


def test_stop_ends_a_detached_run_with_restarts(lab, tmp_path, shared_ckpt):
    inv = recovery_inventory(lab, tmp_path / "inv.yml")
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--detach", "--max-job-restarts", "2",
                 "--spares", "spares", "--env", f"CKPT_DIR={shared_ckpt}", "--env", "STEPS=500",
                 "--env", "STEP_S=0.3", SCRIPT, timeout=180, cwd=Path.cwd())
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = re.search(r"run (\S+) started detached", res.stdout).group(1)
    deadline = time.monotonic() + 180
    while "\"step\": 1" not in (runs / f"{run_id}.supervisor.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    stop = ddpfab("stop", "--runs-dir", str(runs), run_id, cwd=Path.cwd())
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "controller: supervisor stopped" in stop.stdout
    wait_no_processes(lab, timeout=10)
    rec = json.loads((runs / run_id / "manifest.json").read_text())["recovery"]
    assert rec["state"] == "interrupted" and len(rec["attempts"]) == 1


def test_min_nodes_lets_the_job_shrink_instead(lab, tmp_path, shared_ckpt):
    """No spare, --min-nodes 1: node2 is lost and the job goes on on node1 alone, from the checkpoint."""
    inv = recovery_inventory(lab, tmp_path / "inv.yml", spares=False)
    runs, steps = tmp_path / "runs", 20
    out, code = cut_and_recover(lab, inv, runs, "node2", {"CKPT_DIR": str(shared_ckpt)}, steps,
                                options=("--max-job-restarts", "1", "--min-nodes", "1"), after_steps=3)
    assert code == 0, out
    first, second = root_manifest(runs)["recovery"]["attempts"]
    assert second["nodes"] == ["node1"] and second["dropped"] == ["node2"] and second["replaced"] == {}
    resumed = [r for r in records(out, "RESUME") if r["restart"] == 1]
    assert [(r["world"], r["host"]) for r in resumed] == [(1, "node1")]
    after = sorted(r["step"] for r in records(out, "STEP") if r["restart"] == 1)
    assert after == list(range(resumed[0]["resumed_from"] + 1, steps))
