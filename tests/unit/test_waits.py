"""The main thread's waits end at a Ctrl-C that the kernel handed to another thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

# The SIGINT must reach the worker thread, not the main one: the main thread blocks it (Python
# still runs the handler there, once it runs), the worker does not and sleeps; the main thread
# then waits for the worker the way named in argv[1].
CHILD = r"""
import signal, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from ddpfab.remote import waits

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

def sleeper(_=None):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    time.sleep(60)

how = sys.argv[1]
try:
    if how == "join":
        t = threading.Thread(target=sleeper, daemon=True)
        t.start()
        print("waiting", flush=True)
        waits.join(t)
    else:
        pool = ThreadPoolExecutor(2)
        print("waiting", flush=True)
        if how == "result":
            waits.result(pool.submit(sleeper))
        else:
            waits.mapped(pool, sleeper, [1, 2])
except KeyboardInterrupt:
    print("interrupted", flush=True)
    import os
    os._exit(130)
"""


@pytest.mark.parametrize("how", ["join", "result", "mapped"])
def test_a_ctrl_c_taken_by_another_thread_ends_the_main_threads_wait(how):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, how], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)  # the worker is asleep, SIGINT unblocked there only
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        assert proc.stdout.read().strip() == "interrupted"
        assert time.monotonic() - sent < 5, "the wait ended only when the worker did"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mapped_raises_the_first_failure_and_starts_nothing_more():
    """As ``Executor.map``: results in order, the first exception raised, and the calls still
    queued behind it (more items than threads: sync's 128 nodes in 32 threads) never start."""
    from concurrent.futures import ThreadPoolExecutor

    from ddpfab.remote import waits

    started = []

    def call(i: int) -> int:
        started.append(i)
        if i == 1:
            raise ValueError("node 1")
        time.sleep(0.2)
        return i * 10

    with ThreadPoolExecutor(1) as pool:
        assert waits.mapped(pool, call, [2, 3]) == [20, 30]
        started.clear()
        with pytest.raises(ValueError, match="node 1"):
            waits.mapped(pool, call, [1, 2, 3, 4])
    assert started[0] == 1 and set(started) <= {1, 2}  # the one thread may have taken 2 already; never 3, 4


def test_a_pool_left_by_an_exception_does_not_wait_for_its_running_calls():
    """``with ThreadPoolExecutor()`` joins what still runs before an exception leaves the block (a
    node's 120 s probe held a Ctrl-C up that long); ``waits.pool`` lets it leave at once."""
    from ddpfab.remote import waits

    done: list[int] = []
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), waits.pool(1) as pool:
        pool.submit(lambda: (time.sleep(3), done.append(1)))
        pool.submit(lambda: done.append(2))
        raise KeyboardInterrupt
    assert time.monotonic() - started < 1 and done == []  # the first still sleeps, the second never ran
    ended: list[int] = []
    with waits.pool(1) as pool:  # without one, every call has ended with the block
        pool.submit(lambda: (time.sleep(0.3), ended.append(3)))
    assert ended == [3]
