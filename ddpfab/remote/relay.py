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


def relay(client: socket.socket, chan, send: Send, exit_first: bool = False) -> None:
    """Relay *chan*'s command (``exec_command`` done) to *client* until it ends: stdin from the
    socket, stdout and stderr as frames, and ``x`` with its exit status: after the last output,
    or with *exit_first* as soon as sshd sends it (as a channel of one's own tells it: the output
    a descendant still writes follows, until EOF). A client that goes away ends the relay and
    closes *chan*, so a command that ignores its input's end is no longer kept for nobody."""
    done = threading.Event()
    threads = [threading.Thread(target=_relay_stdin, args=(client, chan, done), daemon=True),
               threading.Thread(target=_relay_stderr, args=(chan, send), daemon=True)]
    if exit_first:
        threads.append(threading.Thread(target=_relay_exit, args=(chan, send), daemon=True))
    for th in threads:
        th.start()
    try:
        while True:
            data = chan.recv(65536)
            if not data:
                break
            send(b"o", data)
        threads[1].join()
        if exit_first:
            threads[2].join()
        else:
            send(b"x", str(chan.recv_exit_status()).encode())
    finally:
        done.set()


def _relay_exit(chan, send: Send) -> None:
    try:
        send(b"x", str(chan.recv_exit_status()).encode())
    except OSError:
        pass  # the client went away: the relay ends with it


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
    poll = select.poll()
    poll.register(client, 0)  # POLLHUP and POLLERR are always reported
    try:
        while not done.is_set():
            if poll.poll(500):
                if not done.is_set():
                    chan.close()
                return
    except (OSError, ValueError):  # the socket was closed under us: the relay has ended
        return


def _relay_stderr(chan, send: Send) -> None:
    """The remote side's stderr, sent back as ``e`` frames until it ends, on its own thread:
    a remote side that fills stderr while stdout waits would otherwise stall."""
    try:
        while True:
            data = chan.recv_stderr(65536)
            if not data:
                return
            send(b"e", data)
    except (OSError, EOFError):
        pass
