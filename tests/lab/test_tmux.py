"""``ddpfab run --tmux`` on lab hosts: one tmux window per node, each a terminal on that node's
torchrun (real tmux, sshd, torchrun). Ctrl-C in one window ends that node's launch and ddpfab stops
the other; closing the session or Ctrl-C to ddpfab ends both; a ``breakpoint()`` is driven in its
node's window; nothing is left running or placed on the nodes, and the run is recorded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod
from .helpers import REPO, ddpfab, host_sh, wait_no_processes

SCRIPT = "tests/lab/scripts/tmux_ranks.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


class TmuxRun:
    """``ddpfab run --tmux`` in a subprocess, with a tmux server of the test's own."""

    def __init__(self, inventory: Path, tmp_path: Path, run_id: str, *args: str):
        self.env = {**os.environ, "NO_COLOR": "1", "TMUX_TMPDIR": str(tmp_path)}
        self.env.pop("TMUX", None)
        self.runs, self.run_id, self.session = tmp_path / "runs", run_id, f"ddpfab-{run_id}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpfab", "run", "-i", str(inventory), "--tmux", "--no-sync", "--runs-dir",
             str(self.runs), "--run-id", run_id, *args, SCRIPT],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=self.env)

    def tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", *args], capture_output=True, text=True, env=self.env)

    def pane(self, window: str) -> str:
        res = self.tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", f"{self.session}:{window}")
        return res.stdout if res.returncode == 0 else ""

    def wait_for(self, what, timeout: float, why: str):
        """*what()* once true; else the test fails with ddpfab's output and the windows'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            got = what()
            if got:
                return got
            time.sleep(0.2)
        shown = "".join(f"\n--- window {w}:\n{self.pane(w)}" for w in ("node1", "node2"))
        self.close()
        raise AssertionError(f"not within {timeout} s: {why}; ddpfab said:\n{self.proc.communicate()[0]}{shown}")

    def shows(self, node: str, ranks: tuple[int, ...]) -> str:
        """*node*'s window once it shows each of *ranks* ready there."""
        text = self.pane(node)
        return text if all(f"rank {k} on {node} ready" in text for k in ranks) else ""

    def ended(self, timeout: float = 60) -> str:
        try:
            return self.proc.communicate(timeout=timeout)[0]
        finally:
            self.close()

    def close(self) -> None:
        """What a failed test leaves: the session (its windows' ssh, so the nodes' launches) and ddpfab."""
        self.tmux("kill-server")
        if self.proc.poll() is None:
            self.proc.kill()

    def manifest(self) -> dict:
        return json.loads((self.runs / self.run_id / "manifest.json").read_text())


