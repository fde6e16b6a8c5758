"""The node program as a module (request -> reply) and as the program a node runs (one python,
its code and the requests on stdin, one validated reply per request)."""

from __future__ import annotations

import ast
import errno
import hashlib
import importlib.util
import io
import json
import marshal
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import zlib
from pathlib import Path

import pytest

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hosts.inventory import Node
from ddpfab.node import loop
from ddpfab.node import ops as program
from ddpfab.health import probe
from ddpfab.node import treehash


def run_program(*requests: dict, timeout: float = 60) -> tuple[list[nodeprog.Reply], subprocess.CompletedProcess]:
    """The program as a node runs it: the loader, then code and requests on stdin."""
    reqs = nodeprog.numbered(*requests)
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), input=nodeprog.stdin_for(*reqs),
                          capture_output=True, timeout=timeout)
    return nodeprog.match_replies("local", reqs, proc.stdout.splitlines(), proc.returncode, proc.stderr.decode()), proc


def test_one_request_one_reply_as_a_module(tmp_path):
    out = json.loads(program.handle({"id": 7, "op": "facts", "workdir": str(tmp_path), "script": "x.py"}, {}))
    assert out["id"] == 7 and out["op"] == "facts" and out["ok"] is True
    assert out["result"]["workdir_exists"] is True and out["result"]["script_exists"] is False
    assert out["result"]["python"] == sys.version.split()[0]



@pytest.mark.parametrize("script, workdir, syncable", [
    ("train.py", "/w/p", True), ("src/../train.py", "/w/p", True), ("/w/p/t.py", "/w/p", True),
    ("../train.py", "/w/p", False), ("/opt/t.py", "/w/p", False), ("a/../../t.py", "/w/p", False),
    ("/w/pp/t.py", "/w/p", False), ("~/p/t.py", "~/p", True), ("~/t.py", "~/p", False),
    ("../t.py", "~/p", False), ("/home/u/p/t.py", "~/p", True), ("~/t.py", "/w/p", True)])
def test_a_missing_script_outside_the_workdir_is_not_told_to_sync(script, workdir, syncable):
    """The last two cannot be told apart here (the node expands ~): the usual advice."""
    fix = probe.missing_script_fix(script, workdir, "node3")
    assert (fix == "sync the code first") is syncable, fix
    assert syncable or (f"outside {workdir}" in fix and "node3" in fix)


def test_a_missing_script_that_is_not_here_either_is_a_typo_not_a_sync(tmp_path):
    """``run --no-sync trian.py`` with train.py on the nodes: "sync the code first", which would not
    help (a new user's pass). Not here either: check its name, with the close one."""
    (tmp_path / "train.py").write_text("")
    fix = probe.missing_script_fix("trian.py", "/w/p", "node3", str(tmp_path))
    assert fix == f"it is not here ({tmp_path}) either (did you mean 'train.py'?): check its name", fix
    assert probe.missing_script_fix("train.py", "/w/p", "node3", str(tmp_path)) == "sync the code first"


@pytest.mark.parametrize("req, error", [
    ({"id": 1, "op": "no-such-op"}, "unknown operation 'no-such-op'"),
    ({"id": 2}, "unknown operation None"),
    ({"id": 3, "op": "facts"}, "bad request: KeyError"),  # no workdir
    ({"id": 4, "op": "hash", "workdir": "/no/such/dir"}, "does not exist"),
    ({"id": 5, "op": "stop", "dir": "/tmp/x", "grace": "soon"}, "bad request: ValueError"),
    ([1, 2], "a request is a JSON object"),
])
def test_a_bad_request_is_an_error_reply_not_an_exception(req, error):
    out = json.loads(program.handle(req, {}))
    assert out["ok"] is False and error in out["error"], out
    assert out["id"] == (req.get("id") if isinstance(req, dict) else None)


def test_the_program_answers_every_request_even_after_a_failing_one(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    replies, proc = run_program({"op": "facts", "workdir": str(tmp_path), "script": "train.py"},
                                {"op": "nonsense"},
                                {"op": "hash", "workdir": str(tmp_path / "missing")},
                                {"op": "ps", "root": str(tmp_path / "runs")})
    assert proc.returncode == 0, proc.stderr
    assert [r.op for r in replies] == ["facts", "nonsense", "hash", "ps"]
    assert [r.ok for r in replies] == [True, False, False, True]
    assert replies[0].result["script_exists"] is True
    assert "unknown operation" in replies[1].error and "does not exist" in replies[2].error
    assert replies[3].result["runs"] == []
    with pytest.raises(nodeprog.NodeProgramError, match="host n1: hash: .*does not exist"):
        replies[2].value("n1")


def test_a_broken_frame_ends_the_stream_with_an_error_reply():
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"),
                          input=nodeprog.shipped() + b"abc\n{}", capture_output=True, timeout=60)
    replies = nodeprog.match_replies("n1", [{"id": 1, "op": "facts"}], proc.stdout.splitlines(), proc.returncode,
                                     proc.stderr.decode())
    assert proc.returncode == 2 and not replies[0].ok and "bad frame" in replies[0].error


def test_a_program_that_dies_gives_each_request_an_error_naming_why():
    replies = nodeprog.match_replies("n1", nodeprog.numbered({"op": "facts"}, {"op": "hash"}), [b"junk"], 1,
                                     "Traceback ...\nMemoryError")
    assert [r.ok for r in replies] == [False, False]
    assert all("no reply (exit 1): Traceback ...\nMemoryError" == r.error for r in replies)


@pytest.mark.parametrize("line", [
    b"not json", b"[]", b'{"id": 1, "op": "facts"}', b'{"id": "1", "op": "facts", "ok": true, "result": {}}',
    b'{"id": true, "op": "facts", "ok": true, "result": {}}', b'{"id": 1, "op": "facts", "ok": "yes", "result": {}}',
    b'{"id": 1, "op": "facts", "ok": true, "result": "os.system(1)"}', b'{"id": 1, "op": 3, "ok": true, "result": {}}',
])
def test_replies_are_validated_data(line):
    assert nodeprog.parse_reply(line) is None


def test_a_reply_for_another_request_is_not_taken_for_ours():
    reqs = nodeprog.numbered({"op": "facts"})
    lines = [b'{"id": 9, "op": "facts", "ok": true, "result": {"hostname": "evil"}}']
    assert not nodeprog.match_replies("n1", reqs, lines, 0)[0].ok


def test_mesh_listen_then_connect_in_one_session():
    session: dict = {}
    facts = program.op_facts({"workdir": "/", "find_port": [29500, 29600, 29550]}, session)
    ports = program.op_mesh_listen({"master_port": "found"}, session)
    assert ports["master"] == facts["free_port"] == session["free_port"] and ports["ephemeral"] > 0
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()[1]
    closed.close()
    got = program.op_mesh_connect({"targets": [
        {"target": "me", "kind": "ephemeral", "addr": "127.0.0.1", "port": ports["ephemeral"]},
        {"target": "me", "kind": "master", "addr": "127.0.0.1", "port": ports["master"]},
        {"target": "gone", "kind": "ephemeral", "addr": "127.0.0.1", "port": dead}],
        "attempts": [1.0], "concurrency": 2, "deadline": 10}, session)["probes"]
    assert [p["result"] for p in got] == ["ok", "ok", "refused"]


