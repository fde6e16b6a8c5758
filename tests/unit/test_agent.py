"""The node supervisor, run for real on this machine: it must leave no process behind."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.node import agent

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


def spawn(spec: dict) -> subprocess.Popen:
    """The agent as ddpfab starts it: the node program's ``supervise`` request on stdin, which
    stays open (the link to ddpfab)."""
    proc = subprocess.Popen(nodeprog.argv(sys.executable, *nodeprog.supervisor_words(spec["run_id"])),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdin.write(nodeprog.supervisor_input(spec))
    proc.stdin.flush()
    return proc


def start(tmp_path: Path, exit_code: int) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "tree.py").write_text(TREE)
    spec = {"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1,
            "argv": [sys.executable, str(tmp_path / "tree.py"), str(tmp_path), str(exit_code)]}
    return spawn(spec), tmp_path


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


@pytest.mark.parametrize("sent, why", [(b"!", "another node failed"), (b"!h", "the job hung (--on-hang stop)"),
                                       (b"!o", "another node was stopped from outside the run")])
def test_a_fast_stop_records_why_ddpfab_stopped_the_job(tmp_path, sent, why):
    """``--on-hang stop`` ended every node with the record "stopped by ddpfab: another node failed"
    (a new user's pass: doctor then said so of a hang). The byte after ``!`` says why."""
    proc, d = start(tmp_path, -1)
    pids(d)
    proc.stdin.write(sent)
    proc.stdin.close()
    proc.wait(timeout=30)
    result = json.loads((d / "run" / "result.json").read_text())
    assert result["stopped"] == f"stopped by ddpfab: {why}", result


def test_a_signal_that_lands_inside_the_stop_wait_still_stops_the_job(tmp_path):
    """A SIGTERM's handler runs in the main thread between two steps, which may be inside the main
    loop's ``stop.wait(0.05)`` with the event's own lock held (CPython's ``Event._cond``): the
    handler must not wait for that lock (it would for ever: ``ddpfab stop`` then said "still
    running" and the job ran on), and the main loop still takes the stop."""
    sup = agent.Supervisor({"run_id": "r1", "dir": str(tmp_path / "run")})
    returned = threading.Event()

    def land_inside_the_wait():
        with sup.stop._cond:  # what the main thread holds there
            sup.on_signal(signal.SIGTERM, None)
        returned.set()

    threading.Thread(target=land_inside_the_wait, daemon=True).start()
    assert returned.wait(5), "the signal handler waited for the stop event's lock"
    sup._take_signal()
    assert sup.stop.is_set() and sup.reason == f"signal {int(signal.SIGTERM)}"



# torchrun's --tee passes on a rank's line in pieces as it finds them in its log file, and its own
# stderr can come between two pieces (the CI saw 'STEP {...}[W1203 socket.cpp:207] ...'); a prompt
# without a newline must still show while the job runs
PIECES = r"""
import os, time
os.write(1, b'STEP {"step": 1}')
time.sleep(0.15)
os.write(2, b"[W socket.cpp:207] a warning\n")
time.sleep(0.15)
os.write(1, b"\nprogress 10%\rprogress 20%\r")
os.write(1, b"prompt> ")
time.sleep(3)
os.write(2, b"bye\n")
os.write(1, b"crlf\r")  # a "\r\n" in two writes, another stream's line between them
time.sleep(0.1)
os.write(2, b"err\n")
os.write(1, b"\n")
"""


def test_lines_of_stdout_and_stderr_reach_ddpfab_whole_and_a_prompt_still_shows(tmp_path):
    (tmp_path / "pieces.py").write_text(PIECES)
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1,
                  "argv": [sys.executable, str(tmp_path / "pieces.py")]})
    began, seen = time.monotonic(), b""
    while b"prompt> " not in seen:
        chunk = proc.stdout.read1(4096)
        assert chunk, seen
        seen += chunk
    prompt_after = time.monotonic() - began
    seen += proc.stdout.read()
    assert proc.wait(timeout=10) == 0
    lines = seen.decode().splitlines()
    assert 'STEP {"step": 1}' in lines and "[W socket.cpp:207] a warning" in lines, lines
    assert "progress 10%\rprogress 20%\rprompt> bye\n" in seen.decode()
    assert "crlf\r\n" in seen.decode() and "err" in lines, seen
    assert prompt_after < 3, f"the unfinished line waited for the job's next line ({prompt_after:.1f} s)"
    assert (tmp_path / "run" / "output.log").read_bytes() == seen  # the log holds the same lines


