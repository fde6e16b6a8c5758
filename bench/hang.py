#!/usr/bin/env python3
"""Hang: from a rank stopped with SIGSTOP to the first message that says something is wrong.

    .venv/bin/python bench/hang.py             # N = 4 hosts x 1 process, 2 reps of ddpfab, 1 of each baseline
    .venv/bin/python bench/hang.py --quick     # N = 2, 1 rep, cap 90 s

The job: gloo, READY, then an all_reduce every 50 ms and a line every 20 steps (so a healthy job is
never quiet for long). t=0 is the SIGSTOP of the last rank (found by RANK in its environ, signalled
from the root namespace); t ends at the first line a launcher prints after t=0 that is not the
job's own progress line:
  ddpfab run        --hang-timeout H --on-hang stop: the doctor's verdict (`hang: nodeN rank R ... is
                    stopped`); also recorded: when the job was gone (ddpfab ends it)
  pdsh + torchrun   pdsh -w node[1-N] 'torchrun ...': the ranks' collective timeout error
  torchrun alone    one ssh + torchrun per host: the same
The collective timeout is the process group's (BENCH_PG_TIMEOUT, default 60 s, set for every
launcher alike: a user's default is 30 minutes for gloo, which no benchmark waits for; reported as
such). A launcher still silent at the cap is recorded as "> cap". Writes bench/results/hang.json.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, log
from teardown import Bench, Launch

SIZES = (4,)
QUICK_SIZES = (2,)
SCRIPT = "bench_hang.py"
JOB = """import datetime, os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "60"))))
rank = dist.get_rank()
print("READY", rank, flush=True)
t = torch.zeros(1)
step = 0
while True:
    dist.all_reduce(t)
    if step % 20 == 0:
        print("TICK", rank, step, flush=True)
    step += 1
    time.sleep(0.05)
"""
LAUNCHERS = ("ddpfab run", "pdsh + torchrun", "torchrun alone")
HANG_TIMEOUT_S = 10


class HangBench(Bench):
    def torchrun_cmd(self, n: int, env: str) -> str:
        return super().torchrun_cmd(n, env).replace(" bench_crash.py", f" {SCRIPT}")

    def start(self, launcher: str, n: int, scenario: str) -> Launch:
        if launcher != "ddpfab run":
            return super().start(launcher, n, scenario)
        argv = [PYTHON, "-m", "ddpfab", "run", "-i", str(self.inv[n]), "--no-color", "--runs-dir", str(self.runs),
                *self.no_sync, "--hang-timeout", str(HANG_TIMEOUT_S), "--on-hang", "stop"]
        for k, v in self.job_env.items():
            argv += ["--env", f"{k}={v}"]
        return Launch([subprocess.Popen([*argv, SCRIPT], env=common.env_with(), cwd=self.wd, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                        errors="replace", bufsize=1)])

    def trial_hang(self, launcher: str, n: int) -> dict:
        pid = None
        launch = self.start(launcher, n, "hang")
        try:
            pid = self.procs.find_rank(f"node{n}", n - 1, SCRIPT, self.start_timeout)
            if pid is None:
                raise RuntimeError(f"rank {n - 1} never appeared on node{n}:\n" + "\n".join(launch.out[-40:]))
            launch.wait_ready(n, self.start_timeout)
            time.sleep(2.0)  # training
            t0 = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            said = gone = first = None
            while time.monotonic() - t0 < self.cap:
                with launch.lock:
                    after = [(t, line) for t, line in launch.stamps if t > t0 and "TICK" not in line
                             and line.strip()]
                if after and said is None:
                    said = after[0][0] - t0
                    first = after[0][1].strip()[:200]
                if said is not None and (launcher != "ddpfab run" or launch.exited()):
                    break
                time.sleep(0.05)
            if launcher == "ddpfab run" and launch.exited():
                gone = time.monotonic() - t0
            verdict = next((t - t0 for t, line in launch.stamps if t > t0 and "is stopped (SIGSTOP" in line), None)
            return {"said": said, "first_line": first, "verdict": verdict,
                    "ddpfab_exit": gone}
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except (OSError, TypeError):
                pass
            launch.stop()
            self.procs.kill_all()


def main() -> int:
    parser = common.base_parser("hang", __doc__, reps=2, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 4; --quick 2)")
    parser.add_argument("--cap", type=float, help="seconds after which a launcher counts as silent (default 150; "
                                                  "--quick 90)")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="the job's collective timeout (default 60)")
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    cap = args.cap or (90.0 if args.quick else 150.0)
    work = common.WORK_ROOT / "hang"
    shutil.rmtree(work / "runs", ignore_errors=True)
    (work / "work").mkdir(parents=True, exist_ok=True)
    (work / "work" / SCRIPT).write_text(JOB)
    results: dict[tuple[str, int], list[dict]] = {}
    with common.bench_lab("hang", max(sizes), args.subnet) as lab:
        b = HangBench(lab, work, sizes, cap)
        b.job_env = {"BENCH_PG_TIMEOUT": f"{args.pg_timeout:g}"}
        for rep in range(reps):
            for n in sizes:
                for launcher in LAUNCHERS:
                    if launcher != "ddpfab run" and rep > 0:
                        continue  # the baselines wait for the collective timeout: once is enough
                    r = b.trial_hang(launcher, n)
                    results.setdefault((launcher, n), []).append(r)
                    log(f"rep {rep + 1} N={n} {launcher:<16} first message after "
                        f"{'%.1f s' % r['said'] if r['said'] is not None else '> cap'}: {r['first_line']}")
    series = [{"tool": launcher, "hosts": n, **common.summarize([r["said"] for r in rs], cap=cap),
               "verdict": common.summarize([r["verdict"] for r in rs]) if launcher == "ddpfab run" else None,
               "first_lines": [r["first_line"] for r in rs]}
              for (launcher, n), rs in sorted(results.items())]
    config = {"sizes": list(sizes), "cap_s": cap, "pg_timeout_s": args.pg_timeout, "hang_timeout_s": HANG_TIMEOUT_S,
              "nproc_per_node": 1, "launchers": list(LAUNCHERS), "script": JOB}
    common.write_result(args.out, "hang", args, config, {"series": series}, meta, started)
    for s in series:
        log(f"{s['tool']:<16} N={s['hosts']}: {common.fmt(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
