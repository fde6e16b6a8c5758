"""Connections to nodes over ``ddpfab hold``'s: a command's channels open on the holder's SSH
connection to the node (its ``channel`` op, :mod:`ddpfab.remote.relay`'s frames), so a command
pays no handshake. A :class:`HeldConnection` stands where :func:`ddpfab.remote.ssh.connect`'s
connection would, with the part of it that ddpfab's node work uses (``transport.open_session``
and the channel's exec, stdin, stdout, stderr and exit status; a keepalive). What needs more of
SSH (a pty, agent forwarding, a forwarded port, Fabric's ``run``) gets a connection of its own,
made when first asked for: cold, as without a holder.

:func:`ddpfab.remote.ssh.warm_through` installs :func:`factory` for a command whose cluster has
a holder; a node the holder does not hold the same way (its fingerprint) is connected cold."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
import weakref
from typing import Any

from ddpfab.remote import holder, relay, ssh
from ddpfab.remote.rsh import HEADER
from ddpfab.remote.target import HostKeyPolicy, Target


#: Seconds a failed write waits for the ended command's exit status to arrive
END_WAIT_S = 2.0

#: Output a held channel keeps unread (stdout and stderr together, as paramiko's window) before
#: the holder is made to wait.
BUFFER_MAX = 4 << 20


class HeldChannel:
    """A session channel on the holder's connection to *node*, as paramiko's ``Channel`` for what
    ddpfab uses of it. Asked for a pty, agent forwarding or combined stderr before its command
    starts, it becomes a channel of the node's own connection (:meth:`HeldConnection.cold`)."""

    def __init__(self, conn: HeldConnection, timeout: float | None):
        self._conn, self._open_timeout = conn, timeout
        self._real: Any = None  # the cold connection's channel, once one was needed
        self._sock: socket.socket | None = None
        self._out, self._err = bytearray(), bytearray()
        self._code: int | None = None
        self._ended = False  # the relay's socket ended (the command's output is all here), or closed
        self._cond = threading.Condition()
        self._timeout: float | None = None
        self._combine = False  # stderr's frames go to stdout (as paramiko's set_combine_stderr)
        self._closed = False  # by close()
        self.relay_lost = False  # it ended without the command's exit status, not by close()

    @property
    def closed(self) -> bool:
        """Closed here, or by the node: the relay has ended (as paramiko's ``closed`` once the
        remote side closed; output not read yet can still be read)."""
        if self._real is not None:
            return self._real.closed
        return self._closed or (self._ended and self._sock is not None)

    # -- what only a channel of its own can do -------------------------------------------------
    def _own(self):
        if self._real is None:
            if self._sock is not None:
                raise ssh.SSHError(self._conn.node.name, "a held channel cannot change once its command runs")
            self._real = self._conn.cold().transport.open_session(timeout=self._open_timeout)
        return self._real

    def get_pty(self, *args, **kwargs):
        return self._own().get_pty(*args, **kwargs)

    def request_forward_agent(self, *args, **kwargs):
        return self._own().request_forward_agent(*args, **kwargs)

    def set_combine_stderr(self, combine: bool) -> bool:
        if self._real is not None or self._sock is not None:
            return self._own().set_combine_stderr(combine)
        before, self._combine = self._combine, bool(combine)
        return before

    def resize_pty(self, *args, **kwargs):
        return self._own().resize_pty(*args, **kwargs)

    def __getattr__(self, name: str):
        real = self.__dict__.get("_real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)

    # -- the command ---------------------------------------------------------------------------
    def exec_command(self, command: str) -> None:
        """Start *command* on the node through the holder; an SSHError naming the node when the
        holder cannot (the node unreachable now, or no longer held the same way)."""
        if self._real is not None:
            self._real.exec_command(command)
            return
        self._start(command, b"")

    def exec_program(self, command: str, preamble: bytes) -> None:
        """:meth:`exec_command` of a node program's *command* whose stdin begins with *preamble*
        (its setup head and the program), written here: the holder may have that start running
        already (:mod:`ddpfab.remote.spares`), and then the command's input goes on after it."""
        if self._real is not None:
            self._real.exec_command(command)
            try:
                self._real.sendall(preamble)
            except OSError:
                if not (self._real.exit_status_ready() or self._real.closed):
                    raise  # (ended already: its status says why, as after any write to it)
            return
        self._start(command, preamble)

    def _start(self, command: str, preamble: bytes) -> None:
        if self.closed:
            raise OSError("the channel is closed")
        node = self._conn.node
        sock = holder.connect(self._conn.holder_name, timeout=self._open_timeout or 30)
        if sock is None:  # the holder ended (`hold --stop`, or it died): as with none, the node's own connection
            real = self._conn.cold().transport.open_session(timeout=self._open_timeout or 30)
            real.set_combine_stderr(self._combine)
            if self._timeout is not None:
                real.settimeout(self._timeout)
            self._real = real
            self.exec_program(command, preamble)  # (now its own connection's: as a cold start goes)
            return
        self._sock = sock
        request = {"op": "channel", "node": node.name, "print": self._conn.print, "command": command}
        if preamble:
            request["preamble"] = len(preamble)
        try:
            sock.settimeout(self._open_timeout or 30)
            sock.sendall(json.dumps(request).encode() + b"\n" + preamble)
            kind, payload = _frame(sock)
            sock.settimeout(None)
        except (OSError, EOFError) as exc:
            sock.close()
            raise ssh.SSHError(node.name, f"host {node.name}: the connection holder did not answer ({exc})",
                               kind="holder") from None
        if kind != b"s":
            sock.close()
            raise _refused(node.name, payload if kind == b"f" else b"")
        threading.Thread(target=self._read, name=f"held-{node.name}", daemon=True).start()

    def _read(self) -> None:
        """The relay's frames into the buffers until its end or :meth:`close`; the exit status
        comes when sshd sends it, the output a descendant still writes after it. Full buffers wait
        for their reader: the holder's sends then block, and with them its reads of the node's
        channel, whose SSH window holds the node's command (paramiko's flow control)."""
        sock = self._sock
        assert sock is not None
        try:
            while True:
                kind, payload = _frame(sock)
                with self._cond:
                    while len(self._out) + len(self._err) >= BUFFER_MAX and not self._closed:
                        self._cond.wait()
                    if kind == b"o" or (kind == b"e" and self._combine):
                        self._out += payload
                    elif kind == b"e":
                        self._err += payload
                    elif kind == b"x" and self._code is None:
                        self._code = int(payload) if payload.lstrip(b"-").isdigit() else -1
                        # (-1: the holder's channel closed without one: its connection closing with it)
                        self.relay_lost = self._code == -1 and not self._closed
                    else:
                        return
                    self._cond.notify_all()
        except Exception:  # noqa: BLE001 - the relay's end (EOFError), or closed under us
            return
        finally:
            with self._cond:
                if self._code is None:  # the holder or its connection went away mid-command: as ssh says
                    self._code = -1
                    self.relay_lost = not self._closed
                self._ended = True  # (after the code: closed implies a status, read without the lock)
                self._cond.notify_all()

    def _wait(self, ready) -> None:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        with self._cond:
            while not ready() and not self._ended:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("timed out")  # as paramiko's socket.timeout
                self._cond.wait(left)

    def _take(self, buf: bytearray, nbytes: int) -> bytes:
        """Up to *nbytes* of *buf* once there are some, or b"" once the command has ended."""
        self._wait(lambda: buf)
        with self._cond:
            data = bytes(buf[:nbytes])
            del buf[:nbytes]
            self._cond.notify_all()  # the reader may wait for room
            return data

    def recv(self, nbytes: int) -> bytes:
        return self._real.recv(nbytes) if self._real is not None else self._take(self._out, nbytes)

    def recv_stderr(self, nbytes: int) -> bytes:
        return self._real.recv_stderr(nbytes) if self._real is not None else self._take(self._err, nbytes)

    def recv_ready(self) -> bool:
        return self._real.recv_ready() if self._real is not None else bool(self._out)

    def recv_stderr_ready(self) -> bool:
        return self._real.recv_stderr_ready() if self._real is not None else bool(self._err)

    def exit_status_ready(self) -> bool:
        return self._real.exit_status_ready() if self._real is not None else self._code is not None

    @property
    def eof_received(self) -> bool:
        return self._real.eof_received if self._real is not None else self._ended

    def recv_exit_status(self) -> int:
        if self._real is not None:
            return self._real.recv_exit_status()
        before, self._timeout = self._timeout, None
        try:
            self._wait(lambda: self._code is not None)
        finally:
            self._timeout = before
        return self._code if self._code is not None else -1

    def sendall(self, data: bytes) -> None:
        if self._real is not None:
            self._real.sendall(data)
            return
        if self._sock is None or self.closed:
            raise OSError("the channel is closed")
        try:
            _send_within(self._sock, data, self._timeout)
        except TimeoutError:  # the command runs on and reads nothing: no status is on its way
            raise
        except OSError:
            # the command ended without reading (the holder's end of the relay is gone): its exit
            # status is on its way here, and callers ask for it next, as after paramiko's error
            with self._cond:
                self._cond.wait_for(lambda: self._code is not None, timeout=END_WAIT_S)
            raise

    def send(self, data: bytes) -> int:
        self.sendall(data)
        return len(data)

    def shutdown_write(self) -> None:
        if self._real is not None:
            self._real.shutdown_write()
        elif self._sock is not None:
            with contextlib.suppress(OSError):  # the relay ended already
                self._sock.shutdown(socket.SHUT_WR)

    def settimeout(self, timeout: float | None) -> None:
        if self._real is not None:
            self._real.settimeout(timeout)
        self._timeout = timeout

    def close(self) -> None:
        """End the channel: the holder closes its side (the command's stdin gets EOF)."""
        self._closed = True
        if self._real is not None:
            self._real.close()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._cond:
            if self._code is None:  # as paramiko's closed channel: ready, without a status
                self._code = -1
            self._ended = True
            self._cond.notify_all()


def _refused(name: str, payload: bytes) -> ssh.SSHError:
    """The holder's ``f`` frame (``{"kind", "text", "found"}``: why the node's channel could not
    open, as a cold connect would say it) as the error; validated, never trusted."""
    try:
        why = json.loads(payload)
    except ValueError:
        why = None
    if not isinstance(why, dict) or not isinstance(why.get("text"), str):
        return ssh.SSHError(name, f"host {name}: the connection holder answered out of protocol", "holder")
    kind = str(why["kind"]) if isinstance(why.get("kind"), str) else "holder"
    found = why.get("found") if isinstance(why.get("found"), str) else None
    text = why["text"] if why["text"].startswith(f"host {name}") else f"host {name}: {why['text']}"
    return ssh.SSHError(name, text, kind, found)


def _send_within(sock: socket.socket, data: bytes, timeout: float | None) -> None:
    """*data* onto *sock* within *timeout* (None: however long), TimeoutError after it, as
    paramiko's ``sendall`` under ``settimeout``. Not the socket's own timeout: the reader's
    thread blocks on the same socket and must wait however long the command runs."""
    if timeout is None:
        sock.sendall(data)
        return
    view, deadline = memoryview(data), time.monotonic() + timeout
    try:
        poller = select.poll()  # (not select(): a process with many nodes has descriptors past 1024)
        poller.register(sock, select.POLLOUT)
        while view:
            try:
                view = view[sock.send(view, socket.MSG_DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(min(left, 86400) * 1000):
                raise TimeoutError("timed out")
    except ValueError as exc:  # closed under us (close() from another thread)
        raise OSError("the channel is closed") from exc


def _frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, size = HEADER.unpack(relay.read_exactly(sock, HEADER.size))
    return kind, relay.read_exactly(sock, size) if size else b""


class HeldTransport:
    """The transport part of a :class:`HeldConnection`: sessions through the holder; a keepalive
    is the holder's round trip to the node's sshd."""

    def __init__(self, conn: HeldConnection):
        self._conn = conn
        self._alive = True

    def open_session(self, timeout: float | None = None) -> HeldChannel:
        chan = HeldChannel(self._conn, timeout)
        self._conn.channels.add(chan)
        return chan

    def global_request(self, kind: str, data=None, wait: bool = True):
        reply = holder.request(self._conn.holder_name, {"op": "ping", "node": self._conn.node.name,
                                                        "print": self._conn.print}, timeout=30)
        self._alive = bool(reply and reply.get("alive"))
        if not self._alive:
            raise ssh.SSHError(self._conn.node.name, f"host {self._conn.node.name}: no keepalive answer", "lost")

    def is_active(self) -> bool:
        return self._alive

    def set_keepalive(self, interval: int) -> None:
        pass  # the holder keeps its connection alive

    def __getattr__(self, name: str):  # anything else (a forwarded port): the node's own connection
        return getattr(self._conn.cold().transport, name)


def holder_gone(chan) -> bool:
    """Whether *chan* went through a connection holder whose relay ended without the command's
    exit status, and the holder has ended since (``hold --stop``, or it died): the channel ended
    with it, whatever its command did on the node. A channel of a node's own connection (no
    holder, or one started after the holder's end) is never one."""
    if not isinstance(chan, HeldChannel) or chan._real is not None or not chan.relay_lost:
        return False
    sock = holder.connect(chan._conn.holder_name)
    if sock is None:
        return True
    sock.close()
    return False


class HeldConnection:
    """Stands for :func:`ddpfab.remote.ssh.connect`'s connection to *node*, over the holder
    *holder_name*'s."""

    def __init__(self, holder_name: str, node, print_: str, policy: HostKeyPolicy, ssh_config: str | None):
        self.holder_name, self.node, self.print = holder_name, node, print_
        self._policy, self._ssh_config = policy, ssh_config
        self._cold: Any = None
        self._lock = threading.Lock()
        #: its channels: closing the connection ends them, as closing an SSH connection does
        self.channels: weakref.WeakSet[HeldChannel] = weakref.WeakSet()
        self.transport = HeldTransport(self)
        self._target: Target | None = None

    @property
    def target(self) -> Target:
        """How the node is reached, as its cold connection would be: resolved on first need, so a
        command that needs no more than the held connection never reads the ssh_config (which
        loads paramiko, 0.09 s)."""
        with self._lock:
            if self._target is None:
                self._target = ssh.target_of(self.node, self._policy, self._ssh_config)
            return self._target

    @property
    def host(self) -> str:
        return self.target.host

    def cold(self):
        """The node's own connection, made on first need (as without a holder)."""
        with self._lock:
            if self._cold is None:
                self._cold = ssh.connect(self.node, self._policy, self._ssh_config, warm=False)
            return self._cold

    def __getattr__(self, name: str):  # Fabric's run, client, ...: the node's own connection
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.cold(), name)

    def close(self) -> None:
        """Its channels closed (their commands' input ends: the holder closes them), and its own
        connection if one was made; the holder's connection stays."""
        for chan in list(self.channels):
            chan.close()
        with self._lock:
            cold, self._cold = self._cold, None
        if cold is not None:
            cold.close()


def factory(holder_name: str, prints: dict[str, str], policy: HostKeyPolicy, ssh_config: str | None):
    """:func:`ddpfab.remote.ssh.warm_through`'s factory for the holder *holder_name* holding
    *prints* (node -> fingerprint), made with *policy* and *ssh_config*: a HeldConnection for a
    node held as it would be reached here, else None (connected cold)."""
    def make(node, asked_policy: HostKeyPolicy, asked_config: str | None) -> HeldConnection | None:
        fp = holder.fingerprint(node)
        if prints.get(node.name) != fp or asked_policy != policy or asked_config != ssh_config:
            return None
        return HeldConnection(holder_name, node, fp, policy, ssh_config)
    return make
