"""``ddpfab run --pdb``: the user's terminal drives pdb in a rank on a remote node.

A rank that stops (``breakpoint()``, or an uncaught exception: post-mortem) listens on a Unix
socket in the run's private dir on its node and prints :data:`WAITS`
(:mod:`ddpfab.node.rankpdb`). Seeing that line in the rank's output, the run opens a channel on
that node's SSH connection (no new connection, no port on the node) running a small relay to the
socket, and pumps the terminal's input to it and its output to the terminal. One rank at a
time: the first to stop is attached, the others wait where they are (listed), each attached in
turn when the one before leaves pdb (``continue`` without breakpoints, ``quit``, the rank's end).

While a rank is in the debugger the hang watch does not look for a hang (the other ranks wait in
their next collective for it): :meth:`Debugger.stopped` says which ranks are.
"""

from __future__ import annotations

import os
import posixpath
import re
import select
import shlex
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ddpfab.hosts import nodeenv
from ddpfab.node import rankpdb
from ddpfab.node.agent import PDB_DIR
from ddpfab.optionnames import option
from ddpfab.planning.plan import NodePlan, Plan, PlanError
from ddpfab.remote.streams import write_all

#: What a waiting rank prints (its rank tag stripped): ddpfab.node.rankpdb.WAITS, as a pattern.
WAITS = re.compile(r"^ddpfab-pdb: rank (?P<rank>\d+) \(local rank (?P<local>\d+)\) waits in pdb at "
                   r"(?P<where>.+) \((?P<kind>[^(),]+), pid (?P<pid>\d+)\)$")

#: The relay's exit status when no rank listens there (not stopped, or attached elsewhere).
NOT_WAITING = 3
#: ... and when the job has ended there (its supervisor's result record is in the run's dir).
ENDED = 4
#: What the terminal's end of input (Ctrl-D) sends: pdb's quit.
QUIT = b"q\n"
#: The relay on the node: stdin to the socket, the socket to stdout (stdlib, ~20 ms to start).
RELAY = r"""
import os, socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
path = os.path.expanduser(sys.argv[1])
try:
    s.connect(path)
except OSError:
    sys.exit(4 if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(path)), "result.json")) else 3)
def up():
    while True:
        data = os.read(0, 4096)
        if not data:
            break
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while True:
    data = s.recv(4096)
    if not data:
        break
    os.write(1, data)
"""


@dataclass(frozen=True)
class Stop:
    """A rank waiting in pdb."""

    node: str
    rank: int
    local_rank: int
    where: str
    kind: str
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} on {self.node} (local rank {self.local_rank}, {self.kind} at {self.where})"


def socket_path(node: NodePlan, rank: int) -> str:
    """Where rank *rank* on *node* listens: the node's own rule (:func:`ddpfab.node.rankpdb.socket_path`)
    in the dir its supervisor gives the ranks (:data:`ddpfab.node.agent.PDB_DIR` of the run's remote dir)."""
    return rankpdb.socket_path(posixpath.join(node.remote_dir, PDB_DIR), rank)


def relay_command(node: NodePlan, rank: int) -> str:
    """The command the relay channel runs on *node*: the node's python (``python3`` where the node
    decides it at run time) with the relay, isolated from the job's site and environment."""
    python = "python3" if nodeenv.undecided(node) else node.python
    return shlex.join([python, "-I", "-S", "-c", RELAY, socket_path(node, rank)])


class Debugger:
    """The run's debugger: told of every rank line (:meth:`saw`), attaches one stopped rank at a time."""

    def __init__(self, plan: Plan, transports: dict[str, Callable[[], object]], note: Callable[[str], None],
                 stdin_fd: int = 0, stdout_fd: int = 1):
        self.nodes = {n.name: n for n in plan.nodes}
        self.transports = transports  # node -> its connection's paramiko Transport
        self.note = note
        self.stdin_fd, self.stdout_fd = stdin_fd, stdout_fd
        self.lock = threading.Lock()
        self.waiting: list[Stop] = []
        self.attached: Stop | None = None
        self.session: threading.Thread | None = None
        self.closed = False

    def saw(self, node: str, text: str) -> None:
        """A rank's line (tag stripped) from *node*: a rank that stops is queued, attached if first."""
        m = WAITS.match(text)
        if not m or node not in self.nodes:
            return
        stop = Stop(node, int(m["rank"]), int(m["local"]), m["where"], m["kind"], int(m["pid"]))
        with self.lock:
            if self.closed:
                return
            self.waiting.append(stop)
            attached = self.attached
            if attached is None:
                self._next_locked()
        if attached is not None:  # (said outside the lock: a stdout nobody reads must not hold it)
            self.note(f"pdb: {stop.describe()} waits too; it gets the terminal when "
                      f"rank {attached.rank} leaves the debugger")

    def stopped(self) -> list[Stop]:
        """The ranks in the debugger now (attached first, then those waiting for the terminal)."""
        with self.lock:
            return ([self.attached] if self.attached else []) + list(self.waiting)

    def stopping(self) -> None:
        """The run is being stopped: no rank gets the terminal any more (those waiting for it are
        ending, and a relay to one would say it is not waiting in pdb); the attached one keeps it
        until its relay sees the rank's end."""
        with self.lock:
            self.closed = True
            self.waiting.clear()

    def close(self, wait: float = 5.0) -> None:
        """No more stops; the session of the rank attached last ends first (its relay sees the
        rank's end), at most *wait* seconds, so that what it printed comes before the run's end."""
        self.stopping()
        with self.lock:
            session = self.session
        if session is not None:
            session.join(wait)

    def _next_locked(self) -> None:
        if not self.waiting or self.closed:
            self.attached = None
            return
        self.attached = self.waiting.pop(0)
        self.session = threading.Thread(target=self._session, args=(self.attached,), name="ddpfab-pdb", daemon=True)
        self.session.start()

    def _session(self, stop: Stop) -> None:
        def attached() -> None:
            self.note(f"pdb: attached to {stop.describe()}; `c` continues, `q` quits (the rank then fails); "
                      "the hang watch waits meanwhile")

        try:
            relay(self.transports[stop.node](), self.nodes[stop.node], stop.rank, self.stdin_fd, self.stdout_fd,
                  on_attach=attached)
        except ConnectionError as exc:
            self.note(f"pdb: {exc}")
        except Exception as exc:  # noqa: BLE001 - the rank stays where it is; say why the terminal left it
            self.note(f"pdb: the relay to rank {stop.rank} on {stop.node} ended: {type(exc).__name__}: {exc}")
        else:
            self.note(f"pdb: rank {stop.rank} on {stop.node} left the debugger")
        with self.lock:
            self._next_locked()


