"""Nothing of a sync outlives ddpfab, even when ddpfab is killed with SIGKILL.

A sync starts helpers (OpenSSH masters, rsync and its ssh, a dedicated ssh-agent) and keeps their
sockets and file lists in a private temp dir. ddpfab ends them itself on every normal path, Ctrl-C
included; for the path where it cannot (SIGKILL, OOM killer, a crash of the interpreter) a tiny
watcher process holds the read end of a pipe from ddpfab. The kernel closes ddpfab's end when
ddpfab dies, however it dies; the watcher then ends every helper's process group it was told about
(TERM, then KILL) and removes the temp dir. On a normal exit ddpfab has done all that already and
the watcher finds nothing left.

The helpers run in their own sessions (so a terminal's Ctrl-C reaches ddpfab, which ends them in
order, rather than killing them halfway), which is why they are ended by group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The watcher: stdlib only, started with ``python -I -S -c`` (no site, ~20 ms).
WATCHER = r"""
import os, shutil, signal, sys, time
groups = set()
for line in sys.stdin:  # until ddpfab's end of the pipe closes: exit, crash or SIGKILL
    try:
        pid = int(line[1:])
    except ValueError:
        continue
    (groups.add if line[0] == "+" else groups.discard)(pid)
def alive():
    out = []
    for g in groups:
        try:
            os.killpg(g, 0)
            out.append(g)
        except OSError:
            pass
    return out
for g in alive():
    try:
        os.killpg(g, signal.SIGTERM)
    except OSError:
        pass
deadline = time.monotonic() + 3
while alive() and time.monotonic() < deadline:
    time.sleep(0.05)
for g in alive():
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
for d in sys.argv[1:]:
    shutil.rmtree(d, ignore_errors=True)
"""


class Reaper:
    """The watcher of one sync: :meth:`watch` each helper's process group (its pid, for a
    process started with ``start_new_session=True``), :meth:`forget` it once it has ended,
    :meth:`close` at the end (after ddpfab's own cleanup)."""

    def __init__(self, *dirs: str):
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, *dirs], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     close_fds=True)

    def _send(self, line: str) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self, timeout: float = 10) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def pid_alive(pid: int | None) -> bool:
    """*pid* runs on this machine (one answer for the lab's host inits and the connection holder):
    it exists (another user's too) and is not a zombie (ended, not yet reaped:
    its parent, maybe this very process, has not waited for it)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
