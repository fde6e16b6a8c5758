"""`--pdb` without hosts: the ranks it names, how the command line reads it, the line a waiting rank
prints and how ddpfab reads it back, the node supervisor's setup, and a real python process whose
breakpoint() and uncaught exception wait in pdb on the socket (the relay's end played here)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpfab.cli import build_parser
from ddpfab.cli.run import spell_pdb
from ddpfab.launch import debugger
from ddpfab.node import agent, rankpdb
from ddpfab.planning.plan import PlanError, pdb_ranks

NODE = Path(rankpdb.__file__).parent


@pytest.mark.parametrize("spec, world, ranks", [
    ("", 4, ""), ("all", 4, "all"), ("3", 4, "3"), ("0,2-3", 4, "0,2,3"), ("3,1,1-2", 8, "1,2,3"), (" 5 ", 6, "5")])
def test_pdb_ranks_are_normalised(spec, world, ranks):
    assert pdb_ranks(spec, world) == ranks


@pytest.mark.parametrize("spec, world, words", [
    ("x", 4, "ranks and ranges"), ("3-1", 4, "ranks and ranges"), ("1,,2", 4, "ranks and ranges"),
    ("4", 4, "rank 4 is not in this job (its ranks are 0-3)"), ("2-9", 4, "rank 4 is not in this job")])
def test_pdb_ranks_refuse_what_is_not_a_rank_of_the_job(spec, world, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        pdb_ranks(spec, world)


@pytest.mark.parametrize("argv, spelled", [
    (["run", "-i", "inv", "--pdb", "train.py", "--pdb"], ["run", "-i", "inv", "--pdb=all", "train.py", "--pdb"]),
    (["run", "--pdb", "5", "train.py"], ["run", "--pdb", "5", "train.py"]),
    (["run", "--pdb", "0,2-3", "train.py"], ["run", "--pdb", "0,2-3", "train.py"]),
    (["run", "--pdb", "0, 3", "train.py"], ["run", "--pdb", "0, 3", "train.py"]),  # as pdb_ranks reads it
    (["run", "--env", "--pdb", "--pdb", "t.py"], ["run", "--env", "--pdb", "--pdb=all", "t.py"]),  # an option's value
    (["plan", "--pdb", "--nproc-per-node", "2", "t.py"], ["plan", "--pdb=all", "--nproc-per-node", "2", "t.py"]),
    (["run", "t.py", "--pdb", "x"], ["run", "t.py", "--pdb", "x"]),  # the script's own
    (["run", "--pdb"], ["run", "--pdb=all"]),
    (["exec", "--pdb", "x"], ["exec", "--pdb", "x"]),
    (["run", "--pdb", "-1", "t.py"], ["run", "--pdb", "-1", "t.py"]),  # a mistyped try at ranks: refused as one
    (["run", "--pdb", ",", "t.py"], ["run", "--pdb", ",", "t.py"]),
    # the end of ddpfab's options is no ranks (it was refused, with the advice to write --)
    (["run", "--pdb", "--", "t.py", "--dry-run"], ["run", "--pdb=all", "--", "t.py", "--dry-run"]),
])
def test_a_pdb_without_ranks_is_every_rank_and_never_takes_the_script(argv, spelled):
    assert spell_pdb(argv) == spelled


def test_a_word_after_pdb_that_is_no_file_before_one_that_is_is_taken_for_ranks(tmp_path, monkeypatch, capsys):
    """`run --pdb x ok.py` said `script x not found`, naming no --pdb."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text("")
    assert spell_pdb(["run", "--pdb", "x", "ok.py"]) == ["run", "--pdb", "x", "ok.py"]
    assert spell_pdb(["run", "--pdb", "ok.py", "x"]) == ["run", "--pdb=all", "ok.py", "x"]  # the script's argument
    with pytest.raises(PlanError, match=r"pdb takes 'all' or ranks .* got 'x'"):
        pdb_ranks(build_parser().parse_args(spell_pdb(["run", "-i", "a,", "--pdb", "x", "ok.py"])).pdb, 2)


def test_the_parser_reads_pdb_before_the_script():
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--pdb", "train.py", "--steps", "1"]))
    assert (args.pdb, args.script, args.args) == ("all", "train.py", ["--steps", "1"])
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--pdb", "3", "train.py"]))
    assert (args.pdb, args.script) == ("3", "train.py")
    assert build_parser().parse_args(["run", "-i", "a,b,", "train.py"]).pdb == ""


