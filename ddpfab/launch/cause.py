"""The cause of a failed rank, read from a node's output as it streams: the first exception line
(``RuntimeError: boom``) of each local rank's traceback, and torchrun's "Root Cause" block (which
rank failed first, its exit code, and, for a script decorated with ``@record``, the traceback
from the rank's error file).

The output is data: lines are matched against a few fixed shapes, bounded in length and number,
and nothing in them is ever executed or evaluated. What a rank printed reaches here through
torchrun's ``--tee`` as ``[default<local rank>]:<line>``; torch.distributed's excepthook may
prefix a rank's traceback lines with ``[rank<N>]: `` as well. torchrun's own lines carry no tag
(its own traceback, ending in ``ChildFailedError``, is never taken for the rank's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: An exception line is cut to this many characters.
MAX_LINE = 300
_TAG = re.compile(r"^\[default(\d+)\]:")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_TRACEBACK = "Traceback (most recent call last):"
#: How python reports a script it could not compile (SyntaxError, IndentationError): no header,
#: this line, the code and a caret, then the exception line.
_SYNTAX_REPORT = re.compile(r'^  File ".*", line \d+$')
#: ``RuntimeError: boom``, ``torch.OutOfMemoryError: ...``, ``KeyboardInterrupt``, a class of a
#: function's own (``main.<locals>.ConfigError: ...``).
_EXCEPTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_.<>]*(:.*)?$")
_ROOT = "Root Cause (first observed failure):"
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ROOT_TRACEBACK = re.compile(r"^\s*traceback\s*:\s?(.*)$")
_RULE = re.compile(r"^={20,}$")
#: Lines at column 0 skipped between a rank's traceback header and its first frame: the rank's
#: stdout and stderr reach torchrun's tee as two streams, so what it printed just before raising
#: can come there (seen on the lab under load: the print before the raise between ``Traceback
#: (most recent call last):`` and its frames). A traceback always has a frame before its
#: exception line; after the first, the first line back at column 0 ends it, as it always did.
INTERLEAVED = 3


@dataclass
class Cause:
    """Why a node failed, as far as its output says.

    Args:
        rank: the failing rank's global rank (torchrun's Root Cause), None if not reported.
        local_rank: its local rank on the node, None if not known.
        exit_code: the rank's exit code (torchrun's Root Cause), None if not reported.
        exception: the first exception line of its traceback, None if it printed none.
    """

    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    exception: str | None = None

    def to_dict(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "exit_code": self.exit_code,
                "exception": self.exception}

    def text(self) -> str:
        """``rank 3 (local rank 1), exit code 1: RuntimeError: boom`` (the parts known)."""
        who = []
        if self.rank is not None:
            who.append(f"rank {self.rank}" + (f" (local rank {self.local_rank})" if self.local_rank is not None else ""))
        elif self.local_rank is not None:
            who.append(f"local rank {self.local_rank}")
        if self.exit_code is not None:
            who.append(f"exit code {self.exit_code}")
        head = ", ".join(who)
        if self.exception:
            return f"{head}: {self.exception}" if head else self.exception
        return head


def _clean(text: str) -> str:
    """*text* as one printable line, bounded."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text.strip())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


class CauseReader:
    """Reads one node's output line by line (:meth:`feed`) and keeps only what names the cause."""

    def __init__(self) -> None:
        self.first: dict[int, str] = {}  # local rank -> its first exception line
        self.order: list[int] = []  # local ranks in the order their first exception came
        # local rank in a traceback -> lines skipped before its first frame (None once one came)
        self._in_traceback: dict[int, int | None] = {}
        self._in_root = False
        self._root_traceback = False
        self.root = Cause()

    def feed(self, line: str) -> None:
        tag = _TAG.match(line)
        if tag:
            self._rank_line(int(tag.group(1)), _RANK_PREFIX.sub("", line[tag.end():], count=1))
        else:
            self._torchrun_line(line)

    def _rank_line(self, local: int, text: str) -> None:
        if text.strip() == _TRACEBACK:
            self._in_traceback[local] = 0
            return
        if local not in self._in_traceback and _SYNTAX_REPORT.match(text.rstrip()):
            self._in_traceback[local] = None  # as after a frame: the next line at column 0 is the exception
            return
        if local not in self._in_traceback or not text.strip():
            return
        if text[:1].isspace():  # a frame (or its code line)
            self._in_traceback[local] = None
            return
        skipped = self._in_traceback[local]
        if skipped is not None and skipped < INTERLEAVED:
            self._in_traceback[local] = skipped + 1  # before any frame: the rank's stdout (INTERLEAVED)
            return
        del self._in_traceback[local]  # the first line back at column 0 ends the traceback
        if local not in self.first and _EXCEPTION.match(text.strip()):
            self.first[local] = _clean(text)
            self.order.append(local)

    def _torchrun_line(self, line: str) -> None:
        text = line.rstrip()
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
        elif self._root_traceback and self.root.exception is None:
            # the error file's traceback, indented by two: frames deeper, the exception line at two
            if text.startswith("  ") and not text.startswith("   ") and _EXCEPTION.match(text.strip()):
                self.root.exception = _clean(text)

    def cause(self) -> Cause | None:
        """The failing rank and its exception: torchrun's Root Cause rank (its own exception line,
        else the error file's), else the first rank that printed an exception; None if neither."""
        if self.root.local_rank is not None:
            exception = self.first.get(self.root.local_rank) or self.root.exception
            return Cause(self.root.rank, self.root.local_rank, self.root.exit_code, exception)
        if self.order:
            local = self.order[0]
            return Cause(None, local, None, self.first[local])
        return None
