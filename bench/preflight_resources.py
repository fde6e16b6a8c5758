#!/usr/bin/env python3
"""Preflight with and without the node's resource checks (issue 25): main's ddpfab against this
checkout's, on the same lab hosts, interleaved (rotated order in every repetition).

    .venv/bin/python bench/preflight_resources.py --subnet 10.NN.180.0/24             # 8,32,64 hosts
    .venv/bin/python bench/preflight_resources.py --quick --subnet 10.NN.180.0/24     # 8,32, 1 rep

Tools, each a fresh process as a user types it:
  plan (base)       ddpfab plan -i INV --nproc-per-node 1 SCRIPT, run by the base checkout (--base,
                    default /work/main) with its own venv: connect, probe, preflight (mesh), plan
  plan (this)       the same by this checkout: the probe's facts also carry the node's resources
                    (/dev/shm, filesystems, limits, memory, left-overs) and the preflight judges them
  check (base/this) ddpfab check --fast -i INV --json: its probe phase (phases_s.probe) too
The difference between base and this is the resource checks' cost (the base may lack other
changes of this branch too: the figures say what a user of each gets). Writes
bench/results/preflight_resources.json with the machine's load before and after.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, REPO, log
from scale import sample_run

SIZES = (8, 32, 64)
QUICK_SIZES = (8, 32)
SCRIPT = "tests/lab/scripts/report.py"
TOOLS = ("plan (base)", "plan (this)", "check (base)", "check (this)")


def argv_of(tool: str, inv: Path, base: Path) -> tuple[list[str], Path]:
    python, cwd = (str(base / ".venv" / "bin" / "python"), base) if "(base)" in tool else (PYTHON, REPO)
    if tool.startswith("plan"):
        return [python, "-m", "ddpfab", "plan", "-i", str(inv), "--nproc-per-node", "1", SCRIPT], cwd
    return [python, "-m", "ddpfab", "check", "--fast", "--json", "-i", str(inv)], cwd


def once(tool: str, inv: Path, base: Path, n: int) -> dict:
    argv, cwd = argv_of(tool, inv, base)
    res = sample_run(argv, common.env_with(), cwd=cwd)
    if res["rc"] != 0:
        raise RuntimeError(f"{tool} on {n} hosts failed (exit {res['rc']}):\n{res['out'][-3000:]}")
    out = {"wall": res["wall"]}
    if tool.startswith("check"):
        report = json.loads(res["out"][res["out"].index("{"):])
        out["probe_s"] = report.get("phases_s", {}).get("probe")
        out["resource_checks"] = sum(r["check"] in ("shm", "disk", "nofile", "memlock", "memory", "leftovers")
                                     for r in report["results"])
    return out


def node_side_ms(repeats: int = 200) -> dict:
    """What the resource facts cost on one node (this machine): res_facts alone, in ms, and the
    whole facts op with and without them (each node runs it once per check or run, in parallel)."""
    from ddpfab.node import ops
    from ddpfab.node.resources import res_facts

    def timed(fn) -> dict:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1000)
        return common.summarize(samples)

    req = {"workdir": str(REPO), "leases": True}
    return {"res_facts": timed(lambda: res_facts(req, {})),
            "facts_with": timed(lambda: ops.op_facts(dict(req, resources=True), {})),
            "facts_without": timed(lambda: ops.op_facts(dict(req), {})),
            "load": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    parser = common.base_parser("preflight_resources", __doc__, reps=3, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 8,32,64; --quick 8,32)")
    parser.add_argument("--base", default="/work/main", help="the checkout to compare with (its .venv runs it)")
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    base = Path(args.base)
    micro = node_side_ms()
    log(f"node side: res_facts median {micro['res_facts']['median']:.2f} ms; facts with "
        f"{micro['facts_with']['median']:.2f} ms, without {micro['facts_without']['median']:.2f} ms")
    work = common.WORK_ROOT / "preflight_resources"
    samples: dict[str, dict[int, list[dict]]] = {}
    with common.bench_lab("preflight_resources", max(sizes), args.subnet) as lab:
        invs = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}
        log("warm-up: one untimed run of each tool")
        for tool in TOOLS:
            once(tool, invs[min(sizes)], base, min(sizes))
        for rep in range(reps):
            for i, n in enumerate(sizes):
                k = (rep + i) % len(TOOLS)
                for tool in TOOLS[k:] + TOOLS[:k]:
                    samples.setdefault(tool, {}).setdefault(n, []).append(once(tool, invs[n], base, n))
                log(f"rep {rep + 1}/{reps} N={n} (load {time.strftime('%H:%M:%S')} "
                    f"{Path('/proc/loadavg').read_text().split()[0]}): "
                    + "  ".join(f"{t}={samples[t][n][-1]['wall']:.2f}" for t in TOOLS))
    series = []
    for tool, per_n in samples.items():
        for n, runs in sorted(per_n.items()):
            s = {"tool": tool, "hosts": n, **common.summarize([r["wall"] for r in runs])}
            if tool.startswith("check"):
                s["probe_s"] = common.summarize([r["probe_s"] for r in runs])
                s["resource_checks"] = runs[-1]["resource_checks"]
            series.append(s)
    ratios = {n: round(common.summarize([r["wall"] for r in samples["plan (this)"][n]])["median"] /
                       common.summarize([r["wall"] for r in samples["plan (base)"][n]])["median"], 3) for n in sizes}
    for n in sizes:
        log(f"N={n}: plan this/base = {ratios[n]}")
    common.write_result(args.out, "preflight_resources", args,
                        {"sizes": list(sizes), "tools": list(TOOLS), "base": str(base), "script": SCRIPT},
                        {"series": series, "plan_ratio_this_over_base": ratios, "node_side_ms": micro}, meta, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