def test_the_waiting_line_is_read_back_as_the_rank_prints_it():
    line = rankpdb.WAITS % (5, 1, "/w/my dir (x)/train.py:12", "post-mortem: ValueError", 4242)
    m = debugger.WAITS.match(line)
    assert m and (m["rank"], m["local"], m["where"], m["kind"], m["pid"]) == (
        "5", "1", "/w/my dir (x)/train.py:12", "post-mortem: ValueError", "4242")
    assert debugger.WAITS.match("ddpfab-pdb: rank x waits") is None
    assert rankpdb.wanted("all", 7) and rankpdb.wanted("1,7", 7) and not rankpdb.wanted("1,17", 7)


def test_the_supervisor_installs_the_hooks_with_the_exit_guard_off(tmp_path):
    spec = {"exit_guard": {"mode": "off", "source": "# guard\n"},
            "pdb": {"ranks": "1,5", "node": "node3", "source": "# hooks\n"}}
    env = agent.exit_guard_env(spec, str(tmp_path), {"PYTHONPATH": "/x"})
    guard = tmp_path / agent.GUARD_DIR
    assert env["PYTHONPATH"] == f"{guard}:/x"
    assert (env["DDPFAB_PDB"], env["DDPFAB_PDB_DIR"], env["DDPFAB_PDB_NODE"]) == ("1,5", str(tmp_path / "pdb"), "node3")
    assert "DDPFAB_EXIT_GUARD" not in env  # off: no done records, no os._exit
    assert (guard / "sitecustomize.py").read_text() == "# guard\n"
    assert (guard / "ddpfab_rankpdb.py").read_text() == "# hooks\n"
    assert oct((tmp_path / "pdb").stat().st_mode & 0o777) == "0o700"  # a debugger is code execution: ours only
    # neither asked for: nothing installed
    assert agent.exit_guard_env({"exit_guard": {"mode": "off", "source": "#"}}, str(tmp_path / "b"), {}) == {}


SCRIPT = '''
import json
import os
x = 6
if os.environ["MODE"] == "stop":
    breakpoint()
    print("after the breakpoint", x, flush=True)
elif os.environ["MODE"] == "loop":  # breakpoint() again while the user is attached (a break set)
    for i in range(2):
        breakpoint()
        print("step", i, flush=True)
elif os.environ["MODE"] == "fork":  # a process the rank forked (a DataLoader worker) stays without
    pid = os.fork()
    if pid == 0:
        breakpoint()  # reads /dev/null, as without --pdb: BdbQuit... or returns at once
        os._exit(0)
    os.waitpid(pid, 0)
    print("the child did not wait", flush=True)
elif os.environ["MODE"] == "disterror":  # a collective's error type, raised outside its frames
    class DistBackendError(RuntimeError):
        pass
    DistBackendError.__module__ = "torch.distributed"
    raise DistBackendError("NCCL error: remote process exited")
elif os.environ["MODE"] == "raise":
    raise ValueError("bad batch")
else:  # raised inside a collective: the module's name says so
    exec(compile("raise RuntimeError('Connection closed by peer')", "c10d.py", "exec"),
         {"__name__": "torch.distributed.distributed_c10d"})
'''


