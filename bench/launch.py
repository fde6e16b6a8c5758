#!/usr/bin/env python3
"""Launch overhead: from `ddpfab run` starting to the first line printed by every rank.

    .venv/bin/python bench/launch.py            # N = 2 4 8, 3 repetitions (~6 min on 2 idle cores)
    .venv/bin/python bench/launch.py --quick    # N = 2 4, 1 repetition: a smoke test

The job: 1 process per host running a script that prints one line right after `import torch` and
exits (no process group). Measured, each from process spawn to the last rank's READY line on the
launcher's stdout:
  ddpfab run              python -m ddpfab run -i INV bench_hello.py   (preflight checks on)
  ddpfab run --no-check   the same without the preflight mesh check
  ddpfab run --no-sync    the same without the code sync `run` does first (rsync + tree hash per node;
                          on the lab a no-change sync: the hosts see the controller's /tmp)
  torchrun (local)        python -m torch.distributed.run --nproc-per-node=1 bench_hello.py on this
                          machine: what torchrun itself costs (the baseline the target refers to)
  pdsh + torchrun         pdsh -R ssh -f N -w node[1-N] 'cd WD && python -m torch.distributed.run
                          --nnodes N --node-rank K ...': the same torchrun on the same N hosts,
                          started by the plainest SSH fan-out there is. On this lab all N hosts
                          share this machine's CPUs, so N torchruns importing torch at once are
                          slower than one: this baseline carries the same contention as ddpfab.
Also, once per N: a phase breakdown of one ddpfab run (ddpfab.Cluster.run, the API the CLI calls, in
process with timers around inventory.load, Cluster._sync_code, runner.connect_all, runner.start_probe +
prepare, runner._preflight, make_plan, execute), isolated costs (imports, inventory, a remote python start), and on
the largest N a profile (python -X importtime, pyinstrument) in bench/results/launch-profile.txt.
Writes bench/results/launch.json.
"""

from __future__ import annotations

import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, log

SIZES = (2, 4, 8)
QUICK_SIZES = (2, 4)
SCRIPT = "bench_hello.py"
HELLO = """import os
import time
import torch  # noqa: F401
# when torchrun (this rank's parent) started on this node, by this node's clock: /proc's start
# time in ticks since boot, against /proc/uptime read now (10 ms resolution)
_ticks = int(open("/proc/%d/stat" % os.getppid()).read().rsplit(")", 1)[1].split()[19])
_up = float(open("/proc/uptime").read().split()[0])
print("READY %s %.3f %.3f" % (os.environ["RANK"], time.time(), time.time() - _up + _ticks / os.sysconf("SC_CLK_TCK")),
      flush=True)
"""
READY = re.compile(r"READY (\d+)")
#: HELLO's line: rank, when it printed, when its torchrun started (wall clock: the lab hosts share
#: this machine's clock)
READY_TIMES = re.compile(r"READY (\d+) (\d+\.\d+) (\d+\.\d+)")
RUN_TIMEOUT = 300

#: Runs one `ddpfab run` in-process through the library API (ddpfab.Cluster.load(INV).run(SCRIPT), what
#: the command line calls) with a timestamp (CLOCK_MONOTONIC, shared by all processes) before and after
#: each step of the preparation and execute; events go to stderr as BENCHPHASE lines.
#: argv: INVENTORY RUNS_DIR SCRIPT.
PHASE_DRIVER = r"""
import sys, time
def ev(name):
    sys.stderr.write("BENCHPHASE %s %.6f\n" % (name, time.monotonic()))
    sys.stderr.flush()
ev("interpreter-ready")
import ddpfab
from ddpfab import api
from ddpfab.hosts import inventory
from ddpfab.launch import runner  # what `run` imports (fabric/paramiko)
ev("imports-done")
def wrap(owner, attr, label):
    fn = getattr(owner, attr)
    def timed(*a, **k):
        ev(label + ":start")
        try:
            return fn(*a, **k)
        finally:
            ev(label + ":end")
    setattr(owner, attr, timed)
wrap(inventory, "load", "inventory.load")
wrap(api.Cluster, "_sync_code", "sync")  # `run` syncs the code to every node first (unless sync=False)
wrap(runner, "connect_all", "connect")
wrap(runner, "start_probe", "probe-start")  # one node program session per node for the whole preparation
wrap(runner, "prepare", "prepare")
wrap(runner, "_preflight", "preflight")
wrap(runner, "make_plan", "plan")
wrap(runner, "execute", "execute")
inv, runs_dir, script = sys.argv[1:4]
result = ddpfab.Cluster.load(inv).run(script, runs_dir=runs_dir, color=False)
ev("main-returned")
sys.exit(result.exit_code)
"""


