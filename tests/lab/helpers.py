"""Helpers for lab tests: run the real CLI, read rank reports, inspect hosts' process tables."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod
from ddpfab.node.leases import LEASE_DIR

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "lab" / "scripts"


def ddpfab(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path = REPO,
           input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would (*input*: its stdin, a pipe)."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ddpfab", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd, input=input)


def start_ddpfab(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpfab", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env={**os.environ, "NO_COLOR": "1"})


def host_sh(lab, name: str, script: str, user: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """*script* run inside lab host *name* (all its namespaces), as root or as *user*."""
    init = labmod._child_pid(lab.host(name).pid)
    # HOME as a login on the host has it: nsenter keeps this process's, and the suite may run with
    # another HOME (a fresh one in CI), so `~` would name a dir the node's ssh sessions never use
    argv = ["nsenter", "-t", str(init), "-a", "env", "HOME=/root", "sh", "-c", script]
    if user:
        argv = ["nsenter", "-t", str(init), "-a", "runuser", "-u", user, "--", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)


def link_up(lab, name: str, timeout: float = 30) -> None:
    """Bring *name*'s link (cut with ``ip link set VETH down``) back up, and wait until the host
    reaches every other one on sshd's port: the lab is shared by the tests that follow, and the
    first connects after the cut can still fail (the host's neighbour entries of its peers are
    FAILED from the cut; CI once saw a check right after a cut fail node2->node1 with "No route
    to host")."""
    subprocess.run(["ip", "link", "set", lab.host(name).veth, "up"], check=True)
    peers = [h.address for h in lab.hosts if h.name != name]
    probe = ("import socket, sys, time\n"
             f"deadline = time.monotonic() + {timeout}\n"
             f"for addr in {peers!r}:\n"
             "    while True:\n"
             "        try:\n"
             "            socket.create_connection((addr, 22), timeout=2).close()\n"
             "            break\n"
             "        except OSError as exc:\n"
             "            if time.monotonic() > deadline:\n"
             "                sys.exit(f'{addr}: {exc}')\n"
             "            time.sleep(0.2)\n")
    res = host_sh(lab, name, f"exec python3 -c {shlex.quote(probe)}")
    assert res.returncode == 0, f"{name} does not reach its peers after its link came back up: {res.stderr}"


def reports(stdout: str) -> list[dict]:
    return [json.loads(line.split("REPORT ", 1)[1]) for line in stdout.splitlines() if "REPORT {" in line]


class Terminal:
    """The real CLI on a pseudo-terminal, as a user at a terminal runs it: wait for what it prints
    (:meth:`expect`), type lines (:meth:`send`)."""

    def __init__(self, *args: str, cwd: Path = REPO, env: dict | None = None):
        import fcntl
        import pty
        import struct
        import termios

        self.master, slave = pty.openpty()
        # a wide terminal: a prompt with a long path must not wrap (a shell redraws a wrapped line)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "ddpfab", *args], cwd=cwd, stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True,
                                     env={**os.environ, "NO_COLOR": "1", **(env or {})})
        os.close(slave)
        self.out = b""

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def _read(self, timeout: float) -> bool | None:
        """Read what is there within *timeout*: True (read some), False (the end), None (nothing yet)."""
        import select

        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return None
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the other side closed (EIO): the command ended
            data = b""
        self.out += data
        return bool(data)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """Wait until the output so far matches *pattern* (a regex); fail with the output if not."""
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.text)
            if m:
                return m
            if time.monotonic() > end:
                pytest.fail(f"no {pattern!r} on the terminal after {timeout} s:\n{self.text[-4000:]}\n"
                            f"(its end: {self.text[-200:]!r})")
            if self._read(min(0.5, max(0.0, end - time.monotonic()))) is False and self.proc.poll() is not None:
                pytest.fail(f"ended ({self.proc.returncode}) without {pattern!r}:\n{self.text[-4000:]}")

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def resize(self, rows: int, cols: int) -> None:
        """The terminal's window made *rows* x *cols*, and the command told (SIGWINCH), as a
        terminal emulator does when its window is resized."""
        import fcntl
        import signal
        import struct
        import termios

        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        os.kill(self.proc.pid, signal.SIGWINCH)

    def wait(self, timeout: float = 120) -> int:
        """The command's exit code, its output read to the end."""
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self._read(0.5)
        while self._read(0.1) is True:
            pass
        code = self.proc.wait(timeout=5)
        os.close(self.master)
        return code