@pytest.mark.parametrize("errors, result, attempts", [
    ([errno.EHOSTUNREACH], "ok", 2),  # ARP unanswered once (a link just back): the next attempt connects
    ([errno.EHOSTUNREACH] * 3, os.strerror(errno.EHOSTUNREACH), 3),  # unreachable every time: named so
    ([errno.ENETUNREACH, errno.EHOSTUNREACH], os.strerror(errno.ENETUNREACH), 1),  # no route: an answer
])
def test_a_host_unreachable_connect_is_retried_like_a_timeout(monkeypatch, errors, result, attempts):
    """EHOSTUNREACH on one segment is the kernel's ARP giving up (nobody answered for 3 s), not
    the peer's answer: CI saw a healthy node fail the check so right after its link came back."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    left = list(errors)

    class FlakySocket(socket.socket):
        def connect(self, address):
            if left:
                code = left.pop(0)
                raise OSError(code, os.strerror(code))
            return super().connect(address)

    flaky = types.ModuleType("_socket")  # the node program's own view of _socket, with this socket
    flaky.__dict__.update(vars(program._socket), socket=FlakySocket)
    monkeypatch.setattr(program, "_socket", flaky)
    try:
        got = program.op_mesh_connect({"targets": [{"target": "peer", "kind": "ephemeral", "addr": "127.0.0.1",
                                                    "port": listener.getsockname()[1]}],
                                       "attempts": [1.0, 1.0, 1.0], "concurrency": 1, "deadline": 10}, {})["probes"]
    finally:
        listener.close()
    assert (got[0]["result"], got[0]["attempts"]) == (result, attempts)


def test_ps_and_stop_over_run_records(tmp_path):
    run = tmp_path / "runs" / "20260101-000000-abcdef"
    run.mkdir(parents=True)
    (run / "agent.json").write_text(json.dumps({"run_id": run.name, "agent_pid": os.getpid(), "started": 1.0}))
    (run / "exit_code").write_text("3\n")
    out = program.op_ps({"root": str(tmp_path / "runs")}, {})
    assert out["runs"] == [{"run_id": run.name, "state": "exited", "exit_code": 3, "started": 1.0,
                            "agent_pid": os.getpid(), "dir": str(run)}]
    assert program.op_stop({"dir": str(run), "grace": 0.1}, {}) == {"said": "not running", "stopped": True,
                                                                   "known": True}
    # a run this node never had (a typo of its id): nothing left of it, and not known here
    assert program.op_stop({"dir": str(tmp_path / "runs" / "20990101-000000-abcdef"), "grace": 0.1}, {}) == \
        {"said": "absent", "stopped": True, "known": False}


def test_ps_lists_a_tmux_launch_while_a_process_of_its_session_carries_the_run(tmp_path):
    """A `run --tmux` window's launch has no supervisor: its shell's session is the record."""
    runs = tmp_path / "runs"
    run = runs / "tmux-ps-1"
    run.mkdir(parents=True)
    launch = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, "DDPFAB_RUN_ID": run.name})
    try:
        # Popen (vfork) may return before the kernel has set up the new program's environment:
        # /proc/PID/environ reads empty for that moment (the unit suite saw "exited" 2 times in 8)
        deadline = time.monotonic() + 10
        while b"DDPFAB_RUN_ID=" not in Path(f"/proc/{launch.pid}/environ").read_bytes():
            assert time.monotonic() < deadline, "the launch's environment never showed"
            time.sleep(0.01)
        (run / program.TMUX_PID).write_text(f"{launch.pid}\n")
        (found,) = program.op_ps({"root": str(runs)}, {})["runs"]
        assert (found["run_id"], found["state"], found["exit_code"], found["tmux"]) == (run.name, "running", None, True)
        (run / program.TMUX_PID).write_text(f"{os.getsid(0)}\n")  # a session no process of this run is in
        assert program.op_ps({"root": str(runs)}, {})["runs"][0]["state"] == "exited"
        assert program.op_signal_tmux({"dir": str(run), "run_id": run.name, "signal": "TERM"}, {}) == {"signalled": 0}
        assert launch.poll() is None  # (this test's own session was not signalled either)
        # `ddpfab stop` on the node: no supervisor, so the launch's session is what it ends
        (run / program.TMUX_PID).write_text(f"{launch.pid}\n")
        assert program.op_stop({"dir": str(run), "grace": 2}, {}) == {"said": "stopped its tmux launch", "stopped": True,
                                                                      "known": True}
        assert launch.wait(timeout=5) == -15
        assert program.op_stop({"dir": str(run), "grace": 2}, {}) == {"said": "its tmux launch had ended", "stopped": True,
                                                                      "known": True}
    finally:
        launch.kill()
        launch.wait()
    assert program.op_ps({"root": str(runs)}, {})["runs"][0]["state"] == "exited"  # its session ended with it
    (run / "exit_code").write_text("3\n")  # what its controller recorded at the end
    assert program.op_ps({"root": str(runs)}, {})["runs"][0]["exit_code"] == 3
    (run / "exit_code").write_text("three\n")
    assert program.op_ps({"root": str(runs)}, {})["runs"][0]["exit_code"] is None
    (run / program.TMUX_PID).write_text("not a pid\n")  # records are data
    assert program.op_ps({"root": str(runs)}, {})["runs"] == []


def test_stop_of_a_tmux_launch_outlives_its_record_and_kills_what_ignores_sigterm(tmp_path):
    """The run's own teardown may remove tmux.pid while a stop waits: the session is read once."""
    run = tmp_path / "runs" / "tmux-stop-2"
    run.mkdir(parents=True)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 60"], start_new_session=True,
                                env={**os.environ, "DDPFAB_RUN_ID": run.name})
    try:
        time.sleep(0.2)  # (the trap is set before the exec)
        (run / program.TMUX_PID).write_text(f"{stubborn.pid}\n")
        remover = threading.Timer(0.3, (run / program.TMUX_PID).unlink)
        remover.start()
        assert program.op_stop({"dir": str(run), "grace": 1}, {}) == {"said": "stopped its tmux launch",
                                                                      "stopped": True, "known": True}
        assert stubborn.wait(timeout=5) == -9
    finally:
        stubborn.kill()
        stubborn.wait()


