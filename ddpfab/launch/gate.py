"""``--wait``'s go: a job that waits for its GPUs starts on every node at once, when every node's
supervisor holds its leases (:mod:`ddpfab.node.leases`), or on none."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


#: What a waiting supervisor says (``ddpfab-agent: ...``, :func:`ddpfab.node.agent.wait_for_leases`)
#: when it holds its leases, when it gave them back to an earlier job, and when it promises to keep
#: them for a round of the go.
GRANTED, YIELDED, READY = "ddpfab-agent: granted GPU ", "ddpfab-agent: yielded GPU ", "ddpfab-agent: ready for round "


class Gate:
    """``--wait``: the job starts on every node at once, when every node's supervisor holds its
    leases, or on none. Fed each node's lines. The go is two-phase: when the last node's grant
    completes the set, a round asks every node whether it still holds them (``p<round>;``); a
    node that does says ``ready`` and keeps them; when every node is ready for that round, ``g``
    starts the job everywhere. A node that yields during a round ends it (``u``: the others may
    yield again) and its next grant starts a new round, so a node yielding as the go arrives
    can never start the job partly. Sends happen under the gate's lock, in order on every node.

    Args:
        nodes: the nodes that lease GPUs.
        send: sends bytes to every node's supervisor.
    """

    def __init__(self, nodes: list[str], send: Callable[[bytes], None]):
        self.nodes = set(nodes)
        self.granted: set[str] = set()
        self.ready: set[str] = set()
        self.round = 0
        self.asking = False  # a round is open: its "p" sent, no "g" or "u" yet
        self.gone = False
        self.send = send
        self.arrival = time.time()  # the run's place in every node's queue (the same everywhere)
        self.lock = threading.Lock()

    def saw(self, node: str, line: str) -> None:
        if not line.startswith((GRANTED, YIELDED, READY)):
            return
        with self.lock:
            if self.gone:
                return
            if line.startswith(GRANTED):
                self.granted.add(node)
                if self.granted >= self.nodes and not self.asking:
                    self.round, self.ready, self.asking = self.round + 1, set(), True
                    self.send(b"p%d;" % self.round)
            elif line.startswith(YIELDED):
                self.granted.discard(node)
                self.ready.discard(node)
                if self.asking:
                    self.asking = False
                    self.send(b"u")
            elif self.asking and line[len(READY):].strip() == str(self.round):  # a late answer to an old round: no
                self.ready.add(node)
                if self.ready >= self.nodes:
                    self.gone, self.asking = True, False
                    self.send(b"g")
