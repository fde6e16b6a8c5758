"""Why a run failed, read from its nodes' output as it streams: the one classifier of failures.

Each rank's first exception line (``RuntimeError: boom``), its argument parser's usage error, and
torchrun's "Root Cause" block (which rank failed first, its exit code, and, for a script decorated
with ``@record``, the traceback from the rank's error file) are read per node by
:class:`CauseReader`; the node supervisor's record of the first worker it saw fail (its signal, an
OOM kill) completes them. Each cause is classified (:class:`CauseKind`) as the rank's **own** (an
exception in its code, a usage error, a signal neither torchrun nor ddpfab sent, the OOM killer, a
non-zero exit) or **secondary** (a peer went away: gloo's "Connection closed by peer", NCCL's
"remote process exited", a timed-out collective, a store that lost its server; or a stop by torchrun
or ddpfab). :func:`blame` then names the rank whose cause is its own, first in time, and counts the
victims; a victim is never named as the cause, however early its error came (the peers of a rank
that crashed raise "connection closed" within milliseconds, often before the crash is reported).

The output is data: lines are matched against a few fixed shapes, bounded in length and number,
and nothing in them is ever executed or evaluated. What a rank printed reaches here through
torchrun's ``--tee`` as ``[default<local rank>]:<line>``; torch.distributed's excepthook may
prefix a rank's traceback lines with ``[rank<N>]: `` as well. torchrun's own lines carry no tag
(its own traceback, ending in ``ChildFailedError``, is never taken for the rank's).

The reader also tells the printer what each line is (:class:`Fold`), so the failure's story is
short: a victim's traceback, torchrun's failure report and its teardown log are folded (they stay
in the node logs), known harmless noise is shown once.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
from dataclasses import dataclass, field, replace
from enum import Enum

from ddpfab.health.hints import Signature, signature_of
from ddpfab.node.agent import name_of_signal

#: An exception line is cut to this many characters.
MAX_LINE = 300
#: Lines of the failing rank's traceback kept for the closing block.
TAIL_LINES = 15
#: A traceback held back from the printer is let through past this many lines (bounded memory).
MAX_HELD = 400
#: torchrun's tag on a rank's line (its local rank): the one parser of it (the printer, the
#: monitor and recovery use this).
RANK_TAG = re.compile(r"^\[default(\d+)\]:")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_TRACEBACK = "Traceback (most recent call last):"
#: How python reports a script it could not compile (SyntaxError, IndentationError): no header,
#: this line, the code and a caret, then the exception line.
_SYNTAX_REPORT = re.compile(r'^  File ".*", line \d+$')
#: ``RuntimeError: boom``, ``torch.OutOfMemoryError: ...``, ``KeyboardInterrupt``, a class of a
#: function's own (``main.<locals>.ConfigError: ...``).
_EXCEPTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_.<>]*(:.*)?$")
#: argparse's report of arguments it refused: ``usage: train.py ...`` then ``train.py: error: ...``.
_USAGE = re.compile(r"^usage: ")
_USAGE_ERROR = re.compile(r"^\S+: error: .+")
_ROOT = "Root Cause (first observed failure):"
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ROOT_TRACEBACK = re.compile(r"^\s*traceback\s*:\s?(.*)$")
_RULE = re.compile(r"^={20,}$")
#: torchrun's own exceptions: its report of a failed child, and the stop signal it was sent.
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "SignalException")
#: torchrun's log lines about ending its workers (glog format), after a failure.
_ELASTIC_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ \S*torch/distributed/elastic/(multiprocessing/|agent/server/api\.py"
                          r".*(death signal|shutting down))")
#: torchrun's log line for each worker failure it observes (one per attempt that failed, with
#: ``--max-restarts``): ``... api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 66) of binary: ...``.
_FAILED_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ \S*torch/distributed/elastic/multiprocessing/api\.py:\d+\] "
                         r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: \d+\)")
#: torchrun's log line for a stop signal it got: ``... api.py:753] Received 15 death signal,
#: shutting down workers`` (``Received Signals.SIGTERM ...`` in older versions).
_DEATH_SIGNAL = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ \S*torch/distributed/elastic/agent/server/api\.py:\d+\] "
                           r"Received (?:(\d+)|Signals\.(SIG\w+)) death signal")
#: torchrun's log record of an exit barrier it could not finish (the master's store went away, its
#: job failed elsewhere): this line, then the record's traceback, each line with the same prefix.
_EXIT_BARRIER = re.compile(r"^([IWE]\d{4} [\d:.]+\s+\d+ \S*torch/distributed/elastic/agent/server/api\.py:\d+\]) "
                           r"Error waiting on exit barrier")
#: A C++ exception's stack as torch prints it under a c10d warning of torchrun's own.
_CPP_STACK = re.compile(r"^(Exception raised from \S+ at .* \(most recent call first\):|frame #\d+: .*|"
                        r"<omitting python frames>)$")
#: Python's report of a log record its handler could not write (``logging.Handler.handleError``):
#: this line, the handler's traceback, ``Call stack:`` and the record, ending at its arguments (or
#: at the note that they could not be printed). torchrun writes one when the stop signal comes
#: while it logs its worker's failure.
_LOGGING_ERROR = "--- Logging error ---"
_LOGGING_ERROR_END = re.compile(r"^(Arguments: |Use the traceback above to help find the error\.)")
#: Known harmless noise: shown once per run (each).
NOISE = (re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved"),
         re.compile(r"Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"))
#: The frame of torchrun's OMP_NUM_THREADS notice (a blank line, rules of stars): folded.
_NOTICE_FRAME = re.compile(r"^(\*{20,})?\s*$")
#: Lines at column 0 skipped between a rank's traceback header and its first frame: the rank's
#: stdout and stderr reach torchrun's tee as two streams, so what it printed just before raising
#: can come there (the print before the raise between ``Traceback (most recent call last):`` and
#: its frames). A traceback always has a frame before its exception line. After a frame, a line
#: at column 0 that is not an exception's is the rank's stdout too (shown, the traceback stays
#: open), up to this many; an exception line after such a line must name an exception class
#: (``_CLASS``), so ``loss: 0.5`` after a cut-off traceback is not a cause.
#: Where torch marks the traceback's lines (``[rankN]:``, a rank with a process group), an
#: unmarked line is the rank's stdout wherever it comes.
INTERLEAVED = 3
#: An exception class by its name (after a stray line, where ``Loss: 0.5`` must not pass):
#: ``ValueError``, ``torch.OutOfMemoryError``, ``numpy.core._exceptions._ArrayMemoryError``,
#: ``main.<locals>.ConfigError``, ``KeyboardInterrupt``, ``SystemExit``, ``StopIteration``.
_CLASS = re.compile(r"^([A-Za-z_][A-Za-z0-9_<>]*\.)*_?[A-Z][A-Za-z0-9_]*"
                    r"(Error|Exception|Exit|Interrupt|Warning|Failure|Iteration|Timeout|Fault)(:|$)")

#: What a rank raises when a peer went away: gloo's, NCCL's and the c10d store's words for it (as
#: torch 2.x prints them), and a collective that timed out waiting for a rank that did not come.
PEER_LOST = tuple(re.compile(p) for p in (
    r"Connection closed by peer", r"Connection reset by peer", r"gloo/transport/\S+\] (Read|Write) error",
    r"remote process exited or there was a network error", r"\bncclRemoteError\b",
    r"NCCL communicator was aborted", r"Watchdog caught collective operation timeout",
    r"Process group watchdog thread terminated", r"Timed out waiting \d+ms for (recv|send) operation",
    r"failed to recv, got 0 bytes", r"\bSocket Timeout\b", r"recvValue failed", r"sendBytes failed",
    r"\bDistNetworkError\b",
    # a rank that could not reach a peer at its rendezvous: the peer gone (a restart after a failure)
    r"Gloo connectFullMesh failed",
))
#: The peer's address in gloo's words: ``... Connection closed by peer [10.0.0.12]:50096``.
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


#: A frame line of a traceback or of python's report of code it could not compile.
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')
#: What python raises for code it could not compile: the line names no place; the report's
#: frame line does.
_COMPILE_ERRORS = ("SyntaxError", "IndentationError", "TabError")


def _syntax_place(text: str, lines: list[str]) -> str:
    """`` (train.py, line 2)`` for a SyntaxError (and its kind) whose report named the place,
    else ""."""
    if text.strip().split(":", 1)[0].rsplit(".", 1)[-1] not in _COMPILE_ERRORS:
        return ""
    frames = [m for line in lines if (m := _FRAME.match(line))]
    return f" ({os.path.basename(frames[-1].group(1))}, line {frames[-1].group(2)})" if frames else ""


def noise_of(line: str) -> int | None:
    """Which known harmless noise *line* is (its index in :data:`NOISE`), None if none."""
    return next((i for i, p in enumerate(NOISE) if p.search(line)), None)


class CauseKind(str, Enum):
    """What ended a rank. The first five are the rank's own failure; the last two are secondary."""

    EXCEPTION = "exception"  # an exception raised in the rank
    USAGE = "usage"  # its argument parser refused the arguments (exit 2)
    SIGNAL = "signal"  # killed by a signal neither torchrun nor ddpfab sent (SIGKILL, SIGSEGV, SIGABRT)
    OOM = "oom"  # killed by the kernel's OOM killer
    EXIT = "exit"  # a non-zero exit without a traceback
    PEER_LOST = "peer_lost"  # a peer went away under it (connection closed, collective timed out)
    STOPPED = "stopped"  # ended by torchrun or ddpfab (SIGTERM) after another failure

    @property
    def own(self) -> bool:
        return self not in (CauseKind.PEER_LOST, CauseKind.STOPPED)