def test_the_supervisor_is_an_operation_of_the_same_program(tmp_path):
    spec = {"run_id": "sup-1", "dir": str(tmp_path / "run"), "workdir": str(tmp_path), "grace": 1,
            "argv": [sys.executable, "-c", "import os; print('job says', os.environ['TOKEN'])"],
            "env": {"TOKEN": "s3cret"}}
    argv = nodeprog.argv(sys.executable, *nodeprog.supervisor_words("sup-1"))
    assert "s3cret" not in " ".join(argv) and argv[-2:] == ["ddpfab-agent", "sup-1"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    code, out = _supervised(proc, nodeprog.supervisor_input(spec), tmp_path / "run")
    assert code == 0 and b"job says s3cret" in out
    assert json.loads((tmp_path / "run" / "result.json").read_text())["exit_code"] == 0


def test_follow_streams_a_finished_runs_output_and_its_exit_code(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "output.log").write_bytes(b"line 1\nline 2\n")
    (run / "exit_code").write_text("4\n")
    proc = subprocess.Popen(nodeprog.argv(sys.executable, "ddpfab-node"), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(nodeprog.stdin_for({"id": 1, "op": "follow", "dir": str(run)}))
    proc.stdin.flush()
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 4 and out == b"line 1\nline 2\n"


def test_follow_of_a_run_with_no_record_here_ends_at_once_and_says_so(tmp_path):
    """`ddpfab attach` of a run whose record on the node is gone (pruned after 20 later runs)
    waited for ever, then said "the job goes on"."""
    proc = subprocess.Popen(nodeprog.argv(sys.executable, "ddpfab-node"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(nodeprog.stdin_for({"id": 1, "op": "follow", "dir": str(tmp_path / "gone"), "wait_s": 1}))
    proc.stdin.flush()  # (stdin stays open: attach keeps it open while it follows)
    assert proc.wait(timeout=30) == 255
    assert b"no record of this run here" in proc.stderr.read()
    proc.stdin.close()


def test_follow_waits_for_a_run_dir_its_supervisor_is_still_making(tmp_path):
    """An attempt of a run with restarts is followed as soon as its manifest exists, before its
    supervisors have made their run dirs: a dir that comes within the wait is followed."""
    run = tmp_path / "run"
    proc = subprocess.Popen(nodeprog.argv(sys.executable, "ddpfab-node"), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(nodeprog.stdin_for({"id": 1, "op": "follow", "dir": str(run), "wait_s": 20}))
    proc.stdin.flush()
    time.sleep(1)
    run.mkdir()
    (run / "output.log").write_bytes(b"late\n")
    (run / "exit_code").write_text("0\n")
    assert proc.stdout.read() == b"late\n" and proc.wait(timeout=30) == 0


def test_perf_files_placed_and_removed_only_with_the_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    made = program.op_perf_place({"dir": "runs/p1", "files": {"perfnode.py": "x = 1\n"}}, {})["made"]
    assert (tmp_path / "runs" / "p1" / "perfnode.py").read_text() == "x = 1\n"
    with pytest.raises(program.NodeOpError, match="exists already"):
        program.op_perf_place({"dir": "runs/p1", "files": {}}, {})
    (tmp_path / "mine").mkdir()
    with pytest.raises(program.NodeOpError, match="left alone"):
        program.op_perf_clean({"dir": "mine", "made": [], "marker": "perfnode.py"}, {})
    program.op_perf_clean({"dir": "runs/p1", "made": made, "marker": "perfnode.py"}, {})
    assert not (tmp_path / "runs").exists() and (tmp_path / "mine").is_dir()


def test_the_shipped_program_is_one_namespace_without_clashes():
    """The modules are concatenated: a top-level name defined twice would silently replace the
    first module's (a function calling it would run the other one)."""
    seen: dict[str, str] = {}
    for module in nodeprog.SOURCES:
        for item in ast.parse(Path(module.__file__).read_text()).body:
            names = [item.name] if isinstance(item, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)]
            for name in names:
                assert name not in seen, f"{name} in both {seen[name]} and {module.__name__}"
                seen[name] = module.__name__


def test_the_command_line_carries_no_code_and_no_request():
    words = nodeprog.argv("/opt/venv/bin/python", "ddpfab-node")
    assert words[:3] == ["/opt/venv/bin/python", "-S", "-c"] and len(words[3]) < 500
    assert int(words[5]) + int(words[6]) == len(nodeprog.shipped()) and words[7:] == ["ddpfab-node"]
    line = nodeprog.command(Node("n", "h", python="/opt/venv/bin/python", python_from="inventory"), "ddpfab-node",
                            fallback="python3")
    assert "command -v /opt/venv/bin/python" in line and "exec python3 -S -c" in line


def test_the_program_is_built_once_however_many_sessions_open_at_once(monkeypatch):
    """Sessions open on a thread per node: one builds the program, the others wait for it (each
    compiled it under the GIL before: 50 ms of CPU per node)."""
    import threading

    built = []
    real = compile
    monkeypatch.setattr(nodeprog, "compile", lambda *a, **k: built.append(1) or real(*a, **k), raising=False)
    nodeprog._build.cache_clear()
    go = threading.Barrier(16)
    got = []

    def ship():
        go.wait()
        got.append(nodeprog.shipped())
    threads = [threading.Thread(target=ship) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(set(got)) == 1 and len(got) == 16


def test_a_start_imports_only_what_its_requests_need():
    """The program starts without site and with its heavy standard modules imported at first use
    (ddpfab.remote.nodeprogram.LAZY_MODULES): a request that needs none imports none; facts still finds the
    packages installed in the node's python (torch here), and each lazy module works on first use."""
    def imported(*requests):
        proc = subprocess.run([sys.executable, "-X", "importtime", *nodeprog.argv(sys.executable, "ddpfab-node")[1:]],
                              input=nodeprog.stdin_for(*nodeprog.numbered(*requests)), capture_output=True, timeout=60)
        names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.decode().splitlines() if "|" in line}
        return names, [json.loads(line) for line in proc.stdout.splitlines()]
    names, replies = imported({"op": "ps", "runs_dir": "/nonexistent"})
    assert replies[0]["ok"], replies
    assert not names & {"site", "json", "enum", *nodeprog.LAZY_MODULES, "importlib.util"}, sorted(names)
    names, replies = imported({"op": "facts", "workdir": "/tmp", "peers": {"a": "127.0.0.1"}, "resolve": ["localhost"],
                               "leases": True, "resources": True, "find_port": [29500, 29999, 29700]},
                              {"op": "mesh_listen", "master_port": "found"})
    assert [r["ok"] for r in replies] == [True, True], replies
    assert replies[0]["result"]["torch"] is (importlib.util.find_spec("torch") is not None)
    assert replies[0]["result"]["resolved"]["localhost"].startswith("127.")
    assert {"site", "_socket", "select"} <= names
    # what a run's probe costs every node: none of socket.py (selectors, enum), shutil (bz2, lzma),
    # re, the IDNA codec or queue (measured on a lab node: facts 24 -> 14 ms of CPU)
    assert not names & {"socket", "selectors", "enum", "shutil", "re", "encodings.idna", "queue", "struct"}, sorted(names)
    source = nodeprog.program().decode()
    assert not [line for line in source.splitlines() if line.split(" ")[:1] == ["import"]
                and line.split(" ")[1] in (*nodeprog.LAZY_MODULES, "importlib.util", "json")]


def test_a_no_change_check_and_facts_load_no_openssl(tmp_path, monkeypatch):
    """The digests of names and of the tree over the files' records are the interpreter's own
    (treehash.digest): lock, hash (every file's digest from the cache) and unlock, and facts with
    the GPU leases, import neither hashlib nor OpenSSL's _hashlib (on a python built with OpenSSL's
    digests only, hashlib is what digest() falls back to: there it may, and the answers still hold)."""
    own = all(type(treehash.digest(name)).__module__ != "_hashlib" for name in ("sha256", "sha1"))
    allowed = set() if own else {"hashlib", "_hashlib"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wd = tmp_path / "wd"
    program.handle({"id": 1, "op": "probe", "workdir": str(wd), "nonce": "n", "files": ["a.py", "b/c.py"]}, {})
    (wd / "b").mkdir()
    (wd / "a.py").write_text("a")
    (wd / "b" / "c.py").write_text("c")
    assert json.loads(program.handle({"id": 2, "op": "commit", "workdir": str(wd), "delete": [],
                                      "files": ["a.py", "b/c.py"]}, {}))["ok"]
    time.sleep(treehash.RACY_S + 0.1)  # younger files are never cached (a write in the same tick)
    holder = {"user": "u", "host": "h", "pid": 1, "since": 0.0, "src": "/s", "check": "unchanged"}
    check = [{"op": "lock", "workdir": str(wd), "holder": holder, "wait_s": 0},
             {"op": "hash", "workdir": str(wd), "cache": True}, {"op": "unlock"}]

    def imported(*requests):
        proc = subprocess.run([sys.executable, "-X", "importtime", *nodeprog.argv(sys.executable, "ddpfab-node")[1:]],
                              input=nodeprog.stdin_for(*nodeprog.numbered(*requests)), capture_output=True, timeout=60,
                              env={**os.environ, "DDPFAB_LEASE_DIR": str(tmp_path / "leases")})
        names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.decode().splitlines() if "|" in line}
        return names, [json.loads(line) for line in proc.stdout.splitlines()]
    names, replies = imported(*check)  # the first fills the cache: the files are read, through hashlib
    assert [r["ok"] for r in replies] == [True] * 3 and "hashlib" in names, replies
    names, again = imported(*check)
    assert again[1]["result"]["tree_hash"] == replies[1]["result"]["tree_hash"], again
    assert [r["ok"] for r in again] == [True] * 3 and names & {"hashlib", "_hashlib"} <= allowed, sorted(names)
    names, replies = imported({"op": "facts", "workdir": str(wd), "leases": True})
    assert replies[0]["ok"] and "leases" in replies[0]["result"], replies
    assert names & {"hashlib", "_hashlib"} <= allowed, sorted(names)


@pytest.mark.parametrize("name", ["sha256", "sha1"])
def test_the_own_digests_are_hashlibs_and_hashlib_stands_in_where_there_are_none(name, monkeypatch):
    def both(make):
        h = make(name, b"first")
        h.update(b"\0" * 100_000)
        return h.hexdigest(), make(name).hexdigest()
    assert both(treehash.digest) == both(hashlib.new)
    monkeypatch.setattr(treehash, "_OWN_DIGESTS", {name: ("_no_such_module",)})
    monkeypatch.setattr(treehash, "_DIGESTS", {})
    assert both(treehash.digest) == both(hashlib.new)
    assert treehash._DIGESTS[name] is getattr(hashlib, name)


def test_the_programs_json_gives_what_json_gives_results_and_errors():
    """The shipped program's json (its C parts, without importing json): the same text, values
    and exceptions as json for what the protocol carries and for what it must refuse."""
    source = nodeprog.program().decode()
    namespace: dict = {}
    exec(compile(source[:source.index("_JSON = _Json()")] + "_JSON = _Json()\n", "first-use", "exec"), namespace)
    fast = namespace["_JSON"]
    assert fast._c is not None  # the C parts are there: the fast path is what is tested

    def outcome(fn, arg):
        try:
            return "ok", repr(fn(arg))
        except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
            return type(exc).__name__, str(exc)

    values = [{"id": 1, "op": "hash", "workdir": "/w d/\u00e9", "paths": ["a\nb", "\ud800"], "cache": True},
              {"n": [0, -1, 2.5, -0.0, 10**30, float("inf"), None, True, False, {}, []]}, "x", 3, {1: 2},
              {"s": {1, 2}}, {(1,): 2}, [float("nan")]]
    for value in values:
        assert outcome(fast.dumps, value) == outcome(json.dumps, value), value
    texts = [json.dumps(v) for v in values[:5]] + ['  {"a": 1} \n', '[1, 2', '{"a": NaN}', "1 2", "", '{"a":1,}',
                                                   "nul", b'{"a": 1}', '"\\ud800"']
    for text in texts:
        assert outcome(fast.loads, text) == outcome(json.loads, text), text
    assert fast.JSONDecodeError is json.JSONDecodeError
    for value in values[:5]:  # load and dump: through a file's text, as json's
        mine, theirs = io.StringIO(), io.StringIO()
        fast.dump(value, mine)
        json.dump(value, theirs)
        assert mine.getvalue() == theirs.getvalue() and fast.load(io.StringIO(mine.getvalue())) == json.loads(
            theirs.getvalue())


#: this python, and Debian's own where there is one (its site finds a venv's packages its own way)
VENV_PYTHONS = [sys.executable] + [p for p in ("/usr/bin/python3",) if os.path.exists(p) and os.path.realpath(p)
                                   != os.path.realpath(sys.executable)]


@pytest.mark.parametrize("base", VENV_PYTHONS)
def test_facts_finds_torch_in_site_packages_without_running_site_and_elsewhere_with_it(tmp_path, base):
    """A venv whose site-packages has torch: facts finds it (version, launcher) without running
    site (its .pth hook would say so). torch only on a path a .pth adds: site runs and finds it."""
    venv = tmp_path / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    packages = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())

    def fake_torch(where: Path) -> None:
        (where / "torch" / "distributed").mkdir(parents=True)
        (where / "torch" / "__init__.py").write_text("")
        (where / "torch" / "version.py").write_text("from typing import Optional\n__all__ = ['__version__']\n"
                                                    "__version__ = '9.8.7'\ncuda: Optional[str] = None\n")
        (where / "torch" / "distributed" / "run.py").write_text("")

    def facts() -> tuple[dict, str]:
        proc = subprocess.run(nodeprog.argv(python, "ddpfab-node"), capture_output=True, timeout=60,
                              input=nodeprog.stdin_for(*nodeprog.numbered({"op": "facts", "workdir": "/tmp"})))
        return json.loads(proc.stdout.splitlines()[0])["result"], proc.stderr.decode()

    (packages / "hook.pth").write_text(f"import sys; sys.stderr.write('SITE RAN\\n'); sys.path.append({str(tmp_path / 'extra')!r})\n")
    fake_torch(packages)
    out, err = facts()
    assert (out["torch"], out["torch_version"], out["launcher"]) == (True, "9.8.7", True), out
    assert "SITE RAN" not in err
    shutil.rmtree(packages / "torch")
    fake_torch(tmp_path / "extra")
    out, err = facts()
    assert (out["torch"], out["torch_version"], out["launcher"]) == (True, "9.8.7", True), out
    assert "SITE RAN" in err
    shutil.rmtree(tmp_path / "extra" / "torch")
    out, err = facts()
    assert (out["torch"], out["torch_version"], out["launcher"]) == (False, None, False), out


def test_a_python_with_the_controllers_bytecode_runs_the_compiled_program_any_other_compiles_the_source():
    """The loader as a node runs it: the compiled code when the magic on its command line is its
    python's, else the source (a python of another version); the real program answers either way."""
    words = nodeprog.argv(sys.executable, "ddpfab-node")
    code = zlib.compress(marshal.dumps(compile("print('compiled')", "x", "exec")))
    source = zlib.compress(b"print('source')")
    for magic, said in ((words[4], b"compiled\n"), ("0d0d0a0a", b"source\n")):
        proc = subprocess.run([*words[:4], magic, str(len(code)), str(len(source))], input=code + source,
                              capture_output=True, timeout=60)
        assert proc.stdout == said, proc.stderr
    assert words[4] == importlib.util.MAGIC_NUMBER.hex()
    for magic in (words[4], "0d0d0a0a"):
        proc = subprocess.run([*words[:4], magic, *words[5:]], capture_output=True, timeout=60,
                              input=nodeprog.stdin_for(*nodeprog.numbered({"op": "ps", "runs_dir": "/nonexistent"})))
        replies = nodeprog.match_replies("n1", [{"id": 1, "op": "ps"}], proc.stdout.splitlines(), proc.returncode,
                                         proc.stderr.decode())
        assert proc.returncode == 0 and replies[0].ok, (magic, replies[0].error)


# -- the controller's reading of replies: records are data ----------------------------------------
class FakeChannel:
    """A node program's channel as a :class:`nodeprog.Session` sees it (paramiko's Channel API,
    the calls Session makes): stdout from *chunks* (a list, or an endless generator), then an exit
    status. Stands in for SSH only; the replies are parsed by the real code."""

    def __init__(self, chunks, exit_code: int | None = 0, stderr: bytes = b""):
        self.chunks = iter(chunks)
        self.next = next(self.chunks, None)
        self.stderr, self.exit_code, self.sent, self.closed, self.received = stderr, exit_code, b"", False, 0

    def exec_command(self, command): pass
    def sendall(self, data): self.sent += data
    def recv_ready(self): return self.next is not None
    def recv_stderr_ready(self): return bool(self.stderr)

    def recv(self, n):
        data, self.next = self.next, next(self.chunks, None)
        self.received += len(data)
        return data

    def recv_stderr(self, n):
        data, self.stderr = self.stderr[:n], self.stderr[n:]
        return data

    def exit_status_ready(self): return self.next is None and self.exit_code is not None

    @property
    def eof_received(self): return self.next is None and self.exit_code is not None
    def recv_exit_status(self): return self.exit_code
    def shutdown_write(self): pass
    def close(self): self.closed = True


class FakeConn:
    def __init__(self, chan):
        self.transport = self
        self.chan = chan

    def open_session(self, timeout):
        return self.chan


def session(chunks, **kw) -> nodeprog.Session:
    from ddpfab.hosts.inventory import Node
    return nodeprog.Session(FakeConn(FakeChannel(chunks, **kw)), Node(name="n1", host="10.0.0.1"))


class ProgramChannel(FakeChannel):
    """A channel to the real program on this machine: what the session writes is its stdin, and
    at EOF (``shutdown_write``) it runs; its output and exit status are the channel's."""

    def __init__(self, part: str = nodeprog.WHOLE):
        super().__init__([], exit_code=None)
        self.writes, self.part, self.command = 0, part, ""

    def exec_command(self, command): self.command = command

    def sendall(self, data):
        self.writes += 1
        super().sendall(data)

    def shutdown_write(self):
        proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node", part=self.part), input=self.sent,
                              capture_output=True, timeout=60)
        self.chunks, self.exit_code = iter(proc.stdout.splitlines(keepends=True)), proc.returncode
        self.next = next(self.chunks, None)


class LateOutputChannel(FakeChannel):
    """sshd's order when a program ends between two of its polls: the exit status first, then
    what was still in the pipe, then EOF."""

    def __init__(self, chunks, quiet_polls: int):
        super().__init__(chunks, exit_code=0)
        self.quiet = quiet_polls

    def exit_status_ready(self): return True

    def recv_ready(self):
        self.quiet -= 1
        return self.quiet < 0 and super().recv_ready()

    @property
    def eof_received(self): return self.quiet < 0 and self.next is None


def test_output_that_comes_after_the_exit_status_is_still_taken():
    s = nodeprog.Session(FakeConn(LateOutputChannel([line(1, "ps", runs=[]), line(2, "ps", runs=[])], 5)),
                         Node(name="n1", host="10.0.0.1"))
    reqs = s.send({"op": "ps"}, {"op": "ps"})
    replies = nodeprog.exchange({"n1": s}, {}, timeout=10, sent={"n1": reqs})["n1"]
    assert [r.ok for r in replies] == [True, True], replies


def test_a_program_whose_stdout_stays_open_after_its_exit_gets_its_answer_after_a_grace(monkeypatch):
    monkeypatch.setattr(nodeprog, "OUTPUT_GRACE_S", 0.2)
    chan = LateOutputChannel([line(1, "ps", runs=[])], 0)
    chan.__class__ = type("NoEof", (LateOutputChannel,), {"eof_received": False})
    s = nodeprog.Session(FakeConn(chan), Node(name="n1", host="10.0.0.1"))
    reqs = s.send({"op": "ps"}, {"op": "ps"})
    started = time.monotonic()
    replies = nodeprog.exchange({"n1": s}, {}, timeout=10, sent={"n1": reqs})["n1"]
    assert replies[0].ok and not replies[1].ok and "no reply (exit 0)" in replies[1].error, replies
    assert 0.2 <= time.monotonic() - started < 5


def test_requests_shipped_with_the_program_are_answered_and_their_eof_ends_it(tmp_path):
    """Session(first=..., last=True): the requests go in the program's own write, EOF after them;
    the program answers them and ends (exit 0) with no round trip of the controller's."""
    chan = ProgramChannel()
    s = nodeprog.Session(FakeConn(chan), Node(name="n1", host="10.0.0.1"), last=True,
                         first=[{"op": "ps", "runs_dir": str(tmp_path)}, {"op": "hash", "workdir": "/no/such/dir"}])
    assert chan.writes == 1 and chan.sent.startswith(nodeprog.shipped()) and chan.exit_code == 0
    assert [r["id"] for r in s.first] == [1, 2]
    replies = nodeprog.exchange({"n1": s}, {}, timeout=10, sent={"n1": s.first})["n1"]
    assert [(r.op, r.ok) for r in replies] == [("ps", True), ("hash", False)], replies
    assert "does not exist" in replies[1].error and s.ended


def test_the_workdir_part_alone_is_a_program_that_answers_the_workdir_and_names_what_it_lacks(tmp_path, monkeypatch):
    """WORKDIR_PART, what sync's check of an unchanged tree ships: well under half the program,
    and a program by itself: lock, hash and unlock answered as the whole program answers them; an
    operation of the rest is refused by name, and the program still ends cleanly."""
    monkeypatch.setenv("HOME", str(tmp_path))
    wd = tmp_path / "wd"
    (wd / "pkg").mkdir(parents=True)
    (wd / "pkg" / "a.py").write_text("A = 1\n")
    (wd / "train.py").write_text("print(1)\n")
    paths = ["pkg/a.py", "train.py"]
    part = nodeprog.WORKDIR_PART
    assert len(nodeprog.shipped(part)) < len(nodeprog.shipped()) / 2
    assert b"def op_facts" not in nodeprog.program(part) and b"def op_lock" in nodeprog.program(part)
    chan, node = ProgramChannel(part), Node(name="n1", host="10.0.0.1")
    s = nodeprog.Session(FakeConn(chan), node, last=True, part=part, first=[
        {"op": "lock", "workdir": str(wd), "holder": {"user": "u"}, "wait_s": 0},
        {"op": "hash", "workdir": str(wd), "paths": paths}, {"op": "unlock"}, {"op": "facts", "workdir": str(wd)}])
    assert chan.command == nodeprog.command(node, "ddpfab-node", part=part)
    assert chan.writes == 1 and chan.sent.startswith(nodeprog.shipped(part)) and chan.exit_code == 0
    replies = nodeprog.exchange({"n1": s}, {}, timeout=10, sent={"n1": s.first})["n1"]
    assert [(r.op, r.ok) for r in replies] == [("lock", True), ("hash", True), ("unlock", True), ("facts", False)]
    assert replies[1].result["tree_hash"] == treehash.tree_digest(str(wd), paths)["tree_hash"]
    assert "unknown operation 'facts'" in replies[3].error


def line(rid, op, **result) -> bytes:
    return json.dumps({"id": rid, "op": op, "ok": True, "result": result}).encode() + b"\n"


def test_a_program_that_ended_before_a_request_is_named_by_its_exit_status_not_the_closed_channel():
    """A setup line fails: the node's shell exits at once and its channel closes, maybe before the
    requests are written. The write is no error; the failure is what the exit status says."""
    from ddpfab.hosts import nodeenv
    from ddpfab.hosts.inventory import Node

    chan = FakeChannel([], exit_code=nodeenv.SETUP_FAILED, stderr=f"{nodeenv.SETUP_MARK}: line 1 exit 1\n".encode())
    s = nodeprog.Session(FakeConn(chan), Node(name="n1", host="10.0.0.1", setup=("test -d /nonexistent",)))
    s.chan.closed = True

    def closed(data):  # paramiko's Channel.sendall on a closed channel
        raise OSError("Socket is closed")

    s.chan.sendall = closed
    reqs = s.send({"op": "facts", "workdir": "/"})
    s.poll()
    with pytest.raises(nodeprog.NodeProgramError) as err:
        s.take(reqs)
    assert "setup line 1 `test -d /nonexistent` failed there (exit 1)" in str(err.value), err.value
    s.chan.closed = False
    s.chan.exit_code, s.chan.next = None, b""  # still running: a failed write is the channel's fault
    with pytest.raises(OSError):
        s.send({"op": "facts", "workdir": "/"})


def test_a_reply_naming_another_op_is_no_answer():
    reqs = nodeprog.numbered({"op": "stop", "dir": "d"})
    got = nodeprog.match_replies("n1", reqs, [line(1, "ps", said="x", stopped=True)], 0)[0]
    assert not got.ok and got.op == "stop" and "no reply" in got.error
    s = session([line(1, "ps", said="x", stopped=True)])
    reqs = s.send({"op": "stop", "dir": "d"})
    s.poll()
    got = s.take(reqs)[0]
    assert not got.ok and "no reply (exit 0)" in got.error


def test_a_repeated_id_keeps_the_first_reply_both_ways():
    dup = [line(1, "stop", stopped=False), line(1, "stop", stopped=True)]
    reqs = nodeprog.numbered({"op": "stop", "dir": "d"})
    assert nodeprog.match_replies("n1", reqs, dup, 0)[0].result == {"stopped": False}
    s = session([b"".join(dup)], exit_code=None)
    reqs = s.send({"op": "stop", "dir": "d"})
    s.poll()
    assert s.take(reqs)[0].result == {"stopped": False}


def test_a_session_keeps_no_reply_to_a_request_never_sent():
    s = session([b"".join(line(i, "facts") for i in range(100, 5100)), line(1, "facts", hostname="h")],
                exit_code=None)
    reqs = s.send({"op": "facts", "workdir": "/"})
    while s.poll():
        pass
    assert len(s._replies) == 1  # the 5000 unasked replies were dropped as they came
    assert s.take(reqs)[0].result == {"hostname": "h"}
    s.chan.next = line(1, "facts", hostname="late")  # once taken, its id is answered: a repeat is dropped
    s.poll()
    assert s._replies == {}


def test_a_reply_split_over_many_reads_and_many_in_one_read_are_all_taken():
    big = line(1, "facts", blob="x" * 300_000)
    chunks = [big[i:i + 1000] for i in range(0, len(big), 1000)] + [line(2, "hash", tree_hash="t") + line(3, "ps")[:5],
                                                                    line(3, "ps")[5:]]
    s = session(chunks, exit_code=None)
    reqs = s.send({"op": "facts"}, {"op": "hash"}, {"op": "ps"})
    while s.poll():
        pass
    got = s.take(reqs)
    assert [r.op for r in got] == ["facts", "hash", "ps"] and got[0].result["blob"] == "x" * 300_000
    assert got[1].result == {"tree_hash": "t"} and got[2].result == {}


def test_a_line_without_end_is_refused_past_the_cap_not_buffered():
    s = session((b"x" * 65536 for _ in range(16 * 16)), exit_code=None)  # 16 MiB, no newline
    s.send({"op": "facts"})
    with pytest.raises(nodeprog.NodeProgramError, match="host n1: the node program sent a line of over 8 MiB"):
        while s.poll():
            assert len(s._buf) <= nodeprog.MAX_REPLY_LINE
    assert s.chan.received <= nodeprog.MAX_REPLY_LINE + 2 * 65536
    with pytest.raises(nodeprog.NodeProgramError):  # the session stays broken
        s.poll()


def test_one_poll_reads_a_bounded_amount():
    s = session((b"y" * 65535 + b"\n" for _ in range(64 * 16)), exit_code=None)  # 64 MiB of junk lines
    assert s.poll() is True
    assert s.chan.received <= nodeprog.POLL_BYTES


def test_a_node_that_never_stops_writing_does_not_hold_up_the_others_or_the_deadline():
    def endless():
        while True:
            yield b"z" * 65535 + b"\n"

    chatty, quiet = session(endless(), exit_code=None), session([line(1, "facts", hostname="q")], exit_code=None)
    started = time.monotonic()
    out = nodeprog.exchange({"chatty": chatty, "quiet": quiet}, {"chatty": [{"op": "facts"}], "quiet": [{"op": "facts"}]},
                            timeout=0.5)
    # the deadline is a behaviour, not a speed: before the bound a chatty node kept exchange forever
    assert time.monotonic() - started < 30
    assert isinstance(out["chatty"], nodeprog.NodeProgramError) and out["chatty"].kind == "timeout"
    assert out["quiet"][0].result == {"hostname": "q"}


def test_a_session_says_why_the_program_refused_the_stream():
    refusal = json.dumps({"id": None, "op": None, "ok": False, "error": "bad frame: length 'abc'"}).encode() + b"\n"
    s = session([refusal], exit_code=2, stderr=b"")
    reqs = s.send({"op": "facts"})
    s.poll()
    assert s.take(reqs)[0].error == "bad frame: length 'abc'"


def test_what_a_node_says_is_printed_without_its_control_characters():
    evil = "\x1b]0;pwn\x07\x1b[2Jgone\rover\x9b31m"
    reqs = nodeprog.numbered({"op": "stop", "dir": "d"})
    error = nodeprog.match_replies("n1", reqs, [json.dumps({"id": 1, "op": "stop", "ok": False, "error": evil})], 0)[0].error
    assert error == r"\x1b]0;pwn\x07\x1b[2Jgone\x0dover\x9b31m"
    died = nodeprog.match_replies("n1", reqs, [], 1, "Traceback\n\tline\x1b[31m")[0].error
    assert died == "no reply (exit 1): Traceback\n\tline\\x1b[31m"  # newline and tab kept
    assert nodeprog.printable("host n1: 10.0.0.1 ok\n") == "host n1: 10.0.0.1 ok\n"


def test_facts_with_a_port_that_is_none_are_a_problem_of_that_node():
    from ddpfab.hosts.inventory import Node
    from ddpfab.health.probe import to_facts

    base = {"hostname": "h", "python": "3.12", "home": "/root", "torch": True, "workdir_exists": True}
    node = Node(name="n1", host="10.0.0.1")
    for port in (29500, None):
        assert to_facts(node, {**base, "free_port": port}, 0, 0).free_port == port
    for bad in ({"free_port": True}, {"free_port": "29500"}, {"free_port": 29500.5}, {"free_port": 0},
                {"free_port": 70000}, {"port_free": "yes"}):
        with pytest.raises(nodeprog.NodeProgramError, match=r"host n1: its facts give (free|port)_"):
            to_facts(node, {**base, **bad}, 0, 0)
    assert to_facts(node, {**base, "hostname": "h\x1b[2J"}, 0, 0).hostname == "h\\x1b[2J"


def test_ps_records_name_run_ids_not_paths():
    from ddpfab.launch.jobs import ps_record

    good = {"run_id": "20260101-000000-abcdef", "state": "exited", "exit_code": 3, "started": 1.0}
    assert ps_record(good) == good
    for bad in ({"run_id": "/tmp/evil"}, {"run_id": "../../x"}, {"run_id": "a/b"}, {"run_id": "a..b"},
                {"exit_code": True}, {"exit_code": 1.5}, {"state": "gone"}):
        with pytest.raises(ValueError, match="malformed run record"):
            ps_record({**good, **bad})


def test_a_locate_answer_must_name_a_file_or_dir():
    from ddpfab.transfer.fetch import FetchError, Located, located

    assert located("n1", {"path": "/opt/w/ckpt", "bytes": 5}) == Located("/opt/w/ckpt", 5, 1, "file")
    assert located("n1", {"path": "/opt/w/ckpt/", "bytes": 0, "kind": "dir", "files": 7}) == \
        Located("/opt/w/ckpt/", 0, 7, "dir")
    # the file count only sizes the disk check: what is not a count is one file, never fewer
    for files in ("7", True, 2.5, None, -3, 0):
        assert located("n1", {"path": "/opt/w/ckpt", "bytes": 5, "files": files}).files == 1
    assert located("n1", {"path": "/opt/w/ckpt", "bytes": 5, "kind": "socket"}).kind == "file"
    for bad in ({"path": ["x"]}, {"path": ".."}, {"path": "/opt/w/.."}, {"path": "/opt/w/."}, {"path": "/"},
                {"path": "rel/x"}, {"path": "/opt/w/a\nb"}, {"path": "/opt/w/\x1b[2J"}, {"bytes": "9"},
                {"bytes": True}):
        with pytest.raises(FetchError, match="host n1: locate: the node answered"):
            located("n1", {"path": "/opt/w/ckpt", "bytes": 5, **bad})


def test_an_error_reply_keeps_its_code_and_a_code_that_is_not_text_is_dropped():
    line = '{"id": 1, "op": "probe", "ok": false, "error": "refusing", "code": "not-ours"}'
    assert nodeprog.parse_reply(line) == nodeprog.Reply(1, "probe", False, error="refusing", code="not-ours")
    assert nodeprog.parse_reply(line.replace('"not-ours"', '["x"]')).code == ""
    assert nodeprog.parse_reply('{"id": 1, "op": "ps", "ok": true, "result": {}, "code": "x"}').code == ""


def test_requests_the_loop_cannot_use_are_refused_each_and_the_program_goes_on(tmp_path):
    """An op that is no string, a ``stage`` that holds without its arguments, a name that cannot be
    resolved: each is one refusal (or one fact), never the end of the program or of its facts."""
    reqs = nodeprog.numbered({"op": ["facts"]},
                             {"op": "facts", "workdir": str(tmp_path), "resolve": ["a..b", "localhost", "a\0b", "ü" * 70],
                              "peers": {"p": "127.0.0.1", "q": "1.2.3.4\0"}})
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), input=nodeprog.stdin_for(*reqs),
                          capture_output=True, timeout=60)
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and [r["ok"] for r in replies] == [False, True], (replies, proc.stderr[-500:])
    assert "unknown operation" in replies[0]["error"]
    resolved = replies[1]["result"]["resolved"]
    assert resolved["a..b"].startswith("error:") and resolved["localhost"].startswith("127."), resolved
    assert resolved["a\0b"].startswith("error: not a host name") and resolved["ü" * 70].startswith("error:")
    assert replies[1]["result"]["routes"] == {"p": "lo", "q": None}
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), capture_output=True, timeout=60,
                          input=nodeprog.stdin_for(*nodeprog.numbered({"op": "stage", "hold": True})))
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 1 and len(replies) == 1 and not replies[0]["ok"], (replies, proc.stderr[-500:])
    assert "bad request" in replies[0]["error"] and b"Traceback" not in proc.stderr