def test_ctrl_c_in_one_window_ends_that_node_and_ddpfab_stops_the_other(lab, inventory2, tmp_path):
    run = TmuxRun(inventory2, tmp_path, "tmux-1", "--nproc-per-node", "2")
    try:
        # each window shows its own node's ranks, and only those
        for node, ranks, others in (("node1", (0, 1), (2, 3)), ("node2", (2, 3), (0, 1))):
            text = run.wait_for(lambda n=node, r=ranks: run.shows(n, r), 90, f"{node}'s window shows ranks {ranks}")
            assert not any(f"rank {k} " in text for k in others), text
        assert run.tmux("list-windows", "-t", run.session, "-F", "#{window_name}").stdout.split() == ["node1", "node2"]
        # the launch went to the node's record of the run over stdin (no secret in any command line)
        # and removed itself as its window started it: no file with the env's values while it runs
        for node in ("node1", "node2"):
            left = host_sh(lab, node, "ls ~/.ddpfab/runs/tmux-1/").stdout.split()
            assert "tmux-launch.sh" not in left and "tmux.pid" in left, (node, left)
        # Ctrl-C in node1's window: its torchrun ends, ddpfab stops node2
        assert run.tmux("send-keys", "-t", f"{run.session}:node1", "C-c").returncode == 0
        out = run.ended()
    finally:
        run.close()
    assert run.proc.returncode not in (0, None), out
    assert "node1: its launch ended, exit code" in out, out
    assert "node1 failed: stopping the other nodes (node2)" in out, out
    manifest = run.manifest()
    assert manifest["state"] == "failed" and manifest["first_failure"] == "node1", manifest
    assert manifest["tmux"] == run.session and manifest["nodes"]["node2"]["stopped_by_ddpfab"], manifest
    for node in ("node1", "node2"):  # the launch is gone; the node's record of the run stays, with its end
        left = host_sh(lab, node, "ls ~/.ddpfab/runs/tmux-1/").stdout.split()
        assert "tmux-launch.sh" not in left and "tmux.pid" in left, (node, left)
        code = host_sh(lab, node, "cat ~/.ddpfab/runs/tmux-1/exit_code").stdout.strip()
        assert code == str(manifest["nodes"][node]["exit_code"]), (node, code, manifest["nodes"][node])
    # so ps lists it as ended on both nodes (it listed it no more once the launches ended)
    listed = json.loads(ddpfab("ps", "-i", str(inventory2), "--json").stdout)
    ended = next(r for r in listed["runs"] if r["run_id"] == "tmux-1")
    assert ended["state"] != "running" and set(ended["nodes"]) == {"node1", "node2"}, ended
    # node2, which ddpfab stopped, as stopped (it read exited(1), as if it had failed too); node1 as it ended
    assert ended["nodes"]["node2"]["state"] == "stopped", ended
    assert ended["nodes"]["node2"].get("stopped") == "stopped by ddpfab: node1 failed", ended
    assert ended["nodes"]["node1"]["state"] == "exited", ended
    # logs: its output went to the windows, so torchrun's per-rank logs are what logs copies (it
    # said "output.log is missing: it did not run on this node")
    logs = ddpfab("logs", "--runs-dir", str(run.runs), "tmux-1")
    assert logs.returncode == 0 and "per-rank log files in" in logs.stdout, logs.stdout + logs.stderr
    assert any("rank 0 on node1 ready" in p.read_text() for p in (run.runs / "tmux-1" / "ranks" / "node1").rglob("*.log"))
    assert (run.runs / "tmux-1" / "ssh_config").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("how", ["close the session", "ctrl-c to ddpfab", "ddpfab stop", "close node1's window",
                                 "ddpfab killed", "ddpfab stop from elsewhere"])
