#!/usr/bin/env python3
"""Warm connections: `ddpfab run` and `ddpfab check --fast` with `ddpfab hold` running, beside the
same commands cold and the plainest SSH fan-out.

    .venv/bin/python bench/warm.py                       # run on 8 hosts, check --fast on 8 and 32, 3 reps
    .venv/bin/python bench/warm.py --check-sizes 8,128   # the issue's 128-host check
    .venv/bin/python bench/warm.py --quick               # run on 4 hosts, check on 4, 1 rep

Measured from process spawn:
  ddpfab run (cold)        python -m ddpfab run -i INV bench_hello.py, to every rank's READY line
  ddpfab run (warm)        the same with `ddpfab hold -i INV` running (its connections made before)
  pdsh + torchrun          pdsh -w node[1-N] 'python -m torch.distributed.run ...' (bench/launch.py's)
  check --fast (cold/warm) python -m ddpfab check -i INV --fast, to its exit
Cold and warm use two copies of one inventory (the holder serves the one it was started for), in
alternating order within each repetition; each timed command starts once the CPUs are quiet
(common.quiet: what the one before left running, its nodes' teardown or the holder's spares, has
ended). The job prints one line right after `import torch`, with when it printed and when its
torchrun started: each run's timeline (the last node's torchrun started, the last rank printed,
its line reached here) says where a difference arises, before the nodes start or after.
Writes bench/results/warm.json: medians, ranges and the paired differences and ratios.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import launch as launchbench
from common import PYTHON, log

from ddpfab.remote import spares


def ddpfab(*args: str, cwd: Path, timeout: float = 600) -> tuple[int, float, str]:
    t0 = time.monotonic()
    res = subprocess.run([PYTHON, "-m", "ddpfab", *args], capture_output=True, text=True, cwd=cwd,
                         env=common.env_with(), timeout=timeout)
    return res.returncode, time.monotonic() - t0, res.stdout[-2000:] + res.stderr[-2000:]


class Warm:
    def __init__(self, lab, work: Path, sizes: set[int]):
        self.b = launchbench.Bench(lab, work, sorted(sizes))
        self.cold = {n: self._copy(p) for n, p in self.b.inv.items()}
        self.wd = self.b.wd

    @staticmethod
    def _copy(path: Path) -> Path:
        cold = path.with_name(path.stem + "-cold.yml")
        shutil.copyfile(path, cold)
        return cold

    def hold(self, n: int, on: bool) -> None:
        code, _, out = ddpfab("hold", "-i", str(self.b.inv[n]), *(() if on else ("--stop",)), cwd=self.wd)
        if on and (code != 0 or f"holding {n}/{n}" not in out):
            raise RuntimeError(f"hold on {n} hosts: {out}")

    def run(self, n: int, warm: bool) -> dict[str, float]:
        """One run's :meth:`launch.Run.timeline`: its torchruns' start, its ranks' line, the line here."""
        inv = self.b.inv[n] if warm else self.cold[n]
        saved, self.b.inv[n] = self.b.inv[n], inv
        try:
            return self.b.ddpfab(n)["timeline"]
        finally:
            self.b.inv[n] = saved

    def check(self, n: int, warm: bool) -> float:
        code, took, out = ddpfab("check", "-i", str(self.b.inv[n] if warm else self.cold[n]), "--fast", cwd=self.wd)
        if code != 0:
            raise RuntimeError(f"check --fast on {n} hosts exited {code}: {out}")
        return took


