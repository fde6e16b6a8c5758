#!/usr/bin/env python3
"""`ddpfab sync` with nothing changed against `ddpfab exec hostname`, on the same hosts, same run.

    .venv/bin/python bench/nochange_sync.py [--quick] [--reps R] [--sizes 32,128] [--subnet ...]

The goal (issue 26): a no-change sync at 128 hosts costs <= 1.5x an `exec hostname`: it opens
one connection per node (as exec does), asks each node's program for the workdir's hash under
its lock, and copies nothing. Both are the real command line (`python -m ddpfab ...`, process
start and imports included), interleaved per repetition; the first sync (the copy) is untimed.
Writes bench/results/nochange_sync.json with the machine's load before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

def make_project(root: Path, files: int) -> None:
    for i in range(files):
        d = root / f"pkg{i % 8}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"m{i}.py").write_text(f"X = {i}\n" * 20)
    (root / "train.py").write_text("print('train')\n")


def timed(argv: list[str], cwd: Path) -> float:
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=cwd, env=common.env_with())
    took = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{argv[3:5]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return took


def main() -> int:
    p = common.base_parser("nochange_sync", __doc__.split("\n\n")[0], reps=5, quick_reps=2)
    p.add_argument("--sizes", help="host counts, comma-separated (default 32,128; --quick 8)")
    p.add_argument("--files", type=int, default=300)
    args = p.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, (32, 128), (8,))
    work = common.WORK_ROOT / "nochange_sync"
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=work))
    project = scratch / "project"
    make_project(project, args.files)
    results = {}
    with common.bench_lab("nochange_sync", max(sizes), args.subnet) as lab:
        for n in sizes:
            inv = common.write_inventory(lab, common.names(n), scratch / f"inv{n}.yml",
                                         ddpfab_workdir=f"/opt/ddpfab/nochange{n}")
            sync = [common.PYTHON, "-m", "ddpfab", "sync", "-i", str(inv), "--json", str(project)]
            exec_ = [common.PYTHON, "-m", "ddpfab", "exec", "-i", str(inv), "--no-color", "--", "hostname"]
            first = subprocess.run(sync, capture_output=True, text=True, timeout=1800, env=common.env_with())
            if first.returncode != 0:
                raise SystemExit(f"the first sync failed: {first.stderr[-2000:]}")
            check = subprocess.run(sync, capture_output=True, text=True, timeout=900, env=common.env_with())
            if json.loads(check.stdout).get("fanout") != "none":
                raise SystemExit("a sync with nothing changed did not take the hash-only path")
            samples: dict[str, list[float]] = {"sync (no change)": [], "exec hostname": []}
            for rep in range(reps):
                samples["exec hostname"].append(timed(exec_, scratch))
                samples["sync (no change)"].append(timed(sync, scratch))
                common.log(f"{n} hosts, rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s"
                                                                         for k, v in samples.items()))
            stats = {k: common.summarize(v) for k, v in samples.items()}
            ratio = round(stats["sync (no change)"]["median"] / stats["exec hostname"]["median"], 3)
            results[str(n)] = {"results": stats, "ratio_sync_over_exec": ratio, "loadavg": os.getloadavg()}
            common.log(f"{n} hosts: sync (no change) / exec hostname (median) = {ratio:.2f}x (goal <= 1.5x)")
    common.write_result(args.out, "nochange_sync", args, {"files": args.files, "sizes": list(sizes)},
                        {"sizes": results}, meta, started)
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