def test_closing_the_session_or_ctrl_c_to_ddpfab_ends_every_nodes_launch(lab, inventory2, tmp_path, how):
    run = TmuxRun(inventory2, tmp_path, "tmux-" + how.split()[-1].replace("'", "").replace("elsewhere", "else"))
    try:
        for node, rank in (("node1", 0), ("node2", 1)):
            run.wait_for(lambda n=node, r=rank: run.shows(n, (r,)), 90, f"{node} ready")
        if how == "ddpfab killed":  # nothing of ddpfab runs on: the session closes, the nodes' launches end
            run.proc.kill()
            run.proc.wait()
            deadline = time.monotonic() + 30
            while run.tmux("has-session", "-t", f"={run.session}").returncode == 0:
                assert time.monotonic() < deadline, "the session outlived the ddpfab that ran it"
                time.sleep(0.2)
            wait_no_processes(lab, timeout=30)
            return
        if how == "ddpfab stop from elsewhere":  # no local record: each node ends its launch's session
            res = ddpfab("stop", run.run_id, "-i", str(inventory2), "--runs-dir", str(tmp_path / "elsewhere"))
            assert res.stdout.count("stopped its tmux launch") == 2, res.stdout + res.stderr
            out = run.ended()
            assert re.search(r": (its launch|their launches) ended, exit code", out), out
            # a stop, not a failure: the run blamed the node whose launch ended first ("failed: node2")
            assert run.proc.returncode == 143 and "stopped from outside on node" in out and "failed" not in out, out
            assert "stopped by `ddpfab stop`" in out and run.manifest()["first_failure"] is None, out
            wait_no_processes(lab, timeout=30)
            return
        if how == "close the session":
            assert run.tmux("kill-session", "-t", run.session).returncode == 0
        elif how == "ctrl-c to ddpfab":
            run.proc.send_signal(signal.SIGINT)
        elif how == "ddpfab stop":
            # `ps` lists the run (no supervisor runs it: its windows' sessions do) and says where it is
            listed = ddpfab("ps", "-i", str(inventory2), "--runs-dir", str(run.runs)).stdout
            row = next((line for line in listed.splitlines() if line.startswith(run.run_id + " ")), "")
            assert row.split()[1] == "running" and "node1:running node2:running" in row, listed
            # ps and stop from a terminal whose tmux is another server (the run's is under its own
            # TMUX_TMPDIR, as in `tmux -L`): the record's socket names the run's server
            socket = tmp_path / f"tmux-{os.getuid()}" / "default"
            assert row.endswith(f"(in tmux: tmux -S {socket} attach -t {run.session})"), listed
            here = ddpfab("ps", "-i", str(inventory2), "--runs-dir", str(run.runs), env={"TMUX_TMPDIR": str(tmp_path)})
            assert f"(in tmux: tmux attach -t {run.session})" in here.stdout, here.stdout
            # doctor reads the ranks under each window's launch (it said "node1 local rank 0 is gone; no
            # job record": a --tmux launch has no supervisor)
            doc = ddpfab("doctor", run.run_id, "--runs-dir", str(run.runs), timeout=120)
            assert "is gone" not in doc.stdout and "no job record" not in doc.stdout, doc.stdout + doc.stderr
            assert "node1 rank 0" in doc.stdout and "node2 rank 1" in doc.stdout, doc.stdout
            res = ddpfab("stop", run.run_id, "--runs-dir", str(run.runs))
            assert f"controller: tmux session {run.session}: closed" in res.stdout, res.stdout + res.stderr
        else:  # a window closed by hand: its node's launch is over, as if it failed
            assert run.tmux("kill-window", "-t", f"{run.session}:node1").returncode == 0
        out = run.ended()
    finally:
        run.close()
    if how == "close node1's window":
        assert run.proc.returncode == 255, out
        assert "node1 failed: stopping the other nodes (node2)" in out, out
        assert run.manifest()["first_failure"] == "node1"
        return
    assert run.proc.returncode == 130, out
    said = ("interrupted (SIGINT): ending every node's launch" if how == "ctrl-c to ddpfab"
            else f"the tmux session {run.session} was closed: ending every node's launch")
    assert said in out, out
    assert "did not end" not in out, out  # each node said what was left of its launch: nothing to wait for
    if how == "ctrl-c to ddpfab":  # each node's end said once; the nodes stopped with one exit code, on one line
        stopped = re.findall(r"^ddpfab: (.+): (?:its launch|their launches) ended, exit code (\d+) \(stopped\)$", out,
                             re.M)
        assert sorted(n for names, _ in stopped for n in names.split(", ")) == ["node1", "node2"], out
        assert len({code for _, code in stopped}) == len(stopped), out
    manifest = run.manifest()
    assert manifest["state"] == "interrupted" and manifest["exit_code"] == 130, manifest


def test_a_breakpoint_is_driven_in_its_nodes_window(lab, inventory2, tmp_path):
    run = TmuxRun(inventory2, tmp_path, "tmux-pdb", "--env", "BREAK_RANK=1")
    try:
        run.wait_for(lambda: "(Pdb)" in run.pane("node2"), 90, "rank 1 at its breakpoint in node2's window")
        run.tmux("send-keys", "-t", f"{run.session}:node2", "p int(os.environ['RANK']) * 7", "Enter")
        run.wait_for(lambda: "7\n" in run.pane("node2").split("* 7", 1)[-1], 30, "pdb's answer in the window")
        run.tmux("send-keys", "-t", f"{run.session}:node2", "c", "Enter")
        out = run.ended()
    finally:
        run.close()
    assert run.proc.returncode == 0, out
    assert "succeeded: every node's launch ended with exit code 0 (2 nodes)" in out, out