def kind_of_exception(line: str) -> CauseKind:
    """A rank's exception line: secondary when it is a peer's loss (:data:`PEER_LOST`), else its own."""
    return CauseKind.PEER_LOST if any(p.search(line) for p in PEER_LOST) else CauseKind.EXCEPTION


def kind_of_signal(number: int) -> CauseKind:
    """SIGTERM is what torchrun and ddpfab end ranks with; any other signal is the rank's own."""
    return CauseKind.STOPPED if number == signal.SIGTERM else CauseKind.SIGNAL


@dataclass
class Cause:
    """Why a rank failed, as far as its node's output and supervisor say.

    Args:
        rank: the failing rank's global rank, None if not known.
        local_rank: its local rank on the node, None if not known.
        exit_code: the rank's exit code (torchrun's Root Cause), None if not reported.
        exception: its first exception line (or its usage error), None if it printed none.
        kind: what ended it (:class:`CauseKind`), None when nothing says.
        signal: the signal that killed it, None if none.
        peer: for a lost peer, the address the rank's error names, None if it names none.
        traceback: the last lines of its traceback (at most :data:`TAIL_LINES`).
    """

    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    exception: str | None = None
    kind: CauseKind | None = None
    signal: int | None = None
    peer: str | None = None
    traceback: tuple[str, ...] = ()

    @property
    def own(self) -> bool:
        return self.kind is not None and self.kind.own

    def same_failure(self, other: Cause | None) -> bool:
        """Both are a rank's own failure of the same kind, error and signal, with no other exit
        code (an exit code one node's output gave and another's did not, torchrun's report cut off
        by the stop, tells no two failures apart)."""
        if other is None or not (self.own and other.own):
            return False
        codes = {self.exit_code, other.exit_code} - {None}
        return (self.kind, self.exception, self.signal) == (other.kind, other.exception, other.signal) and len(codes) < 2

    def to_dict(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "exit_code": self.exit_code,
                "exception": self.exception, "kind": self.kind.value if self.kind else None,
                "signal": self.signal, "peer": self.peer}

    def who(self) -> str:
        """``rank 3 (local rank 1)``, ``local rank 1``, or "" (the parts known)."""
        if self.rank is not None:
            return f"rank {self.rank}" + (f" (local rank {self.local_rank})" if self.local_rank is not None else "")
        return f"local rank {self.local_rank}" if self.local_rank is not None else ""

    def text(self) -> str:
        """``rank 3 (local rank 1), exit code 1: RuntimeError: boom``; for a signal ``rank 3 (local
        rank 1) was killed by signal 9 (SIGKILL)`` or ``... by the OOM killer (SIGKILL)``."""
        who = self.who()
        if self.kind is CauseKind.OOM:
            return f"{who or 'a rank'} was killed by the OOM killer (SIGKILL)"
        if self.kind in (CauseKind.SIGNAL, CauseKind.STOPPED) and self.signal is not None and not self.exception:
            return f"{who or 'a rank'} was killed by signal {self.signal} ({name_of_signal(self.signal)})"
        head = ", ".join(part for part in (who, f"exit code {self.exit_code}" if self.exit_code is not None else "")
                         if part)
        if self.exception:
            return f"{head}: {self.exception}" if head else self.exception
        return head


