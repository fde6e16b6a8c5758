"""rsync's remote shell over ddpfab's open SSH connection to a node (stdlib only).

rsync starts its remote side with ``RSH [-l USER] HOST COMMAND...``; ddpfab gives it ``-e
"python3 -I -S .../rsh.py SOCKET"``. This program connects to SOCKET, the unix socket a
:class:`ddpfab.remote.noderunner.NodeRunner` serves in a private (0700) directory, sends the command
(one JSON line), and relays: its stdin to the socket (a half-close is EOF), and the runner's frames
back to its stdout and stderr, ending with the command's exit status as its own. The runner runs
the command on a new channel of the node's one paramiko transport: no second TCP connection, no
ssh options here. Run by path with ``-I -S`` (no site, no ddpfab import): it starts in ~20 ms.

Frames from the runner: one type byte (``o`` stdout, ``e`` stderr, ``x`` exit status as decimal
digits), a 4-byte big-endian length, the payload.
"""

import json
import os
import select
import socket
import struct
import sys
import threading

#: The exit status when the relay itself fails (as ssh's: rsync names it a connection failure).
FAILED = 255
HEADER = struct.Struct(">cI")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _read(fd: int) -> bytes:
    """Read from *fd*, waiting when it is non-blocking (rsync may hand us such a descriptor)."""
    while True:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            select.select([fd], [], [])


def _write(fd: int, data: bytes) -> None:
    """Write all of *data* to *fd*, waiting when it is non-blocking and full."""
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            select.select([], [fd], [])


def _pump_stdin(sock: socket.socket) -> None:
    try:
        while True:
            data = _read(0)
            if not data:
                break
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def main(argv: list) -> int:
    if len(argv) < 3:
        sys.stderr.write("usage: rsh.py SOCKET [-l USER] HOST COMMAND...\n")
        return FAILED
    path, words = argv[0], argv[1:]
    if words[0] == "-l" and len(words) >= 2:  # the runner's connection has its user already
        words = words[2:]
    command = " ".join(words[1:])  # as ssh does: the words joined with spaces, for the remote shell
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall(json.dumps({"command": command}).encode() + b"\n")
    except OSError as exc:
        sys.stderr.write(f"ddpfab rsh: cannot reach ddpfab's connection ({path}): {exc}\n")
        return FAILED
    threading.Thread(target=_pump_stdin, args=(sock,), daemon=True).start()
    while True:
        head = _read_exact(sock, HEADER.size)
        if not head:
            sys.stderr.write("ddpfab rsh: ddpfab's connection ended before the command did\n")
            return FAILED
        kind, size = HEADER.unpack(head)
        payload = _read_exact(sock, size) if size else b""
        if size and not payload:
            return FAILED
        if kind == b"x":
            return int(payload or FAILED)
        _write(1 if kind == b"o" else 2, payload)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the stdin thread may still block in read()
