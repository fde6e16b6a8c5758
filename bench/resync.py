#!/usr/bin/env python3
"""The no-change re-sync before a run: this checkout's sync against the code on `main`, same run.

    .venv/bin/python bench/resync.py [--quick] [--reps R] [--subnet 10.NN.63.0/24] [--base main]

Ownership (a record per workdir, deletions only of placed files, a prepare and a commit step on
each node) must not make the common case slower: `ddpfab run` while nothing changed. Measured,
interleaved per repetition on the same lab and tree (a project of --files files / --mb MB to 4
hosts), for both implementations:

- ``fast path``: what `ddpfab run` does first, ``sync.unchanged()`` over the run's open
  connections (one hash per node, no copy);
- ``full sync``: ``sync.sync_cluster()`` with nothing to copy (what `ddpfab sync` does);
- ``rsync loop``: a plain sequential `rsync -a` per host, verifying nothing, as the floor.

The base's code is materialised with `git archive BASE ddpfab` into a scratch dir and run from
there; each measurement is a subprocess that loads the inventory and opens its connections
untimed, then times the call alone. Writes bench/results/resync.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: One measurement in a subprocess: argv[1] the op, [2] inventory, [3] project. Prints seconds.
DRIVER = r"""
import sys, time
try:
    from ddpfab.hosts import inventory
    from ddpfab.launch import runner
    from ddpfab.remote import ssh
    from ddpfab.transfer import sync
except ImportError:  # --base: a revision from before the subpackages (fd02625)
    from ddpfab import inventory, runner, ssh, sync
op, inv, src = sys.argv[1:4]
cluster = inventory.load(inv)
policy = ssh.HostKeyPolicy()
if op == "fast path":
    conns = runner.connect_all(cluster, policy)
    t0 = time.monotonic()
    res = sync.unchanged(cluster, conns, src)
    took = time.monotonic() - t0
    assert res is not None, "the fast path did not find the tree unchanged"
else:
    t0 = time.monotonic()
    sync.sync_cluster(cluster, src, policy)
    took = time.monotonic() - t0
print(took)
"""


def make_project(root: Path, files: int, megabytes: int) -> None:
    rng = __import__("random").Random(3)
    per = megabytes * 10**6 // files
    for i in range(files):
        d = root / f"pkg{i % 16:02d}" / f"mod{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.py").write_bytes(rng.randbytes(per))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "b"],
                   check=True)


def main() -> int:
    p = common.base_parser("resync", __doc__.split("\n\n")[0], reps=7, quick_reps=2)
    p.add_argument("--base", default="main", help="the git revision to compare with (default: main)")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--mb", type=int, default=40)
    args = p.parse_args()
    reps, meta, started = common.begin(args)
    work = common.WORK_ROOT / "resync"
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=work))
    base_dir = scratch / "base"
    base_dir.mkdir()
    archive = subprocess.run(["git", "-C", str(common.REPO), "archive", args.base, "ddpfab"], check=True,
                             capture_output=True).stdout
    (scratch / "base.tar").write_bytes(archive)
    with tarfile.open(scratch / "base.tar") as tar:
        tar.extractall(base_dir)
    base_rev = subprocess.run(["git", "-C", str(common.REPO), "rev-parse", "--short", args.base],
                              capture_output=True, text=True).stdout.strip()
    project = scratch / "project"
    make_project(project, args.files if not args.quick else 300, args.mb if not args.quick else 5)
    impls = {"this": str(common.REPO), f"{args.base} ({base_rev})": str(base_dir)}
    ops = ("fast path", "full sync")
    samples: dict = {f"{impl}: {op}": [] for impl in impls for op in ops}
    samples["rsync loop"] = []
    with common.bench_lab("resync", 4, args.subnet) as lab:
        names = [h.name for h in lab.hosts]
        invs = {impl: common.write_inventory(lab, names, scratch / f"inv{i}.yml",
                                             ddpfab_workdir=f"/opt/ddpfab/resync{i}")
                for i, impl in enumerate(impls)}
        env = {impl: {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(scratch / f"cache{i}")}
               for i, (impl, path) in enumerate(impls.items())}

        def measure(impl: str, op: str) -> float:
            out = subprocess.run([common.PYTHON, "-c", DRIVER, op, str(invs[impl]), str(project)], env=env[impl],
                                 capture_output=True, text=True, timeout=600, cwd=scratch)
            if out.returncode != 0:
                raise SystemExit(f"{impl} {op} failed: {out.stderr[-2000:]}")
            return float(out.stdout.strip().splitlines()[-1])

        for impl in impls:  # the first copy, and one re-sync to warm the digest caches: untimed
            measure(impl, "full sync")
            measure(impl, "full sync")
        cfg = str(lab.ssh_config)
        for rep in range(reps):
            for impl in impls:
                for op in ops:
                    samples[f"{impl}: {op}"].append(measure(impl, op))
            t0 = time.monotonic()
            for n in names:
                subprocess.run(["rsync", "-a", "-e", f"ssh -F {cfg}", f"{project}/", f"{n}:/opt/ddpfab/resync-rsync/"],
                               check=True, capture_output=True)
            samples["rsync loop"].append(time.monotonic() - t0)
            common.log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items()))
    stats = {k: common.summarize(v) for k, v in samples.items()}
    base = f"{args.base} ({base_rev})"
    ratios = {op: round(stats[f"this: {op}"]["median"] / stats[f"{base}: {op}"]["median"], 3) for op in ops}
    for k, s in stats.items():
        common.log(f"{k:<28} median {s['median']:.3f} s (min {s['min']:.3f}, max {s['max']:.3f})")
    common.log("this / base (median): " + ", ".join(f"{op} {r:.2f}x" for op, r in ratios.items()))
    common.write_result(args.out, "resync", args, {"files": args.files, "mb": args.mb, "hosts": 4, "base": base},
                        {"results": stats, "ratio_this_over_base": ratios}, meta, started)
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
