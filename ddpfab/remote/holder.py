"""Warm connections for repeated commands: ``ddpfab hold`` keeps one SSH connection per node open
in a background process of this user; ``ddpfab exec`` (and ``Cluster.exec``) runs over them.

    ddpfab hold -i lab.yml            # connects every node once, returns; ends after 15 min idle
    ddpfab exec -i lab.yml -- nvidia-smi -L     # no handshake: a session on the held connection
    ddpfab hold -i lab.yml --stop

Why: a cold ``exec`` pays a TCP connect, a key exchange and a host-key check per node (on 32 lab
hosts 0.48 s of wall, against 0.07 s for the same command on open connections). While debugging,
the same few commands run again and again on the same nodes.

What stays the same: the command runs exactly as a cold ``exec`` runs it (:func:`ddpfab.remote.
command.run_in`: the node's setup and python, its own session that ends with the channel), the
output and exit codes are the same, and a node whose connection broke is connected again on the
next command (host key verified as always).

Safety:
- The socket is an abstract Unix socket (no file to leave behind or to remove: the kernel drops
  the name with the process) named from this user's uid and what the connections were made from
  (the inventory's paths, the ssh_config, the host-key policy). Both ends check the other's uid
  (``SO_PEERCRED``): another user can neither use the connections nor pose as the holder.
- A request names each node with a fingerprint of how it is reached (:func:`fingerprint`): a node
  the holder holds differently (the inventory changed since ``hold``) or not at all makes the
  whole command run cold, as if there were no holder.
- Messages are JSON lines, validated; nothing read is executed.
- The holder ends after ``idle`` seconds without a command, on ``hold --stop``, on SIGTERM or
  SIGINT; its connections close with it, and a command still running on a node ends with its
  channel. A client that goes away (Ctrl-C, a closed stdout) ends its commands at once.

This module is the client side and the protocol, free of paramiko and Fabric (a held command's
start does not import them); the holder itself is :class:`ddpfab.remote.holdserver.Holder`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

from ddpfab.problems import DdpfabError
from ddpfab.remote.output import ENDS, HostResult, tell_ended
from ddpfab.remote.reaper import pid_alive

#: Seconds without a command after which the holder ends (``ddpfab hold --idle``).
IDLE_S = 900.0
#: The longest request line a holder reads (the command and the nodes' fingerprints).
MAX_REQUEST = 1 << 20
#: Seconds :func:`start` waits for the holder to have connected every node.
START_WAIT_S = 300.0
#: Seconds :func:`stop` waits for the holder's process to end.
STOP_WAIT_S = 15.0


def fingerprint(node) -> str:
    """How *node* is reached and run on (every field of the inventory's node): a request's node
    is served only by a connection made from the same."""
    text = json.dumps(dataclasses.asdict(node), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def address(sources: str | Iterable[str], ssh_config: str | None, policy) -> str:
    """The abstract socket name of this user's holder for connections made from *sources* (the
    inventory as given to ``-i``), *ssh_config* and the host-key *policy*."""
    sources = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    known_hosts = getattr(policy, "known_hosts", None)
    key = json.dumps([[os.path.abspath(s) if os.path.exists(s) else os.fspath(s) for s in sources],
                      os.path.abspath(ssh_config) if ssh_config else None,
                      os.path.abspath(known_hosts) if known_hosts else None, bool(getattr(policy, "accept_new", False))],
                     sort_keys=True, default=str)
    return f"\0ddpfab-hold-{os.getuid()}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def socket_peer_uid(sock: socket.socket) -> int:
    # struct ucred: pid_t, uid_t, gid_t (the ids unsigned: a uid over 2**31 reads as itself)
    _pid, uid, _gid = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("iII")))
    return uid


def send_message(sock: socket.socket, lock: threading.Lock, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    with lock:
        sock.sendall(data)


# -- the client ---------------------------------------------------------------------------------
class HolderError(DdpfabError):
    """The holder answered something that is not its protocol (each node's result says so), or
    could not start (:func:`start`; *taken*: its name is another holder's)."""

    check = "holder"

    def __init__(self, problems: str = "", taken: bool = False):
        super().__init__(problems)
        self.taken = taken


def connect(name: str, timeout: float = 2.0) -> socket.socket | None:
    """A connection to this user's holder at *name*, or None when there is none (or the name is
    held by another user's process: never talked to)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(name)
        if socket_peer_uid(sock) != os.getuid():
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    except OSError:
        sock.close()
        return None


def _lines(sock: socket.socket):
    """The JSON messages on *sock*, each a dict; HolderError for anything else."""
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            if buf:
                raise HolderError("the holder's answer ended mid-line")
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                event = json.loads(line)
            except ValueError:
                raise HolderError("the holder answered a line that is not JSON") from None
            if not isinstance(event, dict):
                raise HolderError("the holder answered a message that is not an object")
            yield event


def request(name: str, message: dict, timeout: float = 10.0) -> dict | None:
    """One request answered by one message (status, stop); None when no holder is there."""
    sock = connect(name)
    if sock is None:
        return None
    try:
        sock.settimeout(timeout)
        sock.sendall((json.dumps(message) + "\n").encode())
        for event in _lines(sock):
            return event
        return None
    except (OSError, HolderError):
        return None
    finally:
        sock.close()


def exec_held(name: str, nodes, command: str, printer, timeout: float | None = None
              ) -> dict[str, HostResult] | None:
    """*command* on *nodes* over the holder's connections, output to *printer* as a cold exec
    prints it; None when there is no holder or it does not hold every node as given (run cold)."""
    sock = connect(name)
    if sock is None:
        return None
    wanted = {n.name: fingerprint(n) for n in nodes}
    results: dict[str, HostResult] = {}
    started = False  # the holder said it runs the command: from then on its failures are the nodes'
    try:
        sock.sendall((json.dumps({"op": "exec", "nodes": wanted, "command": command, "timeout": timeout})
                      + "\n").encode())
        for event in _lines(sock):
            if not started:
                if event.get("held") is True:
                    started = True
                    continue
                return None  # not held as asked (or any other answer): nothing ran, run cold
            node = event.get("node")
            if event.get("done") is True:
                break
            if node not in wanted:
                raise HolderError(f"the holder answered for a node not asked: {node!r:.60}")
            if isinstance(event.get("line"), str):
                printer.line(node, event["line"], bool(event.get("stderr")))
                if printer.closed:  # nobody reads on: closing the socket ends the commands
                    break
            elif "exit_code" in event or "error" in event:
                code, error, end = event.get("exit_code"), event.get("error"), event.get("end")
                if not (code is None or isinstance(code, int)) or not (error is None or isinstance(error, str)) \
                        or not (end is None or end in ENDS):
                    raise HolderError(f"the holder answered a malformed result for {node}")
                seconds = event.get("seconds")
                results[node] = HostResult(node, exit_code=code, error=error, held=True, end=end,
                                           seconds=float(seconds) if isinstance(seconds, (int, float)) else 0.0)
                tell_ended(printer, results[node])
            else:
                raise HolderError(f"the holder answered an unknown message for {node}")
    except HolderError as exc:
        if not started:
            return None
        for n in wanted:
            results.setdefault(n, HostResult(n, error=f"the connection holder failed: {exc}", held=True))
    except OSError as exc:
        if not started:
            return None  # the holder closed before it ran anything (it was ending): run cold
        for n in wanted:
            results.setdefault(n, HostResult(n, error=f"the connection holder went away ({exc.strerror or exc})",
                                             held=True))
    finally:
        sock.close()
    if not started:
        return None
    for n in wanted:  # ended by a closed printer (as cold: no exit status), or never answered for
        results.setdefault(n, HostResult(n, held=True) if printer.closed else
                           HostResult(n, error="the connection holder gave no result", held=True))
    return {n: results[n] for n in wanted}


def status(name: str) -> dict | None:
    """The holder's status reply (``pid``, ``nodes``, ``connected``, ``prints``: node -> its
    :func:`fingerprint`, ``idle_s``), validated; None when there is none (or it answers nonsense)."""
    got = request(name, {"op": "status"})
    ok = (isinstance(got, dict) and isinstance(got.get("pid"), int) and isinstance(got.get("nodes"), list)
          and isinstance(got.get("connected"), list) and isinstance(got.get("prints"), dict)
          and isinstance(got.get("idle_s"), (int, float)))
    return got if ok else None


def stop(name: str, pid: int, wait: float = STOP_WAIT_S) -> bool:
    """Ask the holder to end and wait until its process (*pid*) has, its connections closed;
    False when it is still there after *wait* seconds."""
    request(name, {"op": "stop"})
    deadline = time.monotonic() + wait
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


#: The holder's interpreter: this python, without the current directory on sys.path (a checkout's
#: ddpfab/ there must not become the long-lived holder), serving the spec on its stdin. It forks
#: once and the first process exits: the holder is no child of the caller (a library user's
#: long-lived process would keep it a zombie once it ends), and stays in the process group the
#: caller made (killed as one when it never gets ready).
_CHILD = ("import os, sys; sys.path.pop(0)\n"
          "if os.fork(): os._exit(0)\n"
          "from ddpfab.remote.holdserver import main; sys.exit(main())")


def start(spec: dict) -> dict:
    """Start a holder, a process of its own session, for *spec* (what :func:`ddpfab.remote.
    holdserver.main` reads on its stdin: the inventory, how to reach it, the idle limit; on stdin,
    never in a command line, as -e values may be secrets); wait for its one line, and return it
    (``ready``, ``pid``, ``failed``: node -> why it is not connected now, ``idle_s``).

    Raises:
        HolderError: it did not start (its words, or how it ended); ``taken`` when its name was
            taken (another holder of the same started at this moment).
    """
    try:
        data = json.dumps(spec).encode()
    except (TypeError, ValueError) as exc:  # (a library caller's -e value JSON cannot write)
        raise HolderError(f"the holder's inventory cannot be handed over: {exc}") from None
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None
        ready: list = []
        try:
            with contextlib.suppress(OSError):  # it ended before reading: what it wrote says why
                proc.stdin.write(data)
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()  # the first process, gone once it forked the holder
            line = b""
            ready, _, _ = select.select([proc.stdout], [], [], START_WAIT_S)
            if ready:
                line = proc.stdout.readline()  # the holder writes its one line whole, or exits (EOF)
        except BaseException:  # (Ctrl-C while it connects): no holder left half-started
            _kill_group(proc.pid)
            raise
        finally:
            proc.stdout.close()
        try:
            msg = json.loads(line) if line else None
        except ValueError:
            msg = None
        if isinstance(msg, dict) and msg.get("ready"):
            return msg
        if not ready:  # still connecting: it and whatever it started, by the group its session began
            _kill_group(proc.pid)
        errors.seek(0)
        tail = " ".join(errors.read()[-300:].decode(errors="replace").split())
    if isinstance(msg, dict) and isinstance(msg.get("error"), str):
        raise HolderError(msg["error"], taken=bool(msg.get("taken")))
    raise HolderError(f"the holder did not connect within {START_WAIT_S:g} s" if not ready
                      else f"the holder exited before it was ready{': ' + tail if tail else ''}")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
