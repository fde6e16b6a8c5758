"""The one SSH layer: every command ddpfab sends to a host goes through here.

It reads the inventory's connection vars (and an optional ssh_config), enforces the host-key
policy, opens connections in parallel and returns per-host results in which a failure on one host
is data, not an exception that loses the others (Fabric's GroupResult model).

A connection is one over ``ddpfab hold``'s where a holder holds the node
(:mod:`ddpfab.remote.heldconn`), else a Fabric connection with host keys checked strictly
(:mod:`ddpfab.remote.sshopen`).
"""

from __future__ import annotations

import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ddpfab.hosts.inventory import Node

# SSHError and HostKeyPolicy are ddpfab.remote.ssh's to callers too
from ddpfab.remote import waits
from ddpfab.remote.ssherror import SSHError
from ddpfab.remote.target import HostKeyPolicy, Target, TargetError, resolve
from ddpfab.results import GroupResult

if TYPE_CHECKING:  # (slow to import: see connect)
    from fabric import Connection

T = TypeVar("T")


class Named(Protocol):
    """What :func:`parallel` needs of a node: its name (an inventory's Node, a plan's NodePlan)."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)
#: The fan-out window (like pdsh's -f): at most this many hosts are worked on at once by
#: :func:`parallel`. Each target host sees one connection from ddpfab, so its sshd's MaxStartups
#: (default 10:30:100) is never reached; the window bounds the controller's threads instead.
WINDOW = 64

#: The factories of the commands running now whose cluster has a holder (:func:`warm_through`):
#: node, policy, ssh_config -> a connection over the holder's, or None for a node it does not
#: hold so. A list, not a current one: commands of several clusters may run at once (threads).
_warm: list[Callable[[Node, HostKeyPolicy, str | None], Any]] = []
_warm_lock = threading.Lock()


@contextmanager
def warm_through(factory: Callable[[Node, HostKeyPolicy, str | None], Any]) -> Iterator[None]:
    """Within: :func:`connect` gives *factory*'s connection where it gives one (over ``ddpfab
    hold``'s connections: :func:`ddpfab.remote.heldconn.factory`, which gives one only for the
    nodes, policy and ssh_config its holder was made with). Process-wide: the per-node threads
    connect too."""
    with _warm_lock:
        _warm.append(factory)
    try:
        yield
    finally:
        with _warm_lock:
            _warm.remove(factory)


def connect(node: Node, policy: HostKeyPolicy, ssh_config: str | None = None,
            timeout: float | None = None, warm: bool = True) -> Connection:
    """An open, host-key-verified Fabric connection to *node* (through its jump hosts, each
    verified the same way), or an SSHError that says which hop failed and why. Under
    :func:`warm_through` (and *warm*), one over the holder's connection where it holds the node."""
    if warm:
        with _warm_lock:
            factories = list(reversed(_warm))
        for factory in factories:
            held = factory(node, policy, ssh_config)
            if held is not None:
                return held
    target = target_of(node, policy, ssh_config)
    if timeout is not None:
        target = _with_timeout(target, timeout)
    # here, not at the top: Fabric and paramiko take 0.1 s to import, which a command whose every
    # node a holder holds never needs (see LAZY in ddpfab/cli/__init__.py)
    from ddpfab.remote import sshopen

    return sshopen.open_connection(node.name, target)


def target_of(node: Node, policy: HostKeyPolicy, ssh_config: str | None = None) -> Target:
    """How *node* is reached (its inventory's connection vars and the ssh_config), or an SSHError
    naming the option at fault."""
    try:
        return resolve(node, policy, ssh_config)
    except TargetError as exc:
        # a TargetError is its sentence only; the node's own name leads it when it is about the node
        raise SSHError(node.name, str(exc), kind="ssh-option",
                       found=str(exc).removeprefix(f"host {node.name}: ")) from None


def _with_timeout(t: Target, timeout: float) -> Target:
    return replace(t, connect_timeout=timeout, jump=_with_timeout(t.jump, timeout) if t.jump else None)