def test_the_program_ends_at_eof_without_teardown_and_loses_no_reply(tmp_path, monkeypatch):
    """At the end of its requests the program leaves at once (os._exit, no teardown of its ~500
    functions: 1.4 ms of sync's check on a lab node): every reply is out first, exit 0, and the
    workdir lock it held is free for the next program."""
    monkeypatch.setenv("HOME", str(tmp_path))
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "a.py").write_text("A = 1\n")
    asks = [{"op": "lock", "workdir": str(wd), "holder": {"user": "u"}, "wait_s": 0}]
    lock_path = loop.lock_path(os.path.realpath(wd))
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    open(lock_path, "w").close()  # a sync locked it once: the check takes the lock for real
    asks += [{"op": "hash", "workdir": str(wd), "paths": ["a.py"]}] * 300
    for _ in range(2):  # the second finds the lock free: the kernel released the first one's
        proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), capture_output=True, timeout=60,
                              input=nodeprog.stdin_for(*nodeprog.numbered(*asks)))
        replies = [json.loads(line) for line in proc.stdout.splitlines()]
        assert proc.returncode == 0 and len(replies) == 301 and all(r["ok"] for r in replies), proc.stderr[-300:]
        assert replies[0]["result"] == {"locked": True}
    reqs = nodeprog.numbered({"op": "hash", "workdir": str(wd), "paths": ["a.py"]})  # in a test: serve returns
    r, w = os.pipe()
    os.write(w, b"".join(nodeprog.frame(q) for q in reqs))
    os.close(w)
    out: list[str] = []
    assert loop.serve(r, out.append) == 0 and json.loads(out[0])["ok"]
    os.close(r)


