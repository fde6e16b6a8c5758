"""SIGINT and SIGTERM as one exception, so that every command ends the same way at every stage.

:class:`Interrupted` is a ``KeyboardInterrupt``: code that already cleans up on Ctrl-C (closing
connections in ``finally``, stopping a job) does the same for SIGTERM. The command line catches
it once (:func:`ddpfab.cli.main`): one line, exit 130 (SIGINT) or 143 (SIGTERM), no traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from ddpfab.node.agent import signal_all, descendants


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached ddpfab."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        """The signal's name (``SIGINT``, ``SIGTERM``)."""
        return signal.Signals(self.signum).name


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Taken(list):
    """The signals :func:`signals_queued` took so far."""

    def forget(self) -> None:
        """The loop held the one it took (it was no stop): the next is queued again, not raised."""
        self.clear()


@contextlib.contextmanager
def signals_queued(events, taken: Taken | None = None) -> Iterator[Taken]:
    """Within: SIGINT and SIGTERM put an :class:`Interrupted` on *events* (a ``queue.SimpleQueue``,
    whose ``put`` is safe in a signal handler) instead of raising it; a loop that waits on
    *events* raises it where it takes it. For code that holds locks (a queue's, the printer's,
    paramiko's): an exception raised by the handler in the middle of one left it held, and the
    next wait on it never returned (``ddpfab run`` hung for good after a Ctrl-C, 1 time in 15).
    A second signal raises, as before: the way out of a main thread blocked where the queue is
    not read (a note to a stdout nobody reads). In the main thread; elsewhere a no-op. The
    signals taken are kept in *taken* (a new :class:`Taken` when none is given), which it yields."""
    taken = Taken() if taken is None else taken
    if threading.current_thread() is not threading.main_thread():
        yield taken
        return

    def queue_first(signum, frame):
        taken.append(signum)
        if len(taken) > 1:
            raise Interrupted(signum)
        events.put(Interrupted(signum))

    previous = {sig: signal.signal(sig, queue_first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield taken
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_interruptible(call: Callable[[], int]) -> int:
    """``call()`` with SIGINT/SIGTERM raising :class:`Interrupted`; if one comes, this process's
    children are ended, one line is printed and the process exits 130/143 at once (threads still
    blocked on a connection that is closing must not hold the exit up)."""
    try:
        with signals_raise():
            return call()
    except BaseException as raised:
        exc = interrupt_in(raised)
        if exc is None:
            raise
        code = exc.exit_code if isinstance(exc, Interrupted) else 130
        end_own_children()
        sys.stderr.write(f"ddpfab: interrupted by {'SIGTERM' if code == 143 else 'SIGINT'}; stopped\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The interrupt *exc* is, or the one it was raised from: a signal that lands while a class
    is created reaches the caller as a RuntimeError raised from it (Python wraps what
    ``__set_name__`` raises; Ansible's imports create classes while an inventory loads). By type
    along ``__cause__``, never by text."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def end_own_children() -> None:
    """TERM this process's child processes (rsync, ssh) so that an interrupted command leaves
    none behind; the node side of each ends when its connection closes."""
    signal_all(descendants(os.getpid()), signal.SIGTERM)