# a stand-in for torchrun (named so; argv[0] basename is what the agent looks for): two workers,
# then a slow shutdown after a failure, as torchrun's is with torch loaded on a busy node. It reaps
# its workers once a second, where torchrun looks every 0.1 s: the agent reads a failed worker's
# status in the moment between its exit and its reaping, and under a loaded CI a 0.1 s moment was
# once lost (the fallback then, torchrun's own exit, is tested below and in test_exit_race). What
# this checks is what the agent does once it has seen the failure.
FAKE_TORCHRUN = r"""
import subprocess, sys, time
codes = [int(c) for c in sys.argv[1:]]
workers = [subprocess.Popen([sys.executable, "-c",
           "import sys,time;time.sleep(2 if %d >= 0 else 300);sys.exit(%d)" % (c, max(c, 0))])
           for c in codes]
open(sys.argv[0] + ".pids", "w").write(" ".join(str(w.pid) for w in workers))
while True:
    states = [w.poll() for w in workers]
    if any(s not in (None, 0) for s in states):
        time.sleep(8)  # torchrun tearing down, writing its error report, exiting
        sys.exit(1)
    if all(s == 0 for s in states):
        sys.exit(0)
    time.sleep(1)
"""


def start_fake_torchrun(tmp_path: Path, codes: list[int], watch: bool) -> subprocess.Popen:
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_TORCHRUN)
    spec = {"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": watch,
            "argv": [sys.executable, str(launcher), *map(str, codes)]}
    return spawn(spec)


