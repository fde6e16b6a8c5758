"""Shared pieces of the benchmarks in bench/: lab bring-up, timing, statistics, process watching,
result files. Stdlib + ddpfab only (matplotlib is needed by report.py alone).

Every benchmark is a script of its own (``.venv/bin/python bench/<name>.py [--quick] [--reps R]``)
that needs root (it brings up a lab of namespace hosts, see ddpfab/lab/__init__.py), always takes its lab
down again (also on Ctrl-C / SIGTERM), and writes ``bench/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
#: Scratch space (labs, workdirs, run records). Under /tmp: the lab hosts see /tmp through an
#: overlay, so scripts written here before the lab comes up are visible on every host.
WORK_ROOT = Path(os.environ.get("DDPFAB_BENCH_WORK", "/tmp/ddpfab-bench"))
PYTHON = sys.executable
#: One subnet per benchmark (all inside 10.213.100.0/24..10.213.120.0/24), so they never clash.
SUBNETS = {
    "fanout": "10.213.101.0/24",
    "launch": "10.213.102.0/24",
    "teardown": "10.213.103.0/24",
    "provision": "10.213.104.0/24",
    # (several engineers share this machine: DDPFAB_BENCH_SUBNET_RECOVERY puts this one elsewhere)
    "recovery": os.environ.get("DDPFAB_BENCH_SUBNET_RECOVERY", "10.213.105.0/24"),
    "scale": "10.213.106.0/24",
    "resync": os.environ.get("DDPFAB_BENCH_SUBNET_RESYNC", "10.213.107.0/24"),
    "perf_check": "10.213.108.0/24",
    "replicate": os.environ.get("DDPFAB_BENCH_SUBNET_REPLICATE", "10.213.109.0/24"),
    "nochange_sync": os.environ.get("DDPFAB_BENCH_SUBNET_NOCHANGE", "10.213.110.0/24"),
    "preflight_resources": os.environ.get("DDPFAB_BENCH_SUBNET_PREFLIGHT", "10.213.111.0/24"),
    "hang": os.environ.get("DDPFAB_BENCH_SUBNET_HANG", "10.213.112.0/24"),
    "leases": os.environ.get("DDPFAB_BENCH_SUBNET_LEASES", "10.213.113.0/24"),
    "warm": os.environ.get("DDPFAB_BENCH_SUBNET_WARM", "10.213.114.0/24"),
    "run_cpu": os.environ.get("DDPFAB_BENCH_SUBNET_RUN_CPU", "10.213.115.0/24"),
}
MASTER_PORT_BASE = 29700


# -- arguments, signals -------------------------------------------------------------------------
def base_parser(name: str, doc: str, reps: int, quick_reps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {quick_reps} repetition(s), fewer sizes (numbers are not for the docs)")
    p.add_argument("--reps", type=int, help=f"repetitions per point (default {reps}, --quick {quick_reps})")
    p.add_argument("--subnet", default=SUBNETS[name], help=f"lab subnet (default {SUBNETS[name]})")
    p.add_argument("--out", default=str(RESULTS / f"{name}.json"), help="result file")
    p.set_defaults(default_reps=reps, quick_reps=quick_reps)
    return p


def reps_of(args) -> int:
    if args.reps:
        return args.reps
    return args.quick_reps if args.quick else args.default_reps


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit("the benchmarks bring up a lab of namespace hosts: run them as root")


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP become SystemExit, so every ``finally`` (lab down, process cleanup) runs."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# -- statistics ----------------------------------------------------------------------------------
def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of *values* (order statistics: the
    number of values below the true median is Binomial(n, 1/2)); None below 6 values, where no
    pair of order statistics covers the median at 95 %."""
    d, n = sorted(values), len(values)
    below, k = 0.0, 0  # P(Binomial(n, 1/2) <= k - 1), k the largest with that <= (1 - level) / 2
    while True:
        p = below + math.comb(n, k) / 2 ** n
        if p > (1 - level) / 2:
            break
        below, k = p, k + 1
    if k == 0:
        return None
    return d[k - 1], d[n - k]


