"""The node program as a module (request -> reply) and as the program a node runs (one python,
its code and the requests on stdin, one validated reply per request)."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab import node as nodeprog
from ddpfab.node import ops as program


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
                          input=nodeprog.program() + b"abc\n{}", capture_output=True, timeout=60)
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


def test_ps_and_stop_over_run_records(tmp_path):
    run = tmp_path / "runs" / "20260101-000000-abcdef"
    run.mkdir(parents=True)
    (run / "agent.json").write_text(json.dumps({"run_id": run.name, "agent_pid": os.getpid(), "started": 1.0}))
    (run / "exit_code").write_text("3\n")
    out = program.op_ps({"root": str(tmp_path / "runs")}, {})
    assert out["runs"] == [{"run_id": run.name, "state": "exited", "exit_code": 3, "started": 1.0,
                            "agent_pid": os.getpid(), "dir": str(run)}]
    assert program.op_stop({"dir": str(run), "grace": 0.1}, {}) == {"said": "not running", "stopped": True}


def test_the_supervisor_is_an_operation_of_the_same_program(tmp_path):
    spec = {"run_id": "sup-1", "dir": str(tmp_path / "run"), "workdir": str(tmp_path), "grace": 1,
            "argv": [sys.executable, "-c", "import os; print('job says', os.environ['TOKEN'])"],
            "env": {"TOKEN": "s3cret"}}
    argv = nodeprog.argv(sys.executable, *nodeprog.supervisor_words("sup-1"))
    assert "s3cret" not in " ".join(argv) and argv[-2:] == ["ddpfab-agent", "sup-1"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(nodeprog.supervisor_input(spec))
    proc.stdin.flush()
    out = b""
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / "exit_code").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.stdin.close()
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0 and b"job says s3cret" in out
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
    assert words[:2] == ["/opt/venv/bin/python", "-c"] and len(words[2]) < 300
    assert int(words[3]) == len(nodeprog.program()) and words[4:] == ["ddpfab-node"]
    line = nodeprog.command("/opt/venv/bin/python", "ddpfab-node", fallback="python3")
    assert "command -v /opt/venv/bin/python" in line and "exec python3 -c" in line