def test_locate_refuses_the_workdir_itself_however_spelt(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    wd = tmp_path / "w"
    (wd / "ckpt").mkdir(parents=True)
    (tmp_path / ".ddpfab" / "runs" / "r1").mkdir(parents=True)
    req = {"op": "locate", "workdir": str(wd), "runs_dir": "~/.ddpfab/runs"}
    (wd / "here").symlink_to(".")
    for path in (".", "./.", "here", str(wd), str(wd) + "/", "~/w", "~/.ddpfab/runs", str(tmp_path / ".ddpfab/runs")):
        found = treehash.node_locate({**req, "path": path})
        assert "itself: name a file or directory in it" in found.get("error", ""), (path, found)
    assert treehash.node_locate({**req, "path": "ckpt"})["kind"] == "dir"
    os.mkfifo(wd / "pipe")
    assert "is not a file or a directory" in treehash.node_locate({**req, "path": "pipe"})["error"]
    assert treehash.node_locate({**req, "path": "~/.ddpfab/runs/r1"})["path"] == str(tmp_path / ".ddpfab/runs/r1")


def test_a_login_banner_before_the_first_reply_is_kept_as_stray_output():
    """An `echo` in a node's .bashrc: the program still answers, and what came first is kept for
    `check` to name (rsync fails on such a node)."""
    s = session([b"Welcome to node2!\n\n", line(1, "facts", hostname="h"), b"later noise\n"], exit_code=None)
    reqs = s.send({"op": "facts", "workdir": "/"})
    while s.poll():
        pass
    assert s.take(reqs)[0].result == {"hostname": "h"}
    assert s.stray == b"Welcome to node2!\n"
    quiet = session([line(1, "facts", hostname="h")], exit_code=None)
    quiet.send({"op": "facts", "workdir": "/"})
    quiet.poll()
    assert quiet.stray == b""


def test_ps_names_a_stopped_job_stopped_and_a_failed_one_exited(tmp_path):
    """``ddpfab stop`` TERMs the supervisor, which records what stopped it (result.json
    ``stopped``): ps said ``exited(143)`` for it. A job that failed on its own (``failed_at``)
    stays exited, even when a stop came after (the worker-failed stop is its own failure)."""
    root = tmp_path / "runs"
    for name, result, code in (("20260101-000000-aaaaaa", {"stopped": "signal 15", "failed_at": None}, 143),
                               ("20260101-000000-bbbbbb", {"stopped": "a worker failed", "failed_at": 5.0}, 1),
                               ("20260101-000000-cccccc", {"stopped": None, "failed_at": None}, 0)):
        run = root / name
        run.mkdir(parents=True)
        (run / "agent.json").write_text(json.dumps({"run_id": name, "agent_pid": os.getpid(), "started": 1.0}))
        (run / "result.json").write_text(json.dumps({"exit_code": code, **result}))
        (run / "exit_code").write_text(f"{code}\n")
    got = {r["run_id"][-1]: (r["state"], r["exit_code"], r.get("stopped"))
           for r in program.op_ps({"root": str(root)}, {})["runs"]}
    assert got == {"a": ("stopped", 143, "signal 15"), "b": ("exited", 1, None), "c": ("exited", 0, None)}


def test_a_preparations_session_goes_on_as_the_supervisor_with_the_master_port_free(tmp_path):
    """A run's preparation (facts that find a port, the mesh probe listening on it) and then its
    supervisor in the same program: the listeners are gone when the job starts (its bind, without
    SO_REUSEADDR, gets the port), and the python the probe's prefix chose is not the job's."""
    argv = nodeprog.argv(sys.executable, *nodeprog.supervisor_words("adopt-1"))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "DDPFAB_PYTHON": sys.executable, "DDPFAB_PYTHON_FROM": "default"})
    reqs = nodeprog.numbered({"op": "facts", "workdir": str(tmp_path), "find_port": [29500, 29999, 29700]},
                             {"op": "mesh_listen", "master_port": "found"})
    proc.stdin.write(nodeprog.stdin_for(*reqs))
    proc.stdin.flush()
    replies = [nodeprog.parse_reply(proc.stdout.readline()) for _ in reqs]
    port = replies[1].result["master"]
    assert port == replies[0].result["free_port"]
    with pytest.raises(OSError):  # it listens there now
        socket.create_server(("", port), reuse_port=False).close()
    job = ("import os, socket; s = socket.socket(); s.bind(('', %d)); s.listen(); "
           "print('bound', os.environ.get('DDPFAB_PYTHON'), os.environ.get('DDPFAB_PYTHON_FROM'))" % port)
    spec = {"run_id": "adopt-1", "dir": str(tmp_path / "run"), "workdir": str(tmp_path), "grace": 1,
            "argv": [sys.executable, "-c", job], "env": {}, "adopted": True}
    code, out = _supervised(proc, nodeprog.frame({"id": 3, "op": "supervise", "spec": spec}), tmp_path / "run")
    assert code == 0 and b"bound None None" in out, out


