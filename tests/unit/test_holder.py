"""The connection holder's client: what it reads back is data, validated; anything it cannot read
makes the nodes' results name the holder, never a traceback; no holder or a request the holder
does not hold runs cold (None). The lab test (tests/lab/test_hold.py) drives the real holder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpfab.hosts.inventory import Node
from ddpfab.remote import holder
from ddpfab.remote.output import summary


class Printer:
    def __init__(self):
        self.lines: list[tuple[str, str, bool]] = []
        self.closed = False

    def line(self, name, text, stderr=False):
        self.lines.append((name, text, stderr))

    def ended(self, result):
        self.lines.append((result.name, "ended", False))


def fake_holder(answer: bytes) -> tuple[str, threading.Thread]:
    """A server of this user on a fresh abstract name that reads one request and sends *answer*."""
    name = f"\0ddpfab-hold-test-{os.getpid()}-{threading.get_ident()}-{len(answer)}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen()

    def serve():
        c, _ = srv.accept()
        c.recv(65536)
        c.sendall(answer)
        c.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return name, t


NODES = [Node("a", "10.0.0.1"), Node("b", "10.0.0.2")]


def test_no_holder_means_cold():
    assert holder.exec_held("\0ddpfab-hold-nobody-here", NODES, "true", Printer()) is None
    assert holder.request("\0ddpfab-hold-nobody-here", {"op": "status"}) is None


@pytest.mark.parametrize("answer", [
    b'{"held": false, "why": "not held as asked: a"}\n',
    b"",  # closed before it ran anything (it was ending): nothing ran
    b'not json\n', b'{"node": "a", "line": "x"}\n',  # no "held": true first: not a holder that runs it
])
def test_a_holder_that_does_not_say_it_runs_the_command_means_cold(answer):
    name, t = fake_holder(answer)
    assert holder.exec_held(name, NODES, "true", Printer()) is None
    t.join(5)


def test_lines_and_results_are_read_as_data():
    name, t = fake_holder(b'{"held": true}\n{"node": "a", "line": "hi", "stderr": false}\n'
                          b'{"node": "b", "line": "oops", "stderr": true}\n'
                          b'{"node": "a", "exit_code": 0, "error": null, "seconds": 0.1}\n'
                          b'{"node": "b", "exit_code": null, "error": "unreachable", "seconds": 0.2}\n'
                          b'{"done": true}\n')
    printer = Printer()
    got = holder.exec_held(name, NODES, "true", printer)
    t.join(5)
    # each node's end reaches the printer as it comes (exec --fold's Ctrl-C reports those as they ended)
    assert printer.lines == [("a", "hi", False), ("b", "oops", True), ("a", "ended", False), ("b", "ended", False)]
    assert (got["a"].exit_code, got["a"].held, got["b"].error) == (0, True, "unreachable")
    code, text = summary(got, 0.5)
    assert code == 255 and "b=unreachable" in text and "over the connections `ddpfab hold` keeps open" in text


def test_a_printer_without_ended_still_gets_the_lines_and_results():
    """A library caller's printer from before ``ended`` existed (``line`` and ``closed`` only)."""
    name, t = fake_holder(b'{"held": true}\n{"node": "a", "line": "hi", "stderr": false}\n'
                          b'{"node": "a", "exit_code": 0, "error": null, "seconds": 0.1}\n'
                          b'{"node": "b", "exit_code": 0, "error": null, "seconds": 0.1}\n{"done": true}\n')

    class Old:
        closed = False
        lines: list = []

        def line(self, name, text, stderr=False):
            self.lines.append(text)

    got = holder.exec_held(name, NODES, "true", Old())
    t.join(5)
    assert Old.lines == ["hi"] and {r.exit_code for r in got.values()} == {0}


@pytest.mark.parametrize("answer, found", [
    (b"not json\n", "not JSON"),
    (b'["a list"]\n', "not an object"),
    (b'{"node": "zz", "line": "x"}\n', "a node not asked"),
    (b'{"node": "a", "exit_code": "0"}\n', "malformed result"),
    (b'{"node": "a", "something": 1}\n', "unknown message"),
    (b'{"node": "a", "line": "x"}', "ended mid-line"),
    (b'{"node": "a", "exit_code": 0}\n', "gave no result"),  # b never answered, then EOF
])
def test_whatever_the_holder_answers_once_it_runs_the_command_the_nodes_results_say_it(answer, found):
    name, t = fake_holder(b'{"held": true}\n' + answer)
    got = holder.exec_held(name, NODES, "true", Printer())
    t.join(5)
    assert set(got) == {"a", "b"}
    assert any(r.error and found in r.error for r in got.values()), got


def test_the_socket_name_is_per_user_and_per_inventory(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {a: {}}}\n")
    one = holder.address([str(inv)], None, None)
    assert one.startswith(f"\0ddpfab-hold-{os.getuid()}-")
    assert holder.address(str(inv), None, None) == one  # a path or a list of one
    assert holder.address([str(inv)], "/etc/ssh/ssh_config", None) != one
    assert holder.address([str(inv), "b,"], None, None) != one
    # a node's every field is in its fingerprint: a changed variable is not served by old connections
    assert holder.fingerprint(Node("a", "h")) != holder.fingerprint(Node("a", "h", workdir="/w"))


def test_a_held_exec_does_not_import_the_ssh_stack(tmp_path):
    """`ddpfab exec` over a holder's connections needs no paramiko or Fabric (their import was a
    third of such a command's start): the whole command line, run against a holder that answers
    for both nodes, leaves them unimported."""
    inv = tmp_path / "lab.yml"
    inv.write_text("all:\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n    b: {ansible_host: 10.0.0.2}\n")
    name, t = fake_holder(b'{"held": true}\n{"node": "a", "line": "hi"}\n{"node": "a", "exit_code": 0}\n'
                          b'{"node": "b", "exit_code": 0}\n{"done": true}\n')
    code = ("import json, sys; from ddpfab.remote import holder; holder.address = lambda *a: chr(0) + sys.argv[1]; "
            "from ddpfab.cli import main; rc = main(['exec', '-i', sys.argv[2], '--', 'true']); "
            "print(json.dumps([rc, sorted(m for m in ('paramiko', 'fabric', 'invoke') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code, name[1:], str(inv)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    t.join(timeout=10)
    assert out.stdout.splitlines()[-1] == "[0, []]", out.stdout + out.stderr
    assert "a | hi" in out.stdout and "over the connections `ddpfab hold` keeps open" in out.stderr, out.stderr


def test_a_signal_that_lands_inside_the_stopping_events_lock_still_ends_the_holder():
    """A SIGTERM's handler runs in the main thread wherever it is, which may be inside
    ``stopping.set()`` (serve's end) with the event's lock held: the handler must not wait for that
    lock (the holder would never end), and serve() still ends on it."""
    from ddpfab.remote import holdserver  # here: it loads paramiko, which a test above must not see

    h = holdserver.Holder(f"\0ddpfab-test-hold-{os.getpid()}", [], connect=lambda node: None)
    returned = threading.Event()

    def land_inside_the_lock():
        with h.stopping._cond:  # what the main thread holds inside Event.set()
            h.on_signal(signal.SIGTERM, None)
        returned.set()

    threading.Thread(target=land_inside_the_lock, daemon=True).start()
    assert returned.wait(5), "the signal handler waited for the stopping event's lock"
    assert h.bind()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        started = time.monotonic()
        h.serve()
        assert time.monotonic() - started < 5 and h.stopping.is_set()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
