"""Did-you-mean: the closest known names to a mistyped one (scripts, groups, hosts, playbooks)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to *n* names of *choices* that look like *word*, best first (difflib's ratio >= 0.6)."""
    return difflib.get_close_matches(word, sorted(set(choices)), n=n, cutoff=0.6)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` or ``" (did you mean 'x' or 'y'?)"``, or "" when nothing is close."""
    found = close_matches(word, choices)
    if not found:
        return ""
    return " (did you mean " + " or ".join(repr(f) for f in found) + "?)"
