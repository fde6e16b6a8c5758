"""Warm connections for repeated commands: ``ddpfab hold`` keeps one SSH connection per node open
in a background process of this user; ``ddpfab exec`` (and ``Cluster.exec``) runs over them.

    ddpfab hold -i lab.yml            # connects every node once, returns; ends after 15 min idle
    ddpfab exec -i lab.yml -- nvidia-smi -L     # no handshake: a session on the held connection
    ddpfab hold -i lab.yml --stop

Why: a cold ``exec`` pays a TCP connect, a key exchange and a host-key check per node (on 32 lab
hosts 0.48 s of wall, against 0.07 s for the same command on open connections). While debugging,
the same few commands run again and again on the same nodes.

What stays the same: the command runs exactly as a cold ``exec`` runs it (:func:`ddpfab.remote.
command.run_over`: the node's setup and python, its own session that ends with the channel), the
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import paramiko

from ddpfab.problems import DdpfabError
from ddpfab.remote import ssh
from ddpfab.remote.command import HostResult, host_error, run_in

#: Seconds without a command after which the holder ends (``ddpfab hold --idle``).
IDLE_S = 900.0
#: The longest request line a holder reads (the command and the nodes' fingerprints).
MAX_REQUEST = 1 << 20


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


def _peer_uid(sock: socket.socket) -> int:
    # struct ucred: pid_t, uid_t, gid_t (the ids unsigned: a uid over 2**31 reads as itself)
    _pid, uid, _gid = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("iII")))
    return uid


def _send(sock: socket.socket, lock: threading.Lock, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    with lock:
        sock.sendall(data)


# -- the client ---------------------------------------------------------------------------------
class HolderError(DdpfabError):
    """The holder answered something that is not its protocol: each node's result says so."""

    check = "holder"


