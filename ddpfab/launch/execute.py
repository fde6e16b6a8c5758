"""Execute a plan: start every node at once, stream its output, stop everything on the first failure.

Thin and effectful by design; every decision was made in :mod:`ddpfab.planning.plan`. Each node runs the
supervisor from :mod:`ddpfab.node.agent` over its own SSH channel; closing our side of a channel (or
losing the connection, or ddpfab dying) tells that node's supervisor to end the job's whole
process tree, so no process outlives the run.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TextIO


from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import hints
from ddpfab.hostlist import compact
from ddpfab.launch import story
from ddpfab.launch.gate import Gate
from ddpfab.launch.cause import RANK_TAG, Blame, Cause, CauseReader, Fold, NodeFailure, blame, noise_of
from ddpfab.launch.dapforward import DapForwarder
from ddpfab.launch.debugger import Debugger
from ddpfab.launch.hangwatch import EXIT_HUNG, HangWatch
from ddpfab.launch.interrupt import Interrupted, Taken, signals_queued, signals_raise
from ddpfab.node import agent, exitguard, rankdebugpy, rankpdb
from ddpfab.node.agent import CANNOT_START, name_of_signal
from ddpfab.optionnames import option
from ddpfab.planning.plan import NodePlan, Plan
from ddpfab.planning.render import command as render_command
from ddpfab.remote import heldconn, ssh, streams
from ddpfab.remote.output import COLORS

if TYPE_CHECKING:  # (slow to import: see ddpfab.remote.ssh.connect)
    from fabric import Connection

#: Seconds the node supervisor gives the job between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0
#: Seconds ddpfab waits for nodes to report after asking them to stop.
STOP_WAIT_S = STOP_GRACE_S + 7.0
#: ddpfab sends each supervisor a heartbeat byte and each sshd a keepalive request this often.
HEARTBEAT_S = 1.0
#: A node whose sshd has not answered a keepalive for this long is declared lost.
LOST_AFTER_S = 5.0
#: A supervisor that has heard no heartbeat for this long ends its job on its own (network cut:
#: no EOF ever reaches it). Longer than LOST_AFTER_S, so ddpfab always notices first.
SILENCE_S = 10.0
#: Seconds without a line from any rank before ddpfab says which nodes it is waiting for; the next
#: report comes after twice the interval, and so on. ``DDPFAB_WAIT_REPORT_S`` overrides (0: never).
WAIT_REPORT_S = 60.0


def agent_spec(plan: Plan, node: NodePlan, detach: bool = False, arrival: float | None = None) -> dict:
    """The job as data for the supervisor: argv (:func:`ddpfab.planning.render.command`), workdir and env
    (no shell line to parse). *arrival*: when the run came (this controller's clock), its place in
    every node's queue with ``--wait``."""
    launch = render_command(plan, node)
    spec = {"run_id": plan.run_id, "dir": node.remote_dir, "workdir": node.workdir, "argv": list(launch.argv()),
            "env": dict(node.env), "grace": STOP_GRACE_S, "log_dir": launch.log_dir}
    if os.environ.get("DDPFAB_KEEP_RECORDS"):  # run records each node keeps (agent.KEEP_RECORDS)
        spec["keep_records"] = int(os.environ["DDPFAB_KEEP_RECORDS"])
    if node.gpus:  # the supervisor leases them before it starts the job (ddpfab.node.leases)
        spec["gpus"] = {"count": node.gpus, "pin": list(node.gpu_pin)}
    if node.name == plan.master:  # held there from the probe's reservation until the job ends
        spec["master_port"] = plan.master_port
    if plan.wait and node.gpus and not detach:  # queue, then start when ddpfab says go (Gate)
        spec["wait"] = {"arrival": arrival if arrival is not None else time.time()}
    if plan.max_restarts == 0:  # any failed worker fails the job: the supervisor need not wait for torchrun
        spec["watch_workers"] = True
    # its ranks: what the supervisor reads every rank's end against (with or without their exit guard)
    spec["nproc"] = node.nproc
    if plan.exit_guard != "off" or plan.pdb or plan.debugpy:  # the ranks' sitecustomize, as data (the node writes it)
        spec["exit_guard"] = {"mode": plan.exit_guard, "source": exitguard_source()}
    if plan.pdb:  # the debugger's hooks in the ranks it names (ddpfab.launch.debugger)
        spec["pdb"] = {"ranks": plan.pdb, "node": node.name, "source": rankpdb_source()}
    if plan.debugpy:  # debugpy in the ranks it names (ddpfab.launch.debugpy forwards their ports)
        spec["debugpy"] = {"ranks": plan.debugpy, "source": rankdebugpy_source()}
    if detach:
        spec["detached"] = True
    else:
        spec["silence"] = SILENCE_S
    return spec


@functools.lru_cache(maxsize=1)
def exitguard_source() -> str:
    """The exit guard's source (:mod:`ddpfab.node.exitguard`), which the node supervisor installs
    as the ranks' ``sitecustomize.py``."""
    return Path(exitguard.__file__).read_text()


@functools.lru_cache(maxsize=1)
def rankdebugpy_source() -> str:
    """debugpy's hooks in the ranks (:mod:`ddpfab.node.rankdebugpy`), written beside ``sitecustomize.py``."""
    return Path(rankdebugpy.__file__).read_text()


@functools.lru_cache(maxsize=1)
def rankpdb_source() -> str:
    """The ranks' debugger hooks (:mod:`ddpfab.node.rankpdb`), which the node supervisor writes
    beside the ranks' ``sitecustomize.py``."""
    return Path(rankpdb.__file__).read_text()


def agent_input(plan: Plan, node: NodePlan, detach: bool = False, arrival: float | None = None) -> bytes:
    """What goes to the supervisor's stdin first: the node program, then its ``supervise``
    request with the spec (env values included: they travel inside the SSH session, never in a
    command line)."""
    return nodeprog.setup_head(node) + nodeprog.supervisor_input(agent_spec(plan, node, detach, arrival))


def remote_command(plan: Plan, node: NodePlan, detach: bool = False) -> str:
    """The command ddpfab really sends: the node's python running the node program, which reads
    its code and the ``supervise`` request (:func:`agent_input`) from stdin and starts
    the node's argv (:mod:`ddpfab.planning.render`) in its own session. Nothing secret in it: ``ps`` on the node shows
    ``... ddpfab-agent RUN_ID``."""
    start = nodeprog.command(node, *nodeprog.supervisor_words(plan.run_id))
    if not detach:
        return start
    if nodeprog.setup_head(node):  # the setup's bootstrap: a script, which setsid runs through a shell
        start = f"sh -c {shlex.quote(start)}"
    # detached: a new session, no link to this SSH session; report once the supervisor is up.
    # A background command's stdin is /dev/null unless redirected: fd 3 hands it this session's.
    record = shlex.quote(f"{node.remote_dir}/agent.json")
    # (`a && b &` would background a subshell that keeps this session's stdout open until b ends)
    return (f"[ -e {record} ] && {{ echo 'ddpfab: run id {plan.run_id} was used on this node already' >&2; exit 1; }}; "
            f"mkdir -p -m 700 {shlex.quote(node.remote_dir)} || exit 1; exec 3<&0; "
            f"setsid {start} <&3 3<&- >/dev/null 2>&1 & exec 3<&-; "
            f"for i in $(seq 100); do [ -s {record} ] && exit 0; sleep 0.05; done; "
            f"echo 'ddpfab: the node supervisor did not start' >&2; exit 1")


@dataclass
class NodeOutcome:
    name: str
    node_rank: int
    exit_code: int | None = None
    error: str | None = None
    lost: bool = False  # declared lost by the monitor (its sshd went silent): no record to fetch there
    holder_gone: bool = False  # its link went through `ddpfab hold`'s connection, which ended under it
    started: float = 0.0
    ended: float = 0.0
    lines: int = 0
    rank_lines: int = 0  # lines from a rank (torchrun's own lines are not)
    last_line: float = 0.0  # time.monotonic() of the last line, 0 = none yet
    last_rank_line: float = 0.0  # ... of the last line from a rank
    last_progress: float = 0.0  # ... of the last ordinary line from a rank (no traceback, no noise)
    stopped_by_ddpfab: bool = False
    remote: dict | None = None  # the supervisor's result.json: restarts, why it stopped
    hints: list[str] = field(default_factory=list)  # known causes seen in its output (hints.py)
    cleanup: str | None = None  # what ending a supervisor-less job there found (None: not needed)
    cause: Cause | None = None  # the failing rank and its first exception line, from its output (cause.py)
    causes: CauseReader = field(default_factory=CauseReader, repr=False, compare=False)  # reads it

    def to_dict(self) -> dict:
        return {"node_rank": self.node_rank, "exit_code": self.exit_code, "error": self.error,
                "started": self.started, "ended": self.ended,
                "duration_s": round(self.ended - self.started, 3) if self.ended else None,
                "lines": self.lines, "stopped_by_ddpfab": self.stopped_by_ddpfab,
                "last_state": self.state(time.monotonic()),
                "restarts": (self.remote or {}).get("restarts"),
                "stopped_reason": (self.remote or {}).get("stopped"), "hints": self.hints,
                "signatures": [sig.key for sig in self.signatures],
                "failed_at": (self.remote or {}).get("failed_at"), "cleanup": self.cleanup,
                "exit_race": self.exit_race,
                "cause": self.cause.to_dict() if self.cause else None}

    @property
    def signatures(self) -> list[hints.Signature]:
        """The known failure signatures its output showed (:class:`CauseReader` collects them)."""
        return self.causes.signatures

    @property
    def exit_race(self) -> dict | None:
        """Its supervisor's word that the job failed only after every rank of the node had finished
        its work (``{"ranks": [...], "aborted": [{"rank", "local_rank", "signal"}]}``), else None."""
        return None if self.error else exit_race_of(self.exit_code, self.remote)

    @property
    def failed(self) -> bool:
        """Ended with an error or a non-zero exit code, not counting a finished node's abort at exit."""
        return (self.error is not None or self.exit_code != 0) and self.exit_race is None

    @property
    def stopped_from_outside(self) -> int | None:
        """The signal its supervisor was stopped by from outside this run (``ddpfab stop`` from
        elsewhere, a kill), before its job failed on its own; None else."""
        return stop_signal_of(self.exit_code, self.remote, self.cause)

    def state(self, now: float) -> str:
        """What the node looked like from here: silent, in rendezvous (only torchrun has spoken),
        quiet for a while, or ended."""
        if self.ended:
            return "ended" if self.exit_code is not None else f"ended ({self.error or 'no exit status'})"
        if not self.lines:
            return "silent since start"
        if not self.rank_lines:
            return "in rendezvous (no rank has printed yet)"
        return f"quiet for {now - self.last_line:.0f} s"


def waiting_report(outcomes: dict[str, NodeOutcome], now: float, quiet_s: float) -> str:
    """One line: which nodes the run waits for, grouped by state (nodes in inventory order)."""
    groups: dict[str, list[str]] = {}
    for name, out in outcomes.items():
        if not out.ended:
            state = out.state(now)
            groups.setdefault("quiet" if state.startswith("quiet") else state, []).append(name)
    parts = [f"{state}: {compact(names)}" for state, names in groups.items()]
    return f"waiting: no rank has printed for {quiet_s:.0f} s; " + "; ".join(parts)


@dataclass
class RunResult:
    exit_code: int
    outcomes: dict[str, NodeOutcome]
    first_failure: str | None = None
    interrupted: str | None = None
    summary: str = ""
    extra: dict = field(default_factory=dict)


#: RunResult.interrupted when the run ended because stdout's reader went away
CLOSED_STDOUT = "closed stdout"
#: ... because the connection holder it ran over ended (``hold --stop``, or it died)
HOLDER_GONE = "the connection holder's end"


class Printer:
    """Prefixes every line with host and global rank, one colour per node, one line at a time.

    torchrun (``--tee``) tags each rank's lines with its local rank; with static rendezvous the
    global rank is the node's offset (the procs of all lower node ranks) plus the local rank.
    Lines from torchrun itself carry the node rank only. With c10d rendezvous torchrun assigns the
    node ranks at run time, so neither is known here: lines show the local rank (``node2 l1|``)
    and torchrun's own lines no rank (``node2 --|``).
    """

    def __init__(self, plan: Plan, stream: TextIO | None = None, color: bool | None = None, verbose: bool = False):
        self.stream = stream or sys.stdout
        self.run_id = plan.run_id
        self.verbose = verbose  # every line as it comes: nothing folded, nothing held
        self.held: dict[tuple[str, int | None], list[str]] = {}  # (node, local rank) -> an open traceback
        self.folded = 0  # lines folded (torchrun's failure reports, the tracebacks of ranks that lost a peer)
        self.folded_kinds: set[Fold] = set()  # which of those
        self.noise_shown: set[int | None] = set()  # the known noise shown once already (cause.NOISE)
        if color is None:
            color = self.stream.isatty() and os.environ.get("NO_COLOR") is None
        self.color = color
        self.width = max(len(n.name) for n in plan.nodes)
        self.rank_width = len(str(plan.world_size - 1))
        self.local_only = getattr(plan, "rdzv", "static") == "c10d"
        self.nodes = {n.name: n for n in plan.nodes}
        self.offset = {n.name: plan.first_rank(n.name) for n in plan.nodes}
        self.lock = threading.Lock()
        self.closed = False  # the reader of the stream went away (`| head`): the rest is dropped

    def _write(self, text: str) -> None:
        """*text* on the stream; once its reader has gone, nothing (the monitor then stops the job)."""
        with self.lock:
            if self.closed:
                return
            try:
                self.stream.write(text)
                self.stream.flush()
            except BrokenPipeError:
                self.closed = True

    def prefix(self, node: str, rank: int | None) -> str:
        n = self.nodes[node]
        if self.local_only:
            who = f"l{rank:<{self.rank_width}}" if rank is not None else "-" * (self.rank_width + 1)
        else:
            who = f"r{rank:<{self.rank_width}}" if rank is not None else f"n{n.node_rank:<{self.rank_width}}"
        text = f"{node:<{self.width}} {who}|"
        if self.color:
            text = f"\x1b[{COLORS[n.node_rank % len(COLORS)]}m{text}\x1b[0m"
        return text

    def line(self, node: str, text: str, fold: Fold = Fold.SHOW, local: int | None = None) -> None:
        """*text* from *node*, as its :class:`~ddpfab.launch.cause.CauseReader` classed it (*fold*,
        for the line of *local* rank, None: torchrun's): shown, held with its traceback, or folded."""
        if self.verbose or fold is Fold.SHOW:
            self._show(node, text)
            return
        key = (node, local)
        if fold is Fold.HOLD:
            self.held.setdefault(key, []).append(text)
        elif fold is Fold.RELEASE:
            for held in self.held.pop(key, []):
                self._show(node, held)
            self._show(node, text)
        elif fold is Fold.NOISE:
            if noise_of(text) not in self.noise_shown:
                self.noise_shown.add(noise_of(text))
                self._show(node, text)
        else:  # DROP, FOLD: a dropped traceback is a victim rank's, or torchrun's own (no rank)
            self.folded += len(self.held.pop(key, [])) + 1
            self.folded_kinds.add(Fold.FOLD if fold is Fold.DROP and local is None else fold)

    def flush(self, node: str, stopped: bool = False) -> None:
        """What is still held of *node*'s output (its stream ended inside a traceback): shown; but
        on a node ddpfab *stopped*, torchrun's own traceback cut off by the stop is folded, as its
        whole report of the stop signal is (a rank's is shown: it may be its own failure's)."""
        for key in [k for k in self.held if k[0] == node]:
            lines = self.held.pop(key)
            if stopped and key[1] is None:
                self.folded += len(lines)
                self.folded_kinds.add(Fold.FOLD)
                continue
            for held in lines:
                self._show(node, held)

    def folded_note(self) -> None:
        """One line saying what was folded, and where it is, when anything was."""
        if self.folded:
            kinds = [what for fold, what in ((Fold.FOLD, "torchrun's reports, tracebacks and notices"),
                                             (Fold.DROP, "the tracebacks of ranks that lost their peer"))
                     if fold in self.folded_kinds]
            self.note(f"{self.folded} lines folded ({', '.join(kinds)}): the node logs keep them "
                      f"(`ddpfab logs {self.run_id}`); {option('verbose', True)} shows them")

    def _show(self, node: str, text: str) -> None:
        rank = None
        tag = RANK_TAG.match(text)
        if tag:
            rank = int(tag.group(1)) + (0 if self.local_only else self.offset[node])
            # torchrun relays a rank's log file by lines as it finds them, so a line the rank has
            # written in pieces (ranks run unbuffered: print("READY", 2) is four writes) can be
            # relayed as pieces, each tagged: "[default0]:READY[default0]: 2". One line again.
            text = text[tag.end():].replace(tag.group(0), "")
        self._write(f"{self.prefix(node, rank)} {text}\n")

    def note(self, text: str) -> None:
        self._write(f"ddpfab: {text}\n")


class _NodeJob:
    gate: Gate | None = None  # --wait's go (set per job; none for a job made without __init__)
    debugger: Debugger | DapForwarder | None = None  # --pdb's or --debugpy's (likewise)

    def __init__(self, plan: Plan, node: NodePlan, conn: Connection, printer: Printer, log: BinaryIO,
                 events: queue.SimpleQueue, reconnect: Callable[[str], Connection] | None = None,
                 gate: Gate | None = None, debugger: Debugger | DapForwarder | None = None,
                 session: nodeprog.Session | None = None):
        self.plan, self.node, self.conn, self.printer = plan, node, conn, printer
        self.session = session  # its preparation's, to go on as the supervisor (else one opened here)
        self.log, self.events, self.reconnect = log, events, reconnect
        self.gate, self.debugger = gate, debugger
        self.outcome = NodeOutcome(node.name, node.node_rank)
        self.chan = None
        self.thread = threading.Thread(target=self._run, name=f"node-{node.name}", daemon=True)
        self.done = threading.Event()
        self.reported = threading.Event()
        self.fast_stop, self.fast_why = False, b""
        self.ping_pending_since: float | None = None

    def start(self) -> None:
        self.thread.start()
        threading.Thread(target=self._heartbeat, name=f"beat-{self.node.name}", daemon=True).start()

    def _heartbeat(self) -> None:
        """Heartbeat bytes for the supervisor, keepalive requests for sshd, until the job ends.

        A keepalive that sshd does not answer (``ping_pending_since`` grows old) means the node or
        the network to it is gone; the monitor reads that and declares the node lost.
        """
        transport = self.conn.transport
        while not self.done.is_set():
            began = time.monotonic()
            chan = self.chan
            if chan is not None and not self.outcome.stopped_by_ddpfab:
                try:
                    chan.send(b"\n")
                except Exception:  # noqa: BLE001 - the job thread reports a dead channel
                    pass
            self.ping_pending_since = began
            try:
                transport.global_request("keepalive@openssh.com", wait=True)
            except Exception:  # noqa: BLE001
                return
            self.ping_pending_since = None
            if not transport.is_active():
                return
            self.done.wait(max(0.0, HEARTBEAT_S - (time.monotonic() - began)))

    def _result_record(self) -> dict | None:
        return result_record(self.conn, self.node)

    def lost_for(self) -> float:
        since = self.ping_pending_since
        return 0.0 if since is None else time.monotonic() - since

    def send(self, data: bytes) -> None:
        """*data* to the supervisor's stdin (a dead channel is the job thread's to report)."""
        chan = self.chan
        if chan is not None and not self.outcome.stopped_by_ddpfab:
            try:
                chan.sendall(data)
            except Exception:  # noqa: BLE001
                pass

    def stop(self, fast: bool = False, why: bytes = b"") -> None:
        """Ask the node's supervisor to end the job: close our write side (EOF on its stdin),
        after a ``!`` when *fast* (another node failed, a hang: no point in a graceful shutdown),
        with *why* (a key of :data:`ddpfab.node.agent.FAST_STOPS`; none: another node failed)."""
        self.outcome.stopped_by_ddpfab = True
        self.fast_stop, self.fast_why = fast, why
        chan = self.chan
        if chan is not None:
            try:
                if fast:
                    chan.sendall(b"!" + why)
                chan.shutdown_write()
            except Exception:  # noqa: BLE001 - a dead channel is already a stopped one
                pass

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass

    def _line(self, text: str) -> None:
        self.outcome.lines += 1
        tag = RANK_TAG.match(text)
        if tag:
            self.outcome.rank_lines += 1
            self.outcome.last_rank_line = self.outcome.last_line
            if self.debugger is not None:  # a rank that stops in pdb says so in a line of its own
                self.debugger.saw(self.node.name, text[tag.end():])
        known = len(self.outcome.signatures)
        fold, local = self.outcome.causes.feed(text)
        if tag and fold is Fold.SHOW:  # the job's own output: it moves (a victim's traceback does not count)
            self.outcome.last_progress = self.outcome.last_line
        self.printer.line(self.node.name, text, fold, local)
        if self.gate is not None:
            self.gate.saw(self.node.name, text)
        self.outcome.hints += [sig.hint for sig in self.outcome.signatures[known:]]

    def _run(self) -> None:
        """The node's whole life on the controller; whatever goes wrong here is this node's
        failure, reported like any other (the monitor always hears that the node ended)."""
        out = self.outcome
        out.started = time.time()
        try:
            self._stream(out)
        except Exception as exc:  # noqa: BLE001 - reported as this node's failure
            out.error = out.error or f"{type(exc).__name__}: {exc}"
        finally:
            out.ended = time.time()
            if out.exit_code not in (None, 0, CANNOT_START) and out.error is None:
                # before the monitor decides: the first worker its supervisor saw fail (a rank killed
                # by a signal prints nothing), and did the job fail only after every rank had finished?
                out.remote = self._result_record()
            out.cause = ranked(self.plan, self.node, node_cause(out.causes, out.remote))
            # a node whose job failed on its own before the stop came is no node ddpfab stopped (as
            # blame_outcomes has it): whatever of its output is held may be the failure's trace
            on_its_own = (out.remote or {}).get("failed_at") is not None or (out.cause is not None and out.cause.own)
            self.printer.flush(self.node.name, stopped=out.stopped_by_ddpfab and not on_its_own)
            self.done.set()
            self.events.put(self.node.name)  # first: the monitor may have others to stop
        try:
            if out.remote is None and out.exit_code != CANNOT_START and not out.lost:
                out.remote = self._result_record()
                if out.remote is None:
                    out.cleanup = self._clean_up_after_supervisor()
        except Exception as exc:  # noqa: BLE001 - the record is informative; the exit code is what counts
            out.cleanup = f"could not check the node afterwards: {type(exc).__name__}: {exc}"
        finally:
            self.reported.set()

    def _stream(self, out: NodeOutcome) -> None:
        log = self.log
        with log:
            arrival = self.gate.arrival if self.gate else None
            if self.session is not None:  # its program runs: it only has to be told to supervise
                spec = {**agent_spec(self.plan, self.node, arrival=arrival), "adopted": True}
                chan = self.session.take_over({"op": "supervise", "spec": spec})
            else:
                chan = self.conn.transport.open_session(timeout=30)
                chan.set_combine_stderr(True)
                chan.exec_command(remote_command(self.plan, self.node))
                chan.sendall(agent_input(self.plan, self.node, arrival=arrival))
            self.chan = chan
            if out.stopped_by_ddpfab:  # a stop that came while the channel was opening
                self.stop(self.fast_stop, self.fast_why)

            def logged(data: bytes) -> None:
                log.write(data)
                log.flush()

            for line in streams.lines(chan.recv, on_chunk=logged):
                out.last_line = time.monotonic()
                self._line(line)
            out.exit_code = chan.recv_exit_status()
            if out.exit_code == -1:
                out.exit_code = None
                if heldconn.holder_gone(chan):
                    out.holder_gone = True
                    out.error = out.error or ("its link went through the connection holder, which ended "
                                              "(`ddpfab hold --stop`, or it died)")
                out.error = out.error or ("the node supervisor ended without an exit status (killed?)"
                                          if self.conn.transport.is_active() else
                                          "the SSH session ended without an exit status (connection lost)")

    def _clean_up_after_supervisor(self) -> str:
        """The supervisor left no result: it was killed or never started. Whatever of the job is
        left on the node is ended by its marker, over a fresh connection (the old one may be the
        reason it is gone). Returns what the node said."""
        conn = self.reconnect(self.node.name) if self.reconnect else self.conn
        try:
            return nodeprog.stop(conn, self.node, self.node.remote_dir, STOP_GRACE_S, timeout=STOP_WAIT_S + 5)[0]
        finally:
            if conn is not self.conn:
                conn.close()


def result_record(conn: Connection, node: NodePlan) -> dict | None:
    """The node supervisor's ``result.json`` of the run (restarts, why it stopped, an exit race),
    None when there is none or it cannot be read."""
    try:
        res = ssh.run(conn, node.name, f"cat {shlex.quote(node.remote_dir)}/result.json", timeout=10)
        record = json.loads(res.stdout) if res.exit_code == 0 else None
        return record if isinstance(record, dict) else None  # records are data: an object, or nothing
    except Exception:  # noqa: BLE001 - the record is informative; the exit code is what counts
        return None


def exit_race_of(code: int | None, record: dict | None) -> dict | None:
    """A node's exit race (its supervisor's word that the job failed only after every rank of the
    node had finished its work), from its exit code and result record; None when it is not one."""
    race = (record or {}).get("exit_race")
    return race if code not in (None, 0) and isinstance(race, dict) else None


def stop_signal_of(code: int | None, record: dict | None, cause: Cause | None) -> int | None:
    """The signal that stopped a node's supervisor (its result record's ``stop_signal``, as data)
    when the node's job did not fail on its own first (no ``failed_at``, no rank's own cause);
    None else, and for a node that exited 0."""
    sig = (record or {}).get("stop_signal")
    if code in (None, 0) or type(sig) is not int or (record or {}).get("failed_at") is not None:
        return None
    return None if cause is not None and cause.own else sig


def stopped_from_outside_line(signals: dict[str, int], cancelled: bool = False) -> str:
    """The closing line of a job stopped from outside the run (node -> the signal its supervisor
    got): ``stopped from outside on node[1-4] (SIGTERM to their supervisors: `ddpfab stop`, or a
    kill); the job was stopped on every node``. *cancelled*: those supervisors were still waiting
    for GPUs (``--wait``): the job never started."""
    names = sorted({name_of_signal(s) for s in signals.values()})
    whose = "its supervisor" if len(signals) == 1 else "their supervisors"
    end = ("the job was cancelled while it waited for GPUs (it never started)" if cancelled
           else "the job was stopped on every node")
    # what sends each: `ddpfab stop` TERMs; a Ctrl-C where a supervisor runs in a terminal (a job
    # started by hand from plan --emit's scripts) INTs it; a closed terminal HUPs it
    senders = {signal.SIGTERM: "`ddpfab stop`", signal.SIGINT: "Ctrl-C in its terminal",
               signal.SIGHUP: "its terminal closed"}
    said = [senders[s] for s in sorted(set(signals.values())) if s in senders] + ["a kill"]
    return (f"stopped from outside on {compact(list(signals))} ({', '.join(names)} to {whose}: "
            f"{', or '.join(said)}); {end}")


def cancelled_waiting(outcomes: Iterable[NodeOutcome]) -> bool:
    """Whether every one of *outcomes* (every node's: the job never started anywhere) is a
    ``--wait`` cancelled before its job started (its supervisor's record says ``cancelled``)."""
    return all((o.remote or {}).get("cancelled") is True for o in outcomes)


def ranked(plan: Plan, node: NodePlan, cause: Cause | None) -> Cause | None:
    """*cause* with its global rank: torchrun's, else the node's offset plus the local rank
    (static rendezvous only: with c10d the node's offset is torchrun's to decide)."""
    if cause is not None and cause.rank is None and cause.local_rank is not None and plan.rdzv == "static":
        return replace(cause, rank=plan.first_rank(node.name) + cause.local_rank)
    return cause


def ended_by_itself(remote: dict | None) -> bool:
    """The supervisor's record (read as data) says it stopped nothing: the job ended by itself."""
    return isinstance(remote, dict) and remote.get("stopped") is None and remote.get("stop_signal") is None \
        and "exit_code" in remote


def node_cause(causes: CauseReader, remote: dict | None) -> Cause | None:
    """A node's cause from its output (*causes*) and its supervisor's record (*remote*): the one
    reading run's monitor and attach share."""
    return causes.cause((remote or {}).get("failed_worker"), unstopped=ended_by_itself(remote))


def supervisor_text(remote: dict | None) -> str:
    """What the node's supervisor record says ended its job, for the closing line when torchrun's
    output named no failing rank: the first worker it saw fail (:func:`failed_worker_text`), else
    torchrun itself killed by a signal (:func:`launcher_text`); "" when it says neither."""
    remote = remote or {}
    return failed_worker_text(remote.get("failed_worker")) or launcher_text(remote.get("launcher"))


def launcher_signal(record: object) -> int | None:
    """The signal the supervisor record's ``launcher`` (``{"pid", "signal"}``: torchrun itself
    killed by a signal nobody on the node sent) names, read as data; None else."""
    if not isinstance(record, dict) or type(record.get("pid")) is not int or type(record.get("signal")) is not int:
        return None
    return record["signal"] if 0 < record["signal"] < 128 and record["pid"] > 0 else None


def launcher_text(record: object) -> str:
    """``torchrun (pid 812) was killed by signal 9 (SIGKILL); its ranks were ended with it``, or ""."""
    sig = launcher_signal(record)
    if sig is None or not isinstance(record, dict):
        return ""
    return (f"torchrun (pid {record['pid']}) was killed by signal {sig} ({name_of_signal(sig)}); its ranks were "
            "ended with it")


def failed_worker_text(record: object) -> str:
    """The supervisor's ``failed_worker`` record (``{"pid", "signal"|"exit"}``), read as data, for
    the closing line when torchrun's output named no failing rank (the supervisor ended the job
    before torchrun's summary): ``a worker (pid 597) was killed by signal 6 (SIGABRT)``; "" else."""
    if not isinstance(record, dict) or type(record.get("pid")) is not int:
        return ""
    pid, sig, code = record["pid"], record.get("signal"), record.get("exit")
    if type(sig) is int:
        try:
            name = f" ({signal.Signals(sig).name})"
        except ValueError:
            name = ""
        return f"a worker (pid {pid}) was killed by signal {sig}{name}"
    if type(code) is int:
        return f"a worker (pid {pid}) exited with {code}"
    return ""


def found_signatures(outcomes: Mapping[str, NodeOutcome]) -> list[tuple[str, hints.Signature]]:
    """(node, signature) for each known failure signature each node's output showed."""
    return [(name, sig) for name, o in outcomes.items() for sig in o.signatures]


def seen_text(found: list[tuple[str, hints.Signature]]) -> str:
    """What a closing line ends with when the output showed known signatures *found*
    (``; seen: CUDA out of memory on node2``), else nothing."""
    seen = "; ".join(f"{sig.what} on {', '.join(nodes)}" for sig, nodes in hints.seen_on(found))
    return f"; seen: {seen}" if seen else ""


def verdict_hints(verdict: Blame, out: NodeOutcome, found: list[tuple[str, hints.Signature]] | None = None,
                  node_hints: Mapping[str, str] | None = None) -> list[str]:
    """The hints after a failure's closing line (run's and attach's): what the known failure
    signatures *found* in the output mean, what sends the signal that killed the rank named (*out*:
    its node's outcome), and what that node's facts showed odd (*node_hints*)."""
    extra = [story.signal_hint(verdict.cause, verdict.node, launcher_signal((out.remote or {}).get("launcher")),
                               no_oom_seen(out.remote, verdict.cause)),
             (node_hints or {}).get(verdict.node or "") if verdict.own or verdict.cause is None else None]
    return hints.verdict_lines(found or []) + [h for h in extra if h]


def no_oom_seen(remote: dict | None, cause: Cause | None) -> bool:
    """The supervisor read its node's kernel log after *cause*'s rank was killed, and it names no
    OOM kill of it (its ``failed_worker`` record's ``oom`` is false, for that local rank)."""
    worker = remote.get("failed_worker") if isinstance(remote, dict) else None
    return (isinstance(worker, dict) and worker.get("oom") is False and worker.get("signal") == signal.SIGKILL
            and type(worker.get("signal")) is int and cause is not None and type(cause.local_rank) is int
            and type(worker.get("local_rank")) is int and worker.get("local_rank") == cause.local_rank)


def blame_outcomes(outcomes: dict[str, NodeOutcome], addresses: dict[str, str], detected: str | None,
                   nprocs: dict[str, int] | None = None) -> Blame:
    """Whose failure ended the run (:func:`ddpfab.launch.cause.blame`): among the nodes that failed
    on their own (their supervisor's ``failed_at``, the node's clock; a node without one, lost or
    its supervisor gone, counts at the time ddpfab saw it end when it was the first seen; a node
    whose output shows a rank's own failure though its stop came first), the rank whose cause is
    its own outranks every victim. A node whose job failed on its own is never "stopped by ddpfab".
    *nprocs*: node -> its ranks (the plan's), for which node is a victim as a whole."""
    nodes = []
    for name, out in outcomes.items():
        failed_at = (out.remote or {}).get("failed_at")
        own = out.cause is not None and out.cause.own and out.exit_code not in (None, 0)
        if out.failed and (failed_at is not None or own):
            out.stopped_by_ddpfab = False
        nodes.append(NodeFailure(name, out.node_rank, failed_at if failed_at is not None else out.ended, out.cause,
                                 out.causes.rank_kinds(), out.causes.peers(),
                                 failed=out.failed and (failed_at is not None or own or name == detected),
                                 ranks=(nprocs or {}).get(name, 1)))
    return blame(nodes, addresses)


#: Seconds within which a second Ctrl-C stops a job whose rank this terminal drives in pdb (the
#: first is held: :meth:`_Monitor._held_at_prompt`).
CONFIRM_S = 3.0
#: Seconds the others get to report a failure of their own when the first node to fail shows only
#: a victim's (a rank that lost its peer): the rank that crashed ends its node a moment later.
SETTLE_S = 3.0


class _Settle:
    """When the monitor stops the others after a failure: at once, unless the failed node's rank
    is known to have only lost its peer or been stopped: then after SETTLE_S (so the node whose rank crashed
    reports its own failure, and its last lines, before it is stopped)."""

    def __init__(self) -> None:
        self.first: str | None = None  # the first failed node seen (a victim's, while settling)
        self.deadline: float | None = None

    def failed(self, name: str, out: NodeOutcome) -> bool:
        """A node failed: True when the others are to be stopped now (all but a known victim)."""
        if out.cause is None or out.cause.kind is None or out.cause.own or out.error is not None:
            self.deadline = None
            return True
        if self.first is None:
            self.first, self.deadline = name, time.monotonic() + SETTLE_S
        return False

    def expired(self, now: float) -> bool:
        """The settling time is over with no failure of a rank's own: stop the others now."""
        if self.deadline is None or now < self.deadline:
            return False
        self.deadline = None
        return True


def execute(plan: Plan, conns: dict[str, Connection], log_dir: Path, printer: Printer,
            reconnect: Callable[[str], Connection] | None = None,
            node_hints: Mapping[str, str] | None = None,
            sessions: Mapping[str, nodeprog.Session] | None = None) -> RunResult:
    """Run *plan* on the open connections; block until every node is done; never leave one running.
    *reconnect(name)* opens a fresh connection to a node (to clean up after a lost supervisor);
    *node_hints*: node -> what the closing lines add when that node is the one named (what its
    facts showed odd: :func:`ddpfab.health.packages.failure_hints`); *sessions*: node -> its
    preparation's session, which becomes its supervisor (``ddpfab.launch.runner.supervisors_to_be``;
    the other nodes' supervisors start in sessions of their own)."""
    sessions = sessions or {}
    events: queue.SimpleQueue = queue.SimpleQueue()  # (put by a signal handler too: see _monitor)
    logs = {}
    try:  # every node's local log before any node starts: a node that cannot have one starts nothing
        for n in plan.nodes:
            path = log_dir / f"{n.name}.log"
            logs[n.name] = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "wb")
    except OSError as exc:
        for log in logs.values():
            log.close()
        why = f"host {n.name}: cannot create its local log {path}: {exc.strerror or exc}; nothing was started"
        printer.note(why)
        return RunResult(2, {m.name: NodeOutcome(m.name, m.node_rank) for m in plan.nodes}, n.name, None, why)
    jobs: dict[str, _NodeJob] = {}

    def to_all(data: bytes) -> None:
        for job in jobs.values():
            job.send(data)

    gate = Gate([n.name for n in plan.nodes if n.gpus], to_all) if plan.wait else None
    transports = {n.name: (lambda c=conns[n.name]: c.transport) for n in plan.nodes}
    debugger: Debugger | DapForwarder | None = None
    if plan.pdb:
        debugger = Debugger(plan, transports, printer.note)
    elif plan.debugpy:
        debugger = DapForwarder(plan, transports, printer.note, str(log_dir))
    jobs.update({n.name: _NodeJob(plan, n, conns[n.name], printer, logs[n.name], events, reconnect, gate, debugger,
                                  sessions.get(n.name)) for n in plan.nodes})
    stop_deadline: float | None = None

    def stop_all(fast: bool = False, why: bytes = b"") -> None:
        nonlocal stop_deadline
        if stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_WAIT_S
            for job in jobs.values():
                if job.outcome.ended == 0:
                    job.stop(fast, why)
            if isinstance(debugger, Debugger):  # after: the stops must not wait for its lock
                debugger.stopping()

    hang = HangWatch(plan, conns, log_dir, printer.note) if plan.hang_timeout > 0 else None
    with signals_raise():
        try:
            return _Monitor(jobs, events, printer, stop_all, lambda: stop_deadline, hang, debugger,
                            node_hints).run()
        finally:
            if debugger is not None:
                debugger.close()


