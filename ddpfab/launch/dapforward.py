"""``ddpfab run --debugpy``: VS Code (any DAP client) on this machine attaches to a rank on a node.

A rank of the job listens with debugpy on its node's loopback and prints :data:`LISTENS`
(:mod:`ddpfab.node.rankdebugpy`). Seeing that line in the rank's output, the run listens on a port
of this machine's loopback and forwards each connection to the rank's port over the node's SSH
connection (a ``direct-tcpip`` channel: no new connection, no port opened beyond the node's
loopback). The local port takes connections from this user only: debugpy runs any code its client
sends, so another user of this machine is refused (the peer's uid, from ``/proc/net/tcp``). It
says where to attach, and keeps the ``launch.json`` entries of every waiting rank
in the run's dir (``runs/RUN_ID/launch.json``), their path mappings from the node's workdir to the
directory the run was started from.

While a rank waits for a client, or a client is attached (it may be paused at a breakpoint), the
hang watch does not look for a hang: :meth:`DapForwarder.stopped` names those ranks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ddpfab.planning.plan import Plan

#: What a listening rank prints (its rank tag stripped): ddpfab.node.rankdebugpy.LISTENS, as a pattern.
LISTENS = re.compile(r"^ddpfab-debugpy: rank (?P<rank>\d+) \(local rank (?P<local>\d+)\) waits for a debugger on "
                     r"127\.0\.0\.1:(?P<port>\d+) \(pid (?P<pid>\d+)\)$")


@dataclass
class Forward:
    """One rank's port, forwarded: *remote_port* on *node*'s loopback, *local_port* on this one's."""

    node: str
    rank: int
    local_rank: int
    remote_port: int
    local_port: int
    clients: int = 0  # connections open now
    attached: bool = False  # a client has connected (the rank runs on from its wait)
    listener: socket.socket | None = None  # this machine's end

    @property
    def in_debugger(self) -> bool:
        """Waiting for its first client, or with one attached (perhaps paused at a breakpoint)."""
        return not self.attached or self.clients > 0


def _copy(recv: Callable[[int], bytes], send: Callable[[bytes], object], done: Callable[[], object]) -> None:
    """Bytes from *recv* to *send* until *recv* gives none or either side fails; then *done()*
    (the half-close that tells the other side)."""
    try:
        while True:
            data = recv(65536)
            if not data:
                break
            send(data)
    except (OSError, EOFError):
        pass
    finally:
        try:
            done()
        except (OSError, EOFError):
            pass


def _shut(listener: socket.socket) -> None:
    """Close *listener*, waking a thread blocked in its accept() (close() alone does not)."""
    for step in (lambda: listener.shutdown(socket.SHUT_RDWR), listener.close):
        try:
            step()
        except OSError:
            pass


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of *conn*, a TCP connection over loopback: the
    owner of the socket whose local address is *conn*'s peer, in ``/proc/net/tcp`` (None: not found)."""
    host, port = conn.getpeername()[:2]
    want = f"{socket.htonl(int.from_bytes(socket.inet_aton(host), 'big')):08X}:{port:04X}"
    try:
        with open("/proc/net/tcp", encoding="ascii") as fh:
            next(fh)
            for line in fh:
                fields = line.split()
                if fields[1] == want:
                    return int(fields[7])
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return None


def launch_entry(run_id: str, fwd: Forward, remote_root: str, local_root: str) -> dict:
    """The ``launch.json`` configuration that attaches VS Code to *fwd*'s rank."""
    return {"name": f"ddpfab {run_id} rank {fwd.rank} ({fwd.node})", "type": "debugpy", "request": "attach",
            "connect": {"host": "127.0.0.1", "port": fwd.local_port},
            "pathMappings": [{"localRoot": local_root, "remoteRoot": remote_root}], "justMyCode": False}


