"""The one error printer of the command line: ``ddpfab: error: ...`` lines on stderr, and the
exit code that goes with them. Problems (:class:`ddpfab.problems.Problem`) print as their text."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

from ..problems import Problem

EXIT_USAGE = 2  # bad input or a failed preflight: nothing was started


def die(lines: Iterable[str | Problem] | str | Problem, code: int = EXIT_USAGE) -> int:
    """Print each line (a string or a problem) as ``ddpfab: error: LINE``; return *code*."""
    for line in [lines] if isinstance(lines, (str, Problem)) else lines:
        sys.stderr.write(f"ddpfab: error: {line}\n")
    return code


def print_problems(problems: Iterable[str | Problem], check: str) -> None:
    """``--json``: *problems* on stdout as ``{"ok": false, "problems": [...]}``, each a problem
    record; a line of text becomes a problem about no one node, *check* its key."""
    records = [(p if isinstance(p, Problem) else Problem(None, check, text=p)).to_dict() for p in problems]
    print(json.dumps({"ok": False, "problems": records}, indent=2, ensure_ascii=False))


def warn(line: str | Problem) -> None:
    sys.stderr.write(f"ddpfab: warning: {line}\n")


def note(line: str) -> None:
    sys.stderr.write(f"ddpfab: {line}\n")
