#!/usr/bin/env python3
"""Teardown: from a rank's crash (or a Ctrl-C) to the last job process gone on every host.

    .venv/bin/python bench/teardown.py            # N = 2 4 8; ddpfab 3 reps, baselines 1 (~6 min on 2 idle cores)
    .venv/bin/python bench/teardown.py --quick    # N = 2 4, 1 rep, cap 10 s: a smoke test

The job: 1 process per host, gloo process group (init timeout 60 s), READY, a barrier, then an
all_reduce every 50 ms. Scenarios:
  crash    the last rank calls os._exit(17) 2 s after the barrier; the others are inside
           all_reduce. t=0 is the moment the crashed process is gone from /proc (polled every
           5 ms from the root namespace, found by RANK in its environ, as tests/lab/test_faults.py does).
  sigint   all ranks READY and 1 s into the loop, then Ctrl-C for the launcher; t=0 is the signal.
t ends when no process of the job (cmdline naming the job script: torchrun, workers, shells,
ddpfab's supervisor) is left on any host (also recorded: when only supervisors/shells were left), read from each host's process table in the root
namespace (one /proc pass per poll, the same view as ddpfab.lab.Lab.processes). Launchers:
  ddpfab run        python -m ddpfab run -i INV --no-sync bench_crash.py; Ctrl-C = SIGINT to ddpfab
                    (--no-sync: the code sync before the start does not touch teardown; launch.py
                    measures it)
  pdsh + torchrun   pdsh -R ssh -w node[1-N] 'cd WD && torchrun --nnodes N --node-rank K ...';
                    Ctrl-C = two SIGINTs to pdsh 0.2 s apart (pdsh aborts on the second within 1 s)
  torchrun alone    one `ssh nodeK 'cd WD && torchrun ...'` per host, as from N terminals;
                    Ctrl-C = SIGINT to node1's torchrun (Ctrl-C in node 1's terminal)
A run still not gone after the cap (30 s) is recorded as "> cap", killed, and not repeated.
Writes bench/results/teardown.json.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, log

SIZES = (2, 4, 8)
QUICK_SIZES = (2, 4)
SCRIPT = "bench_crash.py"
JOB = """import datetime, os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "60"))))
rank = dist.get_rank()
print("READY", rank, flush=True)
dist.barrier()
t = torch.zeros(1)
if rank == int(os.environ.get("BENCH_FAIL_RANK", "-1")):
    time.sleep(float(os.environ.get("BENCH_FAIL_AFTER", "2")))
    os._exit(17)  # a crash: no cleanup, no destroy_process_group
while True:  # the others: in a collective, waiting for the crashed rank
    dist.all_reduce(t)
    time.sleep(0.05)
"""
LAUNCHERS = ("ddpfab run", "pdsh + torchrun", "torchrun alone")
SCENARIOS = ("crash", "sigint")
START_TIMEOUT = 180


class Launch:
    """One launcher process (or several, for torchrun alone) whose stdout is watched for READY."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.ready: set[int] = set()
        self.out: list[str] = []
        self.stamps: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        for p in procs:
            threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p):
        for line in p.stdout:
            with self.lock:
                self.out.append(line.rstrip("\n"))
                self.stamps.append((time.monotonic(), line))
                if "READY " in line:
                    try:
                        self.ready.add(int(line.split("READY ", 1)[1].split()[0]))
                    except (ValueError, IndexError):
                        pass

    def wait_ready(self, world: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < world:
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"only ranks {sorted(self.ready)} of {world} came up:\n" + "\n".join(self.out[-40:]))
            time.sleep(0.02)

    def exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            common.stop_process(p, timeout=3)