def test_a_failed_worker_ends_the_job_without_waiting_for_torchrun(tmp_path):
    proc = start_fake_torchrun(tmp_path, [3, -1], watch=True)  # worker 0 fails, worker 1 hangs
    t0 = time.monotonic()
    proc.wait(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 1  # what torchrun itself would have exited with
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["stopped"].startswith("a worker failed") and "exit 3" in result["stopped"], result
    assert result["failed_worker"] == {"pid": result["failed_worker"]["pid"], "exit": 3}  # as data too
    from ddpfab.launch.execute import failed_worker_text
    assert failed_worker_text(result["failed_worker"]) == f"a worker (pid {result['failed_worker']['pid']}) exited with 3"
    assert failed_worker_text({"pid": 597, "signal": 6}) == "a worker (pid 597) was killed by signal 6 (SIGABRT)"
    for bad in (None, [], {"pid": "597", "signal": 6}, {"pid": 597}, {"pid": True, "exit": 1}):
        assert failed_worker_text(bad) == ""
    assert took < 6.5, f"took {took:.1f} s: the agent waited for the launcher's slow shutdown (2 s + 8 s)"
    workers = [int(p) for p in (tmp_path / "bin" / "torchrun.pids").read_text().split()]
    assert len(workers) == 2 and not any(alive(p) for p in workers)  # the hanging one too


TORCHRUN_STOPPING_THE_OTHERS = r"""
import signal, subprocess, sys, time
first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[0] + ".pids", "w").write("%d %d" % (first.pid, other.pid))
first.wait()  # (a worker that failed: torchrun ends the others with SIGTERM)
time.sleep(0.5)
other.send_signal(signal.SIGTERM)
time.sleep(1)  # (torchrun's monitor looks every 0.1 s: the watcher reads this one's zombie first)
other.wait()
"""


def test_a_sigterm_after_a_worker_whose_status_was_lost_blames_that_worker(tmp_path, monkeypatch):
    """Under load torchrun can reap a worker before the watcher reads its zombie's status (CI: a
    rank aborted at exit, its status lost, and torchrun's SIGTERM of its sibling was then named as
    the abort). torchrun ends the others only after a failure, so the worker that ended first
    unseen is the one that failed; the SIGTERM'd sibling is not."""
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(TORCHRUN_STOPPING_THE_OTHERS)
    proc = subprocess.Popen([sys.executable, str(launcher)])
    pids = tmp_path / "bin" / "torchrun.pids"
    deadline = time.monotonic() + 20
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    first, other = map(int, pids.read_text().split())
    real = agent.exit_status
    monkeypatch.setattr(agent, "exit_status", lambda pid: None if pid == first else real(pid))  # the lost read
    seen: list = []
    stop = agent.threading.Event()
    try:
        agent.watch_workers(proc.pid, lambda pid, how: seen.append((pid, how)), stop, interval=0.05)
    finally:
        proc.kill()
        proc.wait()
    assert seen == [(first, ("status", "unseen"))]


LAUNCHER_THAT_FAILS_ITSELF = r"""
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[0] + ".pids", "w").write(str(worker.pid))
time.sleep(2)
sys.exit(1)  # the launcher fails on its own; its worker is still running
"""


def test_a_worker_the_agent_ends_after_the_launcher_failed_is_not_blamed(tmp_path):
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(LAUNCHER_THAT_FAILS_ITSELF)
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
                  "argv": [sys.executable, str(launcher)]})
    proc.wait(timeout=30)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    # the agent SIGTERMs the orphaned worker itself: that is teardown, not the job's failure
    assert result["exit_code"] == 1 and result["stopped"] is None, result
    worker = int((tmp_path / "bin" / "torchrun.pids").read_text())
    assert not alive(worker)


def test_workers_that_succeed_let_torchrun_finish(tmp_path):
    proc = start_fake_torchrun(tmp_path, [0, 0], watch=True)
    proc.wait(timeout=30)
    assert proc.returncode == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["stopped"] is None and result["exit_code"] == 0 and result["failed_worker"] is None


def test_launcher_detection_matches_whole_argv_words(tmp_path):
    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 30; echo python -m torch.distributed.run"])
    module = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "torch.distributed.run"])
    for p, word in ((shell, b"sleep 30;"), (module, b"time.sleep(30)")):
        deadline = time.monotonic() + 10
        while word not in Path(f"/proc/{p.pid}/cmdline").read_bytes():  # until the child has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
    try:
        assert not agent.is_launcher(shell.pid)  # the text inside one `sh -c` word is not a launcher
        assert agent.is_launcher(module.pid)
    finally:
        for p in (shell, module):
            p.kill()
            p.wait()


def test_exit_status_is_read_from_the_zombie():
    exited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    deadline = time.monotonic() + 10
    while (agent.exit_status(exited.pid) is None or agent.exit_status(killed.pid) is None) \
            and time.monotonic() < deadline:
        time.sleep(0.02)  # not reaped yet: both stay zombies until wait()
    assert agent.exit_status(exited.pid) == ("exit", 5)
    assert agent.exit_status(killed.pid) == ("signal", 9)
    exited.wait()
    killed.wait()
    assert agent.exit_status(exited.pid) is None  # reaped: gone


TORCHRUN_WHOSE_WORKER_IS_KILLED = r"""
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(1.5); os.kill(os.getpid(), 9)"],
                          env=dict(os.environ, RANK="5", LOCAL_RANK="1"))
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[0] + ".pids", "w").write("%d %d" % (worker.pid, other.pid))
time.sleep(300)
"""


