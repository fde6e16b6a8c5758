#!/usr/bin/env python3
"""Where a run's CPU goes: `ddpfab run` (warm and cold) beside pdsh + torchrun on 8 hosts, each
process's CPU-seconds from the kernel's process accounting, by what it is.

    .venv/bin/python bench/run_cpu.py              # 8 hosts, 5 repetitions (as root: accton)
    .venv/bin/python bench/run_cpu.py --quick      # 4 hosts, 1 repetition

On this lab every node's processes share the controller's cores, and a run at 8 hosts is CPU-bound
(each torchrun and each rank imports torch): what a launcher adds in CPU-seconds is what it adds in
wall time, divided by the cores. bench/warm.py measures the time; this says where it goes.

The commands and the job are bench/warm.py's (each once the CPUs are quiet, in rotating order);
accounting is on from the command's start until 3 s after its exit (what it left running ends in
that time). A process is the controller's when it is the launcher or below it; a node's
otherwise (its sshd's children). On a node a process that mapped torch is a torchrun, or a rank
when its parent did too. The holder's CPU over a warm command is read from its /proc.
Writes bench/results/run_cpu.json: per command and kind, the median CPU-seconds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import launch as launchbench
import suite_cpu
import warm as warmbench
from common import log

from ddpfab.remote import spares

#: How long accounting stays on after the command's exit: its nodes' teardown ends in that time.
AFTER_S = 3.0


def kind(p: suite_cpu.Proc, launcher: suite_cpu.Proc) -> str:
    """What *p* is: the controller's (the launcher, or below it) or a node's, and which part."""
    if any(q is launcher for q in (p, *suite_cpu._ancestors(p))):
        if p is launcher or p.comm.startswith(("python", "pdsh")):
            return "controller: the launcher (ddpfab's python, or pdsh)"
        return "controller: ssh, rsync, tools"
    if p.vsz_kb >= suite_cpu.TORCH_VSZ_KB:
        parent = p.parent
        return "node: rank" if parent is not None and parent.vsz_kb >= suite_cpu.TORCH_VSZ_KB else "node: torchrun"
    if p.comm.startswith("python"):
        return "node: ddpfab's python (node program, supervisor)"
    return "node: sshd, shells, tools"


def holders_cpu() -> float:
    """CPU-seconds so far of every `ddpfab hold` process here (its server: ddpfab.remote.holder's child)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if b"ddpfab.remote.holdserver" in (d / "cmdline").read_bytes():  # (python -c: holder._CHILD)
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def accounted(fn, bench: launchbench.Bench, pacct: Path, held: bool) -> dict[str, float]:
    """*fn()* under process accounting: CPU-seconds by kind; with *held* (a warm command), the
    holder's over it too (it runs beside the others, keeping its connections and spares)."""
    pacct.write_bytes(b"")
    holder0 = holders_cpu()
    subprocess.run(["accton", str(pacct)], check=True, stdout=subprocess.DEVNULL)
    try:
        fn()
        time.sleep(AFTER_S)
    finally:
        subprocess.run(["accton", "off"], check=False, stdout=subprocess.DEVNULL)
    procs = suite_cpu.read(str(pacct))
    launcher = next((p for p in reversed(procs) if p.pid == bench.last_pid), None)  # (pids recur: the latest)
    if launcher is None:
        raise RuntimeError("the launcher's own record is missing from the accounting")
    cpu: Counter = Counter()
    for p in procs:
        cpu[kind(p, launcher)] += p.cpu
    if held:
        cpu["controller: the holder (ddpfab hold)"] += holders_cpu() - holder0
    return dict(cpu)


def main() -> int:
    parser = common.base_parser("run_cpu", __doc__, reps=5, quick_reps=1)
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    n = 4 if args.quick else 8
    work = common.WORK_ROOT / "run_cpu"
    shutil.rmtree(work / "runs", ignore_errors=True)
    (work / "work").mkdir(parents=True, exist_ok=True)
    (work / "work" / launchbench.SCRIPT).write_text(launchbench.HELLO)  # before the lab: hosts see it
    commands = {"ddpfab run (warm)": None, "ddpfab run (cold)": None, "pdsh + torchrun": None}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
    scratch = Path(tempfile.mkdtemp(prefix="run-cpu-"))
    with common.bench_lab("run_cpu", n, args.subnet) as lab:
        w = warmbench.Warm(lab, work, {n})
        w.b.procs.skip = (" ddpfab-node",)  # the holder's spares wait there until they end
        fns = {"ddpfab run (warm)": lambda: w.run(n, True), "ddpfab run (cold)": lambda: w.run(n, False),
               "pdsh + torchrun": lambda: w.b.pdsh(n)["ready"]}
        w.hold(n, True)
        try:
            w.run(n, False)
            w.run(n, True)  # warm-up: the holder's spares
            for rep in range(reps):
                order = list(fns)[rep % 3:] + list(fns)[:rep % 3]
                for label in order:
                    time.sleep(spares.IDLE_S + 0.5)
                    common.quiet()
                    samples[label].append(accounted(fns[label], w.b, scratch / "pacct", "warm" in label))
                log(f"rep {rep + 1}/{reps}: " + "  ".join(f"{k}={sum(v[-1].values()):.2f} CPU-s" for k, v in samples.items()))
        finally:
            w.hold(n, False)
            shutil.rmtree(scratch, ignore_errors=True)
    result = {}
    for label, runs in samples.items():
        kinds = sorted({k for r in runs for k in r})
        result[label] = {"total": round(statistics.median(sum(r.values()) for r in runs), 3),
                         "kinds": {k: round(statistics.median(r.get(k, 0.0) for r in runs), 3) for k in kinds},
                         "runs": len(runs)}
        log(f"{label}: {result[label]['total']:.2f} CPU-s  " +
            "  ".join(f"{k}={v:.2f}" for k, v in result[label]["kinds"].items()))
    common.write_result(args.out, "run_cpu", args, {"hosts": n, "script": launchbench.SCRIPT,
                                                    "cores": os.cpu_count()}, {"commands": result}, meta, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