def main() -> int:
    parser = common.base_parser("warm", __doc__, reps=3, quick_reps=1)
    parser.add_argument("--run-size", type=int, help="hosts of the run comparison (default 8; --quick 4)")
    parser.add_argument("--check-sizes", help="comma-separated host counts of check --fast (default 8,32; --quick 4)")
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    run_n = args.run_size or (4 if args.quick else 8)
    check_sizes = [int(x) for x in (args.check_sizes or ("4" if args.quick else "8,32")).split(",")]
    work = common.WORK_ROOT / "warm"
    shutil.rmtree(work / "runs", ignore_errors=True)
    (work / "work").mkdir(parents=True, exist_ok=True)
    (work / "work" / launchbench.SCRIPT).write_text(launchbench.HELLO)  # before the lab: hosts see it
    samples: dict[str, list[float]] = {}
    timeline: dict[str, list[float]] = {}  # the runs' steps before their line here
    failures: list[dict] = []

    def take(label: str, fn) -> None:
        """One sample of *fn*: a time, or a run's timeline (its "line here" is the label's time,
        the steps before it go to series of their own: ``LABEL: torchrun started``...)."""
        time.sleep(spares.IDLE_S + 0.5)  # past the holder's wait before it starts its spares
        common.quiet()
        try:
            got = fn()
            if isinstance(got, dict):
                for step, t in got.items():
                    if step != "line here":
                        timeline.setdefault(f"{label}: {step}", []).append(t)
                got = got["line here"]
            samples.setdefault(label, []).append(got)
        except RuntimeError as exc:  # a lost sample is recorded, not the end of the benchmark
            log(f"{label} failed: {str(exc)[:300]}")
            failures.append({"what": label, "error": str(exc)[-2000:]})

    with common.bench_lab("warm", max([run_n, *check_sizes]), args.subnet) as lab:
        w = Warm(lab, work, {run_n, *check_sizes})
        w.b.procs.skip = (" ddpfab-node",)  # the holders' spares wait there until they end
        for n in sorted({run_n, *check_sizes}):
            w.hold(n, True)
        try:
            log("warm-up: one untimed cold and warm run, one warm check per size (the holder's spares)")
            w.run(run_n, False)
            w.run(run_n, True)
            for n in check_sizes:
                w.check(n, True)
            for rep in range(reps):
                order = (False, True) if rep % 2 == 0 else (True, False)
                for warm in order:
                    take(f"ddpfab run ({'warm' if warm else 'cold'}), {run_n} hosts", lambda warm=warm: w.run(run_n, warm))
                take(f"pdsh + torchrun, {run_n} hosts", lambda: w.b.pdsh(run_n)["timeline"])
                for n in check_sizes:
                    for warm in order:
                        take(f"check --fast ({'warm' if warm else 'cold'}), {n} hosts", lambda n=n, warm=warm: w.check(n, warm))
                log(f"rep {rep + 1}/{reps}: " + "  ".join(f"{k}={v[-1]:.2f}" for k, v in samples.items()))
        finally:
            for n in sorted({run_n, *check_sizes}):
                w.hold(n, False)

    def paired(a: str, b: str) -> dict:
        return launchbench.paired(samples.get(a, []), samples.get(b, []))

    def ratio(a: str, b: str) -> dict:
        pairs = sorted(x / y for x, y in zip(samples.get(a, []), samples.get(b, []), strict=False) if y)
        if not pairs:
            return {}
        ci = common.median_ci(pairs)
        return {"median": round(statistics.median(pairs), 3), "min": round(pairs[0], 3), "max": round(pairs[-1], 3),
                "runs": len(pairs), "ci95": None if ci is None else [round(ci[0], 3), round(ci[1], 3)]}

    run_w, run_c, pdsh = (f"ddpfab run (warm), {run_n} hosts", f"ddpfab run (cold), {run_n} hosts",
                          f"pdsh + torchrun, {run_n} hosts")
    comparisons = {
        f"run warm - pdsh+torchrun, {run_n} hosts (s)": paired(run_w, pdsh),
        f"run cold - pdsh+torchrun, {run_n} hosts (s)": paired(run_c, pdsh),
        f"run warm / run cold, {run_n} hosts": ratio(run_w, run_c),
        **{f"{step}: warm - pdsh+torchrun, {run_n} hosts (s)": launchbench.paired(timeline.get(f"{run_w}: {step}", []),
                                                                                 timeline.get(f"{pdsh}: {step}", []))
           for step in ("torchrun started", "rank printed")},
        **{f"check --fast warm / cold, {n} hosts": ratio(f"check --fast (warm), {n} hosts",
                                                          f"check --fast (cold), {n} hosts") for n in check_sizes},
    }
    for k, v in comparisons.items():
        log(f"{k}: {v}")
    series = [{"what": k, "hosts": int(k.rsplit(" ", 2)[1]), **common.summarize(v)} for k, v in samples.items()]
    steps = [{"what": k, **common.summarize(v)} for k, v in timeline.items()]
    common.write_result(args.out, "warm", args,
                        {"run_hosts": run_n, "check_hosts": check_sizes, "script": launchbench.SCRIPT},
                        {"series": series, "timeline": steps, "comparisons": comparisons, "failures": failures}, meta, started)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