def _clean(text: str) -> str:
    """*text* as one printable line, bounded."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text.strip())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


class Fold(Enum):
    """What the printer does with a line (:meth:`CauseReader.feed`)."""

    SHOW = "show"  # print it now
    HOLD = "hold"  # part of an open traceback: keep it until the traceback ends
    RELEASE = "release"  # the end of a held traceback that is shown: print what was held, then this
    DROP = "drop"  # the end of a held traceback that is folded (a victim's, torchrun's own): drop all
    FOLD = "fold"  # torchrun's failure report or teardown log: folded
    NOISE = "noise"  # known harmless noise: shown once per run


@dataclass
class _RankState:
    """One local rank's traceback as it streams (None: not in one) and what it said."""

    skipped: int | None = None  # lines at column 0 before the first frame (None once a frame came)
    stray: int = 0  # lines at column 0, not an exception's, after a frame (the rank's stdout)
    in_traceback: bool = False
    prefixed: bool = False  # the open traceback's lines carry torch's [rankN]: (its stdout's do not)
    lines: list[str] = field(default_factory=list)
    exception: str | None = None
    kind: CauseKind | None = None
    peer: str | None = None
    traceback: tuple[str, ...] = ()
    usage_seen: bool = False
    usage: str | None = None


class CauseReader:
    """Reads one node's output line by line (:meth:`feed`) and keeps what names the cause."""

    def __init__(self) -> None:
        self.ranks: dict[int, _RankState] = {}
        self.order: list[int] = []  # local ranks in the order their first exception (or usage error) came
        self._in_root = False
        self._root_traceback = False
        self._launcher_traceback = False  # torchrun's own traceback is open
        self._banner = False  # torchrun's failure report (after ChildFailedError) is open
        self._banner_root = False  # ... and its Root Cause part came
        self._logging_error: int | None = None  # lines of an open report of a log record not written
        self._logging_error_exception = False  # ... and its exception line came
        self._record_prefix: str | None = None  # the prefix of an open exit-barrier record (folded)
        self.root = Cause()
        #: the failure torchrun observed first (its first ``failed (exitcode: ...)`` line), as it
        #: stood then: with ``--max-restarts`` the attempts after it fail in its wake (the peers
        #: are gone or elsewhere), so it stays the node's cause once torchrun restarted
        self.first_attempt: Cause | None = None
        self.restarted = False  # torchrun observed a failure after the first: it had restarted
        self.death_signal: int | None = None  # the stop signal torchrun said it got (by ddpfab's stop, or not)
        self.signatures: list[Signature] = []  # the known failure signatures seen, each once (hints.py)

    def feed(self, line: str) -> tuple[Fold, int | None]:
        """Read *line*; returns what the printer does with it, and whose line it is (the local
        rank, None for torchrun's)."""
        tag = RANK_TAG.match(line)
        sig = signature_of(line)
        if sig is not None and sig not in self.signatures:
            self.signatures.append(sig)
        if noise_of(line) is not None:
            return Fold.NOISE, int(tag.group(1)) if tag else None
        if tag:
            local, rest = int(tag.group(1)), line[tag.end():]
            text = _RANK_PREFIX.sub("", rest, count=1)
            return self._rank_line(local, text, prefixed=text != rest), local
        self._torchrun_line(line)
        return self._launcher_fold(line.rstrip()), None

    # -- a rank's lines ------------------------------------------------------------------------

    def _rank_line(self, local: int, text: str, prefixed: bool = False) -> Fold:
        state = self.ranks.setdefault(local, _RankState())
        if text.strip() == _TRACEBACK:
            state.in_traceback, state.skipped, state.stray, state.lines = True, 0, 0, [text]
            state.prefixed = prefixed
            return Fold.HOLD
        if state.in_traceback and state.prefixed and not prefixed:
            return Fold.SHOW  # the rank's stdout, between the lines of a traceback torch marks ([rankN]:)
        if not state.in_traceback and _SYNTAX_REPORT.match(text.rstrip()):
            state.in_traceback, state.skipped, state.stray, state.lines = True, None, 0, [text]
            return Fold.HOLD  # as after a frame: the next line at column 0 is the exception
        if not state.in_traceback:
            return self._usage_line(local, state, text)
        if not text.strip() or text[:1].isspace():  # a frame (or its code line)
            if text.strip():
                state.skipped = None
            return self._held(state, text)
        if state.skipped is not None and state.skipped < INTERLEAVED:
            state.skipped += 1  # before any frame: the rank's stdout (INTERLEAVED)
            return self._held(state, text)
        exception = _EXCEPTION.match(text.strip()) and (not state.stray or _CLASS.match(text.strip()))
        if not exception and state.skipped is None and state.stray < INTERLEAVED:
            state.stray += 1  # after a frame: the rank's stdout (INTERLEAVED)
            return Fold.SHOW
        state.in_traceback = False  # the exception line, or what shows the traceback was cut off
        if not exception:
            return Fold.RELEASE
        kind = kind_of_exception(text)
        if state.exception is None:
            state.exception, state.kind = _clean(text + _syntax_place(text, state.lines)), kind
            state.traceback = tuple(_clean(ln) for ln in [*state.lines, text][-TAIL_LINES:])
            peer = _PEER_ADDRESS.search(text) if kind is CauseKind.PEER_LOST else None
            state.peer = peer.group(1) if peer else None
            self.order.append(local)
        return Fold.RELEASE if kind.own else Fold.DROP

    @staticmethod
    def _held(state: _RankState, text: str) -> Fold:
        if len(state.lines) >= MAX_HELD:  # not a traceback python would print: let it through
            state.in_traceback = False
            return Fold.RELEASE
        state.lines.append(text)
        return Fold.HOLD

    def _usage_line(self, local: int, state: _RankState, text: str) -> Fold:
        if _USAGE.match(text):
            state.usage_seen = True
        elif state.usage_seen and state.usage is None and _USAGE_ERROR.match(text.strip()):
            state.usage = _clean(text)
            if local not in self.order:
                self.order.append(local)
        return Fold.SHOW

    # -- torchrun's lines ----------------------------------------------------------------------

    def _launcher_fold(self, text: str) -> Fold:
        """torchrun's own traceback is held; ending in its report of a failed child or of its stop
        signal it is folded, with the report that follows (up to the rule after its Root Cause). A
        log record torchrun could not write (its report, :data:`_LOGGING_ERROR`) is folded."""
        if self._logging_error is not None:
            fold = self._logging_error_line(text)
            if fold is not None:
                return fold
        if text.strip() == _LOGGING_ERROR:
            self._logging_error, self._logging_error_exception = 0, False
            return Fold.FOLD
        if self._banner:
            if text.strip() == _ROOT:
                self._banner_root = True
            elif self._banner_root and _RULE.match(text.strip()):
                self._banner = self._banner_root = False
            return Fold.FOLD
        if text.strip() == _TRACEBACK:
            self._launcher_traceback = True
            return Fold.HOLD
        if self._launcher_traceback:
            if not text.strip() or text[:1].isspace():
                return Fold.HOLD
            self._launcher_traceback = False
            name = text.split(":", 1)[0]
            if name.endswith(_LAUNCHER_EXCEPTIONS):
                self._banner = name.endswith("ChildFailedError")
                return Fold.DROP
            return Fold.RELEASE
        if self._record_prefix is not None and text.startswith(self._record_prefix):
            return Fold.FOLD
        barrier = _EXIT_BARRIER.match(text)
        if barrier:
            self._record_prefix = barrier.group(1)
            return Fold.FOLD
        folded = _ELASTIC_LOG.match(text) or _NOTICE_FRAME.match(text) or _CPP_STACK.match(text)
        return Fold.FOLD if folded else Fold.SHOW

    def _logging_error_line(self, text: str) -> Fold | None:
        """A line of an open :data:`_LOGGING_ERROR` report: folded while it has the report's shape
        (frames, its traceback's header and one exception line, ``Call stack:``, ``Message:``, up to
        ``Arguments:``); any other line ends the report unread (None: read as any other line), so
        a report cut off never hides what comes after it."""
        assert self._logging_error is not None
        self._logging_error += 1
        if _LOGGING_ERROR_END.match(text):
            self._logging_error = None
            return Fold.FOLD
        if self._logging_error < MAX_HELD:
            if not text.strip() or text[:1].isspace() or text.strip() in (_TRACEBACK, "Call stack:") \
                    or text.startswith("Message: "):
                return Fold.FOLD
            if not self._logging_error_exception and _EXCEPTION.match(text.strip()):
                self._logging_error_exception = True
                return Fold.FOLD
        self._logging_error = None
        return None

    def _torchrun_line(self, line: str) -> None:
        text = line.rstrip()
        if (m := _DEATH_SIGNAL.search(text)) and self.death_signal is None:
            number = int(m.group(1)) if m.group(1) else getattr(signal.Signals, m.group(2), None)
            self.death_signal = int(number) if number is not None else None
            return
        if m := _FAILED_LOG.search(text):
            if self.first_attempt is None:
                self.first_attempt = self._attempt_cause(int(m.group(2)), int(m.group(1)))
            else:
                self.restarted = True
            return
        if text.strip() == _ROOT:
            self._in_root = True
            return
        if not self._in_root:
            return
        if _RULE.match(text.strip()):
            self._in_root = self._root_traceback = False
            return
        if (m := _ROOT_RANK.match(text)) and self.root.rank is None:
            self.root.rank, self.root.local_rank = int(m.group(1)), int(m.group(2))
        elif (m := _ROOT_EXIT.match(text)) and self.root.exit_code is None:
            self.root.exit_code = int(m.group(1))
        elif m := _ROOT_TRACEBACK.match(text):
            self._root_traceback = True
        elif (self._root_traceback and self.root.exception is None and text.startswith("  ")
              and not text.startswith("   ") and _EXCEPTION.match(text.strip())):
            # the error file's traceback, indented by two: frames deeper, the exception line at two
            self.root.exception = _clean(text)

    # -- the verdict ---------------------------------------------------------------------------

    def _outside_sigterm(self, local: int | None) -> bool:
        """torchrun's own words confirm that a SIGTERM from outside the run started it: it says it
        got one itself ("Received 15 death signal"), or the first failure it observed was local
        rank *local* ended by SIGTERM (torchrun logs no failure for a worker it ends itself; a
        rendezvous that went away ends the workers with neither)."""
        first = self.first_attempt
        return self.death_signal == signal.SIGTERM or (
            first is not None and first.signal == signal.SIGTERM and first.local_rank == local)

    def _attempt_cause(self, local: int, code: int) -> Cause:
        """Local rank *local*'s failure as torchrun logged it (*code*: its exit code, negative for
        a signal), with what the rank printed of it by then."""
        printed = self.rank_cause(local)
        if printed is not None:  # its own error, or a lost peer: the first attempt was a victim's
            return replace(printed, exit_code=code if code >= 0 else printed.exit_code)
        sig = -code if code < 0 else None
        kind = kind_of_signal(sig) if sig is not None else CauseKind.EXIT if code else None
        return Cause(None, local, code if sig is None else 128 + sig, None, kind, sig)

    def rank_cause(self, local: int) -> Cause | None:
        """What local rank *local* said of its failure: its first exception, else its usage error."""
        state = self.ranks.get(local)
        if state is None or (state.exception is None and state.usage is None):
            return None
        exit_code = self.root.exit_code if self.root.local_rank == local else None
        if state.exception is not None:
            return Cause(None, local, exit_code, state.exception, state.kind, peer=state.peer,
                         traceback=state.traceback)
        return Cause(None, local, exit_code, state.usage, CauseKind.USAGE)

    def rank_kinds(self) -> dict[int, CauseKind]:
        """Local rank -> the kind of what it said (ranks that said nothing are left out)."""
        return {local: cause.kind for local in self.order if (cause := self.rank_cause(local)) and cause.kind}

    def peers(self) -> set[str]:
        """The addresses this node's victims name as the peer they lost."""
        return {s.peer for s in self.ranks.values() if s.peer}

    def cause(self, worker: dict | None = None, unstopped: bool = False) -> Cause | None:
        """The node's cause: the first rank whose failure is its own, by what it printed; else the
        first worker its supervisor saw fail (*worker*: its ``failed_worker`` record), when that
        rank printed nothing; else torchrun's Root Cause; else a victim's; None if nothing says.
        *unstopped*: the node's supervisor stopped nothing (its record says so): then torchrun's
        report of a rank ended by SIGTERM, confirmed by its own log, is a SIGTERM from outside.
        Once torchrun restarted the node's ranks (``--max-restarts``), the failure it observed
        first (a rank's own, or a victim's): what failed after it failed in its wake."""
        if self.restarted and self.first_attempt is not None:
            return replace(self.first_attempt)  # the attempts after it failed in its wake
        said = [c for local in self.order if (c := self.rank_cause(local))]
        own = [c for c in said if c.own]
        outside = isinstance(worker, dict) and worker.get("outside") is True
        if not own and self.death_signal == signal.SIGTERM and (unstopped or outside):
            # torchrun itself got SIGTERM (not from its supervisor) and ended its ranks with it
            return Cause(None, None, None, "torchrun got signal 15 (SIGTERM) from outside the run and ended its ranks",
                         CauseKind.SIGNAL, signal.SIGTERM)
        root = self._root_cause()
        if unstopped and root.signal == signal.SIGTERM and self._outside_sigterm(root.local_rank):
            root.kind = CauseKind.SIGNAL  # torchrun's first observed failure, a SIGTERM nobody in the run sent
        seen = worker_cause(worker)
        if seen is not None and seen.kind is CauseKind.SIGNAL and seen.signal == signal.SIGTERM \
                and not self._outside_sigterm(seen.local_rank):
            seen = replace(seen, kind=CauseKind.STOPPED)  # unconfirmed: as any SIGTERM, a stop
        if own:
            first = own[0]
            for known in (root, seen):  # what torchrun or the supervisor knew of the same rank
                if known is not None and known.local_rank == first.local_rank:
                    first.rank = first.rank if first.rank is not None else known.rank
                    first.exit_code = first.exit_code if first.exit_code is not None else known.exit_code
            return first
        if seen is not None and (seen.local_rank is None or seen.local_rank not in self.order):
            return seen
        if root.local_rank is not None and root.local_rank not in self.order:
            return root
        if said:
            first = said[0]
            if root.local_rank == first.local_rank:
                first.rank, first.exit_code = root.rank, root.exit_code
            return first
        return root if root.local_rank is not None else None

    def _root_cause(self) -> Cause:
        """torchrun's Root Cause, classified by its exit code (a negative one is a signal)."""
        code, kind, sig = self.root.exit_code, None, None
        if self.root.exception:
            kind = kind_of_exception(self.root.exception)
        elif code is not None and code < 0:
            sig = -code
            kind = kind_of_signal(sig)
        elif code:
            kind = CauseKind.EXIT
        return Cause(self.root.rank, self.root.local_rank, code, self.root.exception, kind, sig)