def test_a_session_someone_looks_at_stays_after_the_run_and_closes_when_they_detach(lab, inventory2, tmp_path):
    """The run's end keeps the session while a client is attached (it closed it anyway: the check
    of who looks asked tmux a pane's question of a session and read nothing), then closes it when
    the client detaches (it stayed for ever, its windows asleep)."""
    run = TmuxRun(inventory2, tmp_path, "tmux-look", "--env", "BREAK_RANK=1")
    client = None
    try:
        run.wait_for(lambda: "(Pdb)" in run.pane("node2"), 90, "rank 1 at its breakpoint in node2's window")
        client = subprocess.Popen(["script", "-qc", f"tmux attach -t ={run.session}", "/dev/null"], env=run.env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run.wait_for(lambda: run.tmux("list-clients", "-t", f"={run.session}").stdout.strip(), 30, "a client")
        run.tmux("send-keys", "-t", f"{run.session}:node2", "c", "Enter")
        out, _ = run.proc.communicate(timeout=60)
        assert run.proc.returncode == 0, out
        assert run.tmux("has-session", "-t", f"={run.session}").returncode == 0, out  # someone looks at it
        run.tmux("detach-client", "-s", f"={run.session}")
        deadline = time.monotonic() + 10
        while run.tmux("has-session", "-t", f"={run.session}").returncode == 0:
            assert time.monotonic() < deadline, "the session stayed after its last client detached"
            time.sleep(0.1)
    finally:
        run.close()
        if client is not None:
            client.kill()
            client.wait()


def test_plan_tmux_types_each_nodes_line_enter_starts_it_and_drives_a_breakpoint(lab, inventory2, tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "TMUX_TMPDIR": str(tmp_path)}
    env.pop("TMUX", None)
    out = tmp_path / "emit"

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", *args], capture_output=True, text=True, env=env)

    def pane(window: str) -> str:
        return tmux("capture-pane", "-p", "-J", "-t", f"ddpfab-tmux-plan:{window}").stdout

    res = subprocess.run([sys.executable, "-m", "ddpfab", "plan", "-i", str(inventory2), "--run-id", "tmux-plan",
                          "--runs-dir", str(tmp_path / "runs"), "--emit", str(out), "--tmux", "--env", "BREAK_RANK=1",
                          SCRIPT],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "tmux session ddpfab-tmux-plan: a window per node, its line typed, not run" in res.stderr
        for node, rank in (("node1", 0), ("node2", 1)):
            line = f"scp -F ssh_config -- rank{rank}-{node}.sh {node}: && ssh -t -F ssh_config {node} sh rank{rank}-{node}.sh"
            assert line in pane(node), pane(node)
            assert f"rank {rank} on" not in pane(node)  # typed, not run
        for node in ("node1", "node2"):
            tmux("send-keys", "-t", f"ddpfab-tmux-plan:{node}", "Enter")

        def wait_for(what, timeout: float = 90) -> None:
            deadline = time.monotonic() + timeout
            while not what():
                assert time.monotonic() < deadline, pane("node1") + pane("node2")
                time.sleep(0.2)

        wait_for(lambda: all(f"rank {r} on {n} ready" in pane(n) for n, r in (("node1", 0), ("node2", 1))))
        # the supervised job's input is the window's terminal: rank 1's breakpoint() is driven there
        wait_for(lambda: "(Pdb)" in pane("node2"))
        tmux("send-keys", "-t", "ddpfab-tmux-plan:node2", "p int(os.environ['RANK']) * 7", "Enter")
        wait_for(lambda: "7\n" in pane("node2").split("* 7", 1)[-1], 30)
        tmux("send-keys", "-t", "ddpfab-tmux-plan:node2", "c", "Enter")
        wait_for(lambda: "rank 1 went on" in pane("node2"), 30)

        def listed() -> str:
            return ddpfab("ps", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), timeout=60).stdout

        wait_for(lambda: "node1:exited(0) node2:exited(0)" in listed(), 60)  # the job ended 0 on both
    finally:
        tmux("kill-server")  # the windows' ssh go: the nodes' torchrun and ranks end with them
    for node, rank in (("node1", 0), ("node2", 1)):  # the copies the README's line made (secret values) are gone
        assert host_sh(lab, node, f"ls ~/rank{rank}-{node}.sh").returncode != 0


def test_without_tmux_the_error_says_how_to_install_it(inventory2, tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "PATH": "/nonexistent"}
    res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inventory2), "--tmux", "--no-sync",
                          "--runs-dir", str(tmp_path / "runs"), SCRIPT], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "tmux is not installed" in res.stderr and "apt-get install tmux" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_second_run_with_the_same_id_is_refused_and_leaves_the_first_alone(lab, inventory2, tmp_path):
    """The same --run-id from another runs dir: refused by the nodes' records of the run, or on
    other nodes by the tmux session's name here, before anything starts; the first run's launches
    and files on the nodes are left as they were (its end is its own)."""
    first = TmuxRun(inventory2, tmp_path, "tmux-same")
    node3 = tmp_path / "node3.yml"
    node3.write_text(labmod.render_inventory(lab, sys.executable, names=["node3"]))

    def second(inventory: Path, runs: str) -> str:
        res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inventory), "--tmux", "--no-sync",
                              "--runs-dir", str(tmp_path / runs), "--run-id", "tmux-same", SCRIPT],
                             capture_output=True, text=True, cwd=REPO, env=first.env, timeout=120)
        assert res.returncode != 0, res.stdout + res.stderr
        return res.stdout + res.stderr

    try:
        for node, rank in (("node1", 0), ("node2", 1)):
            first.wait_for(lambda n=node, r=rank: first.shows(n, (r,)), 90, f"{node}'s window shows rank {rank}")
        out = second(inventory2, "runs-b")
        assert "host node1: " in out and "this run id was used on this node already" in out, out
        out = second(node3, "runs-c")
        assert "tmux session ddpfab-tmux-same exists already" in out, out
        for node in ("node1", "node2"):
            left = host_sh(lab, node, "ls ~/.ddpfab/runs/tmux-same/").stdout.split()
            assert "tmux.pid" in left, (node, left)
        assert first.proc.poll() is None and first.shows("node1", (0,)) and first.shows("node2", (1,))
        assert host_sh(lab, "node3", "ls -d ~/.ddpfab/runs/tmux-same 2>/dev/null || true").stdout.strip() == ""
        first.tmux("kill-session", "-t", first.session)
        out = first.ended()
    finally:
        first.close()
    assert first.proc.returncode == 130, out  # ended by its session's close, as any run --tmux
    wait_no_processes(lab, timeout=30, names=("node1", "node2"))


