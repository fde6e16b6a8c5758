#!/usr/bin/env python3
"""Run every benchmark, then regenerate docs/benchmarks.md and the plots. As root, on a quiet machine:

    .venv/bin/python bench/run_all.py            # ~20 min on 2 idle cores (estimated); --reps 2: ~15 min
    .venv/bin/python bench/run_all.py --quick    # smoke test of the harness (~6 min; numbers not for the docs)
    .venv/bin/python bench/run_all.py --only fanout,teardown

Each benchmark runs as its own process (its own lab, taken down when it ends) and writes
bench/results/<name>.json; a failing benchmark is reported and the others still run; the report
is regenerated from whatever results exist. Exit status: 0 when every benchmark succeeded.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
BENCHMARKS = ("fanout", "launch", "teardown", "provision", "recovery")


def run_child(cmd: list[str]) -> int | None:
    """Run one benchmark; on Ctrl-C or SIGTERM let it take its lab down before returning None."""
    proc = subprocess.Popen(cmd)

    def forward(signum, frame):
        proc.send_signal(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reached the benchmark too (same process group): it is cleaning up
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--reps", type=int, help="pass --reps R to every benchmark (e.g. 1 for a fast full-size check)")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmarks bring up labs of namespace hosts")
    chosen = [b.strip() for b in args.only.split(",")] if args.only else list(BENCHMARKS)
    chosen = [b for b in chosen if b not in {s.strip() for s in args.skip.split(",")}]
    unknown = set(chosen) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    busy = common.cpu_busy()
    if busy > common.BUSY_LIMIT:
        print(f"run_all: WARNING: {100 * busy:.0f}% of the CPUs busy with other work: the numbers will be noisy "
              "(and flagged as such in docs/benchmarks.md)", file=sys.stderr)
    failed = []
    t_all = time.monotonic()
    for name in chosen:
        t0 = time.monotonic()
        print(f"run_all: === {name} ===", file=sys.stderr, flush=True)
        cmd = [sys.executable, str(HERE / f"{name}.py")] + (["--quick"] if args.quick else [])
        cmd += ["--reps", str(args.reps)] if args.reps else []
        rc = run_child(cmd)
        if rc is None:
            print("run_all: interrupted (the benchmark took its lab down)", file=sys.stderr)
            return 130
        print(f"run_all: {name} {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
        if rc != 0:
            failed.append(name)
    rc = subprocess.run([sys.executable, str(HERE / "report.py")], check=False).returncode
    print(f"run_all: done in {time.monotonic() - t_all:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