def test_a_worker_killed_before_a_stop_is_the_nodes_own_failure(tmp_path):
    """SIGKILL (the OOM killer's signal) kills a rank; its peers elsewhere fail at once, and ddpfab's
    fast stop (``!``) can reach this node while its supervisor still lets the rank's last lines
    through. The node failed on its own all the same: not "stopped by ddpfab", the worker's signal
    and ranks recorded (a manifest said exit 143, "another node failed")."""
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(TORCHRUN_WHOSE_WORKER_IS_KILLED)
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
                  "argv": [sys.executable, str(launcher)]})
    pids_file = tmp_path / "bin" / "torchrun.pids"
    deadline = time.monotonic() + 20
    while not pids_file.exists() or not pids_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    worker, other = map(int, pids_file.read_text().split())
    while alive(worker):  # (a zombie reads as dead: it is the moment the kill landed)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)  # the watcher has seen it; its last lines are still being let through
    proc.stdin.write(b"!")  # another node failed: ddpfab's fast stop
    proc.stdin.flush()
    proc.wait(timeout=30)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert proc.returncode == 1 and result["exit_code"] == 1, result
    # (oom: false where this user can read the kernel log, as root, and absent where not)
    assert result["failed_worker"].pop("oom", False) is False, result
    assert result["failed_worker"] == {"pid": worker, "signal": 9, "rank": 5, "local_rank": 1}, result
    assert result["failed_at"] is not None and "another node failed" not in (result["stopped"] or ""), result
    assert not alive(other)


# a torchrun whose worker (rank 4, local rank 1) failed before the supervisor's worker watch saw
# it: its exit guard's record is all that says so (a rank that died within the watch's first look)
TORCHRUN_WHOSE_FAILURE_WAS_MISSED = r"""
import json, os, sys, time
ranks = os.path.join(sys.argv[1], "ranks")
os.makedirs(ranks, exist_ok=True)
with open(os.path.join(ranks, "rank-1.json"), "w") as fh:
    fh.write(json.dumps({"rank": "4", "local_rank": "1", "pid": 4242, "code": 1, "restart": "0",
                         "time": time.time()}))
print("worker failed", flush=True)
time.sleep(300)  # torchrun still ending the others when the stop comes
"""


def test_a_rank_that_failed_before_a_stop_unseen_by_the_watch_is_the_nodes_own_failure(tmp_path):
    """A rank failed on its own within the worker watch's first look (a SyntaxError, an import):
    only its exit guard's record says so. ddpfab's fast stop (another node failed the same way
    first) reached this node before its torchrun ended: ps, doctor and the manifest called the node
    "stopped by ddpfab: another node failed" (exit 143), a new user's pass found."""
    launcher = tmp_path / "torchrun"
    launcher.write_text(TORCHRUN_WHOSE_FAILURE_WAS_MISSED)
    for restarts in (0, 1):
        run = tmp_path / f"run{restarts}"
        spec = {"run_id": "t", "dir": str(run), "grace": 1, "argv": [sys.executable, str(launcher), str(run)]}
        proc = spawn({**spec, "watch_workers": True} if not restarts else spec)
        assert proc.stdout.readline().endswith(b"worker failed\n")
        proc.stdin.write(b"!")  # another node failed: ddpfab's fast stop
        proc.stdin.flush()
        proc.wait(timeout=30)
        result = json.loads((run / "result.json").read_text())
        if restarts:  # torchrun restarts (no watch_workers): an earlier attempt's record says nothing of this one
            assert result["stopped"] == "stopped by ddpfab: another node failed" and result["failed_at"] is None
            continue
        recorded = json.loads((run / "ranks" / "rank-1.json").read_text())
        assert proc.returncode == 1 and result["exit_code"] == 1, result
        assert result["failed_worker"] == {"pid": 4242, "exit": 1, "rank": 4, "local_rank": 1}, result
        assert result["failed_at"] == recorded["time"], result
        assert result["stopped"] == "a worker failed (pid 4242, exit 1) before the stop came", result
        assert agent.ended_state(result) == "exited"