def _best(reps: int, fn) -> float:
    """The least of *reps* timings of ``fn()`` (a fixed cost's least noisy estimate), seconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Run:
    """A launcher process whose output lines are timestamped as they arrive."""

    def __init__(self, argv: list[str], env: dict, cwd: Path):
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL, bufsize=1, errors="replace")
        self.lines: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for r in self.readers:
            r.start()

    @staticmethod
    def _read(stream, into):
        for line in stream:
            into.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            common.stop_process(self.proc)
            raise RuntimeError(f"launcher did not finish in {timeout} s:\n{self.text()}") from None
        for r in self.readers:
            r.join(timeout=5)
        return rc

    def ready(self, world: int) -> float:
        """Seconds from spawn to the last rank's READY line."""
        seen: dict[int, float] = {}
        for t, line in self.lines:
            m = READY.search(line)
            if m:
                seen.setdefault(int(m.group(1)), t)
        if set(seen) != set(range(world)):
            raise RuntimeError(f"ranks seen {sorted(seen)}, expected 0..{world - 1}:\n{self.text()}")
        return max(seen.values()) - self.t0

    def timeline(self, world: int) -> dict[str, float]:
        """Seconds from spawn, each the last of the ranks: their torchrun started, the rank printed
        its READY line, the line reached here (:meth:`ready`); from HELLO's times."""
        got = {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
               for _, line in self.lines if (m := READY_TIMES.search(line))}
        if set(got) != set(range(world)):
            raise RuntimeError(f"ranks with times {sorted(got)}, expected 0..{world - 1}:\n{self.text()}")
        return {"torchrun started": max(t for _, t in got.values()) - self.t0_wall,
                "rank printed": max(p for p, _ in got.values()) - self.t0_wall, "line here": self.ready(world)}

    def first(self, prefix: str, stream: str = "lines") -> float | None:
        for t, line in getattr(self, stream):
            if line.startswith(prefix):
                return t - self.t0
        return None

    def text(self) -> str:
        return "\n".join(line for _, line in sorted(self.lines + self.err))[-4000:]


