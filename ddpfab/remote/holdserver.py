"""The holder behind ``ddpfab hold`` (:mod:`ddpfab.remote.holder` has the client side, the
protocol and the safety rules): one SSH connection per node, opened once and kept, and the
commands of this user's ``ddpfab exec`` run over them, exactly as a cold exec runs them
(:func:`ddpfab.remote.command.run_in`). Apart from the client because it needs the SSH stack
(paramiko, Fabric), which a command run over the holder's connections does not."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import paramiko

from ddpfab.hosts import inventory
from ddpfab.remote import relay, spares, ssh
from ddpfab.remote.command import host_error, run_in
from ddpfab.remote.holder import IDLE_S, MAX_REQUEST, socket_peer_uid, send_message, fingerprint
from ddpfab.remote.output import HostResult


class _SocketPrinter:
    """A printer (:class:`ddpfab.remote.output.Printer`) that sends each line to the client (each
    node's result goes as its own message, after its command); ``closed`` once the
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
            send_message(self.sock, self.lock, {"node": name, "line": text, "stderr": stderr})
        except OSError:
            self.gone()

    def ended(self, result: HostResult) -> None:
        """(The caller sends each node's result itself.)"""

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
        self.signalled: int | None = None  # a SIGTERM/SIGINT/SIGHUP, for serve()'s loop to take
        self.listener: socket.socket | None = None
        self.spares = spares.Spares()  # node programs started ahead of the next command that asks
        self.sparing = threading.Event()  # spares are being started

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
            chan, extra = self._open_session(name)
            return run_in(chan, self.nodes[name], command, printer, timeout, printer.channels, start)
        except Exception as exc:  # noqa: BLE001 - a failure on one host is data
            return HostResult(name, error=host_error(exc), seconds=time.monotonic() - start)
        finally:
            if extra is not None:
                extra.close()

    def _open_session(self, name: str) -> tuple[Any, Any]:
        """A new session channel on the node's connection, and the connection to close after it
        (None: the held one). When the node's sshd allows no more sessions on that connection
        (MaxSessions, 10 by default, held by other commands), one of its own for this command."""
        conn = self._conn(name)
        try:
            return conn.transport.open_session(timeout=30), None
        except paramiko.ChannelException:
            extra = self.connect(self.nodes[name])
            try:
                return extra.transport.open_session(timeout=30), extra
            except BaseException:
                extra.close()
                raise

    def on_signal(self, signum: int, frame: object) -> None:
        """A stop, taken by :meth:`serve`'s loop within its accept timeout. The handler runs in the
        main thread wherever it is, which may be inside ``self.stopping.set()`` (serve's end) with
        the event's lock held: setting the event here would wait for that lock for ever."""
        self.signalled = signum

    def serve(self, on_ready: Callable[[dict[str, str]], None] = lambda failed: None) -> None:
        """Answer requests until idle, stopped or signalled, connecting every node meanwhile
        (*on_ready* gets :meth:`open_all`'s failures); then close every connection and client."""
        assert self.listener is not None, "bind() first"
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        threading.Thread(target=lambda: on_ready(self.open_all()), name="ddpfab-hold-open", daemon=True).start()
        try:
            while not self.stopping.is_set() and self.signalled is None:
                with self.lock:
                    if self.busy == 0 and time.monotonic() - self.last > self.idle:
                        break
                self.spares.renew()  # those grown too old
                self._start_spares_when_idle()
                try:
                    client, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                try:
                    ours = socket_peer_uid(client) == os.getuid()
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
            self.spares.close()
            for conn in conns:
                conn.close()
            for client in clients:  # a client that reads no more must not keep a sender blocked
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _start_spares_when_idle(self) -> None:
        """Start the spares wanted (:mod:`ddpfab.remote.spares`) on a thread of their own once no
        command has run for :data:`ddpfab.remote.spares.IDLE_S`; it stops when one comes."""
        def idle() -> bool:
            with self.lock:
                return (self.busy == 0 and time.monotonic() - self.last >= spares.IDLE_S
                        and not self.stopping.is_set())

        if not self.spares.wanted or self.sparing.is_set() or not idle():
            return
        self.sparing.set()

        def start() -> None:
            try:
                self.spares.start_wanted(lambda name: self._conn(name).transport.open_session(timeout=30), idle)
            finally:
                self.sparing.clear()

        threading.Thread(target=start, name="ddpfab-hold-spares", daemon=True).start()

    def _client(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(10)
            header = relay.read_header(sock)  # only its line: a channel's stdin may follow at once
            if header is None or len(header) > MAX_REQUEST:
                send_message(sock, threading.Lock(), {"held": False, "why": "request too large or cut"})
                return
            req = json.loads(header)
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
            send_message(sock, lock, self.status())
        elif op == "stop":
            self.stopping.set()
            send_message(sock, lock, {"stopping": True, "pid": os.getpid()})
        elif op in ("exec", "channel", "ping"):
            with self.lock:
                self.busy += 1
                self.last = time.monotonic()
            try:
                {"exec": lambda: self._exec(sock, lock, req), "channel": lambda: self._channel(sock, req),
                 "ping": lambda: self._ping(sock, lock, req)}[op]()
            finally:
                with self.lock:
                    self.busy -= 1
                    self.last = time.monotonic()

    def _held_node(self, req: dict) -> str | None:
        """The request's node when it is held as the request's side would reach it (the same
        fingerprint), else None."""
        name, wanted = req.get("node"), req.get("print")
        if not isinstance(name, str) or name not in self.nodes or self.prints[name] != wanted or self.stopping.is_set():
            return None
        return name

    def _channel(self, sock: socket.socket, req: dict) -> None:
        """One command on a new channel of the node's connection, relayed on *sock*
        (:func:`ddpfab.remote.relay.relay`) after an ``s`` frame; ``f`` with why when it cannot start.
        With ``preamble`` (a byte count), that many bytes follow the request and are the command's
        first stdin: a node program's start (:mod:`ddpfab.remote.spares`), which may be running
        already, and is started again for the next command once this one has ended."""
        send = relay.frame_sender(sock)
        name, command, size = self._held_node(req), req.get("command"), req.get("preamble", 0)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= spares.MAX_PREAMBLE:
            send(b"f", json.dumps({"kind": "holder", "text": "malformed request"}).encode())
            return
        try:  # read before any answer: a client still writing it would see a broken pipe, not the answer
            preamble = relay.read_exactly(sock, size, timeout=30)
        except (OSError, EOFError):
            return
        if name is None or not isinstance(command, str):
            send(b"f", json.dumps({"kind": "holder", "text": "not held as asked (another inventory, variables or "
                                                            "ssh_config), or the holder is ending"}).encode())
            return
        chan = extra = None
        try:
            chan = self.spares.take(name, command, preamble) if preamble else None
            try:
                if chan is None:
                    chan, extra = self._open_session(name)
                    chan.exec_command(command)
                    with contextlib.suppress(OSError):  # ended already (a setup line failed): its status says why
                        chan.sendall(preamble)
            except Exception as exc:  # noqa: BLE001 - the client raises it as this node's failure
                send(b"f", json.dumps({"kind": getattr(exc, "kind", "ssh"), "text": host_error(exc),
                                       "found": getattr(exc, "found", None)}).encode())
                return
            send(b"s", b"")
            relay.relay(sock, chan, send, exit_first=True)
        except (OSError, EOFError):
            pass  # the client went away: its channel is closed below, which ends its command's input
        finally:
            if chan is not None:
                chan.close()
            if extra is not None:
                extra.close()
        if preamble:
            self.spares.want(name, command, preamble)

    def _ping(self, sock: socket.socket, lock: threading.Lock, req: dict) -> None:
        """A keepalive round trip to the node's sshd over its connection: ``{"alive": bool}``."""
        name = self._held_node(req)
        alive = False
        if name is not None:
            try:
                transport = self._conn(name).transport
                transport.global_request("keepalive@openssh.com", wait=True)
                alive = transport.is_active()
            except Exception:  # noqa: BLE001 - not alive is the answer
                alive = False
        send_message(sock, lock, {"alive": alive})

    def _exec(self, sock: socket.socket, lock: threading.Lock, req: dict) -> None:
        wanted, command, timeout = req.get("nodes"), req.get("command"), req.get("timeout")
        if (not isinstance(wanted, dict) or not isinstance(command, str)
                or not (timeout is None or (isinstance(timeout, (int, float)) and timeout > 0))):
            send_message(sock, lock, {"held": False, "why": "malformed request"})
            return
        differ = [n for n, fp in wanted.items() if self.prints.get(n) != fp]
        if differ or self.stopping.is_set():
            send_message(sock, lock, {"held": False, "why": f"not held as asked: {', '.join(differ[:4])}" if differ
                               else "the holder is ending"})
            return
        send_message(sock, lock, {"held": True})
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
                    send_message(sock, lock, {"node": node.name, "exit_code": res.exit_code, "error": res.error,
                                              "end": res.end, "seconds": round(res.seconds, 3)})
                except OSError:
                    printer.gone()
            return res

        ssh.parallel([self.nodes[n] for n in wanted], one)
        self.spares.renew(set(wanted))  # the command may have changed what a program finds at its start
        if not printer.closed:
            send_message(sock, lock, {"done": True})


def _spec(data: bytes) -> dict:
    """The holder's spec (what :func:`ddpfab.remote.holder.start` writes), checked as data."""
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError("not an object")
    sources = spec.get("inventory")
    if not (isinstance(sources, list) and sources and all(isinstance(s, str) for s in sources)):
        raise ValueError("inventory: a list of sources")
    for key in ("name", "group"):
        if not isinstance(spec.get(key), str):
            raise ValueError(f"{key}: a string")
    for key in ("limit", "ssh_config", "known_hosts"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ValueError(f"{key}: a string or null")
    extra = spec.get("extra_vars", [])
    if not (isinstance(extra, list) and all(isinstance(e, (str, dict)) for e in extra)):
        raise ValueError("extra_vars: a list of strings and objects")
    idle = spec.get("idle_s")
    if not (isinstance(idle, (int, float)) and idle > 0):
        raise ValueError("idle_s: a number above 0")
    return spec


def main() -> int:
    """The holder's process: read its spec on stdin, load the inventory, take the name, connect
    every node while serving, say ready on stdout (the one line :func:`ddpfab.remote.holder.start`
    reads), serve until done; then leave at once (no thread keeps it alive)."""
    def say(message: dict) -> None:
        print(json.dumps(message), flush=True)

    try:
        spec = _spec(sys.stdin.buffer.read(MAX_REQUEST))
        parsed = inventory.load(spec["inventory"], spec["group"], limit=spec.get("limit"),
                                extra_vars=spec.get("extra_vars") or ())
    except (ValueError, inventory.InventoryError) as exc:
        say({"error": f"the holder's inventory cannot be loaded: {exc}"})
        return 1
    policy = ssh.HostKeyPolicy(known_hosts=spec.get("known_hosts"), accept_new=bool(spec.get("accept_new")))
    keeper = Holder(spec["name"], parsed.nodes, lambda node: ssh.connect(node, policy, spec.get("ssh_config")),
                    idle=spec["idle_s"])
    if not keeper.bind():
        say({"error": "the holder's socket name is taken: another holder started for this inventory at this "
                      "moment, or another user's process has the name (never used)", "taken": True})
        return 1

    def ready(failed: dict[str, str]) -> None:
        say({"ready": True, "pid": os.getpid(), "failed": failed, "idle_s": spec["idle_s"]})
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # nobody reads on: the starter has gone
            os.dup2(devnull, fd)
        os.close(devnull)

    keeper.serve(ready)
    os._exit(0)  # commands still answering (a stop) end with their connections; nothing to join
