"""Benchmark figures quoted in prose, kept equal to bench/results.

A figure that README.md or a doc quotes from a benchmark follows a marker naming it:

    `ddpfab run` spends <!-- bench:launch.own -->0.70 s of its own

The marker does not show when the markdown is rendered. `bench/report.py` rewrites every marked
figure from bench/results/*.json (`report.quoted()` names them), printed the way the text already
prints it: its decimals and its `+` sign; the unit is the figure's own. tests/unit/test_docs.py
checks that each one is current, so a result re-measured without `bench/report.py` fails the unit
tests instead of leaving the README behind the page.

A figure is a number (`5`, `0.70 s`, `+0.84 s`, `8.8x`), a range of two (`0.48-0.64 s`) or a
verdict (`met`, `not met`). Stdlib only: the unit tests import it without the bench's tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNITS = (" s", "x", "")
_NUM = r"[+-]?\d+(?:\.\d+)?"
FIGURE = rf"not met|met|{_NUM}(?:-\d+(?:\.\d+)?)?(?: s\b|x\b)?"
MARKER = re.compile(rf"<!-- bench:(?P<key>[a-z0-9_.]+) -->(?P<figure>{FIGURE})?")
_BODY = re.compile(r"(?P<lo>[+-]?\d+(?:\.(?P<lo_frac>\d+))?)(?:-(?P<hi>\d+(?:\.(?P<hi_frac>\d+))?))?")


@dataclass(frozen=True)
class Figure:
    """One quotable figure: a number, a (low, high) range, or a verdict; with its unit."""

    value: float | int | tuple[float, float] | str | None
    unit: str = ""  # one of UNITS

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unit {self.unit!r} is not one of {UNITS}")


def quoting_files(repo: Path = REPO) -> list[Path]:
    """The markdown files whose prose may quote benchmark figures (docs/benchmarks.md is generated whole)."""
    docs = sorted(p for p in (repo / "docs").glob("*.md") if p.name != "benchmarks.md")
    return [repo / "README.md", repo / "bench" / "README.md", *docs]


def _places(printed: str | None, group: str) -> int:
    if printed is None:
        return 2
    m = _BODY.match(printed)
    return len(m.group(group) or "") if m else 2


def render(fig: Figure, printed: str | None = None) -> str | None:
    """*fig* as *printed* prints it (decimals, a leading `+`), or None when it has no value."""
    v = fig.value
    if v is None:
        return None
    if isinstance(v, str):
        return v
    sign = "+" if printed is not None and printed.startswith("+") else ""
    if isinstance(v, tuple):
        lo, hi = v
        body = f"{lo:{sign}.{_places(printed, 'lo_frac')}f}-{hi:.{_places(printed, 'hi_frac')}f}"
    elif isinstance(v, int) and not isinstance(v, bool):
        body = f"{v:{sign}d}"
    else:
        body = f"{v:{sign}.{_places(printed, 'lo_frac')}f}"
    return body + fig.unit


def problems(text: str, figures: dict[str, Figure], where: str = "") -> list[str]:
    """Every marked figure in *text* that is not what *figures* says, one line each (empty: all current)."""
    out = []
    for m in MARKER.finditer(text):
        key, printed = m["key"], m["figure"]
        line = text.count("\n", 0, m.start()) + 1
        at = f"{where}:{line}: bench:{key}"
        if key not in figures:
            out.append(f"{at}: no such figure (bench/report.py quoted() names {', '.join(sorted(figures))})")
            continue
        want = render(figures[key], printed)
        if want is None:
            out.append(f"{at}: no result to quote (run its benchmark, then bench/report.py)")
        elif printed is None:
            out.append(f"{at}: no figure after the marker (expected {want!r})")
        elif printed != want:
            out.append(f"{at}: says {printed!r}, bench/results say {want!r} (run bench/report.py)")
    return out


def update(text: str, figures: dict[str, Figure]) -> str:
    """*text* with every marked figure that has a value rewritten from *figures* (unknown keys kept)."""
    def one(m: re.Match) -> str:
        fig = figures.get(m["key"])
        want = render(fig, m["figure"]) if fig else None
        return m.group(0) if want is None else f"<!-- bench:{m['key']} -->{want}"

    return MARKER.sub(one, text)