def relay(transport, node: NodePlan, rank: int, stdin_fd: int = 0, stdout_fd: int = 1,
          on_attach: Callable[[], None] | None = None) -> bool:
    """Drive rank *rank*'s pdb on *node* from *stdin_fd*/*stdout_fd*, over a new channel of
    *transport* (the node's paramiko Transport), until its session ends; *on_attach()* first, when
    pdb first speaks. Whether the input's end sent pdb's quit (:data:`QUIT`). ConnectionError when
    the rank is not waiting there (no socket: not stopped, or attached elsewhere)."""
    chan = transport.open_session(timeout=30)
    quit_sent: list[bool] = []
    done = threading.Event()
    try:
        chan.exec_command(relay_command(node, rank))
        pump = threading.Thread(target=_pump_input, args=(chan, done, stdin_fd, quit_sent), name="ddpfab-pdb-in",
                                daemon=True)
        pump.start()
        while True:
            data = chan.recv(4096)
            if not data:
                break
            if on_attach is not None:
                on_attach()
                on_attach = None
            write_all(stdout_fd, data)
        done.set()
        pump.join(1.0)  # its last read goes nowhere else: the next session's input is its own
        code = chan.recv_exit_status()
        if code == ENDED:
            raise ConnectionError(f"the job has ended on {node.name}: rank {rank} waits in pdb no more")
        if code == NOT_WAITING:
            raise ConnectionError(f"rank {rank} is not waiting in pdb on {node.name} (not stopped, or attached "
                                  "from another terminal)")
        if code != 0:
            raise ConnectionError(f"the relay on {node.name} exited with {code}")
    finally:
        done.set()  # (a link that broke too: its input thread must not read the next session's input)
        chan.close()
    return bool(quit_sent)


def _pump_input(chan, done: threading.Event, stdin_fd: int, quit_sent: list[bool] | None = None) -> None:
    """The terminal's input to the attached rank, a line as it comes, until its session ends; at
    the input's end pdb's quit, noted in *quit_sent*."""
    sent = b""  # the end of what was sent: its last command
    while not done.is_set():
        ready, _, _ = select.select([stdin_fd], [], [], 0.2)
        if not ready or done.is_set():
            continue
        data = os.read(stdin_fd, 4096)
        try:
            if not data:  # Ctrl-D: pdb's quit, as at a terminal (the session's end alone is no quit:
                if last_command(sent) in LEAVING:  # the rank then waits for the next user, ddpfab.node.rankpdb)
                    # piped commands ending in `c`: the rank goes on (a quit after it would end it); the
                    # end of input reaches it, so a later prompt (a breakpoint set) detaches, not waits for it
                    chan.shutdown_write()
                    return
                chan.sendall(QUIT)
                if quit_sent is not None:
                    quit_sent.append(True)
                return
            chan.sendall(data)
            sent = (sent + data)[-256:]
        except (OSError, EOFError):  # the session ended meanwhile: what was typed then has no rank to go to
            return


#: pdb's commands that leave the prompt for good (continue, quit): input that ends after one of them
#: has said what the rank is to do, and its end sends no quit.
LEAVING = frozenset({"c", "cont", "continue", "q", "quit", "exit"})


def last_command(sent: bytes) -> str:
    """The last complete, non-empty line of *sent* (the input given to pdb), stripped; "" if none."""
    lines = [line.strip() for line in sent.decode("utf-8", "replace").split("\n")[:-1]]
    return next((line for line in reversed(lines) if line), "")


def refuse_without_input(pdb: str) -> None:
    """PlanError when a ``--pdb`` job (*pdb*: its ranks) would start attached with no input to drive
    pdb from: its ranks would read EOF and fail. The run, its replay, the API: one rule."""
    if pdb and not stdin_usable():
        raise PlanError(f"{option('pdb')} needs an input to drive the debugger from (stdin is /dev/null or closed); "
                        "run it from a terminal")


def stdin_usable() -> bool:
    """Whether this process has an input to drive pdb with (not /dev/null, not closed)."""
    try:
        return not os.path.samefile(f"/proc/self/fd/{sys.stdin.fileno()}", os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
