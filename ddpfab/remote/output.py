"""What ``ddpfab exec`` prints and returns, apart from how it reaches the nodes: the per-host
line printer, a node's result and the summary line. Free of paramiko and Fabric, so that a command
run over the connections ``ddpfab hold`` keeps open (:mod:`ddpfab.remote.holder`) does not import
the SSH stack it does not use (paramiko's import is about a third of such a command's start)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from dataclasses import dataclass
from typing import Protocol, TextIO

from ddpfab.hostlist import fold_by, fold_names

#: A node's exit code when ddpfab could not reach or run on it (as ssh's own).
UNREACHABLE = 255
#: The exit code of a node whose command was silent past ``--timeout`` (as ``timeout(1)``'s).
TIMED_OUT = 124
#: How a node's command ended without an exit code, as data (:attr:`HostResult.end`): silent past
#: ``--timeout``, or its session closed with no exit status (its shell was killed).
ENDS = ("timeout", "no exit status", "interrupted")
#: The terminal colours of the hosts' prefixes, in turn (ANSI SGR codes); a run's ranks use them too.
COLORS = ("36", "33", "35", "32", "34", "31", "96", "93", "95", "92")


def remote_command(words: list[str]) -> str:
    """One word: a shell snippet, as is. Several: a command line, each word quoted."""
    if not any(w.strip() for w in words):  # (`exec -- ''` ran nothing and said every node exited 0)
        raise ValueError("no command given (put it after --)")
    return words[0] if len(words) == 1 else shlex.join(words)


@dataclass
class HostResult:
    name: str
    exit_code: int | None = None
    error: str | None = None
    seconds: float = 0.0
    held: bool = False  # over a connection `ddpfab hold` keeps open (:mod:`ddpfab.remote.holder`)
    end: str | None = None  # one of ENDS: it ran there, but gave no exit code

    @property
    def code(self) -> int:
        if self.end == "timeout":
            return TIMED_OUT
        if self.error is not None or self.exit_code is None:
            return UNREACHABLE
        return self.exit_code

    @property
    def ok(self) -> bool:
        """The command ran there and exited 0."""
        return self.code == 0

    @property
    def problem(self) -> str:
        """Why it is not :attr:`ok`, in a sentence naming the host ("" when it is)."""
        if self.error is not None:
            return f"host {self.name}: {self.error}"
        return "" if self.ok else f"host {self.name}: exit code {self.code}"


class Printer(Protocol):
    """Where ``exec`` sends what the nodes say: each whole *line* as it comes, each node's result
    when its command *ended*; ``closed`` once its reader went away (the commands are then ended)."""

    closed: bool

    def line(self, name: str, text: str, stderr: bool = False) -> None: ...

    def ended(self, result: HostResult) -> None: ...


def tell_ended(printer: object, result: HostResult) -> None:
    """*printer*'s :meth:`Printer.ended` with *result*, when it has one (a library caller's printer
    from before it existed has only ``line`` and ``closed``)."""
    ended = getattr(printer, "ended", None)
    if callable(ended):
        ended(result)


class LinePrinter:
    """``<host> | <line>``, one whole line at a time, one colour per host when on a terminal."""

    def __init__(self, names: list[str], out: TextIO | None = None, err: TextIO | None = None,
                 color: bool | None = None):
        self.out, self.err = out or sys.stdout, err or sys.stderr
        if color is None:
            color = self.out.isatty() and os.environ.get("NO_COLOR") is None
        self.color = color
        self.width = max((len(n) for n in names), default=1)
        self.index = {n: i for i, n in enumerate(names)}
        self.lock = threading.Lock()
        self.closed = False  # stdout's reader went away (`| head`): the commands are ended

    def line(self, name: str, text: str, stderr: bool = False) -> None:
        prefix = f"{name:<{self.width}} |"
        if self.color:
            prefix = f"\x1b[{COLORS[self.index.get(name, 0) % len(COLORS)]}m{prefix}\x1b[0m"
        stream = self.err if stderr else self.out
        with self.lock:
            if self.closed:
                return
            try:
                stream.write(f"{prefix} {text}\n")
                stream.flush()
            except BrokenPipeError:
                self.closed = True

    def ended(self, result: HostResult) -> None:
        """A node's command ended (nothing to print: the summary says how, after every node)."""