def _rank(tmp_path: Path, mode: str) -> subprocess.Popen:
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text((NODE / "exitguard.py").read_text())
    (guard / "ddpfab_rankpdb.py").write_text((NODE / "rankpdb.py").read_text())
    (tmp_path / "pdb").mkdir(mode=0o700)
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(guard), "DDPFAB_PDB": "all", "DDPFAB_PDB_DIR": str(tmp_path / "pdb"),
           "DDPFAB_PDB_NODE": "node9", "RANK": "3", "LOCAL_RANK": "1", "MODE": mode}
    return subprocess.Popen([sys.executable, "-u", str(tmp_path / "job.py")], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _talk(path: Path, lines: list[str], until: bytes) -> bytes:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "the rank never listened"
        time.sleep(0.05)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.settimeout(30)
        out = b""
        for line in lines:
            while not out.endswith(b"(Pdb) "):
                out += s.recv(4096)
            s.sendall(line.encode() + b"\n")
            out = out.replace(b"(Pdb) ", b"(Pdb)> ")  # one prompt answered
        while until not in out:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
        return out


def test_a_breakpoint_waits_on_the_socket_and_continue_goes_on(tmp_path):
    proc = _rank(tmp_path, "stop")
    out = _talk(tmp_path / "pdb" / "rank-3.sock", ["p x * 7", "c"], b"")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert b"node9 rank 3 (Pdb)" in out and b"42" in out
    assert "after the breakpoint 6" in stdout
    assert debugger.WAITS.match(stderr.splitlines()[0])["kind"] == "breakpoint"
    assert not (tmp_path / "pdb" / "rank-3.sock").exists()  # the session closed with `c`


def test_commands_that_arrive_together_all_run_in_order(tmp_path):
    """Lines piped or pasted reach the rank in one write: pdb's first answer dropped the ones read
    ahead with it (one text file for both ways over the socket: a write discards what a read has
    buffered), and the job hung at the next prompt."""
    proc = _rank(tmp_path, "stop")
    sock = tmp_path / "pdb" / "rank-3.sock"
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert time.monotonic() < deadline, "the rank never listened"
        time.sleep(0.05)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock))
        s.settimeout(30)
        s.sendall(b"p x * 7\np x + 1\np 'third'\nc\n")
        out = b""
        while chunk := s.recv(4096):
            out += chunk
    stdout, stderr = proc.communicate(timeout=30)
    assert b"42\n" in out and b"7\n" in out and b"'third'\n" in out, out
    assert proc.returncode == 0 and "after the breakpoint 6" in stdout, (out, stderr)