def worker_cause(record: object) -> Cause | None:
    """The node supervisor's ``failed_worker`` record (``{"pid", "signal"|"exit", "rank"?,
    "local_rank"?, "oom"?, "outside"?}``), read as data, as a cause; None when it says nothing usable."""
    if not isinstance(record, dict) or type(record.get("pid")) is not int:
        return None
    rank, local = record.get("rank"), record.get("local_rank")
    rank = rank if type(rank) is int else None
    local = local if type(local) is int else None
    sig, code = record.get("signal"), record.get("exit")
    if type(sig) is int:
        # a SIGTERM the supervisor saw first, before any failure or stop, came from outside the run
        kind = CauseKind.OOM if record.get("oom") is True else \
            CauseKind.SIGNAL if record.get("outside") is True else kind_of_signal(sig)
        return Cause(rank, local, 128 + sig, None, kind, sig)
    if type(code) is int and code != 0:
        return Cause(rank, local, code, None, CauseKind.EXIT)
    return None


# --- across nodes ---------------------------------------------------------------------------


@dataclass
class NodeFailure:
    """What one failed node says, for :func:`blame`.

    Args:
        name: the node.
        node_rank: its rank in inventory order (ties in time go to the lower one).
        failed_at: when its job failed by its supervisor's clock, None if it does not say.
        cause: its cause (:meth:`CauseReader.cause`), None if nothing says.
        kinds: local rank -> the kind of what each of its ranks said.
        peers: the addresses its victims name.
        failed: it failed on its own (else it was stopped: its victims still count).
        ranks: how many ranks it ran (a node is a victim when every one of them lost its peer).
    """

    name: str
    node_rank: int
    failed_at: float | None
    cause: Cause | None
    kinds: dict[int, CauseKind] = field(default_factory=dict)
    peers: set[str] = field(default_factory=set)
    failed: bool = True
    ranks: int = 1