def test_a_rank_that_failed_after_the_stop_leaves_the_node_stopped(tmp_path):
    """The same record written after the stop came (a rank ended by the stop, its script exiting
    1 on SIGTERM) is the stop's doing: the node stays stopped by ddpfab."""
    launcher = tmp_path / "torchrun"
    launcher.write_text("import signal, subprocess, sys, time\n"
                        "def term(*_):\n"
                        "    subprocess.run([sys.executable, sys.argv[2], sys.argv[1]])\n"
                        "    sys.exit(1)\n"
                        "signal.signal(signal.SIGTERM, term)\n"
                        "print('up', flush=True)\n"
                        "time.sleep(300)\n")
    (tmp_path / "record.py").write_text(TORCHRUN_WHOSE_FAILURE_WAS_MISSED.replace("time.sleep(300)", "pass"))
    run = tmp_path / "run"
    proc = spawn({"run_id": "t", "dir": str(run), "grace": 3, "watch_workers": True,
                  "argv": [sys.executable, str(launcher), str(run), str(tmp_path / "record.py")]})
    assert proc.stdout.readline().endswith(b"up\n")
    proc.stdin.write(b"!")
    proc.stdin.flush()
    proc.wait(timeout=30)
    result = json.loads((run / "result.json").read_text())
    assert (run / "ranks" / "rank-1.json").exists()  # written, after the stop
    assert result["stopped"] == "stopped by ddpfab: another node failed" and result["failed_at"] is None, result
    assert agent.ended_state(result) == "stopped"


def test_a_worker_first_ended_by_sigterm_is_marked_as_sent_from_outside(tmp_path):
    """The first worker to end, ended by SIGTERM, before any rank failed and before any stop:
    neither torchrun (it sends SIGTERM only after a failure) nor ddpfab sent it. Its record says
    so (a new user's pass: a `kill` of one rank read "only secondary failures were seen")."""
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(TORCHRUN_WHOSE_WORKER_IS_KILLED.replace("os.getpid(), 9)", "os.getpid(), 15)"))
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
                  "argv": [sys.executable, str(launcher)]})
    proc.wait(timeout=30)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    worker = int((tmp_path / "bin" / "torchrun.pids").read_text().split()[0])
    assert result["failed_worker"] == {"pid": worker, "signal": 15, "rank": 5, "local_rank": 1, "outside": True}, \
        result


def test_torchrun_killed_by_a_signal_nobody_here_sent_is_recorded(tmp_path):
    """torchrun itself killed (`kill -9` of it, the OOM killer's choice): no worker failed first,
    so the record said nothing of the cause (a new user's pass: "failed: node2 ... exit code 137;
    the others were stopped", no cause)."""
    launcher = tmp_path / "torchrun"
    launcher.write_text("import os, time\nprint('up', flush=True)\ntime.sleep(0.3)\nos.kill(os.getpid(), 9)\n")
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
                  "argv": [sys.executable, str(launcher)]})
    proc.wait(timeout=30)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["exit_code"] == 137 and result["launcher"]["signal"] == 9, result
    assert type(result["launcher"]["pid"]) is int and result["failed_at"] is not None, result
    # a job that ended by itself with an exit code, or one that ddpfab stopped, names no launcher signal
    (tmp_path / "x").mkdir()
    proc, d = start(tmp_path / "x", 7)
    proc.stdout.read()
    proc.wait(timeout=15)
    assert json.loads((d / "run" / "result.json").read_text())["launcher"] is None


