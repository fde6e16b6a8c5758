"""Did-you-mean: the closest known names to a mistyped one (scripts, groups, hosts, playbooks)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to *n* names of *choices* that look like *word*, best first (difflib's ratio >= 0.6)."""
    return difflib.get_close_matches(word, sorted(set(choices)), n=n, cutoff=0.6)


def files_like(name: str, directory: str, suffix: str = "") -> str:
    """:func:`did_you_mean` for a file *name* (it may have a folder in front) that is not in
    *directory*: the files of its folder there (ending in *suffix*) that look like it; "" when none
    does or the folder cannot be listed."""
    folder = os.path.dirname(name)
    try:
        names = [os.path.join(folder, e.name) for e in os.scandir(os.path.join(directory, folder))
                 if e.name.endswith(suffix) and e.is_file()]
    except OSError:
        return ""
    return did_you_mean(name, names)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` or ``" (did you mean 'x' or 'y'?)"``, or "" when nothing is close."""
    found = close_matches(word, choices)
    if not found:
        return ""
    return " (did you mean " + " or ".join(repr(f) for f in found) + "?)"
