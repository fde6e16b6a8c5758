"""One command on a channel of an open SSH connection, relayed to a local socket: the client's
bytes to the command's stdin (its half-close is EOF), the command's stdout and stderr back as
frames, and its exit status. rsync's remote shell (:mod:`ddpfab.remote.rsh`, served by
:class:`ddpfab.remote.noderunner.NodeRunner`) and the channels of ``ddpfab hold``'s connections
(:mod:`ddpfab.remote.heldconn`, served by the holder) speak it.

Frames: one type byte (``o`` stdout, ``e`` stderr, ``x`` exit status as decimal digits, and for
the holder's channels ``s`` started, ``f`` could not start: its reason), a 4-byte big-endian
length, the payload. ``x`` is the last frame for rsync's relay; a holder's channel sends it when
sshd does and ends with the socket's end."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable

from ddpfab.remote.rsh import HEADER

#: Sends one frame (type byte, payload).
Send = Callable[[bytes, bytes], None]


def frame_sender(client: socket.socket) -> Send:
    """A frame sender on *client*, safe from several threads."""
    lock = threading.Lock()

    def send(kind: bytes, data: bytes) -> None:
        with lock:
            client.sendall(HEADER.pack(kind, len(data)) + data)
    return send


def read_header(client: socket.socket) -> bytes | None:
    """The relay's first line (its JSON request, newline included), taken so that nothing of the
    stdin after it is consumed (peeked, then read up to its end); None when the relay ends first
    or the line runs past 1 MiB (a bound on what one request may hold)."""
    header = b""
    while len(header) <= 1 << 20:
        peek = client.recv(65536, socket.MSG_PEEK)
        if not peek:
            return None
        end = peek.find(b"\n")
        header += client.recv(end + 1 if end >= 0 else len(peek))
        if end >= 0:
            return header
    return None


def read_exactly(client: socket.socket, size: int, timeout: float | None = None) -> bytes:
    """The next *size* bytes on *client* (a frame's payload, or the command's first stdin after
    the header), with *timeout* seconds for each read when given (the socket's own timeout
    otherwise, and again afterwards); EOFError when the relay ends first."""
    data = bytearray()
    before = client.gettimeout()
    if timeout is not None:
        client.settimeout(timeout)
    try:
        while len(data) < size:
            chunk = client.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise EOFError("the relay ended")
            data += chunk
    finally:
        if timeout is not None:
            client.settimeout(before)
    return bytes(data)


def relay(client: socket.socket, chan, send: Send, exit_first: bool = False) -> None:
    """Relay *chan*'s command (``exec_command`` done) to *client* until it ends: stdin from the
    socket, stdout and stderr as frames, and ``x`` with its exit status: after the last output,
    or with *exit_first* as soon as sshd has sent it and what came before it is relayed (as a
    channel of one's own tells it: the output a descendant still writes follows, until EOF). The
    relay's end is the socket's end for the client. A client that goes away ends the relay and
    closes *chan*, so a command that ignores its input's end is no longer kept for nobody."""
    done = threading.Event()
    threading.Thread(target=_relay_stdin, args=(client, chan, done), daemon=True).start()
    try:
        if exit_first:
            _relay_exit_first(chan, send)
        else:
            _relay_exit_last(chan, send)
    finally:
        done.set()
        with contextlib.suppress(OSError):  # wakes the stdin thread's read: the client sees the end now
            client.shutdown(socket.SHUT_RDWR)


def _relay_exit_last(chan, send: Send) -> None:
    """*chan*'s stdout and stderr as frames until its EOF (stderr on a thread of its own: a
    command that fills stderr while stdout waits would otherwise stall), then ``x``. Any channel
    (one of the holder's too: rsync's relay over held connections)."""
    err = threading.Thread(target=_relay_stderr, args=(chan, send), daemon=True)
    err.start()
    while True:
        data = chan.recv(65536)
        if not data:
            break
        send(b"o", data)
    err.join()
    send(b"x", str(chan.recv_exit_status()).encode())


def _relay_stderr(chan, send: Send) -> None:
    try:
        while True:
            data = chan.recv_stderr(65536)
            if not data:
                return
            send(b"e", data)
    except (OSError, EOFError):
        pass


def _relay_exit_first(chan, send: Send) -> None:
    """A paramiko channel's stdout and stderr as frames, one thread for both (each taken as it
    is ready: neither stalls the other), and ``x`` once the status is there and the output sshd
    sent before it is relayed (paramiko puts that in the channel's buffers before it makes the
    status ready)."""
    wake = _Wake()  # paramiko's pipe says data and EOF, not the exit status
    threading.Thread(target=wake.after, args=(chan.recv_exit_status,), daemon=True).start()
    try:
        poller = select.poll()
        poller.register(chan.fileno(), select.POLLIN)  # readable while stdout or stderr has data, and after EOF
        poller.register(wake.r, select.POLLIN)
        x_sent = False
        while True:
            # the end and the status first, the buffers after: what came before them is in the
            # buffers by then, so neither is acted on while output sent before it waits there
            ended, status = chan.eof_received or chan.closed, not x_sent and chan.exit_status_ready()
            if chan.recv_ready():
                send(b"o", chan.recv(65536))
            elif chan.recv_stderr_ready():
                send(b"e", chan.recv_stderr(65536))
            elif status:
                send(b"x", str(chan.recv_exit_status()).encode())
                x_sent = True
            elif ended:
                break
            elif any(fd == wake.r for fd, _ in poller.poll(WAKE_S * 1000)):
                os.read(wake.r, 64)
        if not x_sent:
            send(b"x", str(chan.recv_exit_status()).encode())
    finally:
        wake.close()


#: The longest the relay waits without looking at its channel again (a pipe of paramiko's closed
#: while it waits wakes nothing)
WAKE_S = 2.0


class _Wake:
    """A pipe another thread makes readable once, safe to set after it was closed (the thread
    outlives the relay when the status never comes: its write must not reach a reused fd)."""

    def __init__(self) -> None:
        self.r, self._w = os.pipe()
        self._lock = threading.Lock()
        self._open = True

    def after(self, wait: Callable[[], object]) -> None:
        """Readable once *wait()* returned."""
        wait()
        with self._lock:
            if self._open:
                os.write(self._w, b"x")

    def close(self) -> None:
        with self._lock:
            self._open = False
            os.close(self.r)
            os.close(self._w)


def _relay_stdin(client: socket.socket, chan, done: threading.Event) -> None:
    """The client's bytes to the channel, then its end (EOF) passed on: the remote side reads
    until then. Then, until the relay is *done*, a watch for the client's going away (its
    socket hung up, not only half-closed): the channel is closed, as a lost SSH connection
    closes it. A link that breaks ends this direction only."""
    try:
        while True:
            data = client.recv(65536)
            if not data:
                break
            chan.sendall(data)
        chan.shutdown_write()
    except (OSError, EOFError):
        pass
    try:
        poll = select.poll()
        poll.register(client, 0)  # POLLHUP and POLLERR are always reported
        while not done.is_set():
            if poll.poll(500):
                if not done.is_set():
                    chan.close()
                return
    except (OSError, ValueError):  # the socket was closed under us: the relay has ended
        return
