"""Which of a run's preparation sessions go on as its supervisors (runner.supervisors_to_be)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import runner
from ddpfab.remote import nodeprogram as nodeprog

CLUSTER = Inventory("inv.yml", "all", (Node("n1", "10.0.0.1", python="/venv/bin/python", python_from="inventory"),
                                       Node("n2", "10.0.0.2", python="/opt/env/bin/python", python_from="ddpfab_setup",
                                            setup=("source /opt/env/bin/activate",)),
                                       Node("n3", "10.0.0.3", python="/usr/bin/python3", python_from="default")))
RUN_WORDS = nodeprog.supervisor_words("r1")


def session(words=RUN_WORDS, idle=True) -> SimpleNamespace:
    return SimpleNamespace(words=words, idle=idle)


@pytest.mark.parametrize("sessions, synced, kept", [
    ({"n1": session(), "n2": session()}, False, ["n1", "n2"]),
    # a sync changed the workdir: the setup lines that ran before it run again, in a session of its own
    ({"n1": session(), "n2": session()}, True, ["n1"]),
    # a session a held connection's spare started, or one of another run: never this run's supervisor
    ({"n1": session(("ddpfab-node",)), "n2": session(nodeprog.supervisor_words("r2"))}, False, []),
    # something asked and not answered (or the program ended): its output is not the job's
    ({"n1": session(idle=False), "n2": session()}, False, ["n2"]),
    # a python found on PATH: the probe ran whatever a shim there set up, the supervisor would not
    ({"n1": session(), "n3": session()}, False, ["n1"]),
])
def test_a_preparation_session_goes_on_as_the_supervisor_only_where_it_is_the_runs_and_idle(sessions, synced, kept):
    assert sorted(runner.supervisors_to_be(CLUSTER, sessions, "r1", synced)) == kept


class _Chan:
    def __init__(self, ready=False, ended=False):
        self.ready, self.closed, self.ended, self.sent = ready, False, ended, b""

    def recv_ready(self):
        return self.ready

    def exit_status_ready(self):
        return self.ended

    def sendall(self, data):
        self.sent += data

    def set_combine_stderr(self, combine):
        self.combined = combine


def _session(chan) -> nodeprog.Session:
    s = nodeprog.Session.__new__(nodeprog.Session)
    s.chan, s._sent, s._replies, s._broken, s._buf = chan, {}, {}, None, bytearray()
    s._ids = iter(range(5, 10))
    return s


def test_a_session_is_idle_only_with_everything_answered_and_its_program_running():
    assert _session(_Chan()).idle
    assert not _session(_Chan(ready=True)).idle  # output nobody has read
    assert not _session(_Chan(ended=True)).idle
    waiting = _session(_Chan())
    waiting._sent = {3: "facts"}
    assert not waiting.idle


def test_a_takeover_is_the_sessions_last_frame_and_hands_over_its_channel():
    chan = _Chan()
    s = _session(chan)
    assert s.take_over({"op": "supervise", "spec": {"run_id": "r1"}}) is chan and chan.combined
    assert chan.sent == nodeprog.frame({"op": "supervise", "spec": {"run_id": "r1"}, "id": 5})
