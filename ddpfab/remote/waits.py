"""Waits of the main thread that a Ctrl-C ends at once.

The kernel hands a SIGINT to any thread of the process that does not block it: often one of the
threads that copy or hold a connection. Its handler (which raises
:class:`~ddpfab.launch.interrupt.Interrupted`) runs only when the main thread next runs Python
code, and a wait on a lock (``Thread.join()``, ``Future.result()``, ``Executor.map``) is not woken
by it: the Ctrl-C would be taken when what the thread waits for has ended. These waits wait in
slices of :data:`SLICE_S`, between which the main thread runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from concurrent.futures import wait as wait_for
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")

#: How long the main thread waits for another thread at a time.
SLICE_S = 0.2


def result(fut: Future[T]) -> T:
    """*fut*'s result (or its exception, raised)."""
    while not fut.done():
        wait_for([fut], timeout=SLICE_S)
    return fut.result()


def join(thread: threading.Thread) -> None:
    """Until *thread* has ended."""
    while thread.is_alive():
        thread.join(SLICE_S)


def mapped(pool: Executor, fn: Callable[[U], T], items: Iterable[U]) -> list[T]:
    """``list(pool.map(fn, items))``: every result in *items*' order; the first exception, in that
    order, is raised once every earlier one has its result, and (as ``map`` does) the calls not
    started yet never start."""
    futures = [pool.submit(fn, item) for item in items]
    try:
        return [result(f) for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


@contextmanager
def pool(max_workers: int) -> Iterator[ThreadPoolExecutor]:
    """A thread pool whose end never holds up an exception (a Ctrl-C above all): then the calls not
    started are cancelled and those running are not waited for (``with ThreadPoolExecutor()``
    joins them, a node's 120 s probe included); they end with their connections, which the
    caller closes. Without one, every call has ended when the block does."""
    executor = ThreadPoolExecutor(max_workers=max_workers)
    try:
        yield executor
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown(wait=True)
