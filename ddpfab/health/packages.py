"""The odd node out in installed packages: what each node's python has installed, against what
most of the nodes have (pure: the nodes' ``facts`` in, differences out).

A job imports the same modules on every node, so a package one node lacks (or has in another
version) fails that node's ranks alone, at an import, mid-run, or worse: in numbers that differ.
Provisioning makes every node's ``pip freeze`` the same and fails otherwise
(``ddpfab_python_check_identical``); ``ddpfab check`` says the same of nodes set up by hand. The
nodes report their packages in their facts (:func:`ddpfab.node.ops.installed_packages`); here
each package's expected version is the one most nodes that have it have, and a package is
expected at all where at least half the nodes have it. Compared as pip freeze does: pip,
setuptools, wheel and distribute (the venv's own tools, of whatever version the venv was made
with) are left out.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from dataclasses import dataclass, field

#: What ``pip freeze`` leaves out: the tools a venv is made with, not what a job imports.
IGNORED = frozenset({"pip", "setuptools", "wheel", "distribute"})
#: Packages named in a line before ``and N more``.
SHOWN = 4
#: The most packages a fix's ``pip install`` line names (beyond: provision again).
PIP_LINE_MAX = 8


@dataclass(frozen=True)
class Odd:
    """How one node's packages differ from most nodes'.

    Args:
        missing: name -> the version most nodes have, for each package it lacks.
        other: name -> (its version, the version most nodes have).
        extra: name -> its version, for each package most nodes lack.
    """

    missing: dict[str, str | None] = field(default_factory=dict)
    other: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    extra: dict[str, str | None] = field(default_factory=dict)

    @property
    def harmful(self) -> bool:
        """It lacks a package most nodes have, or has another version of one: what fails a job
        (a package of its own fails nothing by being there)."""
        return bool(self.missing or self.other)

    def text(self) -> str:
        """``lacks numpy 2.1.0; has requests 2.31.0 (most nodes: 2.32.0); has also tqdm 4.66.0``."""
        parts = []
        if self.missing:
            parts.append("lacks " + _listed([_spec(n, v) for n, v in self.missing.items()]))
        if self.other:
            parts.append("has " + _listed([f"{_spec(n, mine)} (most nodes: {want or 'no version'})"
                                           for n, (mine, want) in self.other.items()]))
        if self.extra:
            parts.append("has also " + _listed([_spec(n, v) for n, v in self.extra.items()]))
        return "; ".join(parts)

    def requirements(self) -> list[str]:
        """``name==version`` for what it lacks or has in another version (as most nodes have them)."""
        wanted = {**self.missing, **{n: want for n, (_, want) in self.other.items()}}
        return [f"{n}=={v}" if v else n for n, v in sorted(wanted.items())]


def _spec(name: str, version: str | None) -> str:
    return f"{name} {version}" if version else name


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


#: A name as the node program sends it (pip's form) and a version (PEP 440's characters): nothing
#: else reaches a terminal.
_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{0,99}$")
_VERSION = re.compile(r"^[A-Za-z0-9.+!_-]{1,64}$")


def valid(value: object) -> dict[str, str | None] | None:
    """A node's ``packages`` fact as data (name -> version or None), or None when it is missing or
    not what the node program sends (records are data: nothing else is taken)."""
    if not isinstance(value, dict):
        return None
    # an entry no pip would list (a '~umpy' dir an interrupted uninstall left) is dropped alone;
    # a fact with nothing valid in it says nothing
    kept = {k: v for k, v in value.items() if isinstance(k, str) and _NAME.match(k)
            and (v is None or isinstance(v, str) and _VERSION.match(v))}
    return {k: v for k, v in kept.items() if k not in IGNORED} if kept or not value else None


def listed(facts: dict) -> dict[str, str | None] | None:
    """A node's packages from its raw *facts*, when they can be compared: valid (:func:`valid`)
    and not cut short at the node program's cap (``packages_capped``: a python that full is no
    training venv, and a cut list would "lack" whatever sorts after the cut)."""
    return None if facts.get("packages_capped") is True else valid(facts.get("packages"))


def compare(by_node: dict[str, object]) -> dict[str, Odd]:
    """The nodes whose packages differ from most nodes' (node -> how), from each node's
    ``packages`` fact; nodes without a valid one are left out, and fewer than two nodes compare
    nothing."""
    known = {n: p for n, p in ((n, valid(v)) for n, v in by_node.items()) if p is not None}
    if len(known) < 2:
        return {}
    having = Counter(name for pkgs in known.values() for name in pkgs)
    versions: dict[str, Counter] = {}
    for pkgs in known.values():
        for name, version in pkgs.items():
            versions.setdefault(name, Counter())[version] += 1
    # the version most nodes have; a tie goes to the first seen in node order (Counter keeps it)
    usual = {name: counts.most_common(1)[0][0] for name, counts in versions.items()}
    # expected where at least half the nodes have it: of two nodes, the one that lacks a package
    # the other has is the odd one (what fails a job), not the other
    expected = {name for name, count in having.items() if 2 * count >= len(known)}
    odd = {}
    for node, pkgs in known.items():
        found = Odd(missing={n: usual[n] for n in sorted(expected - set(pkgs))},
                    other={n: (pkgs[n], usual[n]) for n in sorted(expected & set(pkgs)) if pkgs[n] != usual[n]},
                    extra={n: pkgs[n] for n in sorted(set(pkgs) - expected)})
        if found.missing or found.other or found.extra:
            odd[node] = found
    return odd


def fix(nodes: list[str], python: str, odd: Odd) -> str:
    """How to give the *python* of *nodes* (the same differences on each) the packages most nodes have."""
    reqs, limit = odd.requirements(), ",".join(nodes)
    if len(reqs) > PIP_LINE_MAX:  # a venv that lacks most of them: provisioning, not a pip line
        return f"provision again (`ddpfab provision -l {limit} -t python` installs the pinned set)"
    if not reqs:  # only packages of its own: they fail nothing unless a job imports them (try: import)
        return ("the same packages on every node (`ddpfab provision -t python` makes them so), or none of them if "
                "no job imports them")
    return (f"provision again (`ddpfab provision -l {limit} -t python` installs the pinned set), or install "
            f"them there: `ddpfab exec -l {limit} -- {shlex.quote(python)} -m pip install {shlex.join(reqs)}`")


def failure_hints(facts: dict[str, dict], pythons: dict[str, str]) -> dict[str, str]:
    """node -> the hint a run's closing lines give when that node is the one named: how its
    python's packages differ from most nodes' (what it lacks or has in another version; packages
    of its own alone are no likely cause), and the fix. *facts*: node -> its raw facts; *pythons*:
    node -> the python its job runs."""
    return {node: (f"{node}'s python ({pythons[node]}) {odd.text()}, unlike most nodes: a likely cause of a "
                   f"failure there alone. Fix: {fix([node], pythons[node], odd)}")
            for node, odd in compare({n: listed(f) for n, f in facts.items()}).items()
            if odd.harmful and node in pythons}