def _supervised(proc: subprocess.Popen, data: bytes, run_dir: Path) -> tuple[int, bytes]:
    """*data* to a node program that becomes a supervisor, then its exit code and output once its
    job has ended (its stdin's EOF after that ends it)."""
    proc.stdin.write(data)
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not (run_dir / "exit_code").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.stdin.close()
    out = proc.stdout.read()
    return proc.wait(timeout=30), out


def test_a_takeover_ends_the_mesh_probes_listeners_of_its_session():
    """A takeover operation begins with what the session's requests held let go of, as at the
    session's end: here the mesh probe's listener (it refuses connections from then on)."""
    replies: list[dict] = []
    found = {}

    def takeover(req):
        port = replies[0]["result"]["ephemeral"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        found["port"] = port
        return 7

    loop.TAKEOVER["test_takeover"] = takeover
    read, write = os.pipe()
    try:
        os.write(write, nodeprog.frame({"id": 1, "op": "mesh_listen"}) + nodeprog.frame({"id": 2, "op": "test_takeover"}))
        os.close(write)
        assert loop.serve(read, write=lambda text: replies.append(json.loads(text))) == 7
    finally:
        del loop.TAKEOVER["test_takeover"]
        os.close(read)
    assert replies[0]["ok"] and found["port"] == replies[0]["result"]["ephemeral"]


def test_release_lets_go_of_the_lock_and_the_port_reservation(tmp_path):
    session: dict = {"lock": ("/wd", os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)),
                     "port_leases": [os.open(tmp_path / "lease", os.O_CREAT | os.O_RDWR)]}
    fds = [session["lock"][1], *session["port_leases"]]
    loop.release(session)
    assert session == {}
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