# a torchrun whose rank 3 (local rank 1) ends well early (os._exit: no exit guard record), then
# rank 2 (local rank 0), which waited for it, fails
TORCHRUN_WHOSE_RANK_LEFT_EARLY = r"""
import os, subprocess, sys, time
early = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(1.0); os._exit(0)"],
                         env=dict(os.environ, RANK="3", LOCAL_RANK="1"))
waiting = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(2.0); sys.exit(1)"],
                           env=dict(os.environ, RANK="2", LOCAL_RANK="0"))
time.sleep(300)  # torchrun still reporting the failure when its supervisor ends it
"""


def test_a_rank_that_ended_well_on_a_node_that_failed_is_recorded(tmp_path):
    """3 x 2, rank 3 ends early (exit 0) while the others wait for it in a collective; its
    sibling then loses its peer. The node's record named only the sibling: the line blamed a
    victim (a new user's pass). The ranks that had ended with exit 0 are recorded."""
    launcher = tmp_path / "torchrun"
    launcher.write_text(TORCHRUN_WHOSE_RANK_LEFT_EARLY)
    proc = spawn({"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
                  "argv": [sys.executable, str(launcher)]})
    proc.wait(timeout=30)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["exit_code"] == 1 and result["failed_worker"]["rank"] == 2, result
    assert result["ended_0"] == [{"rank": 3, "local_rank": 1}], result


def test_a_node_whose_ranks_had_all_finished_when_the_stop_came_exited_0(tmp_path):
    """1 process per node, rank 0 ends early with exit 0 (os._exit: no exit guard record); its
    torchrun waits at its exit barrier when ddpfab stops the node, the others having failed. The
    node read "stopped" (exit 143) and a victim led the line (a new user's pass): it exited 0."""
    launcher = tmp_path / "torchrun"
    launcher.write_text("import os, subprocess, sys, time\n"
                        "w = subprocess.Popen([sys.executable, '-c', 'import os, time; time.sleep(1.0); os._exit(0)'],"
                        " env=dict(os.environ, RANK='0', LOCAL_RANK='0'))\n"
                        "time.sleep(1.5)\nw.wait()\n"  # (torchrun reaps its workers at its next look, not at once)
                        "print('at the barrier', flush=True)\ntime.sleep(300)\n")
    run = tmp_path / "run"
    proc = spawn({"run_id": "t", "dir": str(run), "grace": 1, "watch_workers": True, "nproc": 1,
                  "argv": [sys.executable, str(launcher)]})
    assert proc.stdout.readline().endswith(b"at the barrier\n")
    time.sleep(0.5)  # the watch has seen the worker's exit
    proc.stdin.write(b"!")
    proc.stdin.flush()
    proc.wait(timeout=30)
    result = json.loads((run / "result.json").read_text())
    assert result["exit_code"] == 0 and agent.ended_state(result) == "exited", result


# a torchrun whose tee lags: its worker (local rank 1) writes a traceback to its log file and
# fails; the tee has relayed the first line only when the agent ends the job
LAGGING_TEE = r"""
import os, subprocess, sys, time
logs = os.path.join(sys.argv[1], "r_x1y2", "attempt_0", "1")
os.makedirs(logs)
worker = subprocess.Popen([sys.executable, "-c",
    "import sys, time; time.sleep(0.6); open(sys.argv[1] + '/stdout.log', 'w').write('step 0 ok\\n');"
    "open(sys.argv[1] + '/stderr.log', 'w').write('Traceback (most recent call last):\\n'"
    "'  File \"train.py\", line 3, in <module>\\n' 'ValueError: bad batch\\n'); sys.exit(1)", logs],
    env=dict(os.environ, RANK="5", LOCAL_RANK="1"))
sys.stdout.write("[default1]:step 0 ok\n")
sys.stdout.flush()
while not os.path.getsize(os.path.join(logs, "stderr.log")) if os.path.exists(os.path.join(logs, "stderr.log")) else True:
    time.sleep(0.01)
sys.stderr.write("[default1]:Traceback (most recent call last):\n")
sys.stderr.flush()
time.sleep(300)
"""


