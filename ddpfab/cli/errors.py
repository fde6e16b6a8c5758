"""The one error printer of the command line: ``ddpfab: error: ...`` lines on stderr, and the
exit code that goes with them. Problems (:class:`ddpfab.problems.Problem`) print as their text; a
:class:`ddpfab.problems.DdpfabError` prints as its problems, one line each (its exit code comes from
its type or its ``code``, never from its text).

The exit codes of every command are one table, :data:`EXIT_CODES` (the docs' reference page is
rendered from it; a unit test walks every subcommand's error paths against it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable

from ddpfab.hostlist import FOLD_ABOVE, compact
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.problems import DdpfabError, Problem

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and met a failure (checks found problems, a copy failed, ...)
EXIT_USAGE = 2  # bad input or a failed preflight: nothing was started
EXIT_UNREACHABLE = 255  # exec: a node that could not be reached (ssh's own code for it)
EXIT_SIGINT = 130  # 128 + SIGINT: see ddpfab.launch.interrupt
EXIT_SIGTERM = 143  # 128 + SIGTERM
EXIT_CLOSED_STDOUT = 141  # 128 + SIGPIPE, what a shell reports for a reader that went away

#: Every exit code a command can end with, and what it means: (code, meaning). The docs render it.
EXIT_CODES: tuple[tuple[str, str], ...] = (
    (str(EXIT_OK), "success (`run`, `replay`: also a job whose ranks all finished their work, one of them "
                   "aborting at exit afterwards, the known gloo/torch race: a warning names it)"),
    (str(EXIT_FAILED), "the command went ahead and met a failure: a check found problems, a copy failed, a node "
                       "could not be reached or a job not be stopped"),
    (str(EXIT_USAGE), "refused before anything started or changed: bad input (an option's value, no inventory, an "
                      "unreadable inventory, record or config), a failed preflight; argparse's usage errors too"),
    ("N", "`run`, `replay`, `attach`, `exec`: the failing node's own exit code (`exec`: "
          f"{EXIT_UNREACHABLE} for a node it could not reach, or whose command's session closed without an exit "
          "status); `run`, `attach`: 128 + the signal for a job stopped from outside (`ddpfab stop`)"),
    ("124", "`run`, `replay`, `attach` with `--on-hang stop`: the doctor found the job hung and ddpfab ended it "
            "(its verdict is the closing line); `exec --timeout`: a node's command was silent that long"),
    (f"{EXIT_SIGINT}, {EXIT_SIGTERM}", "interrupted by SIGINT, SIGTERM (one line, nothing left running)"),
    (str(EXIT_CLOSED_STDOUT), "stdout closed before the output ended (`ddpfab ... | head`): the rest is dropped, "
                              "quietly"),
)


#: What :func:`die` and :func:`refuse` print: lines, problems, or an error's problems.
Lines = Iterable[str | Problem] | str | Problem | DdpfabError


def _lines(lines: Lines) -> list[str | Problem]:
    if isinstance(lines, DdpfabError):
        return list(lines.problems)
    return [lines] if isinstance(lines, (str, Problem)) else list(lines)


def folded(lines: list[str | Problem]) -> list[str | Problem]:
    """*lines*, where more than FOLD_ABOVE are problems about one node each: those saying the same
    (check and sentence) of several nodes as one line, at the place of the first
    (``host node[1-32] (32 nodes): workdir /w does not exist there; ...``)."""
    def said(line: str | Problem) -> tuple[str, tuple[str, str]] | None:  # node, (check, the rest)
        if isinstance(line, Problem) and line.node and str(line).startswith(f"host {line.node}: "):
            return line.node, (line.check, str(line).removeprefix(f"host {line.node}: "))
        return None

    about = [said(line) for line in lines]
    if sum(a is not None for a in about) <= FOLD_ABOVE:
        return lines
    nodes: dict[tuple[str, str], list[str]] = {}
    for a in about:
        if a is not None and a[0] not in nodes.setdefault(a[1], []):
            nodes[a[1]].append(a[0])
    out: list[str | Problem] = []
    for line, a in zip(lines, about, strict=True):
        key = a[1] if a is not None else None
        if key is None or len(nodes[key]) == 1:
            out.append(line)
        elif nodes[key]:
            out.append(f"host {compact(nodes[key])}: {key[1]}")
            nodes[key] = []  # (said: the others of the group are skipped)
    return out


def die(lines: Lines, code: int = EXIT_USAGE) -> int:
    """Print each line (a string or a problem; an error's problems) as ``ddpfab: error: LINE``,
    the many nodes' same problem once (:func:`folded`); return *code*."""
    for line in folded(_lines(lines)):
        sys.stderr.write(f"ddpfab: error: {line}\n")
    return code


def print_problems(problems: Iterable[str | Problem], check: str) -> None:
    """``--json``: *problems* on stdout as ``{"ok": false, "problems": [...]}``, each a problem
    record; a line of text becomes a problem about no one node, *check* its key."""
    records = [(p if isinstance(p, Problem) else Problem(None, check, text=p)).to_dict() for p in problems]
    print(json.dumps({"ok": False, "problems": records}, indent=2, ensure_ascii=False))


def refuse(args, lines: Lines, check: str, code: int = EXIT_USAGE) -> int:
    """:func:`die`, and with ``--json`` the same as a problems document on stdout: a command asked
    for JSON writes JSON whatever ends it (*check*: the key of a line about no one node)."""
    lines = _lines(lines)
    if getattr(args, "json", False):
        print_problems(lines, check)
    return die(lines, code)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose own refusals (a bad value, an unknown option: usage, exit 2) also
    write the problems document when ``--json`` was asked for: a command asked for JSON writes
    JSON whatever ends it. (Subparsers are made of the same class.)"""

    _argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        """argparse's, but words no parser took are refused by the subcommand that was given them,
        with its usage and the options that look like them (argparse's own refusal was the
        top-level usage, which lists the commands, not the option mistyped)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(namespace)
            options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            hints = "".join(did_you_mean(w.split("=", 1)[0], options) for w in extras if w.startswith("--"))
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return namespace

    def _chosen(self, namespace) -> argparse.ArgumentParser:
        """The innermost subcommand's parser that *namespace* names (this parser when none)."""
        for action in self._actions:  # argparse has no public walk; _actions is stable since 3.2
            if isinstance(action, argparse._SubParsersAction) and action.dest != argparse.SUPPRESS:
                chosen = action.choices.get(str(getattr(namespace, action.dest, "")))
                if chosen is not None:
                    return chosen._chosen(namespace) if isinstance(chosen, Parser) else chosen
        return self

    def error(self, message: str):
        words = self._argv[:self._argv.index("--")] if "--" in self._argv else self._argv
        if "--json" in words:
            print_problems([message], "usage")
            sys.stdout.flush()
        usage = self.format_usage()
        if usage.count("\n") > 3:  # a command of many options (run's usage is 20 lines): the error first
            usage = f"usage: {self.prog} [options] ... (`{self.prog} --help` lists them)\n"
        self._print_message(usage, sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def warn(line: str | Problem) -> None:
    sys.stderr.write(f"ddpfab: warning: {line}\n")


def note(line: str) -> None:
    sys.stderr.write(f"ddpfab: {line}\n")


def _open_standard_streams() -> None:
    """A stdin or stderr the shell closed (``<&-``, ``2>&-``) reads or writes /dev/null: its fd was
    free, and the first file or socket opened would have taken it (a child's errors into an SSH
    socket), and Python leaves ``sys.stderr`` None, which every message would trip on."""
    for fd, mode in ((0, os.O_RDONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, mode)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # (not fd 0 or 2 themselves: where python found one closed and it is open now, something else
    # took it, and messages must not go there)
    sys.stdin = sys.stdin or open(os.devnull)  # noqa: SIM115 - the process's own streams, for its life
    sys.stderr = sys.stderr or open(os.devnull, "w", buffering=1)  # noqa: SIM115


def closed_stdout_ends_quietly(call: Callable[[], int]) -> int:
    """``call()``, its output flushed here; when the reader of stdout has gone (``ddpfab ... | head``)
    the command ends at once with :data:`EXIT_CLOSED_STDOUT` and no traceback. stdout then points at
    /dev/null, so the interpreter's own flush at exit cannot fail a second time. A stdout closed
    from the start (``>&-``) is such a reader: the same code, before anything starts."""
    _open_standard_streams()
    if sys.stdout is None:
        sys.stderr.write("ddpfab: stdout is closed (>&-): nothing was started\n")
        return EXIT_CLOSED_STDOUT
    try:
        code = call()
        sys.stdout.flush()  # here, not at exit, where a closed pipe prints "Exception ignored"
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_CLOSED_STDOUT