class Bench:
    def __init__(self, lab, work: Path, sizes, cap: float, start_timeout: float = START_TIMEOUT):
        self.lab, self.work, self.cap, self.start_timeout = lab, work, cap, start_timeout
        self.job_env: dict[str, str] = {}  # more environment for the job (every launcher)
        self.wd = work / "work"
        self.runs = work / "runs"
        self.inv = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}
        self.procs = common.HostProcs(lab, [h.name for h in lab.hosts])
        self.port = common.MASTER_PORT_BASE + 200
        # the code sync `run` does first is irrelevant here (t=0 comes later) and measured by launch.py
        from launch import has_sync_flag

        self.no_sync = ["--no-sync"] if has_sync_flag() else []

    def torchrun_cmd(self, n: int, env: str) -> str:
        self.port += 1
        master = self.lab.host("node1").address
        return (f"cd {self.wd} && {env} exec {PYTHON} -m torch.distributed.run --nnodes={n} "
                f"--node-rank=$(( $(hostname | tr -dc 0-9) - 1 )) --nproc-per-node=1 "
                f"--master-addr={master} --master-port={self.port} {SCRIPT}")

    def start(self, launcher: str, n: int, scenario: str) -> Launch:
        fail = {**self.job_env, **({"BENCH_FAIL_RANK": str(n - 1)} if scenario == "crash" else {})}
        pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL, "text": True,
                "errors": "replace", "bufsize": 1}
        if launcher == "ddpfab run":
            argv = [PYTHON, "-m", "ddpfab", "run", "-i", str(self.inv[n]), "--no-color", "--runs-dir", str(self.runs),
                    *self.no_sync]
            for k, v in fail.items():
                argv += ["--env", f"{k}={v}"]
            return Launch([subprocess.Popen([*argv, SCRIPT], env=common.env_with(), cwd=self.wd, **pipe)])
        env = " ".join(f"{k}={v}" for k, v in fail.items())
        if launcher == "pdsh + torchrun":
            # -f N: all N torchruns must start (see bench/launch.py: pdsh's default window is 32)
            return Launch([subprocess.Popen(["pdsh", "-f", str(max(n, 32)), "-w", common.pdsh_hosts(n),
                                             self.torchrun_cmd(n, env)],
                                            env=common.pdsh_env(self.lab), cwd=self.wd, **pipe)])
        cmd = self.torchrun_cmd(n, env)
        return Launch([subprocess.Popen(["ssh", "-F", str(self.lab.ssh_config), name, cmd], env=common.env_with(),
                                        cwd=self.wd, **pipe) for name in common.names(n)])

    def interrupt(self, launcher: str, launch: Launch) -> None:
        if launcher == "ddpfab run":
            launch.procs[0].send_signal(signal.SIGINT)
        elif launcher == "pdsh + torchrun":
            launch.procs[0].send_signal(signal.SIGINT)
            time.sleep(0.2)
            launch.procs[0].send_signal(signal.SIGINT)
        else:
            torchrun = [p for p, cmd in self.procs.scan(SCRIPT)["node1"] if "torch.distributed.run" in cmd
                        and not cmd.startswith(("sh ", "bash ", "/bin/sh", "/bin/bash"))]
            if not torchrun:
                raise RuntimeError("no torchrun process on node1")
            import os

            for p in torchrun:
                os.kill(p, signal.SIGINT)

    def trial(self, launcher: str, n: int, scenario: str) -> dict:
        launch = self.start(launcher, n, scenario)
        try:
            if scenario == "crash":
                pid = self.procs.find_rank(f"node{n}", n - 1, SCRIPT, self.start_timeout)
                if pid is None:
                    raise RuntimeError(f"rank {n - 1} never appeared on node{n}:\n" + "\n".join(launch.out[-40:]))
                launch.wait_ready(n, self.start_timeout)
                while common.pid_alive(pid):
                    time.sleep(0.005)
                t0 = time.monotonic()
            else:
                launch.wait_ready(n, self.start_timeout)
                time.sleep(1.0)
                t0 = time.monotonic()
                self.interrupt(launcher, launch)
            gone = exited = training = None
            last: list[str] = []
            while True:
                now = time.monotonic()
                if exited is None and launch.exited():
                    exited = now - t0
                left = self.procs.scan(SCRIPT)
                if not any(left.values()):
                    gone = now - t0
                    if training is None:
                        training = gone
                    break
                last = sorted(f"{h}:{kind(cmd)}" for h, ps in left.items() for _, cmd in ps)
                if training is None and all(k.endswith((":ddpfab-supervisor", ":shell")) for k in last):
                    training = now - t0  # torchrun and its workers are gone; their supervisor is finishing
                if now - t0 > self.cap:
                    break
                time.sleep(0.01)
            if exited is None:  # how long the launcher takes to return (informative)
                deadline = time.monotonic() + 3
                while not launch.exited() and time.monotonic() < deadline:
                    time.sleep(0.01)
                exited = time.monotonic() - t0 if launch.exited() else None
            left = {} if gone is not None else {h: len(v) for h, v in self.procs.scan(SCRIPT).items() if v}
            # ddpfab says "<node> (node_rank K) failed (...); stopping the other nodes" when it noticed
            noticed = next((t - t0 for t, line in launch.stamps if "stopping the other nodes" in line), None)
            return {"gone": gone, "launcher_exit": exited, "training_gone": training, "noticed": noticed,
                    "left": left, "last": last}
        finally:
            launch.stop()
            self.procs.kill_all()