def _connect(name: str, timeout: float = 2.0) -> socket.socket | None:
    """A connection to this user's holder at *name*, or None when there is none (or the name is
    held by another user's process: never talked to)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(name)
        if _peer_uid(sock) != os.getuid():
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
    sock = _connect(name)
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
    sock = _connect(name)
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
                code, error = event.get("exit_code"), event.get("error")
                if not (code is None or isinstance(code, int)) or not (error is None or isinstance(error, str)):
                    raise HolderError(f"the holder answered a malformed result for {node}")
                seconds = event.get("seconds")
                results[node] = HostResult(node, exit_code=code, error=error, held=True,
                                           seconds=float(seconds) if isinstance(seconds, (int, float)) else 0.0)
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


# -- the holder ---------------------------------------------------------------------------------
class _SocketPrinter:
    """A printer (``line``, ``closed``) that sends each line to the client; ``closed`` once the
    client has gone, and then every channel of its command is closed (ending the commands). A
    channel registered after that is closed by :func:`ddpfab.remote.command.run_in` itself (it
    checks ``closed`` after registering), so a node still connecting never starts its command."""

    def __init__(self, sock: socket.socket, lock: threading.Lock):
        self.sock, self.lock = sock, lock
        self.closed = False
        self.channels: list = []

    def line(self, name: str, text: str, stderr: bool = False) -> None:
        if self.closed:
            return
        try:
            _send(self.sock, self.lock, {"node": name, "line": text, "stderr": stderr})
        except OSError:
            self.gone()

    def gone(self) -> None:
        self.closed = True  # first: a channel registered from now on sees it
        for chan in list(self.channels):
            chan.close()


class Holder:
    """The connections of one cluster's nodes, served on the abstract socket *name*.

    Args:
        name: the socket's name (:func:`address`).
        nodes: the inventory's nodes (``ddpfab.hosts.inventory.Node``).
        connect: node -> an open connection (``ddpfab.remote.ssh.connect`` with the policy).
        idle: seconds without a command after which :meth:`serve` returns.
    """

    def __init__(self, name: str, nodes, connect: Callable[[Any], Any], idle: float = IDLE_S):
        self.name, self.idle = name, idle
        self.nodes = {n.name: n for n in nodes}
        self.prints = {n.name: fingerprint(n) for n in nodes}
        self.connect = connect
        self.conns: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.node_locks = {n.name: threading.Lock() for n in nodes}  # one (re)connect at a time per node
        self.clients: set[socket.socket] = set()
        self.busy = 0  # exec requests being answered
        self.last = time.monotonic()  # the last exec request's start or end
        self.started = time.time()
        self.stopping = threading.Event()
        self.listener: socket.socket | None = None

    def bind(self) -> bool:
        """Take the name; False when a holder (of this user or not) has it already."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
        except OSError:
            sock.close()
            return False
        sock.listen(64)
        sock.settimeout(0.5)
        self.listener = sock
        return True

    def open_all(self) -> dict[str, str]:
        """Connect every node; node -> why not, for those that failed (connected on first use)."""
        got = ssh.parallel(list(self.nodes.values()), lambda node: self._conn(node.name))
        return {name: host_error(err) for name, err in got.items() if isinstance(err, Exception)}

    def _conn(self, name: str):
        """The node's open connection; one that broke (the node rebooted, a network blip ended it)
        is made again, host key verified as on any connect; none once the holder is ending."""
        with self.node_locks[name]:
            with self.lock:
                conn = self.conns.get(name)
            if conn is not None and conn.transport is not None and conn.transport.is_active():
                return conn
            if conn is not None:
                conn.close()
            if self.stopping.is_set():
                raise ConnectionAbortedError("the connection holder is ending")
            conn = self.connect(self.nodes[name])  # SSHError: the node's result says why
            with self.lock:
                if self.stopping.is_set():  # serve() has closed the others: this one too
                    conn.close()
                    raise ConnectionAbortedError("the connection holder is ending")
                self.conns[name] = conn
            return conn

    def _run(self, name: str, command: str, printer: _SocketPrinter, timeout: float | None) -> HostResult:
        start = time.monotonic()
        if printer.closed:  # the client went away before this node's turn
            return HostResult(name)
        extra = None
        try:
            conn = self._conn(name)
            try:
                chan = conn.transport.open_session(timeout=30)
            except paramiko.ChannelException:
                # the node's sshd allows this many sessions per connection (MaxSessions, 10 by
                # default) and other commands hold them: this one gets a connection of its own
                extra = self.connect(self.nodes[name])
                chan = extra.transport.open_session(timeout=30)
            return run_in(chan, self.nodes[name], command, printer, timeout, printer.channels, start)
        except Exception as exc:  # noqa: BLE001 - a failure on one host is data
            return HostResult(name, error=host_error(exc), seconds=time.monotonic() - start)
        finally:
            if extra is not None:
                extra.close()

    def serve(self, on_ready: Callable[[dict[str, str]], None] = lambda failed: None) -> None:
        """Answer requests until idle, stopped or signalled, connecting every node meanwhile
        (*on_ready* gets :meth:`open_all`'s failures); then close every connection and client."""
        assert self.listener is not None, "bind() first"
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stopping.set())
        threading.Thread(target=lambda: on_ready(self.open_all()), name="ddpfab-hold-open", daemon=True).start()
        try:
            while not self.stopping.is_set():
                with self.lock:
                    if self.busy == 0 and time.monotonic() - self.last > self.idle:
                        break
                try:
                    client, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                try:
                    ours = _peer_uid(client) == os.getuid()
                except OSError:
                    ours = False
                if not ours:  # another user: not a word, and no activity
                    client.close()
                    continue
                with self.lock:
                    self.clients.add(client)
                threading.Thread(target=self._client, args=(client,), daemon=True).start()
        finally:
            self.stopping.set()
            self.listener.close()
            with self.lock:
                conns, clients = list(self.conns.values()), list(self.clients)
            for conn in conns:
                conn.close()
            for client in clients:  # a client that reads no more must not keep a sender blocked
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _client(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(10)
            data = b""
            while b"\n" not in data:
                if len(data) > MAX_REQUEST:
                    _send(sock, threading.Lock(), {"held": False, "why": "request too large"})
                    return
                chunk = sock.recv(65536)
                if not chunk:
                    return
                data += chunk
            req = json.loads(data.split(b"\n", 1)[0])
            sock.settimeout(None)
            if isinstance(req, dict):
                self._answer(sock, req)
        except (OSError, ValueError):
            pass
        finally:
            with self.lock:
                self.clients.discard(sock)
            sock.close()

    def status(self) -> dict:
        with self.lock:
            connected = sorted(n for n, c in self.conns.items() if c.transport is not None and c.transport.is_active())
        return {"pid": os.getpid(), "nodes": list(self.nodes), "prints": self.prints, "since": self.started,
                "connected": connected, "idle_s": self.idle}

    def _answer(self, sock: socket.socket, req: dict) -> None:
        lock = threading.Lock()
        op = req.get("op")
        if op == "status":
            _send(sock, lock, self.status())
        elif op == "stop":
            self.stopping.set()
            _send(sock, lock, {"stopping": True, "pid": os.getpid()})
        elif op == "exec":
            with self.lock:
                self.busy += 1
                self.last = time.monotonic()
            try:
                self._exec(sock, lock, req)
            finally:
                with self.lock:
                    self.busy -= 1
                    self.last = time.monotonic()

    def _exec(self, sock: socket.socket, lock: threading.Lock, req: dict) -> None:
        wanted, command, timeout = req.get("nodes"), req.get("command"), req.get("timeout")
        if (not isinstance(wanted, dict) or not isinstance(command, str)
                or not (timeout is None or (isinstance(timeout, (int, float)) and timeout > 0))):
            _send(sock, lock, {"held": False, "why": "malformed request"})
            return
        differ = [n for n, fp in wanted.items() if self.prints.get(n) != fp]
        if differ or self.stopping.is_set():
            _send(sock, lock, {"held": False, "why": f"not held as asked: {', '.join(differ[:4])}" if differ
                               else "the holder is ending"})
            return
        _send(sock, lock, {"held": True})
        printer = _SocketPrinter(sock, lock)

        def watch():  # the client closes its end (Ctrl-C, a closed stdout): end the commands now
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
            printer.gone()

        threading.Thread(target=watch, daemon=True).start()

        def one(node):
            res = self._run(node.name, command, printer, timeout)
            if not printer.closed:
                try:
                    _send(sock, lock, {"node": node.name, "exit_code": res.exit_code, "error": res.error,
                                       "seconds": round(res.seconds, 3)})
                except OSError:
                    printer.gone()
            return res

        ssh.parallel([self.nodes[n] for n in wanted], one)
        if not printer.closed:
            _send(sock, lock, {"done": True})