def outcome(result: HostResult) -> str:
    """A node's end in a word: its exit code, ``timeout``, ``no exit status`` or ``unreachable``."""
    if result.end in ENDS:
        return result.end
    return "unreachable" if result.error else str(result.exit_code)


class FoldPrinter:
    """``exec --fold``: keeps each node's stdout and stderr lines and prints them once the command
    ended everywhere (or was interrupted), nodes that said the same (and ended the same way) once
    under their folded names, the odd ones apart (:func:`fold_report`). The two streams are kept
    apart: they reach here on two channels, so the order between them is not the node's, and two
    nodes that said the same must fold whichever came first."""

    def __init__(self, names: list[str], out: TextIO | None = None):
        self.out = out or sys.stdout
        self.lines: dict[str, list[str]] = {n: [] for n in names}
        self.errs: dict[str, list[str]] = {n: [] for n in names}
        self.ends: dict[str, HostResult] = {}  # the nodes whose command ended, by the time of an interrupt
        self.lock = threading.Lock()
        self.closed = False  # as LinePrinter's: nothing is written before the end

    def line(self, name: str, text: str, stderr: bool = False) -> None:
        with self.lock:
            (self.errs if stderr else self.lines).setdefault(name, []).append(text)

    def ended(self, result: HostResult) -> None:
        with self.lock:
            self.ends[result.name] = result

    def report(self, results: dict[str, HostResult]) -> None:
        with self.lock:
            text = fold_report(self.lines, results, self.errs)
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:
            self.closed = True

    def report_interrupted(self) -> None:
        """What every node said before an interrupt, folded: a node whose command had ended, as it
        ended; the others ``interrupted``."""
        with self.lock:
            ends = dict(self.ends)
        self.report({n: ends.get(n) or HostResult(n, error="interrupted", end="interrupted") for n in self.lines})


def fold_report(lines: dict[str, list[str]], results: dict[str, HostResult],
                errs: dict[str, list[str]] | None = None) -> str:
    """Each group of nodes whose output and end were the same, as clush -b prints them: a rule,
    the folded names (with how many, and how they ended when not with 0), a rule, the lines: its
    stdout's, then its stderr's (*errs*)."""
    errs = errs or {}
    said = {name: (tuple(lines.get(name, ())), tuple(errs.get(name, ())), outcome(r)) for name, r in results.items()}
    out = []
    for names, (text, err, end) in fold_by(said):
        notes = [str(len(names))] if len(names) > 1 else []
        if end != "0":
            notes.append(f"exit {end}" if end.isdigit() else end)
        label = fold_names(names) + (f" ({', '.join(notes)})" if notes else "")
        rule = "-" * min(max(len(label), 15), 79)
        out += [rule, label, rule, *text, *err]
    return "".join(f"{line}\n" for line in out)


def summary(results: dict[str, HostResult], elapsed: float) -> tuple[int, str]:
    """The exit code of ``exec`` (the first failed node's, in inventory order) and its closing
    line, the nodes folded by how they ended: ``node[1-127]=0 node128=1``."""
    failed = [r for r in results.values() if r.code != 0]
    parts = [f"{fold_names(names)}={end}" for names, end in fold_by({r.name: outcome(r) for r in results.values()})]
    held = " (over the connections `ddpfab hold` keeps open)" if results and all(
        r.held for r in results.values()) else ""
    text = (f"{len(results) - len(failed)}/{len(results)} nodes exited 0 in {elapsed:.2f} s{held}: "
            + " ".join(parts))
    return (failed[0].code if failed else 0), text
