"""A channel over ``ddpfab hold``'s connection, against a holder played here on a real abstract
Unix socket with the relay's frames (the real holder, on lab hosts: tests/lab/test_hold.py):
a holder gone mid-command ends the channel (no reader waits for ever), unread output makes the
holder wait instead of filling this process's memory, closing the connection ends its channels,
a refusal is the node's error with its kind, the exit status comes as sshd sends it, writes time
out as ``settimeout`` says; and the relay closes the channel of a client that has gone."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import pytest

from ddpfab.hosts import inventory
from ddpfab.remote import heldconn, holder, relay, ssh
from ddpfab.remote.target import HostKeyPolicy


class FakeHolder:
    """Accepts one channel request on an abstract socket and hands the client to *play*."""

    def __init__(self, play):
        self.name = f"\0ddpfab-test-held-{os.getpid()}-{id(self)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.name)
        self.listener.listen(1)
        self.request: dict = {}
        self.result: dict = {}
        self.thread = threading.Thread(target=self._serve, args=(play,), daemon=True)
        self.thread.start()

    def _serve(self, play) -> None:
        client, _ = self.listener.accept()
        try:
            self.request = json.loads(relay.read_header(client) or b"{}")
            play(client, relay.frame_sender(client), self.result)
        finally:
            client.close()
            self.listener.close()


@pytest.fixture
def node():
    return inventory.load("127.0.0.1,").nodes[0]


def held(fake: FakeHolder, node) -> heldconn.HeldConnection:
    return heldconn.HeldConnection(fake.name, node, holder.fingerprint(node), HostKeyPolicy(), None)


def test_a_holder_gone_mid_command_ends_the_channel(node):
    def play(client, send, result):
        send(b"s", b"")
        send(b"o", b"partial ")  # then the holder is gone: no exit status

    fake = FakeHolder(play)
    chan = held(fake, node).transport.open_session()
    chan.exec_command("echo hi")
    assert fake.request == {"op": "channel", "node": node.name, "print": holder.fingerprint(node), "command": "echo hi"}
    chan.settimeout(10)
    fake.thread.join(timeout=10)
    deadline = time.monotonic() + 10
    while not chan.closed and time.monotonic() < deadline:  # (its reader sees the end)
        time.sleep(0.01)
    assert chan.closed  # by the other side, as paramiko's channel says after the node's close
    assert chan.recv(100) == b"partial "  # what came before is still read
    assert chan.recv(100) == b""  # its end, not a wait for ever
    assert chan.recv_exit_status() == -1 and chan.exit_status_ready()
    # the holder's end, as data: its relay was lost (not closed here) and no holder answers now
    assert chan.relay_lost and heldconn.holder_gone(chan)
    assert not heldconn.holder_gone(object())  # a node's own channel never is


def test_a_node_programs_first_stdin_follows_its_request_and_the_rest_after_it(node):
    """exec_program: the preamble's size in the request and its bytes right after the line (the
    holder writes them or has them written already); what the program is sent next follows."""
    def play(client, send, result):
        result["preamble"] = relay.read_exactly(client, fake.request.get("preamble", 0), timeout=10)
        send(b"s", b"")
        client.settimeout(10)
        result["rest"] = client.recv(100)
        send(b"x", b"0")

    fake = FakeHolder(play)
    chan = held(fake, node).transport.open_session()
    chan.exec_program("python3 -S -c LOADER", b"setup" + b"P" * 200_000)
    chan.sendall(b"5\n{...}")
    assert chan.recv_exit_status() == 0
    fake.thread.join(timeout=10)
    assert fake.request["preamble"] == 200_005 and fake.request["command"] == "python3 -S -c LOADER"
    assert fake.result == {"preamble": b"setup" + b"P" * 200_000, "rest": b"5\n{...}"}


def test_unread_output_makes_the_holder_wait(node):
    def play(client, send, result):
        send(b"s", b"")
        client.settimeout(1.0)
        sent, chunk = 0, b"x" * 65536
        try:
            while sent < 64 << 20:
                send(b"o", chunk)
                sent += len(chunk)
        except OSError:  # (a timeout: the client reads no more)
            pass
        result["sent"] = sent

    fake = FakeHolder(play)
    conn = held(fake, node)
    chan = conn.transport.open_session()
    chan.exec_command("cat big")
    fake.thread.join(timeout=30)
    assert heldconn.BUFFER_MAX <= fake.result["sent"] < heldconn.BUFFER_MAX + (4 << 20), fake.result
    conn.close()


def test_a_channel_the_holder_ended_without_a_status_is_the_holder_s_end_once_it_is_gone(node):
    """The holder closing its own connection to the node first (``hold --stop``) relays its
    channel's end as ``x -1``: no exit status; with the holder gone, that is the holder's end."""
    def play(client, send, result):
        send(b"s", b"")
        send(b"x", b"-1")

    fake = FakeHolder(play)
    chan = held(fake, node).transport.open_session()
    chan.exec_command("sleep 60")
    fake.thread.join(timeout=10)
    assert chan.recv_exit_status() == -1 and chan.relay_lost and heldconn.holder_gone(chan)


def test_closing_the_connection_ends_its_channels(node):
    def play(client, send, result):
        send(b"s", b"")
        client.settimeout(10)
        result["eof"] = client.recv(10) == b""  # the command's input ends: the holder closes it

    fake = FakeHolder(play)
    conn = held(fake, node)
    chan = conn.transport.open_session()
    chan.exec_command("sleep 60")
    time.sleep(0.2)
    assert not chan.closed  # (running)
    began = time.monotonic()
    conn.close()
    fake.thread.join(timeout=10)
    assert fake.result == {"eof": True} and chan.closed
    assert chan.recv(10) == b"" and time.monotonic() - began < 5
    assert not chan.relay_lost and not heldconn.holder_gone(chan)  # closed here: no holder's end


def test_a_refusal_is_the_nodes_error_with_its_kind(node):
    def play(client, send, result):
        send(b"f", json.dumps({"kind": "unreachable", "text": f"host {node.name}: unreachable: no route",
                               "found": "unreachable: no route"}).encode())

    fake = FakeHolder(play)
    chan = held(fake, node).transport.open_session()
    with pytest.raises(ssh.SSHError) as raised:
        chan.exec_command("true")
    assert (raised.value.kind, str(raised.value), raised.value.found) == (
        "unreachable", f"host {node.name}: unreachable: no route", "unreachable: no route")


def test_the_exit_status_comes_before_output_a_descendant_still_writes(node):
    """As sshd tells it on a channel of one's own: `(sleep 5 &); echo hi` has exited while the
    sleep keeps its stdout open; the output after the status still arrives, then the end."""
    go_on = threading.Event()

    def play(client, send, result):
        send(b"s", b"")
        send(b"o", b"hi\n")
        send(b"x", b"3")
        go_on.wait(10)
        send(b"o", b"late\n")

    fake = FakeHolder(play)
    chan = held(fake, node).transport.open_session()
    chan.exec_command("(sleep 5 &); echo hi; exit 3")
    chan.settimeout(10)
    assert chan.recv_exit_status() == 3
    assert chan.exit_status_ready() and not chan.eof_received
    assert chan.recv(100) == b"hi\n"
    go_on.set()
    assert chan.recv(100) == b"late\n"
    assert chan.recv(100) == b"" and chan.eof_received and chan.recv_exit_status() == 3


def test_a_write_the_command_does_not_read_times_out_as_settimeout_says(node):
    def play(client, send, result):
        send(b"s", b"")
        time.sleep(8)  # reads nothing: the socket's buffers fill

    fake = FakeHolder(play)
    conn = held(fake, node)
    chan = conn.transport.open_session()
    chan.exec_command("sleep 60")
    chan.settimeout(0.5)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        chan.sendall(b"x" * (64 << 20))
    # at its timeout, not after a wait for an exit status (END_WAIT_S: the holder's end) that a
    # command still running never sends
    assert time.monotonic() - began < 0.5 + heldconn.END_WAIT_S
    conn.close()


class FakeChannel:
    """A paramiko channel as the relay uses it: output that comes when the test says, an exit
    status, EOF, and ``fileno`` readable while there is output or after EOF and close. Its
    command ignores its input's end."""

    def __init__(self):
        self.r, self.w = os.pipe()
        self.out = bytearray()
        self.status: int | None = None
        self.eof_received = self.closed = self.eof_sent = False
        self.cond = threading.Condition()

    def fileno(self):
        return self.r

    def _say(self):
        self.cond.notify_all()
        os.write(self.w, b"!")

    def give(self, out: bytes = b"", status: int | None = None, eof: bool = False):
        with self.cond:
            self.out += out
            self.status = status if status is not None else self.status
            self.eof_received = self.eof_received or eof
            self._say()

    def recv_ready(self):
        return bool(self.out)

    def recv(self, n):
        with self.cond:
            while not self.out and not (self.eof_received or self.closed):
                self.cond.wait(30)
            data = bytes(self.out[:n])
            del self.out[:n]
            return data

    def recv_stderr_ready(self):
        return False

    def recv_stderr(self, n):
        with self.cond:
            while not (self.eof_received or self.closed):
                self.cond.wait(30)
            return b""

    def exit_status_ready(self):
        return self.status is not None or self.closed

    def recv_exit_status(self):
        with self.cond:
            while self.status is None and not self.closed:
                self.cond.wait(30)
            return -1 if self.status is None else self.status

    def sendall(self, data):
        pass

    def shutdown_write(self):
        self.eof_sent = True

    def close(self):
        with self.cond:
            self.closed = True
            self._say()