def summarize(samples: list[float | None], cap: float | None = None) -> dict:
    """Median and spread of *samples* (seconds). ``None`` = the run hit *cap* (recorded as "> cap")."""
    done = sorted(s for s in samples if s is not None)
    capped = sum(1 for s in samples if s is None)
    out: dict = {"runs": len(samples), "samples": [None if s is None else round(s, 4) for s in samples],
                 "capped": capped, "cap": cap}
    if capped * 2 >= len(samples) and capped:
        # the median itself is beyond the cap
        out.update(median=None, min=done[0] if done else None, max=None, p25=None, p75=None, mean=None,
                   stdev=None)
        return out
    full = sorted([s if s is not None else float("inf") for s in samples])
    out.update(
        median=round(statistics.median(full), 4),
        min=round(full[0], 4),
        max=None if capped else round(full[-1], 4),
        p25=round(_quantile(full, 0.25), 4),
        p75=None if _quantile(full, 0.75) == float("inf") else round(_quantile(full, 0.75), 4),
        mean=None if capped else round(statistics.fmean(done), 4),
        stdev=None if capped or len(done) < 2 else round(statistics.stdev(done), 4),
    )
    return out


def _quantile(sorted_vals: list[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    if sorted_vals[hi] == float("inf"):
        return float("inf") if pos > lo else sorted_vals[lo]
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def fmt(stat: dict | None, unit: str = "s") -> str:
    """'1.23 s (1.10-1.40)' or '> 30 s'."""
    if not stat:
        return "n/a"
    if stat.get("median") is None:
        return f"> {stat['cap']:g} {unit}" if stat.get("cap") else "n/a"
    lo, hi = stat.get("min"), stat.get("max")
    spread = f" ({lo:.2f}-{hi:.2f})" if hi is not None else f" ({lo:.2f}->{stat['cap']:g})"
    return f"{stat['median']:.2f} {unit}{spread if stat['runs'] > 1 else ''}"


# -- machine description ---------------------------------------------------------------------------
def _cmd_version(argv: list[str]) -> str | None:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (res.stdout + res.stderr).strip().splitlines()
    return text[0].strip() if text else None


def _pkg_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_busy(seconds: float = 3.0) -> float:
    """The fraction of all CPUs busy over the next *seconds* (from /proc/stat): other work running
    now. The 1-minute load average cannot tell that apart from the benchmark that just ended."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        b0, t0 = sample()
        time.sleep(seconds)
        b1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return round((b1 - b0) / max(1, t1 - t0), 3)


def quiet(max_busy: float = 0.2, window: float = 0.5, limit: float = 15.0) -> float:
    """Wait until the CPUs are at most *max_busy* busy over *window* seconds (what the last
    command left running has ended: its nodes' teardown, a holder's spares), at most *limit*
    seconds; how long it waited. Taken before each timed command where both sides of a comparison
    run back to back, so neither pays for the other's tail."""
    t0 = time.monotonic()
    while cpu_busy(window) > max_busy and time.monotonic() - t0 < limit:
        pass
    return time.monotonic() - t0


def machine_info() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        mem_gib = round(mem_kb / 2**20, 1)
    git = _cmd_version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    # (results and the page they make are rewritten by the benchmarks themselves: not "dirty")
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                            ".", ":!bench/results", ":!docs"], capture_output=True, text=True).stdout.strip() != ""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "cpu": cpu, "mem_gib": mem_gib,
        "kernel": platform.release(), "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "busy_before": cpu_busy(),
        "git": f"{git}{'+dirty' if dirty else ''}" if git else None,
        "versions": {
            "ddpfab": _pkg_version("ddpfab"), "torch": _pkg_version("torch"),
            "ansible-core": _pkg_version("ansible-core"), "fabric": _pkg_version("fabric"),
            "paramiko": _pkg_version("paramiko"),
            "openssh": _cmd_version(["ssh", "-V"]),
            "pdsh": _cmd_version(["pdsh", "-V"]) if shutil.which("pdsh") else None,
        },
    }


def write_result(path: str | Path, name: str, args, config: dict, data: dict, meta: dict,
                 started: float) -> Path:
    meta = dict(meta)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["quick"] = bool(args.quick)
    meta["reps"] = reps_of(args)
    doc = {"benchmark": name, "meta": meta, "config": config, **data}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    log(f"wrote {path} ({meta['duration_s']:.0f} s; load average {meta['loadavg_start']} -> {meta['loadavg_end']})")
    return path


#: Other work above this fraction of all CPUs before a benchmark starts makes its numbers noisy.
BUSY_LIMIT = 0.25