def test_a_launch_is_kept_on_its_node_only_after_its_keep_line(lab, inventory2):
    """The node's side of placing a launch (its login shell over SSH): the copy is kept, private
    and ending with its keep line, once the placing kept the node; a placing abandoned first (an
    interrupt) sends no keep line and the node removes the copy itself; another run's launch
    there is refused and left as it was."""
    from ddpfab.api import Cluster
    from ddpfab.launch import tmuxrun
    from ddpfab.planning.plan import Facts, RunOptions, make_plan
    from ddpfab.remote import ssh

    cluster = Cluster.load(str(inventory2))
    facts = Facts({n.name: n.data_addr for n in cluster.parsed.nodes}, 29500, "/w")
    node = cluster.parsed.nodes[0]
    conn = ssh.connect(node, cluster.policy, cluster.ssh_config)
    launch = f"~/.ddpfab/runs/%s/{tmuxrun.LAUNCH}"
    try:
        kept, dropped = (make_plan(cluster.parsed, RunOptions("t.py", run_id=r), facts) for r in ("place-kept", "place-dropped"))
        placing = tmuxrun.Placing()
        tmuxrun._place(kept, kept.nodes[0], conn, placing)
        text = host_sh(lab, "node1", f"stat -c %a {launch % 'place-kept'} && tail -n 1 {launch % 'place-kept'}").stdout
        assert placing.placed == ["node1"] and text.split("\n")[0] == "600" and text.split("\n")[1].startswith(
            "# kept "), text
        abandoned = tmuxrun.Placing()
        abandoned.abandon()

        class NoRemoval:  # the connection without the thread's own removal: only the node's is left
            transport = conn.transport

            def run(self, *args, **kwargs):
                pass

        tmuxrun._place(dropped, dropped.nodes[0], NoRemoval(), abandoned)
        assert abandoned.placed == []
        assert host_sh(lab, "node1", f"ls {launch % 'place-dropped'}").returncode != 0  # removed by the node
        before = host_sh(lab, "node1", f"cat {launch % 'place-kept'}").stdout
        with pytest.raises(tmuxrun.RunIdInUse):
            tmuxrun._place(kept, kept.nodes[0], conn, tmuxrun.Placing())
        assert host_sh(lab, "node1", f"cat {launch % 'place-kept'}").stdout == before
    finally:
        conn.close()
        host_sh(lab, "node1", "rm -rf ~/.ddpfab/runs/place-kept ~/.ddpfab/runs/place-dropped")


