"""The node program's workdir lock (one writer per workdir), as functions: real flocks on real
files, a second program process as the other sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.node import loop as program
from ddpfab.transfer import sync

HOLDER = {"user": "alice", "host": "laptop", "pid": 4242, "since": 1764590000.5, "src": "/home/alice/proj"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def probed(tmp_path, session: dict) -> str:
    """A probe of a fresh workdir (create false: it changes nothing), as a sync's first request."""
    req = {"op": "probe", "workdir": str(tmp_path / "work"), "create": False, "nonce": "x"}
    out = json.loads(program.handle(req, session))
    assert out["ok"], out
    return out["result"]["real"]


def other_process_locks(path: str) -> str:
    """Another process's try at the same lock file (as a second sync's node program does)."""
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('got')\n"
            "except OSError: print('busy')")
    return subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True).stdout.strip()


def test_lock_is_held_for_the_session_and_names_its_holder(tmp_path, home):
    mine, theirs = {}, {}
    real = probed(tmp_path, mine)
    assert not os.path.exists(real)  # the probe and the lock write nothing into the workdir
    assert program.op_lock({"holder": HOLDER, "wait_s": 0}, mine) == {"locked": True}
    path = program.lock_path(real)
    assert path.startswith(str(home)) and other_process_locks(path) == "busy"
    probed(tmp_path, theirs)
    out = program.op_lock({"holder": dict(HOLDER, pid=1), "wait_s": 0.2}, theirs)
    assert out["locked"] is False and out["holder"] == dict(HOLDER, node_pid=os.getpid())
    assert "lock" not in theirs
    text = sync.holder_text(out["holder"])
    assert "alice@laptop (pid 4242, since " in text and "from /home/alice/proj" in text
    program.op_unlock({}, mine)
    assert other_process_locks(path) == "got"
    assert program.op_lock({"holder": HOLDER, "wait_s": 0}, theirs) == {"locked": True}


def test_lock_needs_a_probed_workdir_and_changes_need_the_lock(tmp_path, home):
    session = {}
    with pytest.raises(program.NodeOpError):
        program.op_lock({"holder": HOLDER}, session)
    probed(tmp_path, session)
    req = {"op": "probe", "workdir": str(tmp_path / "work"), "create": True, "nonce": "x", "locked": True,
           "files": ["a.py"]}
    out = json.loads(program.handle(req, session))
    assert not out["ok"] and "not locked by this session" in out["error"]
    assert not (tmp_path / "work").exists()
    program.op_lock({"holder": HOLDER}, session)
    assert json.loads(program.handle(req, session))["ok"]
    assert json.loads((tmp_path / "work/.ddpfab/sync.json").read_text())["files"] == ["a.py"]


@pytest.mark.parametrize("written, read", [
    (b"not json", {}),
    (b'["a list"]', {}),
    (json.dumps({"user": "\x1b[2Jevil", "host": 7, "pid": True, "since": -1, "src": "x" * 600}).encode(), {}),
    (json.dumps({"user": "bob", "pid": 12, "extra": "dropped"}).encode(), {"user": "bob", "pid": 12}),
])
def test_a_holder_is_read_back_as_checked_data(tmp_path, written, read):
    path = tmp_path / "lock"
    path.write_bytes(written)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert program.read_holder(fd) == read
    finally:
        os.close(fd)
    assert "another sync" in sync.holder_text({}) and "\x1b" not in sync.holder_text({"user": "\x1b[2J", "pid": 3})


def test_the_lock_is_an_operation_of_the_shipped_program(tmp_path, home):
    """Over the real protocol: the lock ends with the program (stdin EOF), as on a node."""
    reqs = nodeprog.numbered({"op": "probe", "workdir": str(tmp_path / "work"), "create": False, "nonce": "x"},
                             {"op": "lock", "holder": HOLDER, "wait_s": 0})
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), input=nodeprog.stdin_for(*reqs),
                          capture_output=True, check=True)
    replies = nodeprog.match_replies("n", reqs, proc.stdout.splitlines(), proc.returncode)
    assert [r.ok for r in replies] == [True, True] and replies[1].result == {"locked": True}
    path = program.lock_path(replies[0].result["real"])
    assert other_process_locks(path) == "got"  # released by the program's end