def _fit_open_files(hosts: int) -> None:
    """Raise this process's soft open-file limit (towards the hard one) when *hosts* connections
    (a socket each, plus what paramiko and the windowed threads hold) might not fit under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * hosts + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def parallel(nodes: Sequence[N], fn: Callable[[N], T], window: int | None = None,
             release: Callable[[T], object] | None = None) -> GroupResult[T]:
    """``fn(node)`` for every node, *window* (default WINDOW) at a time; per node (in *nodes*'
    order) its result or the exception it raised.

    SIGINT/SIGTERM (Interrupted, a KeyboardInterrupt) reach the caller at once, never as a node's
    result, and the calls not started never start. The caller then has none of the results: with
    *release*, each one made (before the interrupt, or by a call still running, when it ends) is
    handed to it, so that what *fn* opened (a connection) is closed by whoever opened it."""
    results: GroupResult[T] = GroupResult()
    if not nodes:
        return results
    _fit_open_files(len(nodes))
    made = _Made(fn, release)
    pool = ThreadPoolExecutor(max_workers=min(window or WINDOW, len(nodes)))
    try:
        futures = {}
        for n in nodes:
            futures[n.name] = pool.submit(made.call, n)
        for name, fut in futures.items():
            try:
                results[name] = waits.result(fut)
            except Exception as exc:  # noqa: BLE001 - a failure on one host is data
                results[name] = exc
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        made.abandon()
        raise
    pool.shutdown(wait=False)
    return results


class _Made(Generic[N, T]):
    """The results of one :func:`parallel`'s calls, for its *release* once the caller has gone:
    those made before, when it goes; those made after, as they come."""

    def __init__(self, fn: Callable[[N], T], release: Callable[[T], object] | None):
        self.fn, self.release = fn, release
        self.lock = threading.Lock()
        self.kept: list[T] = []
        self.abandoned = False

    def call(self, node: N) -> T:
        value = self.fn(node)
        if self.release is not None:
            with self.lock:
                if not self.abandoned:
                    self.kept.append(value)
                    return value
            self._release(value)
        return value

    def abandon(self) -> None:
        with self.lock:
            self.abandoned, kept, self.kept = True, self.kept, []
        for value in kept:
            self._release(value)

    def _release(self, value: T) -> None:
        if self.release is None:
            return
        try:
            self.release(value)
        except Exception:  # noqa: BLE001 - releasing what nobody holds must not raise
            pass


def on_each(nodes: list[Node] | tuple[Node, ...], policy: HostKeyPolicy, ssh_config: str | None,
            fn: Callable[[Connection, Node], T]) -> GroupResult[T]:
    """``fn(connection, node)`` on every node at once, each over a connection of its own, closed
    after; per node its result or the exception it raised (a node that cannot be reached is one
    failure among the results)."""
    def connected(node: Node) -> T:
        conn = connect(node, policy, ssh_config)
        try:
            return fn(conn, node)
        finally:
            conn.close()
    return parallel(nodes, connected)


@dataclass
class CommandResult:
    node: str
    exit_code: int
    stdout: str
    stderr: str


def run(conn: Connection, node: str, command: str, timeout: float | None = 60,
        stdin: bytes | None = None) -> CommandResult:
    """Run *command* on an open connection and collect its output (for short probes, not jobs)."""
    chan = conn.transport.open_session(timeout=timeout)
    try:
        if timeout:
            chan.settimeout(timeout)
        chan.exec_command(command)
        if stdin is not None:
            try:
                chan.sendall(stdin)
            except OSError:
                if not (chan.closed or chan.exit_status_ready()):
                    raise
                # the command ended before reading its input (a setup line failed): its exit says why
        if not chan.closed:
            chan.shutdown_write()
        out, err = bytearray(), bytearray()
        while True:
            data = chan.recv(65536)
            if not data:
                break
            out += data
        while True:
            data = chan.recv_stderr(65536)
            if not data:
                break
            err += data
        code = chan.recv_exit_status()
    except TimeoutError:
        found = f"`{command[:60]}` did not finish within {timeout:g} s"
        raise SSHError(node, f"host {node}: {found}", found=found) from None
    finally:
        chan.close()
    return CommandResult(node, code, out.decode(errors="replace"), err.decode(errors="replace"))
