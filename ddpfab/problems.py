"""A problem found on the way to a run, as data: which node, what was checked, what was expected,
what was found, and the fix. The library returns these; the command line prints them (one error
printer, :mod:`ddpfab.cli.errors`) or writes them as JSON. Nothing re-parses a problem's text."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from collections.abc import Iterable
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One problem. *text* is the full sentence a person reads (it names the node, what was
    expected and found, and the fix); the other fields say the same as data.

    Args:
        node: the inventory name of the node it is about; None when about no single node.
        check: what was checked, a short stable key (``"master_port"``, ``"script"``, ``"ssh"``).
        expected: what should have been there.
        found: what was there.
        fix: what to do about it.
        text: the sentence as printed (``host NODE: ...``); built from the fields when empty.
    """

    node: str | None
    check: str
    expected: str = ""
    found: str = ""
    fix: str = ""
    text: str = ""

    def __str__(self) -> str:
        if self.text:
            return self.text
        where = f"host {self.node}: " if self.node else ""
        parts = [f"{self.check}: expected {self.expected}" if self.expected else self.check]
        if self.found:
            parts.append(f"found {self.found}")
        if self.fix:
            parts.append(self.fix)
        return where + ", ".join(parts[:2]) + (f"; {parts[2]}" if len(parts) > 2 else "")

    def about(self, node: str, check: str | None = None) -> bool:
        """Whether this problem is about *node* (and, given, *check*): exact names, never a substring."""
        return self.node == node and (check is None or self.check == check)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": str(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        if not isinstance(data, dict) or not isinstance(data.get("check"), str):
            raise ValueError(f"not a problem record: {data!r}")
        fields = {k: data.get(k, "") for k in ("expected", "found", "fix", "text")}
        if not all(isinstance(v, str) for v in fields.values()) or not isinstance(data.get("node"), (str, type(None))):
            raise ValueError(f"not a problem record: {data!r}")
        return cls(node=data.get("node"), check=data["check"], **fields)


class DdpfabError(Exception):
    """The base of every ddpfab exception: what went wrong as a list of :class:`Problem`.
    ``str()`` is their sentences, one a line (what a person reads); the problems say the same as
    data, so a caller decides by ``problem.node``/``problem.check`` or the exception's type, never
    by its text. (The node program's own files are shipped stdlib-only and do not import this:
    their failures arrive as replies and become problems on the controller.)

    Args:
        problems: the problems, or one; a line of text becomes a problem about no single node
            whose check is *check*.
        check: the key of a line of text given without a Problem (default: the class's
            :attr:`check`).
    """

    #: The check key of a line of text this exception was given (each class names its own).
    check: str = "error"

    def __init__(self, problems: Problem | str | Iterable[Problem | str] = (), check: str | None = None):
        items = [problems] if isinstance(problems, (str, Problem)) else list(problems)
        key = check or type(self).check
        self.problems: list[Problem] = [p if isinstance(p, Problem) else Problem(None, key, text=p) for p in items]
        super().__init__("\n".join(map(str, self.problems)))

    def nodes(self) -> list[str]:
        """The nodes the problems are about, in order, each once (exact names)."""
        return list(dict.fromkeys(p.node for p in self.problems if p.node is not None))

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "problems": [p.to_dict() for p in self.problems]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DdpfabError:
        """The exception a record describes, as data: an instance of *cls* carrying the problems
        (a subclass's own attributes beyond them are not in the record)."""
        if not isinstance(data, dict) or not isinstance(data.get("problems"), list):
            raise ValueError(f"not an error record: {data!r}"[:200])
        err = cls.__new__(cls)
        DdpfabError.__init__(err, [Problem.from_dict(p) for p in data["problems"]])
        return err


class NodeError(DdpfabError):
    """A failure on one node (reaching it, or its program's answer), as text and as data.
    ``str()`` is the sentence a person reads (it names the node); the attributes and the one
    problem say the same for a per-node report, so nothing has to cut the node's name off the
    sentence.

    Args:
        node: the inventory name of the node.
        message: the sentence (``host NODE: ...``, or ``host NODE: jump host J (ADDR): ...``).
        kind: what failed, a short stable key (``"unreachable"``, ``"changed-host-key"``, ``"timeout"``);
            the problem's check.
        found: what went wrong, without naming the node (``unreachable: ...``); the whole
            message when the raiser has no shorter one.
    """

    def __init__(self, node: str, message: str, kind: str, found: str | None = None):
        self.node = node
        self.kind = kind
        self.found = message if found is None else found
        super().__init__([Problem(node, kind, found=self.found, text=message)])