def begin(args) -> tuple[int, dict, float]:
    """The start every benchmark shares: root, clean-up on signals, the machine described (with how
    busy it is: measured once, warned about here), the clock. Returns (reps, meta, started)."""
    require_root()
    install_signal_handlers()
    meta = machine_info()
    if meta["busy_before"] > BUSY_LIMIT:
        log(f"WARNING: {100 * meta['busy_before']:.0f}% of this machine's {os.cpu_count()} CPUs busy with other "
            "work: the numbers will be noisy")
    return reps_of(args), meta, time.monotonic()


def sizes_of(args, default: tuple[int, ...], quick: tuple[int, ...]) -> tuple[int, ...]:
    """The host counts: --sizes, else the quick or the full default."""
    return tuple(int(x) for x in args.sizes.split(",")) if args.sizes else (quick if args.quick else default)


# -- the lab ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def bench_lab(name: str, hosts: int, subnet: str, gpus: int = 0):
    """A lab of *hosts* hosts (with *gpus* stand-in GPUs each) for benchmark *name*; always taken down again."""
    from ddpfab import lab as labmod

    lab_dir = WORK_ROOT / name / "lab"
    if labmod.Lab.load(lab_dir) is not None:  # left over by a killed run of this benchmark
        log(f"taking down a stale lab in {lab_dir}")
        labmod.down(lab_dir)
    t0 = time.monotonic()
    # hosts must see the benchmark's work dir (it may lie under /tmp, which is each host's own)
    the_lab, _ = labmod.up(lab_dir, hosts=hosts, subnet=subnet, python=PYTHON, share=[WORK_ROOT], gpus=gpus)
    log(f"lab of {hosts} hosts up in {time.monotonic() - t0:.1f} s ({subnet}, {lab_dir})")
    try:
        yield the_lab
    finally:
        t0 = time.monotonic()
        close_control_masters(the_lab)
        labmod.down(lab_dir)
        log(f"lab down in {time.monotonic() - t0:.1f} s")