def test_what_the_tee_had_not_relayed_of_a_failed_rank_is_relayed_after_the_job(tmp_path):
    launcher = tmp_path / "bin" / "torchrun"
    launcher.parent.mkdir()
    launcher.write_text(LAGGING_TEE)
    spec = {"run_id": "t", "dir": str(tmp_path / "run"), "grace": 1, "watch_workers": True,
            "log_dir": str(tmp_path / "logs"), "argv": [sys.executable, str(launcher), str(tmp_path / "logs")]}
    proc = spawn(spec)  # (its stdin, the link to ddpfab, stays open)
    proc.wait(timeout=30)
    out = proc.stdout.read()
    assert proc.returncode == 1, out
    lines = out.decode().splitlines()
    told = [ln for ln in lines if ln.startswith("[default1]:")]
    assert told == ["[default1]:step 0 ok", "[default1]:Traceback (most recent call last):",
                    '[default1]:  File "train.py", line 3, in <module>', "[default1]:ValueError: bad batch"], lines
    assert (tmp_path / "run" / "output.log").read_bytes().decode().count("ValueError: bad batch") == 1


def test_rank_lines_counts_whole_tagged_lines_however_the_chunks_fall():
    tally = agent.RankLines({1: "stdout", 2: "stderr"})
    for fd, chunk in [(1, b"[default0]:a\n[default1]:b"), (2, b"[default1]:x\n"), (1, b" still b\n"),
                      (1, b"torchrun's own\n"), (1, b""), (1, b"[default0]:c\n\n[default12]:d\n")]:
        tally(fd, chunk)
    assert tally.count == {("stdout", 0): 2, ("stdout", 1): 1, ("stderr", 1): 1, ("stdout", 12): 1}


def test_unrelayed_lines_are_the_newest_attempts_past_what_was_relayed(tmp_path):
    for attempt, text in (("attempt_0", "old\n"), ("attempt_1", "one\ntwo\r\nthree")):
        (tmp_path / "r_1" / attempt / "0").mkdir(parents=True)
        (tmp_path / "r_1" / attempt / "0" / "stderr.log").write_bytes(text.encode())
    assert agent.unrelayed_lines(str(tmp_path), 0, {("stderr", 0): 1}) == [b"[default0]:two\n", b"[default0]:three\n"]
    assert agent.unrelayed_lines(str(tmp_path), 0, {}, limit=1) == [b"[default0]:three\n"]
    assert agent.unrelayed_lines(str(tmp_path), 3, {}) == []
    assert agent.unrelayed_lines(str(tmp_path / "none"), 0, {}) == []


