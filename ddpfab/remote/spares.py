"""Node programs started ahead of their command by ``ddpfab hold``.

Most of what a node does for a warm command that talks to the node program (a check's facts, a
run's preparation, sync's hash check) is starting it: sshd's session, python and the program, on
every node at once. Once a command has opened such a session, the holder starts one more like it
on the node (the same command line, the program written first on its stdin) and keeps it waiting
for its first request; the next command that asks for exactly that gets it. Spares are started
when no command has run through the holder for :data:`IDLE_S` (a start costs the node what the
command's own start would, and on shared cores that must not be while a command runs), and one
that was taken is started again then.

What a spare has done before it is asked is what any start does before its first request: start
python and load the program, whose operations all look at the node when they are asked (facts,
hashes, locks). Only such a start is made ahead (:func:`startable`): never a command with setup
lines (their effects are the user's, at the time the user asks), a python the node chooses when
the command starts, or any other command. A spare older than :data:`MAX_AGE_S` is replaced, and a
node's spares are replaced after an ``exec`` there (it may have replaced their python). A spare
ends with its channel (its stdin's EOF ends the program): when it is replaced, or the holder ends.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpfab.remote.nodeprogram import LOADER

#: Seconds a spare waits to be used; an older one is replaced (a python replaced on the node since
#: would otherwise answer for up to this long).
MAX_AGE_S = 120.0
#: Seconds without a command after which the holder starts the spares wanted.
IDLE_S = 1.0
#: Spares kept per node, one per distinct command (the whole program and sync's part of it): each
#: is an idle python on the node and a session of the connection's (sshd's MaxSessions, 10).
PER_NODE = 2
#: The most stdin a request may ask to be written first (setup head and program: ~0.2 MB).
MAX_PREAMBLE = 16 << 20


def startable(command: str, preamble: bytes) -> bool:
    """Whether *command* may be started before it is asked for: a node program's start and nothing
    else (``PYTHON -S -c LOADER MAGIC CODE SOURCE ddpfab-node``: its python by path, no setup lines,
    whose effects are the user's, no words but the program's), with exactly the program as its
    first stdin."""
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    return (len(words) == 8 and words[0].startswith("/") and words[1:4] == ["-S", "-c", LOADER]
            and words[7] == "ddpfab-node" and words[5].isdigit() and words[6].isdigit()
            and len(preamble) == int(words[5]) + int(words[6]))


@dataclass
class _Spare:
    chan: Any
    started: float


class Spares:
    """The spares of every node, by node and by (command, preamble)."""

    def __init__(self, max_age: float = MAX_AGE_S, per_node: int = PER_NODE):
        self.max_age, self.per_node = max_age, per_node
        self._lock = threading.Lock()
        # keyed by (command, preamble): the bytes themselves, whose hash Python computes once per
        # object (a request's preamble is looked up by take and want: one pass over its bytes)
        self._ready: dict[str, OrderedDict[tuple[str, bytes], _Spare]] = {}
        self._wanted: set[tuple[str, tuple[str, bytes]]] = set()  # (node, key) to start
        self._preambles: dict[bytes, bytes] = {}  # one copy of each preamble for every node
        self._closed = False

    def take(self, node: str, command: str, preamble: bytes):
        """The node's spare for *command* started with *preamble* (its channel, the command running
        and its first bytes written), or None: none, or it has ended or grown too old (closed)."""
        with self._lock:
            spare = self._ready.get(node, OrderedDict()).pop((command, preamble), None)
        if spare is None:
            return None
        chan = spare.chan
        transport = chan.get_transport()
        if (time.monotonic() - spare.started > self.max_age or chan.closed or chan.exit_status_ready()
                or transport is None or not transport.is_active()):
            chan.close()
            return None
        return chan

    def want(self, node: str, command: str, preamble: bytes) -> None:
        """A spare of *command* (started with *preamble*) on *node*, at the next :meth:`start_wanted`,
        unless one is ready."""
        if not startable(command, preamble):
            return
        with self._lock:
            if not self._closed and (command, preamble) not in self._ready.get(node, {}):
                self._wanted.add((node, (command, self._preambles.setdefault(preamble, preamble))))

    def renew(self, nodes=None) -> None:
        """Replace the spares (of *nodes*, default all) older than :attr:`max_age` (all of them
        when *nodes* are given: a command ran there that may have changed what a program finds at
        its start): closed now, started again at the next :meth:`start_wanted`."""
        old = []
        now = time.monotonic()
        with self._lock:
            for node, ready in self._ready.items():
                if nodes is not None and node not in nodes:
                    continue
                for key, spare in list(ready.items()):
                    if nodes is not None or now - spare.started > self.max_age:
                        del ready[key]
                        old.append(spare.chan)
                        self._wanted.add((node, key))
        for chan in old:
            chan.close()

    @property
    def wanted(self) -> bool:
        return bool(self._wanted)

    def start_wanted(self, open_session: Callable[[str], Any], go: Callable[[], bool]) -> None:
        """Start the spares wanted, one after another while *go()* (no command is running);
        *open_session(node)*: a new session channel on the node's connection."""
        while go():
            with self._lock:
                if self._closed or not self._wanted:
                    return
                node, key = self._wanted.pop()
            self._start(node, key, functools.partial(open_session, node))

    def _start(self, node: str, key: tuple[str, bytes], open_session: Callable[[], Any]) -> None:
        """Start the spare of *key* (its command, its preamble); the node's oldest other
        spare makes room when it has :attr:`per_node`. A failure to start one is no one's failure:
        the next command starts its program itself."""
        chan = None
        try:
            chan = open_session()
            chan.exec_command(key[0])
            chan.sendall(key[1])
        except Exception:  # noqa: BLE001 - no spare, nothing else changes
            if chan is not None:
                chan.close()
            return
        evicted = []
        with self._lock:
            ready = self._ready.setdefault(node, OrderedDict())
            if self._closed or key in ready:
                evicted.append(chan)
            else:
                ready[key] = _Spare(chan, time.monotonic())
                while len(ready) > self.per_node:
                    evicted.append(ready.popitem(last=False)[1].chan)
        for old in evicted:
            old.close()

    def close(self) -> None:
        """End every spare; none is started after this."""
        with self._lock:
            self._closed = True
            chans = [s.chan for ready in self._ready.values() for s in ready.values()]
            self._ready.clear()
            self._wanted.clear()
            self._preambles.clear()
        for chan in chans:
            with contextlib.suppress(Exception):
                chan.close()
