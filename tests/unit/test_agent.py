"""The node supervisor, run for real on this machine: it must leave no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ddpfab import agent

AGENT = Path(agent.__file__)

# a job tree like torchrun's: a parent, a child in a session of its own (as torchrun's workers
# are), and a grandchild that ignores SIGTERM; each writes its pid to a file
TREE = r"""
import os, signal, subprocess, sys, time
d = sys.argv[1]
kid = subprocess.Popen([sys.executable, "-c",
    "import os,signal,subprocess,sys,time;signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "open(sys.argv[1]+'/kid','w').write(str(os.getpid()));"
    "g=subprocess.Popen([sys.executable,'-c','import time;time.sleep(300)']);"
    "open(sys.argv[1]+'/grandkid','w').write(str(g.pid));time.sleep(300)", d], start_new_session=True)
open(d + "/parent", "w").write(str(os.getpid()))
print("tree up", flush=True)
code = int(sys.argv[2])
if code >= 0:
    time.sleep(0.5)
    sys.exit(code)
time.sleep(300)
"""


def start(tmp_path: Path, exit_code: int) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "tree.py").write_text(TREE)
    spec = {"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1,
            "command": f"{sys.executable} {tmp_path / 'tree.py'} {tmp_path} {exit_code}"}
    proc = subprocess.Popen([sys.executable, str(AGENT), json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, tmp_path


def pids(d: Path) -> list[int]:
    deadline = time.monotonic() + 20
    while not all((d / f).exists() and (d / f).read_text() for f in ("parent", "kid", "grandkid")):
        assert time.monotonic() < deadline, "job tree never came up"
        time.sleep(0.05)
    return [int((d / f).read_text()) for f in ("parent", "kid", "grandkid")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_link_closed_ends_the_whole_tree_even_detached_and_term_ignoring(tmp_path):
    proc, d = start(tmp_path, -1)
    tree = pids(d)
    assert all(alive(p) for p in tree)
    t0 = time.monotonic()
    proc.stdin.close()  # what sshd delivers when ddpfab goes away
    proc.wait(timeout=10)
    assert time.monotonic() - t0 < 5
    assert not any(alive(p) for p in tree)
    run = d / "run"
    assert (run / "stopped").read_text().strip() == "controller link closed"
    record = json.loads((run / "agent.json").read_text())
    assert record["agent_pid"] == proc.pid and record["pgid"] == record["pid"] > 0
    assert oct(run.stat().st_mode & 0o777) == "0o700"


def test_job_exit_code_is_relayed_and_stragglers_are_ended(tmp_path):
    proc, d = start(tmp_path, 7)
    tree = pids(d)
    out = proc.stdout.read()  # keep the link open: the job ends by itself
    proc.wait(timeout=15)
    assert proc.returncode == 7
    assert b"tree up" in out
    assert (d / "run" / "exit_code").read_text().strip() == "7"
    assert "tree up" in (d / "run" / "output.log").read_text()
    assert not any(alive(p) for p in tree)


def test_sigterm_to_the_agent_ends_the_tree(tmp_path):
    proc, d = start(tmp_path, -1)
    tree = pids(d)
    proc.terminate()
    proc.wait(timeout=10)
    assert not any(alive(p) for p in tree)
    assert (d / "run" / "stopped").read_text().startswith("signal")
