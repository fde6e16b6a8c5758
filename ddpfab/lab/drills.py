"""Slow-node drills on ``ddpfab lab`` hosts: make one host a straggler, then undo it.

What ``ddpfab check --perf`` must find, made with the real kernel mechanisms (root only):

- :func:`throttled_link`: tc's token bucket filter on the host's ``eth0`` inside its netns (what
  it sends) and on the bridge side of its veth (what it receives). The kernel here has no netem.
- :func:`cpu_quota`: a cgroup v1 CPU quota (``cpu.cfs_quota_us``) holding every process of the
  host, its sshd included, so what sshd starts later inherits it.

Both are context managers that remove what they added, also when the body raises.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ddpfab.lab import Lab, LabError, run_command

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def throttled_link(lab: Lab, name: str, rate: str = "30mbit", burst: str = "32kbit",
                   latency: str = "400ms") -> Iterator[None]:
    """Host *name*'s link shaped to *rate* both ways."""
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    veth = lab.host(name).veth
    run_command(["ip", "netns", "exec", lab.host(name).netns, "tc", "qdisc", "add", "dev", "eth0", *tbf])
    try:
        run_command(["tc", "qdisc", "add", "dev", veth, *tbf])
        try:
            yield
        finally:
            run_command(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
    finally:
        run_command(["ip", "netns", "exec", lab.host(name).netns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)


def host_pids(lab: Lab, name: str) -> list[int]:
    """Every process in host *name*'s PID namespace, its sshd (PID 1 there) included."""
    ns = lab.host(name).pid_namespace()
    if ns is None:
        raise LabError(f"lab host {name} is not running")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    found.append(int(entry))
            except OSError:
                pass
    return found


@contextlib.contextmanager
def cpu_quota(lab: Lab, name: str, percent: int, group: str | None = None) -> Iterator[Path]:
    """Every process of host *name* held to *percent* of one CPU (cgroup v1 cfs quota, 100 ms
    period). Yields the cgroup's path; afterwards its processes go back to the root cgroup and the
    cgroup is removed."""
    if not (CGROUP_CPU / "cgroup.procs").exists():
        raise LabError(f"no cgroup v1 cpu controller at {CGROUP_CPU}: the CPU drill needs one")
    path = CGROUP_CPU / (group or f"ddpfab-drill-{lab.host(name).netns}-{os.getpid()}")
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text("100000")
        (path / "cpu.cfs_quota_us").write_text(str(int(percent * 1000)))
        for pid in host_pids(lab, name):
            with contextlib.suppress(ProcessLookupError):
                (path / "cgroup.procs").write_text(str(pid))
        yield path
    finally:
        _empty_and_remove(path)


def _empty_and_remove(path: Path, patience_s: float = 10.0) -> None:
    """Move the cgroup's processes back to the root cgroup and remove it. A process the host forks
    while they move (sshd accepting a connection) starts inside the group, and the kernel refuses
    to remove a group with a task in it (EBUSY): so move again until it is empty."""
    deadline = time.monotonic() + patience_s
    while True:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.05)