class _Monitor:
    """The run's monitor: wait for every node; stop them all on the first failure, on SIGINT/SIGTERM,
    or on a hang verdict with ``--on-hang stop``. One loop (:meth:`run`) of small steps: an event
    (a node ended: :meth:`ended`; a signal: :meth:`interrupt`), or a tick every 0.1 s without one
    (:meth:`tick`: lost links, the waiting report, the hang watch, the settling time, the stop
    deadline); then the closing line (:meth:`result`)."""

    def __init__(self, jobs: dict[str, _NodeJob], events: queue.SimpleQueue, printer: Printer, stop_all,
                 stop_deadline, hang: HangWatch | None = None, debugger: Debugger | DapForwarder | None = None,
                 node_hints: Mapping[str, str] | None = None):
        self.jobs, self.events, self.printer = jobs, events, printer
        self.node_hints = dict(node_hints or {})
        self.stop_all, self.stop_deadline, self.hang, self.debugger = stop_all, stop_deadline, hang, debugger
        self.pending = set(jobs)
        nodes = next(iter(jobs.values())).plan.nodes if jobs else ()
        self.addresses = {n.name: n.data_addr for n in nodes}
        self.nprocs = {n.name: n.nproc for n in nodes}
        self.settle = _Settle()
        self.hung: list[str] | None = None  # the doctor's verdict when the hang watch stopped the job
        self.interrupted: str | None = None
        self.from_outside: dict[str, int] = {}  # node -> the signal that stopped it from outside the run
        self.first_failure: str | None = None
        self.extra_wait: float | None = None  # after the stop deadline: the dropped links' last chance
        self.wait_base = float(os.environ.get("DDPFAB_WAIT_REPORT_S", WAIT_REPORT_S))
        self.wait_every, self.quiet_since, self.next_report = self.wait_base, None, 0.0
        self.in_pdb_at = 0.0  # when a rank was last seen in the debugger (monotonic)
        self.held_sigint_at = -CONFIRM_S  # when a Ctrl-C at a pdb prompt was last held (_held_at_prompt)
        self.signals = Taken()  # what signals_queued took while the loop ran
        self.started = 0.0

    def run(self) -> RunResult:
        try:
            self.started = time.monotonic()
            for job in self.jobs.values():
                job.start()
            with signals_queued(self.events, self.signals):  # a signal is taken in the loop, never inside a lock
                while self.pending:
                    try:
                        self.step()
                    except Interrupted as exc:
                        self.interrupt(exc)
            while not self.events.empty():  # a signal that came as the last node ended: the run was interrupted
                late = self.events.get()
                if isinstance(late, Interrupted) and self.interrupted is None:
                    self.interrupted = late.name
            for job in self.jobs.values():  # their supervisors' result records, fetched after the stop
                job.reported.wait(timeout=STOP_WAIT_S + 10)
        finally:
            for job in self.jobs.values():
                job.close()
        return self.result()

    def step(self) -> None:
        if self.printer.closed and self.interrupted is None:  # `| head` had enough: as an interrupt
            self.interrupted = CLOSED_STDOUT
            self.stop_all()
            sys.stderr.write("ddpfab: stdout was closed: stopping the job on every node\n")
        try:
            name = self.events.get(timeout=0.1)
        except queue.Empty:
            return self.tick()
        if isinstance(name, Interrupted):
            raise name
        return self.ended(name)

    def ended(self, name: str) -> None:
        """Node *name*'s job ended: a failure of its own stops the others (after settling, for a victim)."""
        self.pending.discard(name)
        out = self.jobs[name].outcome
        if out.holder_gone and self.interrupted is None and self.first_failure is None and not self.from_outside:
            # every link went with it: no node failed (a failure or a stop that came first tells its own story)
            self.interrupted = HOLDER_GONE
            self.printer.note("the connection holder ended (`ddpfab hold --stop`, or it died): this run's links to "
                              "the nodes went with it; each node's supervisor stops the job as its link ends")
            self.stop_all(fast=True, why=agent.HOLDER_ENDED)
            return
        sig = out.stopped_from_outside
        if sig is not None and self.interrupted is None:
            # `ddpfab stop` from elsewhere: a stop, unless a rank failed on its own (result() decides:
            # a victim that lost its peer to the stop comes first as often as not)
            if not self.from_outside and self.stop_deadline() is None:
                self.printer.note(f"{name}: stopped from outside this run ({name_of_signal(sig)} to its supervisor); "
                                  "stopping the job on every node")
                self.stop_all(fast=True, why=agent.STOPPED_OUTSIDE)
            self.from_outside[name] = sig
            return
        if out.failed and self.interrupted is None and not out.stopped_by_ddpfab and self.stop_deadline() is None:
            self.first_failure = self.first_failure or name
            if self.settle.failed(name, out):
                self.printer.note(story.live_line(name, out, self.addresses))
                self.stop_all(fast=True)

    def interrupt(self, exc: Interrupted) -> None:
        if self.interrupted is not None:  # a second signal: leave now (run's finally closes every link)
            raise exc
        if self._held_at_prompt(exc):
            return
        self.interrupted = exc.name
        self.stop_all()  # first: the note can block on a stdout nobody reads
        self.printer.note(f"{self.interrupted}: stopping the job on every node")

    def _held_at_prompt(self, exc: Interrupted) -> bool:
        """A Ctrl-C while this terminal drives a rank's pdb is held, not a stop: in pdb it is a
        habit (a new prompt, or a break back in after ``c``), and the job is worth keeping. A second
        one within :data:`CONFIRM_S` stops the job, as ever."""
        attached = self.debugger.attached if isinstance(self.debugger, Debugger) else None
        if exc.signum != signal.SIGINT or attached is None:
            return False
        now = time.monotonic()
        if now - self.held_sigint_at <= CONFIRM_S:
            return False
        self.held_sigint_at = now
        self.signals.forget()  # (the next one comes through the loop too, not raised wherever it lands)
        self.printer.note(f"pdb: Ctrl-C while {attached.describe()} is in the debugger does not stop the job: "
                          f"Ctrl-C again within {CONFIRM_S:g} s stops it on every node; `q` quits the rank, "
                          "`c` lets it go on")
        return True

    def tick(self) -> None:
        self.mark_lost()
        now = time.monotonic()
        last = self.last_activity(now)
        self.report_waiting(now, last)
        self.watch_hang(now, last)
        if self.settle.expired(now) and self.stop_deadline() is None:
            first = self.settle.first
            self.printer.note(story.live_line(first, self.jobs[first].outcome, self.addresses, settled=SETTLE_S))
            self.stop_all(fast=True)
        self.enforce_deadline()

    def mark_lost(self) -> None:
        for n in self.pending:
            job = self.jobs[n]
            if job.outcome.error is None and job.lost_for() > LOST_AFTER_S:
                job.outcome.error = f"lost: no answer from its sshd for {LOST_AFTER_S:g} s (host down or network cut)"
                job.outcome.lost = True
                job.close()  # unblocks its reader; its supervisor stops on silence

    def last_activity(self, now: float) -> float:
        """When a rank last printed (or the run started, or a rank was last in a debugger)."""
        if self.debugger is not None and self.debugger.stopped():
            # the others wait for a rank in a debugger in their next collective: not quiet, not
            # hung; a quiet spell starts when the debugger is left
            self.in_pdb_at = now
        return max([self.started, self.in_pdb_at] + [j.outcome.last_rank_line for j in self.jobs.values()])

    def report_waiting(self, now: float, last: float) -> None:
        if last != self.quiet_since:  # a rank printed: the next report is a full interval away
            self.quiet_since, self.wait_every, self.next_report = last, self.wait_base, last + self.wait_base
        if self.wait_base > 0 and self.stop_deadline() is None and now >= self.next_report:
            self.printer.note(waiting_report({n: j.outcome for n, j in self.jobs.items()}, now, now - last))
            self.wait_every *= 2  # a growing interval: a long wait is not a wall of notes
            self.next_report = now + self.wait_every

    def watch_hang(self, now: float, last: float) -> None:
        # armed once a rank has printed: init_process_group is behind every rank then (before it,
        # ranks still importing are not hung; the waiting lines cover that)
        if self.hang is None or self.stop_deadline() is not None:
            return
        if not any(j.outcome.rank_lines for j in self.jobs.values()):
            return
        self.hang.tick(last, now)
        if self.hang.stop_now.is_set() and self.hang.verdict is not None and self.hung is None:
            self.hung = self.hang.verdict.lines
            self.printer.note(f"{option('on_hang', 'stop')}: stopping the job on every node")
            self.stop_all(fast=True, why=agent.HUNG)

    def enforce_deadline(self) -> None:
        deadline = self.extra_wait or self.stop_deadline()
        if deadline is not None and time.monotonic() > deadline:
            for n in self.pending:  # unresponsive: drop the link; the supervisor sees EOF
                self.jobs[n].outcome.error = self.jobs[n].outcome.error or "did not stop in time"
                self.jobs[n].close()
            self.extra_wait = time.monotonic() + 5

    def result(self) -> RunResult:
        outcomes = {n: j.outcome for n, j in self.jobs.items()}
        for name, out in outcomes.items():
            # (after a holder's end the supervisors were still stopping when asked for their record)
            if out.cleanup and not out.holder_gone:
                self.printer.note(f"{name}: its node supervisor left no record; cleanup there: {out.cleanup}")
        self.printer.folded_note()
        verdict = (blame_outcomes(outcomes, self.addresses, self.first_failure, self.nprocs)
                   if not self.interrupted and not self.hung else Blame(self.first_failure))
        stopped = self.from_outside and not self.interrupted and not self.hung and not verdict.own
        if stopped:  # no rank failed on its own: its victims are the stop's
            verdict = Blame(None)
        code, summary = self.closing(outcomes, verdict)
        interrupted = self.interrupted  # a stop from outside is one too: no restart follows it
        if stopped:
            interrupted = name_of_signal(next(iter(self.from_outside.values())))
        # the node the line leads with, where the victims point, is the run's first failure
        lead = story.leading(verdict, {n: o for n, o in outcomes.items() if n != verdict.node})
        return RunResult(code, outcomes, lead or verdict.node, interrupted, summary)

    def closing(self, outcomes: dict[str, NodeOutcome], verdict: Blame) -> tuple[int, str]:
        """The run's exit code and closing line (with the notes that go before it)."""
        if self.interrupted == CLOSED_STDOUT:  # 128 + SIGPIPE, as a shell reports a writer whose reader went away
            return 141, "stdout was closed (its reader went away); the job was stopped on every node"
        if self.interrupted == HOLDER_GONE:
            return 1, ("the connection holder ended while this run followed the job (`ddpfab hold --stop`, or it "
                       "died); the job was stopped on every node (its supervisors stop it when their link ends)")
        if self.interrupted:
            return (130 if self.interrupted == "SIGINT" else 143,
                    f"interrupted by {self.interrupted}; the job was stopped on every node")
        if self.hung:
            return (EXIT_HUNG, f"hung: {'; '.join(self.hung)}; the job was stopped on every node "
                               f"({option('on_hang', 'stop')})")
        if self.from_outside and not verdict.node:  # (result(): no rank failed on its own) as a shell says it
            first = next(iter(self.from_outside.values()))
            signals = {n: self.from_outside[n] for n in outcomes if n in self.from_outside}
            return 128 + first, stopped_from_outside_line(signals, cancelled_waiting(outcomes.values()))
        if verdict.node:
            out = outcomes[verdict.node]
            found = found_signatures(outcomes)
            summary = story.closing_line(verdict, out, supervisor_text(out.remote),
                                         self.addresses, outcomes) + seen_text(found)
            hang = self.hang.standing(max((o.last_progress for o in outcomes.values()), default=0.0)) \
                if self.hang is not None and not verdict.own else None
            if hang is not None:  # the ranks' timeouts followed a hang the watch had found: it comes first
                summary = f"failed after a hang: {'; '.join(hang.lines)}; then {summary.removeprefix('failed: ')}"
            for line in story.other_nodes(outcomes, verdict.node, self.addresses):
                self.printer.note(line)
            for line in verdict_hints(verdict, out, found, self.node_hints):
                self.printer.note(f"hint: {line}")
            return (out.exit_code if out.exit_code not in (None, 0) else 1), summary
        if races := {n: o.exit_race for n, o in outcomes.items() if o.exit_race}:
            # the exit-code policy (ddpfab/cli/errors.py): the work is done, a warning says the rest
            self.printer.note(f"warning: {hints.exit_abort_hint()}")
            return 0, exit_race_summary(races)
        return 0, f"all {len(outcomes)} nodes exited 0"


def exit_race_summary(races: dict[str, dict]) -> str:
    """The closing line of a run whose ranks all finished their work, some node's job failing only
    after that (its supervisor's ``exit_race`` records, by node): ``all ranks finished their work;
    rank 3 (node2) aborted at exit (known upstream race)``."""
    aborted = [f"rank {a['rank']} ({name}) aborted at exit" + (f" (signal {a['signal']})" if "signal" in a else
                                                              f" (exit code {a['exit']})" if "exit" in a else
                                                              " (its exit status was reaped before it was seen)")
               for name, race in races.items() for a in race.get("aborted") or ()]
    if not aborted:  # the supervisor did not see which worker: the node's job failed after all its ranks finished
        aborted = [f"a rank of {name} aborted at exit" for name in races]
    return f"all ranks finished their work; {', '.join(aborted)} (known upstream race)"