@dataclass
class Blame:
    """Whose failure ended the run.

    Args:
        node: the node named: the one whose rank failed on its own (first in time), else the one
            the victims point at, else the first to fail; None when no node failed.
        cause: that node's cause, None if nothing says.
        own: the cause is the rank's own (not a lost peer or a stop).
        lost_peer: ranks elsewhere (not the cause's) that lost their peer.
        pointed: with no cause of a rank's own, the node whose address the victims' errors name.
        pointed_alone: that node is no victim as a whole (not all its ranks lost their peer).
    """

    node: str | None
    cause: Cause | None = None
    own: bool = False
    lost_peer: int = 0
    pointed: str | None = None
    pointed_alone: bool = False

    def victims(self) -> str:
        """``2 other ranks lost their peer`` (or "")."""
        if not self.lost_peer:
            return ""
        many = self.lost_peer != 1
        return f"{self.lost_peer} other rank{'s' if many else ''} lost {'their' if many else 'its'} peer"


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def _standing(cause: Cause | None) -> int:
    """How a node's cause ranks for blame: 0 a rank's own, 1 unknown (nothing says), 2 secondary."""
    if cause is not None and cause.own:
        return 0
    return 1 if cause is None or cause.kind is None else 2


def blame(nodes: list[NodeFailure], addresses: dict[str, str]) -> Blame:
    """The node to name among *nodes* (every node that ended badly; those that did not fail on
    their own only count their victims); *addresses*: node -> its data-plane address (to map a
    victim's peer address to a node).

    A rank whose cause is its own outranks any victim, whatever the times; among those, the first
    by its node's ``failed_at`` (then node rank). A node that says nothing of its cause still
    outranks a known victim. With only secondary causes, the node the victims name by address is
    pointed at (:func:`pointed_node`), and the first in time is named."""
    failures = [f for f in nodes if f.failed]
    if not failures:
        return Blame(None)
    best = min(_standing(f.cause) for f in failures)
    first = min((f for f in failures if _standing(f.cause) == best),
                key=lambda f: (f.failed_at is None, f.failed_at or 0.0, f.node_rank))
    # the victims besides the rank named (itself one, when no rank failed on its own)
    lost = sum(1 for f in nodes for local, kind in f.kinds.items() if kind is CauseKind.PEER_LOST
               and not (f is first and first.cause is not None and first.cause.local_rank == local))
    if best < 2:  # a rank's own cause, or a node that says nothing of its cause: not a known victim
        return Blame(first.name, first.cause, best == 0, lost)
    pointed = pointed_node(nodes, addresses)
    # no victim as a whole, and its own victims do not point back at the first to fail (a link
    # between the two, each naming the other, says nothing of which one failed first)
    back = any(_same_address(addresses.get(first.name, ""), a) for f in nodes if f.name == pointed for a in f.peers)
    return Blame(first.name, first.cause, False, lost, pointed,
                 pointed is not None and pointed not in _victim_nodes(nodes) and not back)