class Bench:
    def __init__(self, lab, work: Path, sizes):
        self.lab, self.work = lab, work
        self.wd = work / "work"
        self.runs = work / "runs"
        self.inv = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}
        self.port = common.MASTER_PORT_BASE
        self.procs = common.HostProcs(lab, [h.name for h in lab.hosts])
        self.last_pid: int | None = None  # the launcher process of the latest ddpfab() or pdsh() (bench/run_cpu.py)

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def settle(self) -> None:
        """Wait until the job left nothing on any host (kill what outlives 20 s)."""
        deadline = time.monotonic() + 20
        while self.procs.count():
            if time.monotonic() > deadline:
                log(f"killing leftovers: {self.procs.scan()}")
                self.procs.kill_all()
                return
            time.sleep(0.05)

    def ddpfab(self, n: int, *flags: str) -> dict:
        argv = [PYTHON, "-m", "ddpfab", "run", "-i", str(self.inv[n]), "--no-color", "--runs-dir", str(self.runs),
                *flags, SCRIPT]
        run = Run(argv, common.env_with(), self.wd)
        self.last_pid = run.proc.pid
        try:
            rc = run.wait()
            if rc != 0:
                raise RuntimeError(f"ddpfab run exited {rc}:\n{run.text()}")
            return {"ready": run.ready(n), "started": run.first("ddpfab: run "), "timeline": run.timeline(n)}
        finally:
            common.stop_process(run.proc)
            self.settle()

    def local(self) -> dict:
        argv = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                f"--master-port={common.free_port()}", SCRIPT]
        run = Run(argv, common.env_with(), self.wd)
        try:
            rc = run.wait()
            if rc != 0:
                raise RuntimeError(f"torchrun exited {rc}:\n{run.text()}")
            return {"ready": run.ready(1)}
        finally:
            common.stop_process(run.proc)

    def pdsh(self, n: int, script: str = SCRIPT, timeout: float = RUN_TIMEOUT) -> dict:
        master = self.lab.host("node1").address
        remote = (f"cd {self.wd} && exec {PYTHON} -m torch.distributed.run --nnodes={n} "
                  f"--node-rank=$(( $(hostname | tr -dc 0-9) - 1 )) --nproc-per-node=1 "
                  f"--master-addr={master} --master-port={self.next_port()} {script}")
        # -f N: a job's N torchruns must all start (pdsh's default window of 32 would keep hosts 33.. waiting
        # behind the first 32, which wait in rendezvous for them: a 64-host job never starts)
        run = Run(["pdsh", "-f", str(max(n, 32)), "-w", common.pdsh_hosts(n), remote], common.pdsh_env(self.lab),
                  self.wd)
        self.last_pid = run.proc.pid
        try:
            rc = run.wait(timeout)
            exited = time.monotonic() - run.t0
            if rc != 0:
                raise RuntimeError(f"pdsh exited {rc}:\n{run.text()}")
            return {"ready": run.ready(n), "exit": exited, "timeline": run.timeline(n)}
        finally:
            common.stop_process(run.proc)
            self.settle()

    def phases(self, n: int, script: str = SCRIPT, timeout: float = RUN_TIMEOUT) -> dict:
        """One `ddpfab run` of *script*, timed step by step; also its exit time and what the controller
        process held (peak threads, open files, memory; CPU seconds)."""
        argv = [PYTHON, "-c", PHASE_DRIVER, str(self.inv[n]), str(self.runs), script]
        run = Run(argv, common.env_with(), self.wd)
        sampler = common.ProcessSampler(run.proc.pid)
        try:
            rc = run.wait(timeout)
            exited = time.monotonic() - run.t0
            controller = sampler.result()
            if rc != 0:
                raise RuntimeError(f"phase driver exited {rc}:\n{run.text()}")
            ev = {}
            for _, line in run.err:
                if line.startswith("BENCHPHASE "):
                    _, name, t = line.split()
                    ev[name] = float(t) - run.t0
            ready = run.ready(n)
            first_ready = min(t for t, line in run.lines if READY.search(line)) - run.t0
        finally:
            common.stop_process(run.proc)
            self.settle()
        sync = (ev["sync:start"], ev["sync:end"]) if "sync:start" in ev else (ev["connect:end"],) * 2
        if "probe-start:start" in ev:  # one node program per node: started once, asked everything
            after = ev.get("preflight:start", ev["plan:start"])
            probing = [("start the node program per node, send facts + mesh listen", ev["probe-start:start"],
                        ev["probe-start:end"]),
                       ("code sync (tree hash in the same session; rsync only when it differs)", *sync),
                       ("probe (wait for the facts sent with the start)", ev["prepare:start"], after)]
        else:
            probing = [("code sync (tree hash per node; rsync only when it differs)", *sync),
                       ("probe (python snippet per node)", ev["probe:start"], ev["probe:end"])]
        steps = [
            ("python start", 0.0, ev["interpreter-ready"]),
            ("imports (ddpfab, fabric/paramiko)", ev["interpreter-ready"], ev["imports-done"]),
            ("parse args + inventory.load", ev["imports-done"], ev["inventory.load:end"]),
            ("connect (SSH, host keys)", ev["connect:start"], ev["connect:end"]),
            *probing,
            ("preflight mesh check", ev["preflight:start"], ev["preflight:end"]),
            ("plan", ev["plan:start"], ev["plan:end"]),
            ("run record + start nodes -> first rank READY", ev["plan:end"], first_ready),
            ("first -> last rank READY", first_ready, ready),
        ]
        accounted = sum(b - a for _, a, b in steps)
        steps.append(("other (gaps between the steps)", 0.0, ready - accounted))
        return {"hosts": n, "ready": round(ready, 3), "exit": round(exited, 3), "controller": controller,
                "steps": [{"step": s, "seconds": round(b - a, 3)} for s, a, b in steps],
                "events": {k: round(v, 4) for k, v in ev.items()}}

    def micro(self, n: int, reps: int = 5) -> dict:
        """Small, isolated costs behind the profile's suggestions (min of *reps*: the least noisy
        estimate of a fixed cost). Seconds."""
        from ddpfab.hosts import inventory
        from ddpfab.remote import ssh

        inv = str(self.inv[n])

        def local(code: str) -> float:
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                subprocess.run([PYTHON, "-c", code], check=True, capture_output=True, env=common.env_with(),
                               cwd=self.wd)
                best = min(best, time.perf_counter() - t0)
            return best

        out = {
            "python -c pass": local("pass"),
            "import paramiko": local("import paramiko"),
            "import fabric (paramiko + invoke + fabric)": local("import fabric"),
            "import ddpfab.cli": local("import ddpfab.cli"),
            "ddpfab.cli.build_parser() (imports every plugin module)": local(
                "import ddpfab.cli as c; c.build_parser()"),
            "import ddpfab.runner (what `run` imports)": local("import ddpfab.launch.runner"),
            "build_parser() then import ddpfab.runner": local("import ddpfab.cli as c; c.build_parser(); import ddpfab.launch.runner"),
            "ddpfab.inventory.load(inventory) (Ansible parses it)": local(
                f"import os; os.environ['DDPFAB_INVENTORY_CACHE'] = '0'; "
                f"from ddpfab.hosts import inventory; inventory.load({inv!r})"),
            "ddpfab.inventory.load(inventory) (cached: Ansible's result, file unchanged)": local(
                f"from ddpfab.hosts import inventory; inventory.load({inv!r})"),
        }
        cluster = inventory.load(inv)
        node = cluster.nodes[0]
        peer = self.lab.host("node2").address
        conn = ssh.connect(node, ssh.HostKeyPolicy())
        try:
            def remote(cmd: str) -> float:
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    res = ssh.run(conn, node.name, cmd)
                    if res.exit_code != 0:
                        raise RuntimeError(f"{cmd!r} on {node.name}: exit {res.exit_code} {res.stderr}")
                    best = min(best, time.perf_counter() - t0)
                return best

            out["ssh.run true (open connection, TCP_NODELAY as ddpfab sets it)"] = remote("true")
            sock = conn.transport.sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            out["ssh.run true (Nagle on: paramiko's default)"] = remote("true")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            from ddpfab.health import probe

            peers = {h.name: h.address for h in self.lab.hosts[1:n]}
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                probe.probe_node(conn, node, workdir=str(self.wd), script=SCRIPT, find_port=True, peers=peers)
                best = min(best, time.perf_counter() - t0)
            out[f"probe.probe_node on one node ({len(peers)} peers)"] = best
            try:  # the one node program: what shipping it costs a node's python, beyond its start
                from ddpfab.remote import nodeprogram as nodeprog

                out[f"node program: start, read {len(nodeprog.program()) // 1024} kB, compile, one ps (node's python)"] = \
                    _best(reps, lambda: nodeprog.call(conn, node, {"op": "ps"}, timeout=60)[0].value(node.name))
            except ImportError:  # before: no node program
                pass
            out["ssh.run python -c pass (node's python)"] = remote(f"{node.python} -c pass")
            out["ssh.run 31 x ip -o route get"] = remote(
                f"for i in $(seq 31); do ip -o route get {peer} >/dev/null; done")
            t0 = time.perf_counter()
            ssh.connect(node, ssh.HostKeyPolicy()).close()
            out["ssh.connect one host (incl. host key check)"] = time.perf_counter() - t0
        finally:
            conn.close()
        return {k: round(v, 4) for k, v in out.items()}

    def profile(self, n: int) -> tuple[dict, str]:
        args = ["-m", "ddpfab", "run", "-i", str(self.inv[n]), "--no-color", "--runs-dir", str(self.runs), SCRIPT]
        res = subprocess.run([PYTHON, "-X", "importtime", *args], capture_output=True, text=True,
                             env=common.env_with(), cwd=self.wd, timeout=RUN_TIMEOUT)
        self.settle()
        summary = common.importtime_summary(res.stderr)
        text = [f"# python -X importtime -m ddpfab run on {n} hosts: imports {summary['total_ms']:.0f} ms "
                "(self time summed; importtime's own overhead included)", "", "## by root package (self time)"]
        text += [f"{k:<24} {v:8.1f} ms" for k, v in summary["by_package_ms"].items()]
        text += ["", "## top-level imports (cumulative)"]
        text += [f"{e['module']:<40} {e['cumulative_ms']:8.1f} ms" for e in summary["top_level_ms"]]
        if common.pyinstrument_available():
            out = self.work / "launch-pyinstrument.txt"
            subprocess.run([PYTHON, "-m", "pyinstrument", "--no-color", "-r", "text", "-o", str(out), *args],
                           capture_output=True, text=True, env=common.env_with(), cwd=self.wd, timeout=RUN_TIMEOUT)
            self.settle()
            if out.exists():
                text += ["", f"# pyinstrument, one `ddpfab run` on {n} hosts (main thread; the per-node "
                         "threads show as waits)", "", out.read_text()]
        return summary, "\n".join(text) + "\n"


