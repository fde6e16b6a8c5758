#!/usr/bin/env python3
"""The fast check's time (`ddpfab check --fast`, what `ddpfab run` runs as its preflight) at
N = 8, 32, 64 lab hosts, before and after the data-plane probes of issue 25 (the bulk transfer per
ring neighbour and to the master, the advertised-address connects): the same lab, the two trees
interleaved (alternating order in every repetition), the machine's load recorded per sample.

    .venv/bin/python bench/preflight_dataplane.py --subnet 10.NN.111.0/24            # 8,32,64 hosts
    .venv/bin/python bench/preflight_dataplane.py --quick --subnet 10.NN.111.0/24    # 8,32, 1 repetition

"before" is a tree exported from --before-ref (default main) with `git archive`, run with that tree
first on PYTHONPATH (the node program is shipped from the controller's source, so the nodes run
that tree's probe too); "after" is this checkout. Each sample is a fresh process as a user types
it; its --json gives the phases (connect, probe, mesh). Writes bench/results/preflight_dataplane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, REPO, RESULTS, log

SIZES = (8, 32, 64)
QUICK_SIZES = (8, 32)
TREES = ("before", "after")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/preflight_dataplane.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition at 8 and 32 hosts")
    p.add_argument("--reps", type=int, help="repetitions per point (default 3, --quick 1)")
    p.add_argument("--sizes", help="host counts, comma-separated (default 8,32,64)")
    p.add_argument("--subnet", default=os.environ.get("DDPFAB_BENCH_SUBNET_DATAPLANE", "10.213.114.0/24"))
    p.add_argument("--before-ref", default="main", help="the git ref measured as 'before' (default main)")
    p.add_argument("--out", default=str(RESULTS / "preflight_dataplane.json"))
    p.set_defaults(default_reps=3, quick_reps=1)
    return p


def export_tree(ref: str, dest: Path) -> Path:
    """*ref*'s files in *dest* (fresh), for PYTHONPATH."""
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def once(tree: str, inv: Path, before: Path, n: int) -> dict:
    env = common.env_with()
    if tree == "before":
        env["PYTHONPATH"] = str(before) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    res = subprocess.run([PYTHON, "-m", "ddpfab", "check", "--fast", "--json", "-i", str(inv)], capture_output=True,
                         text=True, env=env, timeout=600, cwd="/")
    wall = time.monotonic() - t0
    report = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    if res.returncode != 0 or not report.get("ok"):
        raise RuntimeError(f"check ({tree}) on {n} hosts failed (exit {res.returncode}): "
                           f"{report.get('problems') or res.stderr[-2000:]}")
    checks = sorted({r["check"] for r in report["results"]})
    return {"tree": tree, "n": n, "wall_s": round(wall, 3), "seconds": report.get("seconds"),
            "phases_s": report.get("phases_s"), "load1": round(load, 2), "bulk": "bulk" in checks}


def main() -> int:
    args = parser().parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    work = common.WORK_ROOT / "preflight_dataplane"
    before = export_tree(args.before_ref, work / "before")
    meta["before_ref"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.before_ref],
                                        capture_output=True, text=True).stdout.strip()
    samples: list[dict] = []
    with common.bench_lab("preflight_dataplane", max(sizes), args.subnet) as lab:
        invs = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}
        for n in sizes:
            for rep in range(reps):
                for tree in (TREES if rep % 2 == 0 else TREES[::-1]):
                    s = once(tree, invs[n], before, n)
                    samples.append(s)
                    log(f"{n} hosts, {tree}: {s['seconds']:.2f} s (mesh {s['phases_s'].get('mesh', 0):.2f} s, "
                        f"load {s['load1']})")
    table = {}
    for n in sizes:
        row = {}
        for tree in TREES:
            row[tree] = common.summarize([s["seconds"] for s in samples if s["n"] == n and s["tree"] == tree])
            row[f"{tree}_mesh"] = common.summarize([s["phases_s"].get("mesh") for s in samples
                                                    if s["n"] == n and s["tree"] == tree])
        row["added_s"] = round(row["after"]["median"] - row["before"]["median"], 2)
        row["ratio"] = round(row["after"]["median"] / row["before"]["median"], 2)
        table[str(n)] = row
        log(f"{n} hosts: before {common.fmt(row['before'])}, after {common.fmt(row['after'])}: "
            f"{row['added_s']:+.2f} s ({row['ratio']:.2f}x)")
    common.write_result(args.out, "preflight_dataplane", args, {"sizes": list(sizes), "trees": list(TREES)},
                        {"table": table, "samples": samples}, meta, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
