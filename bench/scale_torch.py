"""The parts of bench/scale.py that run torch on the hosts (one process per host, gloo):

  teardown   a rank crashes -> the last job process gone on every host, N = 8..128: `ddpfab run`
             against pdsh + torchrun, with bench/teardown.py's job and method (its Bench, its cap)
  run        one real `ddpfab run` of a small gloo script (init, all_reduce, print, exit) at 64 and
             128 hosts, end to end and step by step (bench/launch.py's phase driver), against
             pdsh + torchrun of the same script
  jobs       a detached run at 64 and 128 hosts, then `ps`, `logs`, `attach` (Ctrl-C once every
             rank's line is shown) and `stop` (also: until its last process is gone), of a job
             without torch under a stand-in torchrun (STANDIN_RUN; below): 128 real torchruns do
             not fit in this machine's memory
A torch part runs at a size only when the torch jobs fit in the memory available then
(TORCH_GIB_PER_HOST per host + RESERVE_GIB); else the result records why it was not run.

Each command's controller process is sampled (threads, open files, memory, CPU) as scale.py does.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import common
import launch
import teardown
from common import PYTHON, log

#: One real job: a process group over every node, one all_reduce checked, one line per rank.
GLOO = """import datetime, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
t = torch.ones(1)
dist.all_reduce(t)
assert int(t.item()) == dist.get_world_size(), t
print("READY", dist.get_rank(), "sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""
GLOO_SCRIPT = "bench_gloo.py"
#: The detached job, without torch: N torchruns do not fit in memory at 128 hosts (each imports
#: torch: ~146 MiB private memory; 128 torchruns + 128 workers ~38 GiB on a 24 GiB machine). One
#: line per rank, a marker file per rank in the lab's shared dir (polled here: no SSH), then idle.
LIGHT = """import os, pathlib, time

print("READY", os.environ["RANK"], flush=True)
pathlib.Path(os.environ["BENCH_READY_DIR"], os.environ["RANK"]).touch()
while True:
    time.sleep(1)
"""
LIGHT_SCRIPT = "bench_light.py"
#: A stand-in for torchrun (``python -m torch.distributed.run`` found first on the job's
#: PYTHONPATH): the same flags, one worker per --nproc-per-node with torchrun's RANK/LOCAL_RANK/
#: WORLD_SIZE/MASTER_* environment, output relayed with --tee's "[default<k>]:" prefix, torchrun's
#: exit code; SIGINT/SIGTERM go to the workers. No torch import (~10 MiB instead of ~146 MiB).
STANDIN_RUN = """import argparse, os, signal, subprocess, sys, threading

p = argparse.ArgumentParser()
for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port", "--max-restarts",
             "--tee", "--log-dir", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf"):
    p.add_argument(flag)
p.add_argument("script")
p.add_argument("args", nargs=argparse.REMAINDER)
a = p.parse_args()
nproc, node = int(a.nproc_per_node), int(a.node_rank or 0)
if a.log_dir:
    os.makedirs(a.log_dir, exist_ok=True)
workers = []
for k in range(nproc):
    env = dict(os.environ, RANK=str(node * nproc + k), LOCAL_RANK=str(k), WORLD_SIZE=str(int(a.nnodes) * nproc),
               MASTER_ADDR=a.master_addr or "", MASTER_PORT=a.master_port or "")
    workers.append(subprocess.Popen([sys.executable, a.script, *a.args], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT))
def relay(k, w):
    for line in w.stdout:
        sys.stdout.buffer.write(b"[default%d]:" % k + line)
        sys.stdout.flush()
threads = [threading.Thread(target=relay, args=(k, w)) for k, w in enumerate(workers)]
for t in threads:
    t.start()
def forward(sig, _frame):
    for w in workers:
        w.send_signal(sig)
signal.signal(signal.SIGINT, forward)
signal.signal(signal.SIGTERM, forward)
codes = [w.wait() for w in workers]
for t in threads:
    t.join()
sys.exit(next((c if c > 0 else 1 for c in codes if c), 0))
"""
READY = re.compile(r"READY (\d+)")


LIGHT_CRASH = """import os, pathlib, time

rank = int(os.environ["RANK"])
print("READY", rank, flush=True)
if rank == int(os.environ.get("BENCH_FAIL_RANK", "-1")):
    time.sleep(2)
    os._exit(17)
while True:
    time.sleep(1)
"""
READY = re.compile(r"READY (\d+)")
#: Memory one host's job takes with real torch: torchrun and its worker each import torch (~146 MiB
#: private each); the job's processes on a host measured 269 MiB PSS on average, 291 at most (32 hosts).
TORCH_GIB_PER_HOST = 0.29
#: Left free for the other work on this shared machine while a torch job runs.
RESERVE_GIB = 2.0


def start_timeout(n: int) -> float:
    """How long N hosts may take to import torch twice each (torchrun, worker) and meet: ~2 s of
    CPU per host on 2 loaded cores, generously."""
    return 120 + 6 * n


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def torch_fits(n: int) -> str | None:
    """None when N hosts' torch jobs fit in memory now, else why not (recorded, not run: an OOM
    kill on this shared machine could hit another engineer's work)."""
    need, have = n * TORCH_GIB_PER_HOST + RESERVE_GIB, mem_available_gib()
    if need <= have:
        return None
    return (f"not run: {n} hosts' torch jobs need ~{n * TORCH_GIB_PER_HOST:.1f} GiB "
            f"({TORCH_GIB_PER_HOST} GiB per host: torchrun + worker import torch) + {RESERVE_GIB:g} GiB kept free; "
            f"{have:.1f} GiB available")


def standin(work: Path) -> Path:
    """A dir for the job's PYTHONPATH whose ``torch.distributed.run`` is STANDIN_RUN."""
    root = work / "standin"
    (root / "torch" / "distributed").mkdir(parents=True, exist_ok=True)
    (root / "torch" / "__init__.py").write_text('"""bench/scale_torch.py: a stand-in, no torch here."""\n')
    (root / "torch" / "distributed" / "__init__.py").write_text("")
    (root / "torch" / "distributed" / "run.py").write_text(STANDIN_RUN)
    return root


def crash_teardown(lab, work: Path, sizes, cap: float, light_sizes=()) -> list[dict]:
    """teardown.py's crash scenario at every size, `ddpfab run` and pdsh + torchrun, once each (where
    the torch jobs fit in memory); at *light_sizes* also `ddpfab run` of the stand-in job."""
    out = []
    real = teardown.Bench(lab, work, sizes, cap, start_timeout=start_timeout(max(sizes)))
    real.wd.mkdir(parents=True, exist_ok=True)
    (real.wd / teardown.SCRIPT).write_text(teardown.JOB)
    for i, n in enumerate(sizes):
        launchers = ("ddpfab run", "pdsh + torchrun")[::1 if i % 2 == 0 else -1]
        for launcher in launchers:
            why = torch_fits(n)
            if why:
                out.append({"tool": launcher, "hosts": n, "job": "torch", "skipped": why})
                log(f"teardown after a crash, N={n} {launcher}: {why}")
                continue
            out.append({"tool": launcher, "hosts": n, "job": "torch", **real.trial(launcher, n, "crash")})
            _log_trial(out[-1], cap)
    if light_sizes:
        light = teardown.Bench(lab, work / "light", light_sizes, cap, start_timeout=start_timeout(max(light_sizes)))
        light.wd.mkdir(parents=True, exist_ok=True)
        (light.wd / teardown.SCRIPT).write_text(LIGHT_CRASH)
        light.job_env = {"PYTHONPATH": str(standin(work))}
        for n in light_sizes:
            out.append({"tool": "ddpfab run", "hosts": n, "job": "stand-in",
                        **light.trial("ddpfab run", n, "crash")})
            _log_trial(out[-1], cap)
    return out


def _log_trial(r: dict, cap: float) -> None:
    g = f"{r['gone']:.2f} s" if r["gone"] is not None else f"> {cap:g} s (left: {r['left']})"
    log(f"teardown after a crash, N={r['hosts']} {r['tool']} ({r['job']} job): gone after {g}")


def real_run(lab, work: Path, sizes) -> list[dict]:
    """One `ddpfab run` of GLOO per size, step by step, and pdsh + torchrun of the same script."""
    b = launch.Bench(lab, work, sizes)
    b.wd.mkdir(parents=True, exist_ok=True)
    (b.wd / GLOO_SCRIPT).write_text(GLOO)
    out = []
    for n in sizes:
        why = torch_fits(n)
        if why:
            out.append({"hosts": n, "skipped": why})
            log(f"real run on {n} hosts: {why}")
            continue
        r = b.phases(n, GLOO_SCRIPT, timeout=start_timeout(n) + 120)
        log(f"ddpfab run on {n} hosts: every rank's line after {r['ready']:.1f} s, exit after {r['exit']:.1f} s, "
            f"controller {r['controller']}")
        why = torch_fits(n)
        p = {"skipped": why} if why else b.pdsh(n, GLOO_SCRIPT, timeout=start_timeout(n) + 120)
        log(f"pdsh + torchrun on {n} hosts: {p}")
        out.append({"hosts": n, "ddpfab": r,
                    "pdsh + torchrun": {k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()}})
    return out


def detached_commands(lab, work: Path, sizes, sample_run) -> list[dict]:
    """Per size: `run --detach` of the stand-in job (no torch: 128 torchruns do not fit in memory
    here; the commands' work is the controller's fan-out and reads of the run dir on each node,
    whatever the job), then ps, logs, attach, stop on the running job, each sampled."""
    wd = work / "work"
    wd.mkdir(parents=True, exist_ok=True)
    (wd / LIGHT_SCRIPT).write_text(LIGHT)
    pythonpath = standin(work)
    runs = work / "runs"
    procs = common.HostProcs(lab, [h.name for h in lab.hosts])
    out = []
    for n in sizes:
        inv = str(common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml"))
        ready_dir = lab.shared_dir / f"bench-ready{n}"  # every host writes where this process reads
        ready_dir.mkdir(parents=True, exist_ok=True)
        for f in ready_dir.iterdir():
            f.unlink()
        base = [PYTHON, "-m", "ddpfab"]

        def step(name: str, argv: list[str], ok, until=None, timeout: float = 600) -> dict:
            res = sample_run(argv, common.env_with(), cwd=wd, until=until, timeout=timeout)
            if not ok(res):
                raise RuntimeError(f"{name} on {n} hosts failed (exit {res['rc']}):\n{res['out'][-3000:]}")
            row = {"command": name, "hosts": n, "job": "stand-in", "wall": round(res["wall"], 3),
                   "output_lines": len(res["out"].splitlines()), "output_bytes": len(res["out"].encode()),
                   **{k: (round(res[k], 2) if isinstance(res[k], float) else res[k])
                      for k in ("cpu_s", "threads", "fds", "rss_mib")}}
            if res["until_s"] is not None:
                row["until_s"] = round(res["until_s"], 3)
            out.append(row)
            log(f"{name} on {n} hosts: {row}")
            return res

        try:
            started = step("run --detach", [*base, "run", "--detach", "-i", inv, "--no-color", "--runs-dir", str(runs),
                                            "--env", f"BENCH_READY_DIR={ready_dir}", "--env", f"PYTHONPATH={pythonpath}",
                                            LIGHT_SCRIPT], lambda r: r["rc"] == 0)
            m = re.search(r"\b(\d{8}-\d{6}-[0-9a-f]+)\b", started["out"])
            if not m:
                raise RuntimeError(f"no run id in the output of run --detach:\n{started['out'][-2000:]}")
            run_id = m.group(1)
            t0 = time.monotonic()
            while len(list(ready_dir.iterdir())) < n:
                if time.monotonic() - t0 > 120:
                    raise RuntimeError(f"only {len(list(ready_dir.iterdir()))} of {n} ranks ready")
                time.sleep(0.1)
            out[-1]["all_ranks_ready_s"] = round(started["wall"] + time.monotonic() - t0, 2)
            step("ps", [*base, "ps", "-i", inv, "--runs-dir", str(runs)],
                 lambda r: r["rc"] == 0 and run_id in r["out"])
            step("logs", [*base, "logs", run_id, "--runs-dir", str(runs)],
                 lambda r: r["rc"] == 0 and len(list((runs / run_id).glob("*.remote.log"))) == n)
            step("attach", [*base, "attach", run_id, "--runs-dir", str(runs)],
                 lambda r: r["until_s"] is not None, until=lambda text: len(set(READY.findall(text))) >= n)
            before = procs.count(LIGHT_SCRIPT)
            res = step("stop", [*base, "stop", run_id, "--runs-dir", str(runs)], lambda r: r["rc"] == 0)
            t1 = time.monotonic()
            while procs.count(LIGHT_SCRIPT):
                if time.monotonic() - t1 > 60:
                    raise RuntimeError(f"job processes left 60 s after stop: {procs.scan(LIGHT_SCRIPT)}")
                time.sleep(0.01)
            out[-1]["gone_after_s"] = round(res["wall"] + time.monotonic() - t1, 3)
            out[-1]["job_processes_before"] = before
        finally:
            procs.kill_all()
    return out
