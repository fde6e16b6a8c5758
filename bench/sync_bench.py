#!/usr/bin/env python3
"""Benchmark `ddpfab sync` on a local lab (run by hand, as root; ~5 minutes; not part of CI).

    .venv/bin/python bench/sync_bench.py                 # writes docs/sync-benchmarks.md + docs/sync-bench.png
    .venv/bin/python bench/sync_bench.py --quick         # smaller trees, fewer repetitions (~1 min)

The plot needs matplotlib, which ddpfab does not depend on: `.venv/bin/pip install matplotlib`.
Without it the numbers and the markdown are still written.

(a) A tree of ~5,000 files / ~200 MB to 4 lab hosts: first sync, no-change re-sync and
    one-file-changed re-sync, for `ddpfab sync` (parallel rsync + a hash check on every node)
    against a plain sequential `rsync -a --delete` loop and an `scp -r` loop (neither verifies
    anything; scp copies everything every time).
(b) Star vs tree fan-out to 2, 4 and 8 hosts with the controller's uplink shaped by `tc` (a token
    bucket on the lab bridge's egress in the root namespace: traffic from this machine to the
    hosts; host-to-host traffic is bridged between the veths and does not cross it).

Every number is wall time of a complete sync (for ddpfab: the `sync_cluster` call, i.e. without
the ~1-2 s the CLI spends loading the inventory through Ansible). Medians with min-max spread.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddpfab import lab as labmod
from ddpfab.hosts import inventory
from ddpfab.remote import ssh
from ddpfab.transfer.sync import sync_cluster


def make_tree(root: Path, files: int, megabytes: int, seed: int = 1) -> tuple[int, int]:
    """*files* files in nested dirs: many small "code" files plus a few large ones holding most of
    the bytes (weights, fixtures), random content so compression cannot cheat."""
    rng = random.Random(seed)
    if root.exists():
        shutil.rmtree(root)
    large = max(1, files // 50)
    small = files - large
    small_bytes = min(small * 4096, megabytes * 10**6 // 10)
    large_each = (megabytes * 10**6 - small_bytes) // large
    total = 0
    for i in range(files):
        d = root / f"pkg{i % 20:02d}" / f"mod{i % 7}" / (f"sub{i % 3}" if i % 2 else "")
        d.mkdir(parents=True, exist_ok=True)
        size = large_each if i < large else small_bytes // small
        name = f"weights_{i}.bin" if i < large else f"file_{i}.py"
        (d / name).write_bytes(rng.randbytes(size))
        total += size
    return files, total


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, **kw)


def parallel_ssh(the_lab, nodes: list[str], command: str) -> None:
    procs = [subprocess.Popen(["ssh", "-F", str(the_lab.ssh_config), n, command]) for n in nodes]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"`{command}` failed on a node")


def cluster_of(the_lab, names: list[str], workdir: str, tmp: Path) -> inventory.Inventory:
    inv = labmod.render_inventory(the_lab, sys.executable, names=names)
    inv = inv.replace("    ddpfab_nproc_per_node: 1\n", f"    ddpfab_nproc_per_node: 1\n    ddpfab_workdir: {workdir}\n")
    path = tmp / f"inv-{len(names)}-{workdir.replace('/', '_')}.yml"
    path.write_text(inv)
    return inventory.load(path)


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "runs": times}


# -- (a) ---------------------------------------------------------------------------------------------
def bench_methods(the_lab, tree: Path, reps: int, tmp: Path) -> dict:
    nodes = [h.name for h in the_lab.hosts[:4]]
    policy = ssh.HostKeyPolicy()
    cfg = str(the_lab.ssh_config)
    wd = {"ddpfab": "/opt/ddpfab/bench-ddpfab", "rsync loop": "/opt/ddpfab/bench-rsync",
          "scp loop": "/opt/ddpfab/bench-scp"}
    cluster = cluster_of(the_lab, nodes, wd["ddpfab"], tmp)
    touched = sorted(tree.rglob("file_*.py"))[0]
    extra: dict = {}

    def run(method: str) -> None:
        if method == "ddpfab":
            res = sync_cluster(cluster, tree, policy)
            extra.setdefault("ddpfab_bytes_sent", []).append(
                {n: r.bytes_sent for n, r in res.nodes.items()})
        elif method == "rsync loop":
            for n in nodes:
                sh(["rsync", "-a", "--delete", "-e", f"ssh -F {cfg}", f"{tree}/", f"{n}:{wd[method]}/"])
        else:  # scp has no update mode: a full copy into an emptied dir (emptied untimed, above)
            for n in nodes:
                sh(["scp", "-r", "-q", "-F", cfg, str(tree), f"{n}:{wd[method]}"])

    # methods interleaved within each repetition, so a change in the machine's load (its CPUs are
    # shared) hits all of them alike instead of whichever happens to run last
    scenarios = ("first sync", "no change", "one file changed")
    out: dict = {m: {} for m in wd}
    for scenario in scenarios:
        times: dict[str, list[float]] = {m: [] for m in wd}
        for _ in range(reps):
            if scenario == "one file changed":
                with open(touched, "a") as fh:
                    fh.write(f"# {time.time()}\n")
            for method in wd:
                if method == "scp loop" and scenario != "first sync":
                    continue  # no update mode: the very same full copy as a first sync, not run again
                if scenario == "first sync":
                    parallel_ssh(the_lab, nodes, f"rm -rf {wd[method]}; mkdir -p /opt/ddpfab")
                times[method].append(timed(functools.partial(run, method)))
                print(f"  (a) {method:<11} {scenario:<17} {times[method][-1]:6.2f} s", flush=True)
        for method in wd:
            if times[method]:
                out[method][scenario] = summary(times[method])
            else:
                out[method][scenario] = {**out[method]["first sync"], "same_as_first_sync": True}
    parallel_ssh(the_lab, nodes, "rm -rf " + " ".join(wd.values()))  # free the overlay space
    out["_extra"] = extra
    return out


# -- (b) ---------------------------------------------------------------------------------------------
def bench_fanout(the_lab, tree: Path, counts: list[int], reps: int, rate: str, tmp: Path) -> dict:
    policy = ssh.HostKeyPolicy()
    workdir = "/opt/ddpfab/bench-fanout"
    sh(["tc", "qdisc", "replace", "dev", the_lab.bridge, "root", "tbf", "rate", rate, "burst", "256kb",
        "latency", "100ms"])
    out: dict = {"star": {}, "tree": {}}
    try:
        for n in counts:
            names = [h.name for h in the_lab.hosts[:n]]
            cluster = cluster_of(the_lab, names, workdir, tmp)
            times: dict[str, list[float]] = {"star": [], "tree": []}
            runs: dict[str, list] = {"star": [], "tree": []}
            for _ in range(reps):
                for fanout in ("star", "tree"):
                    parallel_ssh(the_lab, names, f"rm -rf {workdir}")
                    start = time.monotonic()
                    res = sync_cluster(cluster, tree, policy, fanout=fanout)
                    times[fanout].append(time.monotonic() - start)
                    runs[fanout].append({"sources": {k: r.source for k, r in res.nodes.items()},
                                         "transfer_s": {k: r.transfer_s for k, r in res.nodes.items()},
                                         "notes": res.notes})
                    print(f"  (b) {fanout:<4} {n} nodes {times[fanout][-1]:6.2f} s  {res.fanout}"
                          f"{'  ' + ' | '.join(res.notes) if res.notes else ''}", flush=True)
            for fanout in ("star", "tree"):
                out[fanout][str(n)] = {**summary(times[fanout]), "sources": runs[fanout][-1]["sources"],
                                       "details": runs[fanout]}
            parallel_ssh(the_lab, names, f"rm -rf {workdir}")
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", the_lab.bridge, "root"], capture_output=True)
    return out


# -- report ------------------------------------------------------------------------------------------
def fmt(s: dict) -> str:
    same = " = first sync*" if s.get("same_as_first_sync") else ""
    return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f}){same}"


def write_markdown(results: dict, path: Path, plot: Path | None) -> None:
    env, a, b = results["env"], results["a"], results["b"]
    lines = [
        "# Sync benchmarks",
        "",
        "Measured by `bench/sync_bench.py` on a local lab (hosts are network namespaces with sshd on "
        "this machine; see `ddpfab/lab/__init__.py`). Numbers are wall times of complete syncs: median and (min-max) over "
        f"{env['reps_a']} runs for (a), {env['reps_b']} for (b). Re-run: `.venv/bin/python bench/sync_bench.py` "
        f"(this run took {env.get('bench_s', '?')} s{', part (b) only' if env.get('merged') else ''}).",
        "",
        f"Machine: {env['cpus']} CPUs ({env['machine']}), load average {env['load_before']} when the run started "
        "(the CPUs are shared with other work, so the spread is real noise, not measurement error); "
        f"{env['rsync']}; {env['ssh']}." + (f" {env['merged'][0].upper()}{env['merged'][1:]}." if env.get("merged")
                                              else ""),
        "",
        f"## (a) {env['tree_a']['files']} files, {env['tree_a']['bytes'] / 1e6:.0f} MB to 4 hosts",
        "",
        "| | first sync | no change | one file changed |",
        "|---|---|---|---|",
    ]
    for method in ("ddpfab", "rsync loop", "scp loop"):
        lines.append(f"| {method} | " + " | ".join(fmt(a[method][s]) for s in
                                                    ("first sync", "no change", "one file changed")) + " |")
    lines += ["", "Ratio to ddpfab (median / median; above 1 means ddpfab is faster):", "",
              "| | first sync | no change | one file changed |", "|---|---|---|---|"]
    for method in ("rsync loop", "scp loop"):
        lines.append(f"| {method} | " + " | ".join(
            f"{a[method][s]['median'] / a['ddpfab'][s]['median']:.2f}x"
            for s in ("first sync", "no change", "one file changed")) + " |")
    sent = a.get("_extra", {}).get("ddpfab_bytes_sent", [])
    if sent:
        last = sent[-1]
        lines += ["", f"Bytes ddpfab put on the wire per node for the last one-file-changed re-sync: "
                      f"{', '.join(f'{k} {v / 1e3:.0f} kB' for k, v in last.items())} (rsync's delta transfer)."]
    lines += ["",
              "- ddpfab syncs the 4 hosts in parallel, then checks the tree hash on every host. Content digests "
              "are cached by (size, mtime, ctime, inode), like git's index, so a re-sync re-reads only files that "
              "changed (and files younger than 2 s); the first re-sync after a copy still reads everything. "
              "The plain loops verify nothing.",
              "- \\* scp has no update mode: a re-sync is the same full copy as a first sync (into an emptied dir; "
              "the emptying is not timed), so it is not run again; its first-sync numbers stand for all three.",
              "",
              f"## (b) star vs tree fan-out, controller uplink shaped to {env['rate']}",
              "",
              f"Tree: {env['tree_b']['files']} files, {env['tree_b']['bytes'] / 1e6:.0f} MB; first sync into empty "
              "workdirs.",
              "",
              "| hosts | star | tree | star / tree |",
              "|---|---|---|---|"]
    for n in sorted(b["star"], key=int):
        s, t = b["star"][n], b["tree"][n]
        lines.append(f"| {n} | {fmt(s)} | {fmt(t)} | {s['median'] / t['median']:.2f}x |")
    lines += ["",
              "The star crosses the uplink once per host, so its time grows linearly with the host count; the "
              "tree crosses it once and then doubles the number of holders each round (host-to-host, unshaped), "
              "so its time grows with log2 of the host count plus a per-hop SSH setup. In this lab all hosts share "
              "the controller's CPUs, so host-to-host copies are CPU-bound (SSH encryption, rsync) and the tree's "
              "parallel hops do not get parallel CPUs; on real machines each hop has its own, and the tree gains "
              "more.",
              f"Who sent to whom in the largest tree: {b['tree'][max(b['tree'], key=int)]['sources']}."]
    big = b["tree"][max(b["tree"], key=int)]
    if big.get("details"):
        hops = [t for d in big["details"] for k, t in d["transfer_s"].items()
                if d["sources"][k] not in ("controller", "shared") and t is not None]
        firsts = [d["transfer_s"][k] for d in big["details"] for k in d["sources"] if d["sources"][k] == "controller"]
        fallbacks = sum(len(d["notes"]) for d in big["details"])
        lines += [f"In that tree, the copy over the uplink took a median {statistics.median(firsts):.1f} s and each "
                  f"host-to-host copy {statistics.median(hops):.1f} s (min {min(hops):.1f}, max {max(hops):.1f}); "
                  f"{fallbacks} hop(s) fell back to the controller. The tree pays off when the tree's size over the "
                  "uplink rate is larger than that per-hop cost."]
    if plot:
        lines += ["", f"![sync benchmarks]({plot.name})"]
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    a, b = results["a"], results["b"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    scenarios = ("first sync", "no change", "one file changed")
    methods = ("ddpfab", "rsync loop", "scp loop")
    width = 0.27
    for i, m in enumerate(methods):
        med = [a[m][s]["median"] for s in scenarios]
        lo = [a[m][s]["median"] - a[m][s]["min"] for s in scenarios]
        hi = [a[m][s]["max"] - a[m][s]["median"] for s in scenarios]
        ax1.bar([x + (i - 1) * width for x in range(3)], med, width, yerr=[lo, hi], capsize=3, label=m)
    ax1.set_xticks(range(3), scenarios)
    ax1.set_ylabel("seconds (median, min-max)")
    env = results["env"]
    ax1.set_title(f"(a) {env['tree_a']['files']} files / {env['tree_a']['bytes'] / 1e6:.0f} MB to 4 hosts")
    ax1.legend()
    for fanout in ("star", "tree"):
        ns = sorted(b[fanout], key=int)
        med = [b[fanout][n]["median"] for n in ns]
        ax2.errorbar([int(n) for n in ns], med, yerr=[[m - b[fanout][n]["min"] for m, n in zip(med, ns)],
                                                      [b[fanout][n]["max"] - m for m, n in zip(med, ns)]],
                     marker="o", capsize=3, label=fanout)
    ax2.set_xlabel("hosts")
    ax2.set_ylabel("seconds (median, min-max)")
    ax2.set_title(f"(b) fan-out, uplink {env['rate']}, {env['tree_b']['bytes'] / 1e6:.0f} MB")
    ax2.set_xticks([int(n) for n in sorted(b["star"], key=int)])
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small trees, fewer runs (a smoke test of the bench)")
    ap.add_argument("--subnet", default="10.213.62.0/24", help="the bench lab's subnet")
    ap.add_argument("--work", default="/tmp/ddpfab-bench-sync", help="scratch dir (trees, lab state)")
    ap.add_argument("--rate", default="20mbit", help="the shaped uplink for (b), a tc rate")
    ap.add_argument("--only", choices=("a", "b"), help="run one part only; the other comes from --merge")
    ap.add_argument("--merge", metavar="RESULTS", help="with --only: take the other part from these saved results")
    ap.add_argument("--out", default=str(REPO / "docs"), help="where the markdown and the plot go")
    ap.add_argument("--from-json", metavar="RESULTS", help="only rewrite the markdown and plot from saved results")
    args = ap.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        out, suffix = Path(args.out), ("-quick" if "-quick" in args.from_json else "")
        plot = out / f"sync-bench{suffix}.png"
        write_markdown(results, out / f"sync-benchmarks{suffix}.md", plot if write_plot(results, plot) else None)
        return 0
    # a TERM (timeout, kill) unwinds like Ctrl-C, so the lab and the tc qdisc are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("the bench needs root (it brings up a lab of network namespaces)", file=sys.stderr)
        return 2
    files_a, mb_a, files_b, mb_b, reps_a, reps_b, counts = (5000, 200, 500, 8, 3, 2, [2, 4, 8])
    if args.quick:
        files_a, mb_a, files_b, mb_b, reps_a, reps_b, counts = (500, 20, 100, 4, 1, 1, [2, 4])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tree_a, tree_b = work / "tree-a", work / "tree-b"
    started = time.monotonic()
    old = json.loads(Path(args.merge).read_text()) if args.merge else None
    if args.only and not old:
        print("--only needs --merge RESULTS (the saved results of a full run) for the other part", file=sys.stderr)
        return 2
    env = {"cpus": os.cpu_count(), "machine": platform.machine(),
           "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
           "rsync": subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
           "ssh": subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip(),
           "reps_a": reps_a, "reps_b": reps_b, "rate": args.rate}
    results = {"env": env}
    if args.only:  # the other part, and what described it, from the earlier run
        other = "b" if args.only == "a" else "a"
        results[other] = old[other]
        keys = ("tree_b", "reps_b", "rate") if other == "b" else ("tree_a", "reps_a")
        env.update({k: old["env"][k] for k in keys if k in old["env"]})
        env["merged"] = (f"part ({other}) comes from an earlier run of the same code, started at load average "
                         f"{old['env']['load_before']}")
    if args.only != "b":
        n, size = make_tree(tree_a, files_a, mb_a)
        env["tree_a"] = {"files": n, "bytes": size}
    if args.only != "a":
        n, size = make_tree(tree_b, files_b, mb_b, seed=2)
        env["tree_b"] = {"files": n, "bytes": size}
    lab_dir = work / "lab"
    the_lab, _ = labmod.up(lab_dir, hosts=max(counts + [4]) if args.only != "a" else 4, subnet=args.subnet)
    try:
        if args.only != "b":
            results["a"] = bench_methods(the_lab, tree_a, reps_a, work)
        if args.only != "a":
            results["b"] = bench_fanout(the_lab, tree_b, counts, reps_b, args.rate, work)
    finally:
        labmod.down(lab_dir)
    results["env"]["bench_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (work / f"results{suffix}.json").write_text(json.dumps(results, indent=1) + "\n")  # every run, raw
    plot = out / f"sync-bench{suffix}.png"
    write_markdown(results, out / f"sync-benchmarks{suffix}.md", plot if write_plot(results, plot) else None)
    shutil.rmtree(tree_a, ignore_errors=True)
    shutil.rmtree(tree_b, ignore_errors=True)
    print(f"done in {results['env']['bench_s']} s: {out / f'sync-benchmarks{suffix}.md'} "
          f"(raw: {work / f'results{suffix}.json'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