def test_the_sessions_stream_reads_from_its_reader_and_writes_to_its_writer():
    """pdb's `!sys.stdin.readlines()` reads the session's input (pdb sets sys.stdin to it)."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        duplex = rankpdb._Duplex(theirs.makefile("r", encoding="utf-8", newline="\n"),
                                 theirs.makefile("w", buffering=1, encoding="utf-8", newline="\n"))
        mine.sendall(b"one\ntwo\nthree\n")
        mine.shutdown(socket.SHUT_WR)
        assert duplex.readline() == "one\n" and duplex.readable()
        duplex.write("answer\n")
        assert duplex.readlines() == ["two\n", "three\n"]  # read ahead, kept across the write
        duplex.close()
        assert mine.recv(100) == b"answer\n"


def test_an_uncaught_exception_waits_post_mortem_then_the_rank_fails_with_it(tmp_path):
    proc = _rank(tmp_path, "raise")
    out = _talk(tmp_path / "pdb" / "rank-3.sock", ["p x", "q"], b"")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert b"-> raise ValueError" in out and b"(Pdb)> 6\n" in out
    assert "post-mortem: ValueError" in stderr and "ValueError: bad batch" in stderr


@pytest.mark.parametrize("mode", ["stop", "raise"])
def test_a_user_who_goes_away_without_quitting_leaves_the_rank_waiting_where_it_was(tmp_path, mode):
    """The relay's end (the user's terminal closed, Ctrl-C in `ddpfab debug`) is no quit: the rank
    waits again at the same place (it read EOF, quit and failed), and the next user goes on from
    there: at a breakpoint `c` finishes the job; post-mortem `q` ends it with its exception."""
    proc = _rank(tmp_path, mode)
    sock = tmp_path / "pdb" / "rank-3.sock"
    first = _talk(sock, ["p x"], b"6\n")  # then the connection closes: the user went away
    assert b"(Pdb)> 6\n" in first
    out = _talk(sock, ["p x + 1", "c" if mode == "stop" else "q"], b"")
    stdout, stderr = proc.communicate(timeout=30)
    assert b"7\n" in out, out
    waits = [debugger.WAITS.match(ln) for ln in stderr.splitlines() if debugger.WAITS.match(ln)]
    # waiting again in the same frame (at a breakpoint: at the line pdb stopped at, after the call)
    assert len(waits) == 2 and waits[0]["kind"] == waits[1]["kind"], stderr
    assert waits[0]["where"].rsplit(":", 1)[0] == waits[1]["where"].rsplit(":", 1)[0], stderr
    if mode == "stop":
        assert proc.returncode == 0 and "after the breakpoint 6" in stdout, stderr
    else:
        assert proc.returncode == 1 and "ValueError: bad batch" in stderr and "BdbQuit" not in stderr


def test_the_terminal_s_end_of_input_is_pdb_s_quit():
    """Ctrl-D at `ddpfab debug`'s terminal sends pdb's quit (the relay's end alone is a detach)."""
    class Chan:
        sent = b""

        def sendall(self, data):
            Chan.sent += data

    read, write = os.pipe()
    os.close(write)  # the terminal's end of input
    quit_sent: list[bool] = []
    try:
        debugger._pump_input(Chan(), threading.Event(), read, quit_sent)
    finally:
        os.close(read)
    assert Chan.sent == debugger.QUIT == b"q\n"
    assert quit_sent == [True]  # `ddpfab debug` says so: a script's piped commands ended without `c`


@pytest.mark.parametrize("piped, quits", [(b"p x\nc\n", False), (b"p x\ncontinue\n\n", False), (b"q\n", False),
                                          (b"p x\n", True), (b"c\np x\n", True), (b"p c\n", True)])
def test_piped_commands_that_end_in_continue_send_no_quit(piped, quits):
    """`printf 'p x\nc\n' | ddpfab debug RUN --rank 1` said ddpfab had sent pdb's quit and the rank
    would fail at its next prompt: the commands had said what to do, and the job went on."""
    class Chan:
        sent = b""
        shut = False

        def sendall(self, data):
            Chan.sent += data

        def shutdown_write(self):
            Chan.shut = True

    read, write = os.pipe()
    os.write(write, piped)
    os.close(write)
    quit_sent: list[bool] = []
    try:
        debugger._pump_input(Chan(), threading.Event(), read, quit_sent)
    finally:
        os.close(read)
    assert Chan.sent == piped + (debugger.QUIT if quits else b"")
    assert quit_sent == ([True] if quits else [])
    # the input's end reaches the rank: with a breakpoint set, `c` would stop it at a prompt again,
    # and pdb there must read the end (and wait for the next user), not wait for more (a review's find)
    assert Chan.shut is not quits


def test_a_breakpoint_while_attached_is_driven_on_the_same_session(tmp_path):
    """`c` with a break set keeps the session; the next breakpoint() prompts there again instead of
    waiting on a new socket nobody can reach (the run's terminal is still on the old one)."""
    proc = _rank(tmp_path, "loop")
    never = SCRIPT.splitlines().index('    raise ValueError("bad batch")') + 1  # a line the loop never reaches
    out = _talk(tmp_path / "pdb" / "rank-3.sock", [f"b {never}", "c", "p i * 10", "cl 1", "c"], b"step 1")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert out.count(b"node9 rank 3 (Pdb)") == 5 and b"10\n" in out
    assert "step 0\nstep 1" in stdout
    assert len([ln for ln in stderr.splitlines() if debugger.WAITS.match(ln)]) == 1  # one wait, one socket


def test_a_process_the_rank_forked_does_not_wait_in_pdb(tmp_path):
    proc = _rank(tmp_path, "fork")
    stdout, stderr = proc.communicate(timeout=30)
    assert "the child did not wait" in stdout and "waits in pdb" not in stderr


def test_a_collectives_error_type_gets_no_post_mortem_wherever_it_surfaces(tmp_path):
    proc = _rank(tmp_path, "disterror")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "remote process exited" in stderr and "waits in pdb" not in stderr


def test_an_exception_raised_inside_a_collective_gets_no_post_mortem(tmp_path):
    proc = _rank(tmp_path, "collective")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "RuntimeError: Connection closed by peer" in stderr
    assert "waits in pdb" not in stderr and not list((tmp_path / "pdb").iterdir())


# -- --debugpy: the same ranks' spelling, its own line, the supervisor's setup ----------------------
def test_debugpy_ranks_are_read_as_pdb_ranks_and_refusals_name_debugpy():
    assert pdb_ranks("1,3-4", 6, "debugpy") == "1,3,4"
    with pytest.raises(PlanError, match="debugpy='9': rank 9 is not in this job"):
        pdb_ranks("9", 4, "debugpy")
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--debugpy", "train.py", "--debugpy"]))
    assert (args.debugpy, args.script, args.args) == ("all", "train.py", ["--debugpy"])
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--debugpy", "2", "train.py"]))
    assert (args.debugpy, args.pdb, args.script) == ("2", "", "train.py")


def test_the_listening_line_is_read_back_as_the_rank_prints_it():
    from ddpfab.launch import dapforward
    from ddpfab.node import rankdebugpy

    m = dapforward.LISTENS.match(rankdebugpy.LISTENS % (5, 1, 40123, 4242))
    assert m and (m["rank"], m["local"], m["port"], m["pid"]) == ("5", "1", "40123", "4242")
    assert rankdebugpy.wanted("all", 3) and rankdebugpy.wanted("1,3", 3) and not rankdebugpy.wanted("13", 3)
    # not a named rank, or a process the rank started (its DataLoader workers): nothing listens
    assert not rankdebugpy.install({"DDPFAB_DEBUGPY": "1", "RANK": "2", "LOCAL_RANK": "0"})
    assert not rankdebugpy.install({"DDPFAB_DEBUGPY": "2", "RANK": "2", "LOCAL_RANK": "0",
                                    rankdebugpy.OWNER_VAR: "77"})


def test_the_supervisor_installs_debugpy_in_the_ranks_it_names(tmp_path):
    spec = {"exit_guard": {"mode": "off", "source": "# guard\n"}, "debugpy": {"ranks": "3", "source": "# dap\n"}}
    env = agent.exit_guard_env(spec, str(tmp_path), {})
    guard = tmp_path / agent.GUARD_DIR
    assert env["PYTHONPATH"] == str(guard) and env["DDPFAB_DEBUGPY"] == "3" and "DDPFAB_PDB" not in env
    assert (guard / "ddpfab_rankdebugpy.py").read_text() == "# dap\n"


def test_pdb_and_debugpy_together_and_debugpy_detached_are_refused(tmp_path, monkeypatch):
    from ddpfab.api import Cluster
    from ddpfab.hosts.inventory import load
    from ddpfab.planning.plan import Facts, RunOptions, make_plan

    # the planner decides it: run, plan, replay and the API all plan
    cluster = load("a,b,")
    facts = Facts(addresses={"a": "10.0.0.1", "b": "10.0.0.2"}, master_port=29501, cwd="/w", homes={})
    assert make_plan(cluster, RunOptions("t.py", debugpy="1"), facts).debugpy == "1"
    with pytest.raises(PlanError, match="a rank is debugged one way"):
        make_plan(cluster, RunOptions("t.py", pdb="all", debugpy="1"), facts)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print(1)\n")
    with pytest.raises(PlanError, match="debugpy with detach"):  # before any node is contacted
        Cluster.load("a,b,").run("t.py", debugpy="1", detach=True)
    # --tmux with --pdb never goes together: said first, not "--pdb needs an input" (fixing the
    # input only met this refusal next)
    assert shutil.which("tmux"), "scripts/setup.sh installs tmux"
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115 - closed with the test's process
    with pytest.raises(PlanError, match="tmux with pdb"):
        Cluster.load("a,b,").run("t.py", pdb="all", tmux=True)


class _Chan:
    """A paramiko channel's surface over one end of a socketpair (the node's debugpy at the other)."""

    def __init__(self, sock):
        self.sock = sock

    def recv(self, n):
        return self.sock.recv(n)

    def sendall(self, data):
        self.sock.sendall(data)

    def shutdown_write(self):
        self.sock.shutdown(socket.SHUT_WR)

    def close(self):
        self.sock.close()


class _Transport:
    def __init__(self):
        self.opened = []  # (dest, the node's end)

    def open_channel(self, kind, dest, src, timeout=None):
        assert kind == "direct-tcpip"
        mine, node = socket.socketpair()
        self.opened.append((dest, node))
        return _Chan(mine)


def test_the_forwarder_serves_this_user_only_and_a_restarted_rank_replaces_its_port(tmp_path):
    from types import SimpleNamespace

    from ddpfab.launch import dapforward
    from ddpfab.node import rankdebugpy

    plan = SimpleNamespace(run_id="r1", nodes=[SimpleNamespace(name="node2", workdir="/w")])
    transport, notes = _Transport(), []
    fwd = dapforward.DapForwarder(plan, {"node2": lambda: transport}, notes.append, str(tmp_path), "/here")
    fwd.saw("node2", rankdebugpy.LISTENS % (3, 1, 41000, 77))
    port = json.loads((tmp_path / "launch.json").read_text())["configurations"][0]["connect"]["port"]
    assert [f.rank for f in fwd.stopped()] == [3]  # waiting for its client: no hang is looked for
    # this user: forwarded to the rank's port on the node's loopback, both ways
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        deadline = time.monotonic() + 10
        while not transport.opened and time.monotonic() < deadline:
            time.sleep(0.02)
        dest, node_end = transport.opened[0]
        assert dest == ("127.0.0.1", 41000)
        client.sendall(b"ping")
        assert node_end.recv(4) == b"ping"
        node_end.sendall(b"pong")
        assert client.recv(4) == b"pong"
    # another user of this machine: refused, nothing forwarded
    other = subprocess.run(["runuser", "-u", "nobody", "--", "bash", "-c",
                            f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected && cat <&3 && echo closed"],
                           capture_output=True, text=True, timeout=30)
    assert other.stdout.split() == ["connected", "closed"], other.stdout + other.stderr
    assert len(transport.opened) == 1 and any("refused a connection" in n and "another user" in n for n in notes)
    # torchrun restarted the rank: a new port; the old one is closed
    fwd.saw("node2", rankdebugpy.LISTENS % (3, 1, 42000, 78))
    entries = json.loads((tmp_path / "launch.json").read_text())["configurations"]
    assert len(entries) == 1 and entries[0]["connect"]["port"] != port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    fwd.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", entries[0]["connect"]["port"]), timeout=5)


def test_once_the_run_is_stopping_no_waiting_rank_gets_the_terminal():
    """Ctrl-C while attached to rank 3 with ranks 2, 1, 0 waiting: each was handed the terminal
    as the job was torn down, and each said `rank N is not waiting in pdb ... (not stopped, or
    attached from another terminal)`. A stopping run hands it to none; nor to a rank that stops
    after that."""
    from types import SimpleNamespace

    notes: list[str] = []
    relays: list[str] = []
    d = debugger.Debugger(SimpleNamespace(nodes=[SimpleNamespace(name="node2")]),
                          {"node2": lambda: relays.append("relay") or None}, notes.append)
    d.attached = debugger.Stop("node2", 3, 1, "t.py:6", "breakpoint", 99)
    d.waiting = [debugger.Stop("node2", r, r % 2, "t.py:6", "breakpoint", 90 + r) for r in (2, 1, 0)]
    d.stopping()
    with d.lock:  # the attached rank's relay ended (the rank was stopped): what comes next
        d._next_locked()
    d.saw("node2", rankpdb.WAITS % (1, 1, "t.py:6", "breakpoint", 91))
    assert (d.attached, d.waiting, d.session, relays, notes) == (None, [], None, [], [])


def test_a_ctrl_c_while_a_rank_is_driven_in_pdb_is_held_and_a_second_one_stops():
    """A Ctrl-C at `run --pdb`'s prompt (a pdb habit) stopped the job on every node. Now the first
    one is held, with a line saying so; a second within CONFIRM_S stops the job as before, and
    with no rank attached the first one stops it."""
    import io
    import queue
    import signal
    import types

    from ddpfab.launch import execute
    from ddpfab.launch.interrupt import Interrupted

    from .test_failure_story import plan3

    plan = plan3()
    dbg = debugger.Debugger(plan, {}, lambda text: None)
    out, stops = io.StringIO(), []
    monitor = execute._Monitor({n.name: types.SimpleNamespace(plan=plan) for n in plan.nodes}, queue.SimpleQueue(),
                               execute.Printer(plan, stream=out, color=False),
                               lambda fast=False, why=b"": stops.append(fast), lambda: None, debugger=dbg)
    monitor.interrupt(Interrupted(signal.SIGINT))  # no rank in the debugger: a stop
    assert monitor.interrupted == "SIGINT" and stops == [False]
    monitor.interrupted, stops[:] = None, []
    dbg.attached = debugger.Stop("node2", 1, 0, "train.py:7", "breakpoint", 4242)
    monitor.signals.append(signal.SIGINT)  # (as signals_queued took it)
    monitor.interrupt(Interrupted(signal.SIGINT))
    assert monitor.interrupted is None and stops == [] and not monitor.signals
    assert "Ctrl-C while rank 1 on node2 (local rank 0, breakpoint at train.py:7) is in the debugger does not stop " \
           "the job: Ctrl-C again within 3 s stops it on every node" in out.getvalue()
    monitor.interrupt(Interrupted(signal.SIGTERM))  # not a Ctrl-C: a stop at once
    assert monitor.interrupted == "SIGTERM" and stops == [False]
    monitor.interrupted, stops[:] = None, []
    monitor.interrupt(Interrupted(signal.SIGINT))  # the second Ctrl-C, within CONFIRM_S
    assert monitor.interrupted == "SIGINT" and stops == [False]