def has_sync_flag() -> bool:
    """Whether this ddpfab's `run` syncs the code first (and so has --no-sync)."""
    res = subprocess.run([PYTHON, "-m", "ddpfab", "run", "--help"], capture_output=True, text=True, check=False)
    return "--no-sync" in res.stdout


def paired(a: list[float], b: list[float]) -> dict:
    """Median (range, and the median's 95 % confidence interval) of a[i] - b[i]: the difference
    within each repetition, drift cancelled."""
    d = sorted(x - y for x, y in zip(a, b))
    if not d:
        return {}
    ci = common.median_ci(d)
    return {"median": round(statistics.median(d), 4), "min": round(d[0], 4), "max": round(d[-1], 4), "runs": len(d),
            "ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)]}


def main() -> int:
    parser = common.base_parser("launch", __doc__, reps=3, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 2,4,8; --quick 2,4)")
    parser.add_argument("--no-profile", action="store_true", help="skip the phase breakdown and profile")
    args = parser.parse_args()
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    work = common.WORK_ROOT / "launch"
    shutil.rmtree(work / "runs", ignore_errors=True)  # run records of earlier runs
    (work / "work").mkdir(parents=True, exist_ok=True)
    (work / "work" / SCRIPT).write_text(HELLO)  # before the lab: the hosts see /tmp via an overlay
    samples: dict[str, dict[int, list[float]]] = {}
    extra: dict[str, dict[int, list[float]]] = {}
    tools = ("ddpfab run", "ddpfab run --no-check", "ddpfab run --no-sync", "pdsh + torchrun", "torchrun (local)")
    if not has_sync_flag():
        tools = tuple(t for t in tools if t != "ddpfab run --no-sync")
    phases, profile, micro = [], None, None
    failures: list[dict] = []

    def add(tool, n, t, into=samples):
        into.setdefault(tool, {}).setdefault(n, []).append(t)

    with common.bench_lab("launch", max(sizes), args.subnet) as lab:
        b = Bench(lab, work, sizes)
        log("warm-up: one untimed local torchrun (page cache) and ddpfab run")
        b.local()
        b.ddpfab(min(sizes))
        for rep in range(reps):
            for i, n in enumerate(sizes):
                k = (rep + i) % len(tools)
                for tool in tools[k:] + tools[:k]:
                    try:
                        if tool.startswith("ddpfab run"):
                            r = b.ddpfab(n, *tool.split()[2:])
                            add(f"{tool}: prepared", n, r["started"], extra)
                        elif tool == "pdsh + torchrun":
                            r = b.pdsh(n)
                        else:
                            r = b.local()
                    except RuntimeError as exc:  # a lost sample is recorded, not the end of the benchmark
                        log(f"rep {rep + 1}/{reps} N={n}: {tool} failed: {str(exc)[:300]}")
                        failures.append({"tool": tool, "hosts": n, "rep": rep, "error": str(exc)[-2000:]})
                        continue
                    add(tool, n, r["ready"])
                log(f"rep {rep + 1}/{reps} N={n}: " + "  ".join(
                    f"{t}={samples[t][n][-1]:.2f}" for t in tools if len(samples.get(t, {}).get(n, [])) > rep))
        if not args.no_profile:
            for n in sizes:
                log(f"phase breakdown of one ddpfab run on {n} hosts")
                phases.append(b.phases(n))
            log("micro-measurements (imports, inventory, remote python start)")
            micro = b.micro(max(sizes))
            log(f"profiling one ddpfab run on {max(sizes)} hosts")
            profile, text = b.profile(max(sizes))
            common.RESULTS.mkdir(parents=True, exist_ok=True)
            (common.RESULTS / "launch-profile.txt").write_text(text)

    series = [{"tool": t, "hosts": n, **common.summarize(v)} for t, per_n in {**samples, **extra}.items()
              for n, v in sorted(per_n.items())]
    overhead = []
    for n in sizes:
        s = {t: samples[t][n] for t in samples}
        overhead.append({
            "hosts": n,
            "vs_local_torchrun": paired(s["ddpfab run"], s["torchrun (local)"]),
            "no_check_vs_local_torchrun": paired(s["ddpfab run --no-check"], s["torchrun (local)"]),
            "vs_pdsh_torchrun": paired(s["ddpfab run"], s["pdsh + torchrun"]),
            "no_check_vs_pdsh_torchrun": paired(s["ddpfab run --no-check"], s["pdsh + torchrun"]),
            "preflight_check": paired(s["ddpfab run"], s["ddpfab run --no-check"]),
            **({"no_sync_vs_local_torchrun": paired(s["ddpfab run --no-sync"], s["torchrun (local)"]),
                "no_sync_vs_pdsh_torchrun": paired(s["ddpfab run --no-sync"], s["pdsh + torchrun"]),
                "code_sync": paired(s["ddpfab run"], s["ddpfab run --no-sync"])} if "ddpfab run --no-sync" in s else {}),
            "pdsh_torchrun_vs_local": paired(s["pdsh + torchrun"], s["torchrun (local)"]),
        })
    config = {"sizes": list(sizes), "nproc_per_node": 1, "script": HELLO}
    common.write_result(args.out, "launch", args, config,
                        {"series": series, "overhead": overhead, "phases": phases, "profile": profile, "micro": micro,
                         "failures": failures}, meta, started)
    for o in overhead:
        log(f"N={o['hosts']}: ddpfab - local torchrun {o['vs_local_torchrun'].get('median')} s, "
            f"- pdsh+torchrun {o['vs_pdsh_torchrun'].get('median')} s, preflight {o['preflight_check'].get('median')} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
