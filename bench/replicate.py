#!/usr/bin/env python3
"""``--replicate``'s copy: one file from rank 0's node to every other node, relayed by the controller
(what ddpfab does) against node-to-node rsync (what it could do), on a lab of 4 hosts.

    .venv/bin/python bench/replicate.py            # a 50 MB file, 4 hosts, 5 repetitions
    .venv/bin/python bench/replicate.py --quick    # 1 repetition

Ways, each ending with every receiver holding the file and its sha256 checked there:
  relay          ddpfab.launch.replicate.relay over open ddpfab.remote.ssh connections: node1 sends the file
                 once, the controller writes each chunk to node2..node4 as it arrives, each
                 receiver hashes while it writes and renames the file into place (the run's path)
  rsync star     on node1: rsync to node2, node3, node4 at once (node-to-node SSH), then
                 sha256sum on each receiver
  rsync tree     node1 -> node2, then node1 -> node3 and node2 -> node4 at once (sync's
                 --fanout tree shape), then sha256sum on each receiver
Node-to-node SSH uses the lab's key and ssh_config, which the hosts see (a real cluster needs
that trust set up; ddpfab's relay needs none). Ways are interleaved per repetition. Writes
bench/results/replicate.json.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import WORK_ROOT, log

HOSTS = 4
WORKDIR = "/opt/ddpfab/replicate-bench"
FILE = "snapshot.pt"
WAYS = ("relay", "rsync star", "rsync tree")


def on(lab, node: str, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(lab.ssh_config), node, command], capture_output=True, text=True,
                          timeout=timeout, check=True)


def main() -> int:
    p = common.base_parser("replicate", __doc__, reps=5, quick_reps=1)
    p.add_argument("--mb", type=int, default=50, help="file size in MB (default 50)")
    args = p.parse_args()
    reps, meta, started = common.begin(args)
    from ddpfab.remote import nodeprogram as nodeprog
    from ddpfab.hosts import inventory
    from ddpfab.launch import replicate, runner
    from ddpfab.remote import ssh

    names = common.names(HOSTS)
    results: dict[str, list[float]] = {w: [] for w in WAYS}
    with common.bench_lab("replicate", HOSTS, args.subnet) as lab:
        inv = common.write_inventory(lab, names, WORK_ROOT / "replicate" / "inv.yml", ddpfab_workdir=WORKDIR)
        for n in names:
            on(lab, n, f"mkdir -p {WORKDIR}")
        on(lab, "node1", f"head -c {args.mb * 1000 * 1000} /dev/urandom > {WORKDIR}/{FILE}")
        want = on(lab, "node1", f"sha256sum {WORKDIR}/{FILE}").stdout.split()[0]
        cluster = inventory.load(str(inv))
        conns = runner.connect_all(cluster, ssh.HostKeyPolicy())
        nodes = {n.name: n for n in cluster.nodes}
        workdirs = {n: WORKDIR for n in names}
        cfg = shlex.quote(f"ssh -F {lab.ssh_config}")
        src = f"{WORKDIR}/{FILE}"

        def clear() -> None:
            for n in names[1:]:
                on(lab, n, f"rm -f {WORKDIR}/{FILE}")

        def check_all() -> None:
            procs = [subprocess.Popen(["ssh", "-F", str(lab.ssh_config), n, f"sha256sum {src}"],
                                      stdout=subprocess.PIPE, text=True) for n in names[1:]]
            for n, proc in zip(names[1:], procs):
                out, _ = proc.communicate(timeout=300)
                assert out.split()[0] == want, (n, out)

        def relay() -> None:
            [reply] = nodeprog.call(conns["node1"], nodes["node1"],
                                    replicate.stat_request(WORKDIR, (FILE,), scan=False), timeout=300)
            info = reply.value("node1")["files"][FILE]
            copy = replicate.Copy(FILE, "node1", info["sha256"], info["bytes"], to=names[1:])
            problems = replicate.relay(copy, conns, nodes, workdirs)
            assert not problems, problems

        def rsync(pairs: list[tuple[str, str]]) -> None:
            by_src: dict[str, list[tuple[str, str]]] = {}
            for s, d in pairs:
                by_src.setdefault(s, []).append((s, d))
            procs = []
            for s, ps in by_src.items():
                cmd = " & ".join(f"rsync -t -e {cfg} {src} {d}:{WORKDIR}/" for _, d in ps) + " & wait"
                procs.append(subprocess.Popen(["ssh", "-F", str(lab.ssh_config), s, cmd]))
            for proc in procs:
                assert proc.wait(timeout=300) == 0

        def star() -> None:
            rsync([("node1", n) for n in names[1:]])
            check_all()

        def tree() -> None:
            rsync([("node1", "node2")])
            rsync([("node1", "node3"), ("node2", "node4")])
            check_all()

        ways = {"relay": relay, "rsync star": star, "rsync tree": tree}
        for rep in range(reps):
            for k in range(len(WAYS)):
                way = WAYS[(rep + k) % len(WAYS)]
                clear()
                t0 = time.monotonic()
                ways[way]()
                results[way].append(time.monotonic() - t0)
                log(f"rep {rep + 1}/{reps} {way}: {results[way][-1]:.2f} s")
        for c in conns.values():
            c.close()
    data = {"results": {w: common.summarize(v) for w, v in results.items()},
            "samples": {w: [round(x, 3) for x in v] for w, v in results.items()}}
    config = {"hosts": HOSTS, "mb": args.mb, "receivers": HOSTS - 1}
    common.write_result(args.out, "replicate", args, config, data, meta, started)
    for w in WAYS:
        log(f"{w}: {common.fmt(data['results'][w])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