def _victim_nodes(nodes: list[NodeFailure]) -> set[str]:
    """The nodes that are victims as a whole: every rank of theirs lost its peer."""
    return {f.name for f in nodes if sum(k is CauseKind.PEER_LOST for k in f.kinds.values()) >= max(f.ranks, 1)}


def pointed_node(nodes: list[NodeFailure], addresses: dict[str, str]) -> str | None:
    """The node the victims' errors name (*addresses*: node -> data-plane address), None when they
    name none of them. In a ring all_reduce each victim names its neighbour, and the victims of
    victims name victims: nearly every node is named. So a node that is no victim itself (not all
    its ranks lost their peer: one left early, hangs or crashes in a ``finally``) comes first, then one
    the first victim in time names, then the most named, then the first in inventory order."""
    names = {f.name: {n for n, addr in addresses.items() if any(_same_address(addr, a) for a in f.peers)}
             for f in nodes}  # the nodes each failure's victims name
    named: dict[str, int] = {}
    for node in (n for f in nodes for n in names[f.name]):
        named[node] = named.get(node, 0) + 1
    if not named:
        return None
    # a node with a rank that did not lose its peer may hold the cause (its other ranks lost theirs)
    victims = _victim_nodes(nodes)
    timed = [f for f in nodes if f.peers and f.failed_at is not None]
    first_named = names[min(timed, key=lambda f: (f.failed_at, f.node_rank)).name] if timed else set()
    order = {n: i for i, n in enumerate(addresses)}
    return min(named, key=lambda n: (n in victims, n not in first_named, -named[n], order[n]))