def job_processes(lab, names=("node1", "node2", "node3")) -> dict[str, list[tuple[int, str]]]:
    """Every non-sshd process on each host: after a job ends this must be empty."""
    return {n: lab.processes(n) for n in names}


def wait_no_processes(lab, timeout: float, names=("node1", "node2", "node3")) -> float:
    """Seconds until no job process is left on any host; fails the test after *timeout*."""
    start = time.monotonic()
    while True:
        left = {n: p for n, p in job_processes(lab, names).items() if p}
        if not left:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"processes left on hosts after {timeout} s: {left}")
        time.sleep(0.05)


#: What a library may leave in a host's /tmp on its own account: caches a job's files are not, kept
#: across runs on purpose (torch writes ``torchinductor_<user>`` the first time a process builds a
#: DDP model). Anything else a job leaves in /tmp is a leftover.
LIBRARY_CACHES = re.compile(r"^torchinductor_[A-Za-z0-9_.-]+$")
#: The GPU lease dir (ddpfab.node.leases) on a host with GPUs: its holder records, the older
#: versions' GPU locks and the port locks stay on purpose (one per GPU and reserved port). A queue
#: ticket left there, or anything else, is a leftover.
LEASE_FILES = re.compile(r"^(gpu-[0-9]+\.(holder|lock)|port-[0-9]+\.lock)$")


def host_tmp_leftovers(lab, name: str) -> list[str]:
    """What host *name* wrote to its own /tmp (its overlay's upper layer): files and empty dirs.

    The host's /tmp starts empty (see ``lab.PRIVATE_TMP``). The dirs the lab shares into it (the
    checkout, the tests' temp dirs) are no leftovers, nor their parents; what a host wrote inside
    them is, except Python's bytecode cache of the checkout (hosts import ddpfab from it, as
    from NFS). Library caches (LIBRARY_CACHES) at the top of /tmp are not the job's files."""
    store = Path(lab.store) / name
    shares = [Path(s) for s in lab.shares]
    uppers = [(store / "upper_tmp", Path("/tmp"))] + [(store / f"upper_share{i}", s) for i, s in enumerate(shares)]
    left = []
    for upper, real_root in uppers:
        for p in upper.rglob("*"):
            real = real_root / p.relative_to(upper)
            top = real.relative_to("/tmp").parts[0]
            if LIBRARY_CACHES.match(top):
                continue
            if real.parent == Path(LEASE_DIR) and LEASE_FILES.match(real.name) or real == Path(LEASE_DIR):
                continue
            if p.is_dir() and (any(p.iterdir()) or any(s == real or s.is_relative_to(real) for s in shares)):
                continue
            if real.is_relative_to(REPO) and "__pycache__" in real.relative_to(REPO).parts:
                continue
            left.append(str(real))
    return left


def assert_no_leftovers(lab) -> None:
    """No process, no listener but sshd, no temp file on any of the lab's hosts."""
    names = [h.name for h in lab.hosts]
    wait_no_processes(lab, timeout=5, names=names)
    for name in names:
        listening = lab.netns_exec(name, ["ss", "-Htln"], capture_output=True, text=True).stdout.split("\n")
        ports = sorted({ln.split()[3].rsplit(":", 1)[1] for ln in listening if ln.strip()})
        assert ports == ["22"], f"{name} has listeners left: {ports}"
        left = host_tmp_leftovers(lab, name)
        assert not left, f"{name} has temp files left in /tmp: {left[:10]}"
