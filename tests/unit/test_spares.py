"""Node programs ``ddpfab hold`` starts ahead of their command (:mod:`ddpfab.remote.spares`), on
channels played here: only a node program's start is ever started ahead; a spare is handed out
once, for exactly the command and first stdin it was started with; an ended, too old or
disconnected one is closed, not used; a node keeps at most ``per_node``; nothing is started while
a command runs, and closing ends every spare. The real holder on lab hosts: tests/lab/test_hold.py."""

from __future__ import annotations

import shlex

import pytest

from ddpfab.hosts import inventory
from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.remote import spares


class Transport:
    def __init__(self):
        self.active = True

    def is_active(self) -> bool:
        return self.active


class Chan:
    """A session channel as the spares use it: what was run and written, and its state."""

    def __init__(self, transport: Transport, fail: bool = False):
        self.transport, self.fail = transport, fail
        self.command, self.stdin = None, b""
        self.closed = self.exited = False

    def get_transport(self):
        return self.transport

    def exec_command(self, command: str) -> None:
        if self.fail:
            raise OSError("no session")
        self.command = command

    def sendall(self, data: bytes) -> None:
        self.stdin += data

    def exit_status_ready(self) -> bool:
        return self.exited

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def program():
    """A node program's start as a session sends it for a node whose python is set (by path) and
    which has no setup lines: its command line and its first stdin."""
    node = inventory.load("127.0.0.1,", extra_vars=["ddpfab_python=/opt/venv/bin/python"]).nodes[0]
    return nodeprog.command(node, "ddpfab-node"), nodeprog.setup_head(node) + nodeprog.shipped()


def started(pool: spares.Spares, opened: list[Chan], transport: Transport | None = None) -> None:
    transport = transport or Transport()

    def open_session(node: str) -> Chan:
        opened.append(Chan(transport))
        return opened[-1]
    pool.start_wanted(open_session, go=lambda: True)


def test_a_spare_is_the_command_and_its_first_stdin_handed_out_once(program):
    command, preamble = program
    pool, opened = spares.Spares(), []
    pool.want("node1", command, preamble)
    started(pool, opened)
    assert [(c.command, c.stdin) for c in opened] == [(command, preamble)]
    assert pool.take("node1", command, preamble + b"x") is None  # other first bytes: not this start
    assert pool.take("node2", command, preamble) is None
    assert pool.take("node1", command, preamble) is opened[0]
    assert pool.take("node1", command, preamble) is None  # handed out once
    assert not opened[0].closed


def test_only_a_node_programs_own_start_is_ever_started_ahead(program):
    """Not a setup line (the user's, run when asked), not a python the node picks at the start,
    not a supervisor, not another command, not other first bytes."""
    command, preamble = program
    assert spares.startable(command, preamble)
    with_setup = inventory.load("127.0.0.1,", extra_vars=["ddpfab_python=/opt/venv/bin/python",
                                                          "ddpfab_setup='kinit -R'"]).nodes[0]
    undecided = inventory.load("127.0.0.1,").nodes[0]
    others = [(nodeprog.command(n, "ddpfab-node"), nodeprog.setup_head(n) + nodeprog.shipped())
              for n in (with_setup, undecided)]
    assert nodeprog.setup_head(with_setup), "the setup travels on stdin, before the program"
    others += [(command.replace("ddpfab-node", "ddpfab-agent run-1"), preamble), ("rm -rf ~/ckpt", preamble),
               ("python3 train.py", b"x"), (command, b""), (command, preamble + b"more")]
    pool, opened = spares.Spares(), []
    for other, first in others:
        assert not spares.startable(other, first), other[:80]
        pool.want("node1", other, first)
    assert not pool.wanted
    started(pool, opened)
    assert opened == []


@pytest.mark.parametrize("how", ["too old", "ended", "closed", "connection lost"])
def test_a_spare_that_cannot_be_used_as_fresh_is_closed_not_handed_out(program, how):
    command, preamble = program
    pool, opened, transport = spares.Spares(max_age=0.0 if how == "too old" else 60.0), [], Transport()
    pool.want("node1", command, preamble)
    started(pool, opened, transport)
    chan = opened[0]
    if how == "ended":
        chan.exited = True
    elif how == "closed":
        chan.closed = True
    elif how == "connection lost":
        transport.active = False
    assert pool.take("node1", command, preamble) is None
    assert chan.closed


def test_a_node_keeps_at_most_per_node_the_oldest_making_room(program):
    _, preamble = program
    pool, opened = spares.Spares(per_node=2), []
    commands = [shlex.join(nodeprog.argv(f"/opt/{v}/bin/python", "ddpfab-node")) for v in "abc"]
    for command in commands:
        pool.want("node1", command, preamble)
        started(pool, opened)
    assert [c.closed for c in opened] == [True, False, False]
    assert pool.take("node1", commands[2], preamble) is opened[2]


def test_nothing_is_started_while_a_command_runs_and_a_failed_start_is_no_error(program):
    command, preamble = program
    pool = spares.Spares()
    pool.want("node1", command, preamble)
    pool.start_wanted(lambda node: pytest.fail("started while busy"), go=lambda: False)
    assert pool.wanted
    failed = Chan(Transport(), fail=True)
    pool.start_wanted(lambda node: failed, go=lambda: True)
    assert failed.closed and not pool.wanted
    assert pool.take("node1", command, preamble) is None


def test_closing_ends_every_spare_and_starts_none_after(program):
    command, preamble = program
    pool, opened = spares.Spares(), []
    pool.want("node1", command, preamble)
    pool.want("node2", command, preamble)
    started(pool, opened)
    pool.close()
    assert all(c.closed for c in opened)
    pool.want("node1", command, preamble)
    assert not pool.wanted


def test_old_spares_and_those_of_a_node_an_exec_ran_on_are_replaced(program):
    command, preamble = program
    pool, opened = spares.Spares(max_age=60.0), []
    for node in ("node1", "node2"):
        pool.want(node, command, preamble)
    started(pool, opened)
    pool.renew()  # none is old yet
    assert not pool.wanted and not any(c.closed for c in opened)
    pool.renew({"node2"})  # an exec ran there
    assert [c.closed for c in opened] == [False, True] or [c.closed for c in opened] == [True, False]
    replaced = next(c for c in opened if c.closed)
    started(pool, opened)
    assert len(opened) == 3 and not opened[2].closed
    pool.max_age = -1.0  # every spare is old now
    pool.renew()
    assert all(c.closed for c in opened) and pool.wanted
    started(pool, opened)
    assert [c.closed for c in opened[3:]] == [False, False] and replaced.closed