def relayed(chan: FakeChannel, exit_first: bool) -> tuple[socket.socket, threading.Thread]:
    """The relay of *chan* in a thread, as the holder serves it (its socket closed after); the
    client's end of the socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def serve():
        try:
            with contextlib.suppress(OSError):  # its last frame to a client that has gone: the callers' case
                relay.relay(ours, chan, relay.frame_sender(ours), exit_first)
        finally:
            ours.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    theirs.settimeout(10)
    return theirs, th


@pytest.mark.parametrize("exit_first", [False, True])
def test_a_client_that_goes_away_closes_its_channel_a_half_close_does_not(exit_first):
    chan = FakeChannel()
    theirs, th = relayed(chan, exit_first)
    theirs.shutdown(socket.SHUT_WR)  # the command's input ends; its output is still wanted
    time.sleep(1.5)
    assert chan.eof_sent and not chan.closed
    began = time.monotonic()
    theirs.close()  # the client is gone
    th.join(timeout=10)
    assert not th.is_alive() and chan.closed and time.monotonic() - began < 5


@pytest.mark.parametrize("exit_first", [False, True])
def test_the_relays_end_is_the_clients_eof_though_its_input_stays_open(exit_first):
    chan = FakeChannel()
    theirs, th = relayed(chan, exit_first)
    chan.give(b"bye\n", status=0, eof=True)  # the client never half-closes: its input stays open
    assert [heldconn._frame(theirs) for _ in range(2)] == [(b"o", b"bye\n"), (b"x", b"0")]
    assert theirs.recv(10) == b""  # the end, not a wait for the client's next byte
    th.join(timeout=10)
    assert not th.is_alive()
    theirs.close()


def test_the_exit_status_follows_what_sshd_sent_before_it():
    chan = FakeChannel()
    chan.give(b"hi\n", status=3)  # in the buffers before the relay looks: sent before the status
    theirs, th = relayed(chan, True)
    assert [heldconn._frame(theirs) for _ in range(2)] == [(b"o", b"hi\n"), (b"x", b"3")]
    chan.give(b"late\n", eof=True)  # a descendant's, after the status
    assert heldconn._frame(theirs) == (b"o", b"late\n")
    assert theirs.recv(10) == b""
    th.join(timeout=10)
    theirs.close()
