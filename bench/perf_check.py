"""`ddpfab check --perf` on a lab: how long it takes, how far healthy nodes spread, and the drills.

For each lab size: REPS healthy checks (time, and every node's and link's ratio to the median: the
spread the thresholds in ddpfab/health/perf.py must stay clear of), then one check with one host's link
throttled by tc and one with one host's CPU held to a cgroup quota (the ratio each fault
produces). The drills' report figures are copied to docs/ (perf-link-drill-*.svg,
perf-cpu-drill-*.svg).

    .venv/bin/python bench/perf_check.py [--sizes 4,8] [--reps 3] [--subnet 10.213.108.0/24] [--quick]

Every run of the check goes through the CLI, as a user's would (``ddpfab check --perf --json``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import (
    PYTHON,
    REPO,
    WORK_ROOT,
    base_parser,
    begin,
    bench_lab,
    log,
    names,
    sizes_of,
    write_inventory,
    write_result,
)

DOCS = REPO / "docs"


def check(inventory: Path, runs: Path) -> tuple[dict, float]:
    t0 = time.monotonic()
    res = subprocess.run([PYTHON, "-m", "ddpfab", "check", "--perf", "-i", str(inventory), "--runs-dir", str(runs),
                          "--json"], capture_output=True, text=True, cwd=REPO, timeout=900)
    wall = time.monotonic() - t0
    if res.returncode not in (0, 1):
        raise SystemExit(f"check --perf failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout), wall


def spread(result: dict) -> dict:
    figs = result["node_figures"].values()
    links = result["links"].values()
    return {"compute": [min(f["compute_ratio"] for f in figs), max(f["compute_ratio"] for f in figs)],
            "memory": [min(f["memory_ratio"] for f in figs), max(f["memory_ratio"] for f in figs)],
            "link": [min(v["ratio"] for v in links), max(v["ratio"] for v in links)],
            "latency": [min(v["lat_ratio"] for v in links), max(v["lat_ratio"] for v in links)]}


def summary(record: dict, wall: float) -> dict:
    r = record["result"]
    return {"seconds": record["seconds"], "bench_seconds": record.get("bench_seconds"), "wall_s": round(wall, 2), "stragglers": r["stragglers"],
            "findings": [f["text"] for f in r["findings"]], "spread": spread(r), "medians": r["medians"],
            "links": len(r["links"]), "run_dir": record["run_dir"]}


def main() -> int:
    p = base_parser("perf_check", __doc__, reps=3, quick_reps=1)
    p.add_argument("--sizes", help="lab sizes, comma-separated (default 4,8; --quick 3)")
    p.add_argument("--cpu-percent", type=int, default=5, help="the CPU drill's quota, %% of one CPU")
    args = p.parse_args()
    reps, meta, started = begin(args)
    from ddpfab.lab.drills import cpu_quota, throttled_link

    data: dict = {"sizes": {}}
    for n in sizes_of(args, (4, 8), (3,)):
        work = WORK_ROOT / "perf_check" / f"n{n}"
        shutil.rmtree(work, ignore_errors=True)
        runs = work / "runs"
        with bench_lab("perf_check", n, args.subnet) as lab:
            inv = write_inventory(lab, names(n), work / "inventory.yml")
            point: dict = {"healthy": []}
            for i in range(reps):
                rec, wall = check(inv, runs)
                point["healthy"].append(summary(rec, wall))
                log(f"{n} hosts, healthy {i + 1}/{reps}: {rec['seconds']:.1f} s, stragglers {rec['result']['stragglers']}")
            slow = names(n)[-1]
            with throttled_link(lab, slow):
                rec, wall = check(inv, runs)
            point["link_drill"] = {"node": slow, **summary(rec, wall)}
            log(f"{n} hosts, {slow} link throttled: {rec['result']['stragglers']}")
            shutil.copy(Path(rec["run_dir"]) / "nodes.svg", DOCS / f"perf-link-drill-{n}-nodes.svg")
            shutil.copy(Path(rec["run_dir"]) / "links.svg", DOCS / f"perf-link-drill-{n}-links.svg")
            slow = names(n)[1]
            with cpu_quota(lab, slow, args.cpu_percent):
                rec, wall = check(inv, runs)
            point["cpu_drill"] = {"node": slow, "percent": args.cpu_percent, **summary(rec, wall)}
            log(f"{n} hosts, {slow} CPU at {args.cpu_percent}%: {rec['result']['stragglers']}")
            shutil.copy(Path(rec["run_dir"]) / "nodes.svg", DOCS / f"perf-cpu-drill-{n}-nodes.svg")
        data["sizes"][str(n)] = point
    write_result(args.out, "perf_check", args, {"reps": reps, "cpu_percent": args.cpu_percent}, data, meta, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