#: In a terminal of its own (pty.fork: its session's foreground), and in a background group of it.
IN_A_TERMINAL = """
import os, sys
sys.path.insert(0, sys.argv[1])
from ddpfab.node import agent
fd = os.dup(0)
print("foreground", agent._terminal(fd) == fd, flush=True)
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)  # `sh script &` from a shell with job control
    fd = os.dup(0)
    print("background", agent._terminal(fd), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_hand_run_jobs_input_is_the_scripts_terminal_in_the_foreground_only():
    pid, main = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", IN_A_TERMINAL, str(Path(__file__).resolve().parents[2])])
    out = b""
    try:
        while True:
            try:
                chunk = os.read(main, 1024)
            except OSError:  # EIO: the child's side closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.waitpid(pid, 0)
        os.close(main)
    assert out.decode().split() == ["foreground", "True", "background", "None"], out
    assert agent._terminal(True) is None and agent._terminal(1) is None  # never stdio, never a bool
    read, write = os.pipe()
    try:
        assert agent._terminal(read) is None
        with pytest.raises(OSError):  # closed: a pipe kept for nobody holds its writer
            os.fstat(read)
    finally:
        os.close(write)


def test_a_job_that_exited_0_as_a_stop_came_exited():
    """A rank that left the group early (exit 0) let its node's job end 0 while ddpfab stopped the
    others: its record said "stopped by ddpfab", and doctor and ps called it stopped where the run
    said "exited 0" (a new user's pass at 24 nodes)."""
    stopped = "stopped by ddpfab: another node failed"
    assert agent.ended_state({"exit_code": 0, "stopped": stopped, "failed_at": None}) == "exited"
    assert agent.ended_state({"exit_code": 143, "stopped": stopped, "failed_at": None}) == "stopped"
    assert agent.ended_state({"exit_code": 1, "stopped": stopped, "failed_at": 5.0}) == "exited"
    assert agent.ended_state({"exit_code": 143, "cancelled": True, "stopped": "signal 15"}) == "cancelled"
    # `ddpfab stop` (a signal to the supervisor) of a job that traps it and exits 0: stopped
    assert agent.ended_state({"exit_code": 0, "stopped": "signal 15", "stop_signal": 15, "failed_at": None}) == "stopped"


def test_a_fast_stop_s_reason_read_apart_from_its_bang_is_kept(tmp_path):
    """The ``!`` and its reason may arrive in two reads (a relay that splits them)."""
    proc, d = start(tmp_path, -1)
    pids(d)
    proc.stdin.write(b"!")
    proc.stdin.flush()
    time.sleep(0.05)
    proc.stdin.write(b"h")
    proc.stdin.close()
    proc.wait(timeout=30)
    result = json.loads((d / "run" / "result.json").read_text())
    assert result["stopped"] == "stopped by ddpfab: the job hung (--on-hang stop)", result


def test_a_rank_record_with_an_impossible_time_or_rank_is_left_out(tmp_path):
    """An attacker's pass: a rank record with "time": 10**400 made float() raise in the supervisor's
    end (no result.json then); "-Infinity" counted as a failure before any stop; a rank "²" passed
    isdigit() and int() raised."""
    ranks = tmp_path / agent.RANKS_DIR
    ranks.mkdir()
    for local, rec in enumerate(('{"rank": "0", "local_rank": "0", "pid": 1, "code": 1, "restart": "0", "time": %s}'
                                 % ("1" + "0" * 400),
                                 '{"rank": "1", "local_rank": "1", "pid": 2, "code": 1, "restart": "0", '
                                 '"time": -Infinity}',
                                 '{"rank": "\u00b2", "local_rank": "2", "pid": 3, "code": 1, "restart": "0"}')):
        (ranks / f"rank-{local}.json").write_text(rec)
    done = agent.ranks_done(str(tmp_path))
    assert sorted(done) == [0, 1] and done[0]["time"] is None and done[1]["time"] is None, done
    assert agent.failed_before(str(tmp_path), 1e12) is None


def test_torchrun_s_workers_are_found_by_its_children_alone_and_by_a_scan_alike(monkeypatch):
    """The workers of a torchrun under the supervisor's job: read from the kernel's children files
    (a few reads; a look at every process was ~1 ms, 5 times a second on every node while torchrun
    started), and from a look at every process on kernels without them: the same pids, the
    launcher's children that have not exited (one that exited and is not reaped is none)."""
    from ddpfab.node import agent as node_agent

    launcher = ("import subprocess, sys, time; ps = [subprocess.Popen(['sleep', '30']) for _ in range(2)]; "
                "z = subprocess.Popen(['true']); print('up', flush=True); time.sleep(30)")
    job = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"{launcher}\" -m torch.distributed.run x; :"],
                           stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert job.stdout.readline() == b"up\n"
        time.sleep(0.3)  # (`true` has exited; torchrun never reaps it)
        found = sorted(node_agent.torchrun_workers(job.pid))
        assert len(found) == 2, found
        assert all(node_agent.proc_stat(p)[0] == "S" for p in found)
        monkeypatch.setattr(node_agent, "_live_children", lambda pid: None)  # a kernel without children files
        assert sorted(node_agent.torchrun_workers(job.pid)) == found
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
