"""Host names folded into pdsh/clush ranges (``node[01-31,33]``), and nodes folded by what they
said: the many that agree printed once, the odd ones apart (``dshbak -c``, ``clush -b``). Every
list of nodes ddpfab prints is folded here."""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

#: A name's last run of digits, with what comes before and after it.
_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")

Key = TypeVar("Key", bound=Hashable)
#: Up to this many nodes each says its own line; beyond, the nodes that say the same share one
#: (``node[1-64,66-128] (127 nodes): stopped``): every per-node report of the command line.
FOLD_ABOVE = 16


def _padded(digits: str) -> bool:
    return len(digits) > 1 and digits.startswith("0")


def _follows(prev: str, nxt: str) -> bool:
    """Can *nxt* extend a range that ends at *prev*? The next number, written the same way: both
    without leading zeros, or both of one width (``09`` then ``10`` is ``[09-10]``)."""
    if int(nxt) != int(prev) + 1:
        return False
    return len(nxt) == len(prev) or not (_padded(prev) or _padded(nxt))


def number_ranges(numbers: list[str], sep: str = ",") -> str:
    """``1-3,5`` of decimal *numbers* (as written: ``09`` and ``10`` join only at one width)."""
    ordered = sorted(dict.fromkeys(numbers), key=lambda d: (int(d), len(d)))
    parts: list[str] = []
    start = end = ordered[0]
    for digits in ordered[1:]:
        if _follows(end, digits):
            end = digits
            continue
        parts.append(start if start == end else f"{start}-{end}")
        start = end = digits
    parts.append(start if start == end else f"{start}-{end}")
    return sep.join(parts)


def _folded_parts(names: Iterable[str]) -> list[str]:
    groups: dict[tuple[str, str] | str, list[str]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            groups.setdefault((m.group(1), m.group(3)), []).append(m.group(2))
        else:
            groups.setdefault(name, [])
    out = []
    for key, numbers in groups.items():
        if isinstance(key, str):
            out.append(key)
        elif len(set(numbers)) == 1:
            out.append(f"{key[0]}{numbers[0]}{key[1]}")
        else:
            out.append(f"{key[0]}[{number_ranges(numbers)}]{key[1]}")
    return out


def fold_names(names: Iterable[str]) -> str:
    """*names* as one folded list: ``node[1-3,5],gpu-a`` (pdsh's and clush's syntax). Names that
    differ only in their last number share a bracket; the groups keep the order of their first
    name; a name alone in its group stays as it is (``node7``)."""
    return ",".join(_folded_parts(names))


def compact(names: Sequence[str], limit: int = 8) -> str:
    """Names for a sentence: up to 3 of them, or up to *limit* that do not fold, as they are
    (``node7, node9, node12``); else folded, with how many (``node[11-17,19] (8 nodes)``,
    ``node[1-40,42], gpu-a (42 nodes)``)."""
    parts = _folded_parts(names)
    if len(names) <= 3 or (len(names) <= limit and len(parts) == len(names)):
        return ", ".join(names)
    return ", ".join(parts) + f" ({len(names)} nodes)"


def fold_by(values: dict[str, Key]) -> list[tuple[list[str], Key]]:
    """Node -> what it said (any hashable), as (nodes, value) groups of equal values: the largest
    group first, then by the first node of each in *values*' order, so the odd ones come last."""
    groups: dict[Key, list[str]] = {}
    for name, value in values.items():
        groups.setdefault(value, []).append(name)
    order = {value: i for i, value in enumerate(groups)}
    return [(names, value) for value, names in sorted(groups.items(), key=lambda g: (-len(g[1]), order[g[0]]))]
