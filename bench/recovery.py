#!/usr/bin/env python3
"""Recovery: from a node's network cut to the restarted job's first training step, on a spare.

    .venv/bin/python bench/recovery.py            # 3 reps (~4 min on 2 idle cores)
    .venv/bin/python bench/recovery.py --quick    # 1 rep: a smoke test

Lab: node1 and node2 run the job, node3 is the spare (inventory group `spares`). The job is
tests/lab/scripts/ckpt_steps.py (gloo, 1 process per node, a checkpoint every 0.3 s step in a
shared dir), started by `ddpfab run --max-job-restarts 1 --spares spares` with the code synced
to a workdir under /opt (so the spare really receives it). t=0: `ip link set <node2's veth> down`
once both ranks are past step 3. Measured, per repetition:
  loss -> first step   the first `STEP` line of restart 1 (its rank's own clock, the same machine)
  loss -> detected     when ddpfab declared node2 lost (the attempt's end in the manifest)
  ddpfab's recovery    the manifest's recovery_s: from the loss detected to the next attempt
                       started (health check, re-plan, sync to the spare, probe, preflight)
Against the same job cold-started on node1 + node3 by a person who noticed (`ddpfab run`
with nothing to sync): launch -> first step. Writes bench/results/recovery.json.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, REPO, log

SCRIPT = "tests/lab/scripts/ckpt_steps.py"
CAP = 180.0


class Watch:
    """A ddpfab process whose output lines are stamped as they come."""

    def __init__(self, argv: list[str], cwd: Path):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=common.env_with(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def steps(self) -> list[dict]:
        return [json.loads(ln.split("STEP ", 1)[1]) for ln in list(self.lines) if "STEP {" in ln]

    def wait(self, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline or self.proc.poll() is not None and not cond():
                raise RuntimeError("gave up waiting:\n" + "".join(self.lines[-30:]))
            time.sleep(0.05)


def source_tree(work: Path) -> Path:
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(REPO / "ddpfab", src / "ddpfab", ignore=shutil.ignore_patterns("__pycache__"))
    (src / Path(SCRIPT).parent).mkdir(parents=True)
    shutil.copy(REPO / SCRIPT, src / SCRIPT)
    return src


def inventory(lab, path: Path, names: list[str], spares: bool) -> Path:
    import yaml

    common.write_inventory(lab, names, path, ddpfab_workdir=f"/opt/ddpfab-bench-recovery-{uuid.uuid4().hex[:8]}")
    if spares:
        inv = yaml.safe_load(path.read_text())
        inv["all"]["children"] = {"spares": {"hosts": {"node3": None}}}
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def job_gone(lab, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while lab.processes(name) and time.monotonic() < deadline:
        time.sleep(0.1)


def recovery_trial(lab, work: Path, src: Path, rep: int) -> dict:
    ckpt = Path(lab.shared_dir) / f"bench-recovery-{uuid.uuid4().hex[:8]}"
    inv = inventory(lab, work / f"inv-{rep}.yml", ["node1", "node2", "node3"], spares=True)
    runs = work / f"runs-{rep}"
    shutil.rmtree(runs, ignore_errors=True)
    w = Watch([PYTHON, "-m", "ddpfab", "run", "-i", str(inv), "--no-color", "--runs-dir", str(runs),
               "--max-job-restarts", "1", "--spares", "spares", "--env", f"CKPT_DIR={ckpt}", "--env", "STEPS=40",
               "--env", "STEP_S=0.3", SCRIPT], src)
    veth = lab.host("node2").veth
    try:
        w.wait(lambda: sum(s["step"] >= 3 for s in w.steps()) >= 2, CAP)
        t_cut = time.time()
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        w.wait(lambda: any(s["restart"] == 1 for s in w.steps()), CAP)
        first = min(s["t"] for s in w.steps() if s["restart"] == 1)
        w.proc.wait(timeout=CAP)
        job_gone(lab, "node2", 30)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        common.stop_process(w.proc, timeout=3)
        shutil.rmtree(ckpt, ignore_errors=True)
    manifests = [json.loads(p.read_text()) for p in runs.glob("*/manifest.json")]
    root = next(m for m in manifests if m.get("recovery") and not m.get("recovery_of"))
    a0, a1 = root["recovery"]["attempts"][:2]
    return {"exit_code": w.proc.returncode, "loss_to_first_step": first - t_cut,
            "loss_to_detected": a0["ended"] - t_cut, "recovery_s": a1["recovery_s"],
            "attempt_start_to_first_step": first - a1["started"], "replaced": a1["replaced"]}


def cold_trial(lab, work: Path, src: Path, rep: int) -> float:
    ckpt = Path(lab.shared_dir) / f"bench-recovery-cold-{uuid.uuid4().hex[:8]}"
    inv = inventory(lab, work / f"inv-cold-{rep}.yml", ["node1", "node3"], spares=False)
    # the code is on the nodes already (a person re-running after noticing): sync it once first
    subprocess.run([PYTHON, "-m", "ddpfab", "sync", "-i", str(inv)], cwd=src, env=common.env_with(),
                   capture_output=True, check=True)
    t0 = time.time()
    w = Watch([PYTHON, "-m", "ddpfab", "run", "-i", str(inv), "--no-color", "--runs-dir", str(work / "runs-cold"),
               "--env", f"CKPT_DIR={ckpt}", "--env", "STEPS=2", "--env", "STEP_S=0", SCRIPT], src)
    try:
        w.wait(lambda: bool(w.steps()), CAP)
        first = min(s["t"] for s in w.steps())
        w.proc.wait(timeout=CAP)
    finally:
        common.stop_process(w.proc, timeout=3)
        shutil.rmtree(ckpt, ignore_errors=True)
    return first - t0


def main() -> int:
    parser = common.base_parser("recovery", __doc__, reps=3, quick_reps=1)
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    work = common.WORK_ROOT / "recovery"
    work.mkdir(parents=True, exist_ok=True)
    trials, cold = [], []
    with common.bench_lab("recovery", 3, args.subnet) as lab:
        src = source_tree(work)
        for rep in range(reps):
            t = recovery_trial(lab, work, src, rep)
            log(f"rep {rep + 1}/{reps}: loss -> first step {t['loss_to_first_step']:.1f} s "
                f"(detected {t['loss_to_detected']:.1f} s, recovery {t['recovery_s']:.1f} s, exit {t['exit_code']})")
            trials.append(t)
            c = cold_trial(lab, work, src, rep)
            log(f"rep {rep + 1}/{reps}: cold start -> first step {c:.1f} s")
            cold.append(c)
    data = {"trials": trials, "summary": {
        key: common.summarize([t[key] for t in trials]) for key in
        ("loss_to_first_step", "loss_to_detected", "recovery_s", "attempt_start_to_first_step")}}
    data["summary"]["cold_start_to_first_step"] = common.summarize(cold)
    common.write_result(args.out, "recovery", args, {"hosts": 3, "step_s": 0.3, "reps": reps}, data, meta, started)
    return 0 if all(t["exit_code"] == 0 for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
