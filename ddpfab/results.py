"""Per-host results in Fabric's ``GroupResult`` style: host name -> its result, or the exception
its work raised. A failure on one host is data next to the others' results; callers read
:attr:`GroupResult.succeeded` and :attr:`GroupResult.failed` instead of testing each value's type.

Its own module (not :mod:`ddpfab.remote.ssh`): the node program's controller side
(:func:`ddpfab.remote.nodeprogram.exchange`) returns one too, and must not load paramiko.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ddpfab.problems import Problem

T = TypeVar("T")
U = TypeVar("U")


class GroupResult(dict[str, T | Exception], Generic[T]):
    """host -> its result, or the exception its work raised (in the order its maker says)."""

    @property
    def succeeded(self) -> dict[str, T]:
        """host -> result, for the hosts whose work returned."""
        return {k: v for k, v in self.items() if not isinstance(v, Exception)}

    @property
    def failed(self) -> dict[str, Exception]:
        """host -> exception, for the hosts whose work raised."""
        return {k: v for k, v in self.items() if isinstance(v, Exception)}

    @property
    def ok(self) -> bool:
        """Every host's work returned, and each result that has an ``ok`` says so (an exec's
        :class:`ddpfab.remote.output.HostResult`: exit code 0)."""
        return not self.problems

    @property
    def problems(self) -> list[Problem]:
        """One problem per host whose work raised or whose result is not ``ok``, in host order."""
        out = []
        for host, value in self.items():
            if isinstance(value, Exception):
                given = [p for p in getattr(value, "problems", None) or () if isinstance(p, Problem)]
                out += given or [Problem(host, "error", text=f"host {host}: {value}")]
            elif getattr(value, "ok", True) is False:
                out.append(Problem(host, "exit", text=str(getattr(value, "problem", "")) or f"host {host}: failed"))
        return out

    def map(self, fn: Callable[[T], U]) -> GroupResult[U]:
        """``fn(result)`` for each host that succeeded; a failed host keeps its exception. The
        hosts keep their order. (An exception *fn* raises is the caller's: it is not a host's.)"""
        return GroupResult({k: v if isinstance(v, Exception) else fn(v) for k, v in self.items()})