def kind(cmd: str) -> str:
    """What a job process is, for the record of which ones went last."""
    if "ddpfab-agent" in cmd:  # the loader's words after the program (ddpfab.remote.nodeprogram.supervisor_words)
        return "ddpfab-supervisor"
    if "torch.distributed.run" in cmd:
        return "torchrun"
    if cmd.startswith(("sh ", "bash ", "/bin/sh ", "/bin/bash ")):
        return "shell"
    return "worker"


def main() -> int:
    parser = common.base_parser("teardown", __doc__, reps=3, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 2,4,8; --quick 2,4)")
    parser.add_argument("--baseline-reps", type=int, help="repetitions for pdsh/torchrun (default 1: they either "
                        "hit the cap, which is not repeated, or end when gloo notices; --reps if smaller)")
    parser.add_argument("--cap", type=float, help="seconds after which a teardown counts as '> cap' (default 30; "
                                                  "--quick 10)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset of: "
                        + ", ".join(LAUNCHERS))
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    base_reps = args.baseline_reps or 1
    cap = args.cap or (10.0 if args.quick else 30.0)
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    work = common.WORK_ROOT / "teardown"
    shutil.rmtree(work / "runs", ignore_errors=True)  # run records of earlier runs
    (work / "work").mkdir(parents=True, exist_ok=True)
    (work / "work" / SCRIPT).write_text(JOB)
    results: dict[tuple[str, str, int], list[dict]] = {}
    with common.bench_lab("teardown", max(sizes), args.subnet) as lab:
        b = Bench(lab, work, sizes, cap)
        for rep in range(max(reps, base_reps)):
            for i, n in enumerate(sizes):
                for scenario in SCENARIOS:
                    k = (rep + i) % len(launchers)
                    for launcher in launchers[k:] + launchers[:k]:
                        want = reps if launcher == "ddpfab run" else base_reps
                        done = results.get((launcher, scenario, n), [])
                        if len(done) >= want or any(r["gone"] is None for r in done):
                            continue  # enough, or already beyond the cap once: no point waiting again
                        r = b.trial(launcher, n, scenario)
                        results.setdefault((launcher, scenario, n), []).append(r)
                        g = f"{r['gone']:.2f} s" if r["gone"] is not None else f"> {cap:g} s (left: {r['left']})"
                        log(f"rep {rep + 1} N={n} {scenario:<6} {launcher:<16} gone after {g}")
    series = []
    for (launcher, scenario, n), rs in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        series.append({"tool": launcher, "scenario": scenario, "hosts": n,
                       **common.summarize([r["gone"] for r in rs], cap=cap),
                       "launcher_exit": common.summarize([r["launcher_exit"] for r in rs], cap=cap),
                       "training_gone": common.summarize([r["training_gone"] for r in rs], cap=cap),
                       "noticed": common.summarize([r["noticed"] for r in rs]) if launcher == "ddpfab run"
                       and scenario == "crash" else None,
                       "left_at_cap": [r["left"] for r in rs if r["left"]],
                       "last_to_go": [r["last"] for r in rs]})
    config = {"sizes": list(sizes), "cap_s": cap, "pg_timeout_s": 60, "fail_after_s": 2, "nproc_per_node": 1,
              "baseline_reps": base_reps, "launchers": launchers, "script": JOB}
    common.write_result(args.out, "teardown", args, config, {"series": series}, meta, started)
    for s in series:
        log(f"{s['scenario']:<6} {s['tool']:<16} N={s['hosts']}: {common.fmt(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
