"""Lines of a byte stream read in chunks (an SSH channel, a pipe): one loop for every reader; and
every byte of a chunk written to a file descriptor."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

CHUNK = 65536


def lines(read: Callable[[int], bytes], on_chunk: Callable[[bytes], None] | None = None,
          size: int = CHUNK) -> Iterator[str]:
    """Each line of what ``read(size)`` returns until it returns ``b""`` (end of stream), decoded
    (undecodable bytes replaced), without its ``\\n`` or ``\\r\\n``; a last line without a newline
    comes too. *on_chunk* sees every chunk as read (a raw log), before its lines are yielded.

    Args:
        read: reads at most *size* bytes; ``b""`` at the end (``chan.recv``, ``chan.recv_stderr``).
        on_chunk: called with each chunk as it is read.
        size: the most bytes one read asks for.
    """
    pending = b""
    while data := read(size):
        if on_chunk is not None:
            on_chunk(data)
        pending += data
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", "replace").rstrip("\r")
    if pending:
        yield pending.decode("utf-8", "replace").rstrip("\r")


def write_all(fd: int, data: bytes) -> None:
    """All of *data* to *fd* (``os.write`` may take part of it: a terminal, a pipe)."""
    while data:
        data = data[os.write(fd, data):]