def test_an_interrupt_while_tmux_makes_the_session_leaves_no_session(lab, inventory2, tmp_path):
    """Ctrl-C reaches ddpfab while tmux is making the session (a terminal's Ctrl-C goes to the tmux
    client too): tmux has made it, no window id came back. ddpfab closes it before it exits, and
    nothing starts on a node. A ``tmux`` on PATH before the real one sends the SIGINT to ddpfab
    right after the real tmux made the session."""
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "tmux"
    shim.write_text(f'#!/bin/sh\n{shutil.which("tmux")} "$@"\ncode=$?\n'
                    'if [ "$1" = new-session ]; then kill -INT "$PPID"; sleep 5; fi\nexit $code\n')
    shim.chmod(0o755)
    env = {**os.environ, "NO_COLOR": "1", "TMUX_TMPDIR": str(tmp_path), "PATH": f"{shims}:{os.environ['PATH']}"}
    env.pop("TMUX", None)
    res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inventory2), "--tmux", "--no-sync",
                          "--runs-dir", str(tmp_path / "runs"), "--run-id", "tmux-cut", SCRIPT],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    sessions = subprocess.run(["tmux", "ls"], capture_output=True, text=True, env=env).stdout
    subprocess.run(["tmux", "kill-server"], capture_output=True, env=env)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "ddpfab-tmux-cut" not in sessions, sessions
    wait_no_processes(lab, timeout=30, names=("node1", "node2"))
    for node in ("node1", "node2"):
        left = host_sh(lab, node, "ls ~/.ddpfab/runs/tmux-cut/ 2>/dev/null || true").stdout.split()
        assert "tmux-launch.sh" not in left and "tmux.pid" not in left, (node, left)


def test_plan_tmux_whose_session_name_is_taken_says_so_and_leaves_that_session(inventory2, tmp_path):
    """`plan --emit --tmux` where a session of the run's name exists (the same --run-id again)
    ended in a traceback; it says what tmux said, keeps the session that was there, exits 1."""
    env = {**os.environ, "NO_COLOR": "1", "TMUX_TMPDIR": str(tmp_path)}
    env.pop("TMUX", None)

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", *args], capture_output=True, text=True, env=env)

    assert tmux("new-session", "-d", "-s", "ddpfab-tmux-taken", "-n", "mine", "sleep 600").returncode == 0
    try:
        res = subprocess.run([sys.executable, "-m", "ddpfab", "plan", "-i", str(inventory2), "--run-id", "tmux-taken",
                              "--offline", "--emit", str(tmp_path / "emit"), "--tmux", SCRIPT],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "Traceback" not in res.stderr
        assert "ddpfab: error: tmux new-session failed: duplicate session: ddpfab-tmux-taken" in res.stderr, res.stderr
        assert "no tmux session was opened" in res.stderr and (tmp_path / "emit" / "README.txt").is_file()
        assert tmux("list-windows", "-t", "=ddpfab-tmux-taken", "-F", "#{window_name}").stdout.split() == ["mine"]
    finally:
        tmux("kill-server")
