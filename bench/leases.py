#!/usr/bin/env python3
"""GPU leases and the queue of `run --wait` (issue 27): how soon a waiting job starts once its GPUs
are released, and what leasing adds to a launch.

    .venv/bin/python bench/leases.py [--quick] [--reps R] [--subnet 10.NN.111.0/24]

On one lab of 8 hosts with 4 stand-in GPUs each (``ddpfab lab up --gpus 4``: a stand-in
nvidia-smi, the leases are the real lease sockets):

- ``release -> start``: a plain process on node1 and node2 holds all their GPU leases (the node
  program's own ``take_leases``, so the release is the kernel's, at a known instant); a
  ``ddpfab run --wait`` for 4 GPUs on both queues behind it. The holder lets go (its stdin gets a
  line: it closes its lease files and exits); measured from just before that line to (1) the
  waiting job's go on its last node (its supervisor's ``leased GPU`` line reaching ddpfab) and
  (2) its script's first statement on its last node (after torchrun's start). All hosts share
  this machine's clock.
- ``leasing overhead at 8 nodes``: ``ddpfab run`` of a script that exits at once, spawn to exit,
  on all 8 hosts: ``--gpus-per-node 0`` (no GPU lease: the same lab, the same probe) against
  ``--gpus-per-node 1`` (a lease per node) and ``--gpus-per-node 1 --wait`` (tickets and the
  two-phase go), interleaved in a rotating order per repetition. Deltas and ratios of medians.

Writes bench/results/leases.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: The waiting job's script: when it started (this machine's clock), nothing else.
STARTED = "import time; print('STARTED %.6f' % time.time(), flush=True)\n"

#: Holds every GPU lease of its node until a line arrives on stdin; then releases and exits.
HOLDER = ("import sys; sys.path.insert(0, %r); from ddpfab.node import leases; "
          "fds, gpus, _ = leases.take_leases(4, [], 'bench-holder'); print('HELD', gpus, flush=True); "
          "sys.stdin.readline(); [__import__('os').close(fd) for fd in fds]") % str(common.REPO)


def host_popen(lab, name: str, argv: list[str]) -> subprocess.Popen:
    """*argv* inside lab host *name*, its stdin and stdout ours."""
    from ddpfab import lab as labmod

    init = labmod._child_pid(lab.host(name).pid)
    return subprocess.Popen(["nsenter", "-t", str(init), "-a", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def ddpfab_cmd(*args: str) -> list[str]:
    return [common.PYTHON, "-m", "ddpfab", *args]


def release_to_start(lab, inv: Path, script: Path, runs: Path, rep: int) -> tuple[float, float]:
    """One repetition of (release -> go on the last node, release -> script start on the last node)."""
    holders = [host_popen(lab, n, [common.PYTHON, "-c", HOLDER]) for n in ("node1", "node2")]
    try:
        for h in holders:
            line = h.stdout.readline()
            if not line.startswith("HELD ['0', '1', '2', '3']"):
                raise SystemExit(f"the holder did not get the GPUs: {line!r}")
        waiter = subprocess.Popen(ddpfab_cmd("run", "-i", str(inv), "--limit", "node1:node2", "--wait",
                                             "--run-id", f"bench-wait-{rep}-{os.getpid()}", "--runs-dir", str(runs),
                                             "--gpus-per-node", "4", "--nproc-per-node", "1", "--no-sync",
                                             str(script)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=common.env_with(NO_COLOR="1", DDPFAB_WAIT_REPORT_S="0"))
        seen: list[tuple[float, str]] = []
        waiting = threading.Event()

        def read() -> None:
            for ln in waiter.stdout:
                seen.append((time.time(), ln))
                if "waiting: place" in ln and sum("waiting: place" in s for _, s in seen) >= 2:
                    waiting.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        if not waiting.wait(300):
            raise SystemExit("the waiting job never queued on both nodes:\n" + "".join(s for _, s in seen))
        time.sleep(1.0)  # settled in the queue
        released = time.time()
        for h in holders:
            h.stdin.write("go\n")
            h.stdin.flush()
        if waiter.wait(timeout=300) != 0:
            raise SystemExit("the waiting job failed:\n" + "".join(s for _, s in seen))
        reader.join(timeout=10)
    finally:
        for h in holders:
            if h.poll() is None:
                h.kill()
            h.wait()
    go = [t for t, s in seen if "ddpfab-agent: leased GPU" in s]
    started = [float(s.split("STARTED ", 1)[1]) for _, s in seen if "STARTED " in s]
    if len(go) != 2 or len(started) != 2:
        raise SystemExit("the waiting job's lines are not as expected:\n" + "".join(s for _, s in seen))
    return max(go) - released, max(started) - released


def launch(inv: Path, script: Path, runs: Path, extra: list[str]) -> float:
    t0 = time.monotonic()
    res = subprocess.run(ddpfab_cmd("run", "-i", str(inv), "--runs-dir", str(runs), "--nproc-per-node", "1",
                                    "--no-sync", *extra, str(script)),
                         capture_output=True, text=True, timeout=600, env=common.env_with(NO_COLOR="1"))
    took = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"run {' '.join(extra)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return took


VARIANTS = {"no GPU lease (--gpus-per-node 0)": ["--gpus-per-node", "0"],
            "a lease per node (--gpus-per-node 1)": ["--gpus-per-node", "1"],
            "a lease per node, --wait": ["--gpus-per-node", "1", "--wait"]}


def main() -> int:
    p = common.base_parser("leases", __doc__.split("\n\n")[0], reps=5, quick_reps=1)
    args = p.parse_args()
    reps, meta, started = common.begin(args)
    work = common.WORK_ROOT / "leases"
    work.mkdir(parents=True, exist_ok=True)
    script = work / "started.py"
    script.write_text(STARTED)
    runs = work / "runs"
    hosts = 8
    samples: dict[str, list[float]] = {"release -> go": [], "release -> script start": [],
                                       **{k: [] for k in VARIANTS}}
    with common.bench_lab("leases", hosts, args.subnet, gpus=4) as lab:
        names = [h.name for h in lab.hosts]
        inv = common.write_inventory(lab, names, work / "inventory.yml")
        launch(inv, script, runs, ["--gpus-per-node", "0"])  # warm the page cache: untimed
        for rep in range(reps):
            go, start = release_to_start(lab, inv, script, runs, rep)
            samples["release -> go"].append(go)
            samples["release -> script start"].append(start)
            order = list(VARIANTS)[rep % len(VARIANTS):] + list(VARIANTS)[:rep % len(VARIANTS)]
            for name in order:
                samples[name].append(launch(inv, script, runs, VARIANTS[name]))
            common.log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items()))
    stats = {k: common.summarize(v) for k, v in samples.items()}
    base = stats["no GPU lease (--gpus-per-node 0)"]["median"]
    overhead = {k: {"delta_s": round(stats[k]["median"] - base, 3), "ratio": round(stats[k]["median"] / base, 3)}
                for k in list(VARIANTS)[1:]}
    for k, s in stats.items():
        common.log(f"{k:<40} median {s['median']:.3f} s (min {s['min']:.3f}, max {s['max']:.3f})")
    common.log("leasing at 8 nodes against none: " + ", ".join(
        f"{k}: {v['delta_s']:+.2f} s ({v['ratio']:.2f}x)" for k, v in overhead.items()))
    common.write_result(args.out, "leases", args, {"hosts": hosts, "gpus_per_host": 4, "queue_hosts": 2},
                        {"results": stats, "overhead_vs_no_lease": overhead}, meta, started)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
