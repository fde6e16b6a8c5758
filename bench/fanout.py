#!/usr/bin/env python3
"""Fan-out latency: one trivial command (`hostname`) on N lab hosts, end to end, cold connections.

    .venv/bin/python bench/fanout.py            # N = 2 4 8 16 32, 5 repetitions (~4 min on 2 idle cores)
    .venv/bin/python bench/fanout.py --quick    # N = 2 8 32, 1 repetition: a smoke test

Tools, each a fresh process as a user would type it (wall time from spawn to exit, output checked):
  ddpfab exec        python -m ddpfab exec -i INV -- hostname
  pdsh               pdsh -R ssh -w node[1-N] hostname     (lab ssh_config via PDSH_SSH_ARGS; fanout 32)
  ssh loop           for h in node1..nodeN; do ssh -F ssh_config $h hostname; done
  ansible            ansible all -i INV -m command -a hostname   (the repo's ansible.cfg; its
                     ControlPersist masters closed before each run, so every run is cold)
  ansible (warm)     the same again at once, over the ControlPersist masters the cold run left
  ddpfab startup     python -m ddpfab exec -i INV --nodes - -- true: interpreter, imports, inventory
                     load, then exit before any SSH (the fixed cost inside `ddpfab exec`)
  ddpfab exec (held) the same `ddpfab exec` on a copy of the inventory that `ddpfab hold` holds:
                     the connections stay open between commands (started once per N, untimed;
                     stopped at the end; the copy keeps the cold `ddpfab exec` cold)
and in this process, on the same inventory (no interpreter start, no inventory load):
  in-process cold    ddpfab.remote.ssh.connect + ddpfab.remote.ssh.run on every host at once (ddpfab.remote.ssh.parallel)
  in-process warm    ddpfab.remote.ssh.run on the connections already open: the floor under
                     `ddpfab exec (held)` (no interpreter start, no inventory load, no output through a socket)

Tools are interleaved (rotated order inside every repetition) so load drifts hit all of them alike.
Writes bench/results/fanout.json (+ fanout-profile.txt: importtime and pyinstrument of one
`ddpfab exec` on the largest N).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, REPO, log

SIZES = (2, 4, 8, 16, 32)
QUICK_SIZES = (2, 8, 32)
TOOLS = ("ddpfab exec", "pdsh", "ssh loop", "ansible", "ddpfab startup", "ddpfab exec (held)")
ANSIBLE = str(Path(PYTHON).parent / "ansible")
COMMAND_TIMEOUT = 300


class Bench:
    def __init__(self, lab, work: Path, sizes: tuple[int, ...]):
        self.lab, self.work = lab, work
        self.inv = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}
        self.held = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}-held.yml") for n in sizes}
        #: per N, this process's CPU seconds (user + system) during each in-process cold run: the
        #: controller's share, which real hosts would not spread over N machines as they do sshd's
        self.cpu: dict[int, list[float]] = {}

    def argv_env(self, tool: str, n: int) -> tuple[list[str], dict]:
        inv = str(self.inv[n])
        if tool == "ddpfab exec":
            return [PYTHON, "-m", "ddpfab", "exec", "-i", inv, "--no-color", "--", "hostname"], common.env_with()
        if tool == "ddpfab exec (held)":
            return ([PYTHON, "-m", "ddpfab", "exec", "-i", str(self.held[n]), "--no-color", "--", "hostname"],
                    common.env_with())
        if tool == "ddpfab startup":
            return [PYTHON, "-m", "ddpfab", "exec", "-i", inv, "--nodes", "-", "--", "true"], common.env_with()
        if tool == "pdsh":
            return ["pdsh", "-w", common.pdsh_hosts(n), "hostname"], common.pdsh_env(self.lab)
        if tool == "ssh loop":
            loop = 'cfg=$1; shift; for h in "$@"; do ssh -F "$cfg" "$h" hostname || exit 1; done'
            return ["bash", "-c", loop, "bash", str(self.lab.ssh_config), *common.names(n)], common.env_with()
        if tool in ("ansible", "ansible (warm)"):
            return ([ANSIBLE, "all", "-i", inv, "-m", "ansible.builtin.command", "-a", "hostname"],
                    common.env_with(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1"))
        raise ValueError(tool)

    def once(self, tool: str, n: int) -> float:
        argv, env = self.argv_env(tool, n)
        t0 = time.perf_counter()
        res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT,
                             stdin=subprocess.DEVNULL)
        elapsed = time.perf_counter() - t0
        if tool == "ddpfab exec (held)" and "over the connections `ddpfab hold` keeps open" not in res.stderr:
            raise RuntimeError(f"{tool} on {n} hosts ran cold:\n{res.stderr[-2000:]}")
        if tool == "ddpfab startup":
            ok = res.returncode == 2 and "--nodes" in res.stderr  # refused after loading the inventory
        else:
            seen = {int(x) for x in common.HOSTNAME_RE.findall(res.stdout)}
            ok = res.returncode == 0 and seen >= set(range(1, n + 1))
        if not ok:
            raise RuntimeError(f"{tool} on {n} hosts failed (exit {res.returncode}):\n"
                               f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        return elapsed

    def hold(self, n: int, stop: bool = False) -> None:
        """Start (untimed) or stop the holder of the held copy of the inventory of *n* hosts."""
        res = subprocess.run([PYTHON, "-m", "ddpfab", "hold", "-i", str(self.held[n]), *(["--stop"] if stop else [])],
                             capture_output=True, text=True, env=common.env_with(), timeout=COMMAND_TIMEOUT)
        if res.returncode != 0:
            raise RuntimeError(f"ddpfab hold{' --stop' if stop else ''} on {n} hosts failed:\n{res.stderr[-2000:]}")

    def ansible_pair(self, n: int) -> tuple[float, float]:
        """A cold run (no ControlPersist master) and, right after it, a warm one."""
        common.close_control_masters(self.lab)
        cold = self.once("ansible", n)
        warm = self.once("ansible (warm)", n)
        common.close_control_masters(self.lab)
        return cold, warm

    def in_process(self, n: int) -> tuple[float, float]:
        from ddpfab.hosts import inventory
        from ddpfab.remote import ssh

        cluster = inventory.load(self.inv[n])
        nodes = list(cluster.nodes)
        policy = ssh.HostKeyPolicy()
        conns = {}

        def connect_run(node):
            conn = ssh.connect(node, policy)
            conns[node.name] = conn
            return ssh.run(conn, node.name, "hostname")

        try:
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            cold = ssh.parallel(nodes, connect_run)
            t_cold = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            self.cpu.setdefault(n, []).append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            t0 = time.perf_counter()
            warm = ssh.parallel(nodes, lambda node: ssh.run(conns[node.name], node.name, "hostname"))
            t_warm = time.perf_counter() - t0
        finally:
            for c in conns.values():
                c.close()
        for results in (cold, warm):
            bad = {k: v for k, v in results.items() if isinstance(v, BaseException) or v.exit_code != 0}
            if bad:
                raise RuntimeError(f"in-process run on {n} hosts failed: {bad}")
        return t_cold, t_warm

    def profile(self, n: int) -> tuple[dict, str]:
        argv, env = self.argv_env("ddpfab exec", n)
        res = subprocess.run([PYTHON, "-X", "importtime", *argv[1:]], capture_output=True, text=True, env=env,
                             timeout=COMMAND_TIMEOUT)
        summary = common.importtime_summary(res.stderr)
        text = [f"# python -X importtime -m ddpfab exec on {n} hosts: imports {summary['total_ms']:.0f} ms "
                f"(importtime's own overhead included)", ""]
        text += [f"{k:<24} {v:8.1f} ms" for k, v in summary["by_package_ms"].items()]
        if common.pyinstrument_available():
            out = self.work / "fanout-pyinstrument.txt"
            subprocess.run([PYTHON, "-m", "pyinstrument", "--no-color", "-r", "text", "-o", str(out),
                            "-m", *argv[2:]], capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT)
            if out.exists():
                text += ["", f"# pyinstrument, one `ddpfab exec` on {n} hosts (main thread)", "",
                         out.read_text()]
        return summary, "\n".join(text) + "\n"


def main() -> int:
    parser = common.base_parser("fanout", __doc__, reps=5, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 2,4,8,16,32; --quick 2,8,32)")
    parser.add_argument("--skip", default="", help="comma-separated tools to leave out (e.g. ansible)")
    parser.add_argument("--no-profile", action="store_true", help="skip the importtime/pyinstrument profile")
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    tools = [t for t in TOOLS if t not in skip]
    work = common.WORK_ROOT / "fanout"
    work.mkdir(parents=True, exist_ok=True)
    samples: dict[str, dict[int, list[float]]] = {}

    def add(tool: str, n: int, t: float) -> None:
        samples.setdefault(tool, {}).setdefault(n, []).append(t)

    profile = None
    with common.bench_lab("fanout", max(sizes), args.subnet) as lab:
        b = Bench(lab, work, sizes)
        try:
            if "ddpfab exec (held)" in tools:
                for n in sizes:
                    b.hold(n)
            log("warm-up (page cache, pycache): one untimed run of each tool")
            for tool in tools:
                if tool == "ansible":
                    b.ansible_pair(min(sizes))
                else:
                    b.once(tool, min(sizes))
            b.in_process(min(sizes))
            b.cpu.clear()  # (the warm-up's)
            for rep in range(reps):
                for i, n in enumerate(sizes):
                    k = (rep + i) % len(tools)
                    for tool in tools[k:] + tools[:k]:
                        if tool == "ansible":
                            cold, warm = b.ansible_pair(n)
                            add("ansible", n, cold)
                            add("ansible (warm)", n, warm)
                        else:
                            add(tool, n, b.once(tool, n))
                    cold, warm = b.in_process(n)
                    add("in-process cold", n, cold)
                    add("in-process warm", n, warm)
                    line = "  ".join(f"{t}={samples[t][n][-1]:.2f}" for t in samples if n in samples[t])
                    log(f"rep {rep + 1}/{reps} N={n}: {line}")
        finally:  # no holder outlives the benchmark
            if "ddpfab exec (held)" in tools:
                for n in sizes:
                    b.hold(n, stop=True)
        if not args.no_profile:
            log(f"profiling one `ddpfab exec` on {max(sizes)} hosts")
            profile, text = b.profile(max(sizes))
            common.RESULTS.mkdir(parents=True, exist_ok=True)
            (common.RESULTS / "fanout-profile.txt").write_text(text)

    series = [{"tool": tool, "hosts": n, **common.summarize(vals)}
              for tool, per_n in samples.items() for n, vals in sorted(per_n.items())]
    config = {"sizes": list(sizes), "command": "hostname", "tools": list(samples),
              "pdsh_fanout": 32, "ansible_cfg": "ansible.cfg (forks 32, pipelining, ControlPersist 30s)"}
    controller_cpu = [{"hosts": n, **common.summarize(vals)} for n, vals in sorted(b.cpu.items()) if n in sizes]
    common.write_result(args.out, "fanout", args, config,
                        {"series": series, "profile": profile, "controller_cpu": controller_cpu}, meta, started)
    for s in series:
        log(f"{s['tool']:<18} N={s['hosts']:<3} {common.fmt(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