class DapForwarder:
    """The run's debugpy ports: told of every rank line (:meth:`saw`), forwards each listening rank."""

    def __init__(self, plan: Plan, transports: dict[str, Callable[[], object]], note: Callable[[str], None],
                 record_dir: str | None = None, local_root: str | None = None):
        self.plan = plan
        self.workdirs = {n.name: n.workdir for n in plan.nodes}
        self.transports = transports  # node -> its connection's paramiko Transport
        self.note = note
        self.record = os.path.join(record_dir, "launch.json") if record_dir else None
        self.local_root = local_root or os.getcwd()
        self.lock = threading.Lock()
        self.forwards: list[Forward] = []
        self.listeners: list[socket.socket] = []
        self.channels: list[object] = []
        self.closed = False

    def saw(self, node: str, text: str) -> None:
        """A rank's line (tag stripped) from *node*: a rank that listens gets its local port."""
        m = LISTENS.match(text)
        if not m or node not in self.workdirs:
            return
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        fwd = Forward(node, int(m["rank"]), int(m["local"]), int(m["port"]), listener.getsockname()[1])
        with self.lock:
            if self.closed:
                listener.close()
                return
            # a rank torchrun restarted listens anew: its old forward leads nowhere
            for old in [f for f in self.forwards if (f.node, f.rank) == (node, fwd.rank)]:
                self.forwards.remove(old)
                if old.listener is not None and old.listener in self.listeners:
                    self.listeners.remove(old.listener)
                    _shut(old.listener)
            fwd.listener = listener
            self.forwards.append(fwd)
            self.listeners.append(listener)
            self._write_record_locked()
        threading.Thread(target=self._accept, args=(listener, fwd), name="ddpfab-debugpy", daemon=True).start()
        entry = launch_entry(self.plan.run_id, fwd, self.workdirs[node], self.local_root)
        where = f" (all entries: {self.record})" if self.record else ""
        self.note(f"debugpy: rank {fwd.rank} on {node} waits for a debugger: attach to 127.0.0.1:{fwd.local_port}"
                  f"{where}; its launch.json entry: {json.dumps(entry)}")

    def stopped(self) -> list[Forward]:
        """The ranks waiting for a client or with one attached."""
        with self.lock:
            return [f for f in self.forwards if f.in_debugger]

    def close(self, wait: float = 0.0) -> None:
        """No more forwards: the listeners (woken from accept) and every open channel are closed."""
        with self.lock:
            self.closed = True
            listeners, channels = list(self.listeners), list(self.channels)
        for listener in listeners:
            _shut(listener)
        for chan in channels:
            try:
                chan.close()  # type: ignore[attr-defined]
            except OSError:
                pass

    def _write_record_locked(self) -> None:
        if self.record is None:
            return
        entries = [launch_entry(self.plan.run_id, f, self.workdirs[f.node], self.local_root) for f in self.forwards]
        try:
            with open(self.record, "w", encoding="utf-8") as fh:
                json.dump({"version": "0.2.0", "configurations": entries}, fh, indent=1)
                fh.write("\n")
        except OSError as exc:
            self.note(f"debugpy: cannot write {self.record}: {exc.strerror or exc}")

    def _accept(self, listener: socket.socket, fwd: Forward) -> None:
        while True:
            try:
                client, peer = listener.accept()
            except OSError:  # closed: the run ended
                return
            if self.closed:
                client.close()
                return
            uid = peer_uid(client)
            if uid != os.getuid():
                who = f"another user (uid {uid})" if uid is not None else "a process whose user is unknown"
                self.note(f"debugpy: refused a connection to rank {fwd.rank}'s port from {who}")
                client.close()
                continue
            try:
                chan = self.transports[fwd.node]().open_channel(  # type: ignore[attr-defined]
                    "direct-tcpip", ("127.0.0.1", fwd.remote_port), peer, timeout=30)
            except Exception as exc:  # noqa: BLE001 - this client fails; the rank waits on for another
                self.note(f"debugpy: cannot reach rank {fwd.rank}'s port on {fwd.node}: {type(exc).__name__}: {exc}")
                client.close()
                continue
            with self.lock:
                fwd.attached, fwd.clients = True, fwd.clients + 1
                self.channels.append(chan)
            threading.Thread(target=self._pump, args=(client, chan, fwd), name="ddpfab-debugpy-io",
                             daemon=True).start()

    def _pump(self, client: socket.socket, chan, fwd: Forward) -> None:
        """Bytes both ways until either side closes; then both are closed."""
        reader = threading.Thread(target=_copy, args=(chan.recv, client.sendall, lambda: client.shutdown(socket.SHUT_WR)),
                                  name="ddpfab-debugpy-down", daemon=True)
        reader.start()
        try:
            _copy(client.recv, chan.sendall, chan.shutdown_write)
        finally:
            reader.join(10)
            client.close()
            chan.close()
            with self.lock:
                fwd.clients -= 1
                if chan in self.channels:
                    self.channels.remove(chan)