def write_inventory(lab, names: list[str], path: Path, **extra_vars) -> Path:
    """An inventory of *names* (lab hosts) with the lab's connection vars (+ *extra_vars*)."""
    import yaml

    from ddpfab import lab as labmod

    inv = yaml.safe_load(labmod.render_inventory(lab, PYTHON, names=names))
    inv["all"]["vars"].update(extra_vars)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def names(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def close_control_masters(lab, control_dirs: tuple[str, ...] = ("/tmp/ddpfab-ansible-cp", "~/.ansible/cp")) -> None:
    """Close the SSH ControlMaster connections Ansible left to *this lab's* hosts (ControlPersist),
    so the next Ansible run starts cold. Sockets of other labs are not touched: the path is
    ssh's %C hash of (local host, address, port, user)."""
    for d in control_dirs:
        d = os.path.expanduser(d)
        if not os.path.isdir(d):
            continue
        for h in lab.hosts:
            subprocess.run(["ssh", "-o", f"ControlPath={d}/%C", "-O", "exit", f"root@{h.address}"],
                           capture_output=True, timeout=10)


# -- processes on lab hosts ------------------------------------------------------------------------
class HostProcs:
    """One pass over /proc finds every process of the given lab hosts (by PID namespace), as
    ``Lab.processes(name)`` does per host, cheaply enough to poll every few milliseconds."""

    def __init__(self, lab, host_names: list[str]):
        self.lab = lab
        #: command line endings not counted (a holder's waiting node programs, which it ends itself)
        self.skip: tuple[str, ...] = ()
        self.ns = {}
        for n in host_names:
            ns = lab.host(n).pid_namespace()
            if ns is None:
                raise RuntimeError(f"lab host {n} is down")
            self.ns[ns] = n

    def scan(self, marker: str | None = None) -> dict[str, list[tuple[int, str]]]:
        """host -> [(pid, cmdline)] of non-sshd processes (whose cmdline contains *marker*)."""
        found: dict[str, list[tuple[int, str]]] = {n: [] for n in self.ns.values()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                host = self.ns.get(os.readlink(f"/proc/{entry}/ns/pid"))
                if host is None:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                        continue
            except OSError:
                continue
            if not cmd or cmd.startswith(("sshd", "/usr/sbin/sshd")) or (self.skip and cmd.endswith(self.skip)):
                continue
            if marker is not None and marker not in cmd:
                continue
            found[host].append((int(entry), cmd))
        return found

    def count(self, marker: str | None = None) -> int:
        return sum(len(v) for v in self.scan(marker).values())

    def find_rank(self, host: str, rank: int, marker: str, timeout: float) -> int | None:
        """The pid of the training process of global rank *rank* on *host* (by RANK in its environ)."""
        deadline = time.monotonic() + timeout
        want = f"RANK={rank}".encode()
        while time.monotonic() < deadline:
            for pid, _cmd in self.scan(marker)[host]:
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                # only torchrun's workers have RANK and LOCAL_RANK (torchrun itself, the shells and
                # ddpfab's supervisor do not)
                if want in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
                    return pid
            time.sleep(0.02)
        return None

    def kill_all(self, timeout: float = 10) -> int:
        """SIGKILL every non-sshd process on these hosts (they are the benchmark's own lab hosts),
        until none is left; returns how many were killed."""
        killed = 0
        deadline = time.monotonic() + timeout
        while True:
            procs = [p for v in self.scan().values() for p, _ in v]
            if not procs:
                return killed
            for p in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
                    killed += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes survive SIGKILL on lab hosts: {procs}")
            time.sleep(0.05)


def sample_process(pid: int, peak: dict) -> bool:
    """Read *pid*'s threads, open files, resident memory and CPU seconds (user+system) from /proc
    into *peak* (maxima; CPU: the last value seen). False once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                peak["threads"] = max(peak.get("threads", 0), int(line.split()[1]))
            elif line.startswith("VmRSS:"):
                peak["rss_mib"] = max(peak.get("rss_mib", 0.0), int(line.split()[1]) / 1024)
        peak["fds"] = max(peak.get("fds", 0), len(os.listdir(f"/proc/{pid}/fd")))
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        peak["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return True
    except (OSError, ValueError, IndexError):
        return False


class ProcessSampler:
    """Samples one process (a ddpfab command: the controller) every 20 ms from a thread, for a
    process the caller waits for itself: peak threads, open files, resident memory, CPU seconds."""

    def __init__(self, pid: int, interval: float = 0.02):
        import threading

        self.pid, self.interval, self.peak = pid, interval, {"threads": 0, "fds": 0, "rss_mib": 0.0, "cpu_s": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and sample_process(self.pid, self.peak):
            self._stop.wait(self.interval)

    def result(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=2)
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in self.peak.items()}


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def stop_process(proc: subprocess.Popen | None, timeout: float = 5) -> None:
    """End a process this benchmark started (TERM, then KILL), by its pid only."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HOSTNAME_RE = re.compile(r"\bnode(\d+)\b")


def env_with(**extra: str) -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    # as a user runs it: with the bytecode cache (a sandbox may switch it off; then every start
    # would compile ddpfab's modules again)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra)
    return env


def pdsh_env(lab, **extra: str) -> dict[str, str]:
    """pdsh over ssh with the lab's ssh_config (host keys checked, the lab's key)."""
    return env_with(PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=f"-F {lab.ssh_config} -a -x -l%u %h", **extra)


def pdsh_hosts(n: int) -> str:
    return f"node[1-{n}]" if n > 1 else "node1"


# -- profiles --------------------------------------------------------------------------------------
_IMPORT_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)\s*$")


def importtime_summary(stderr: str, top: int = 12) -> dict:
    """Digest of ``python -X importtime`` output: total, cost per root package (self time summed),
    and the most expensive top-level imports (cumulative)."""
    total_us = 0
    by_root: dict[str, int] = {}
    toplevel: list[tuple[int, str]] = []
    for line in stderr.splitlines():
        m = _IMPORT_LINE.match(line)
        if not m:
            continue
        self_us, cum_us, indent, name = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        total_us += self_us
        root = name.split(".")[0]
        by_root[root] = by_root.get(root, 0) + self_us
        if len(indent) <= 1:
            toplevel.append((cum_us, name))
    toplevel.sort(reverse=True)
    roots = sorted(by_root.items(), key=lambda kv: -kv[1])
    return {
        "total_ms": round(total_us / 1000, 1),
        "by_package_ms": {k: round(v / 1000, 1) for k, v in roots if v >= 1000},
        "top_level_ms": [{"module": n, "cumulative_ms": round(c / 1000, 1)} for c, n in toplevel[:top]],
    }


def pyinstrument_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyinstrument") is not None
