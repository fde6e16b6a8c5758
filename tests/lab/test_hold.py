"""`ddpfab hold`: one SSH connection per node kept open by a background process of this user;
`ddpfab exec` runs over it with the same output and exit codes as a cold exec, and everything
ends cleanly (--stop, idle, a closed stdout, a broken connection made again).

Real parts: the lab's sshd hosts, connections counted inside each host with ``ss``, a second
Unix user (``nobody``) for the socket's owner checks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab import lab as labmod
from ddpfab.api import Cluster
from ddpfab.remote import holder

from .helpers import REPO, ddpfab, host_sh

NODES = ("node1", "node2", "node3")
#: Another user, by exec (runuser would fork: killing it would leave its python running).
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def inventory3(lab, tmp_path) -> Path:
    """The lab's three hosts; after the test no holder of it runs (one left is killed, and fails the test)."""
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(lab, sys.executable))
    yield path
    left = holders_of(path)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # (it may end meanwhile)
            os.kill(pid, signal.SIGKILL)
    assert not left, f"holders left running: {left}"


def holders_of(inventory: Path) -> list[int]:
    """The holder of *inventory* (as `ddpfab hold -i INVENTORY` starts it), alive: [its pid] or []."""
    held = Cluster.load(str(inventory)).held()
    return [held.pid] if held is not None and alive(held.pid) else []


def connections(lab) -> dict[str, int]:
    """Established connections to each node's sshd, counted inside the node."""
    got = {}
    for n in NODES:
        out = lab.netns_exec(n, ["ss", "-Htn", "state", "established", "( sport = :22 )"],
                             capture_output=True, text=True, check=True).stdout
        got[n] = len([ln for ln in out.splitlines() if ln.strip()])
    return got


def end_sessions(lab, name: str) -> int:
    """Kill the sshd processes of lab host *name*'s connections (not its listener): what a reboot
    or a network cut leaves the controller with; how many there were."""
    killed = 0
    for pid, cmd in lab.processes(name, sshd=True):
        if cmd.startswith(("sshd: ", "sshd-session: ")) and "[listener]" not in cmd:  # the connection's
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def holder_pid(inventory: Path) -> int | None:
    res = ddpfab("hold", "-i", str(inventory), "--status")
    if res.returncode != 0:
        return None
    return int(res.stderr.split("pid ")[1].split()[0])


def alive(pid: int) -> bool:
    """*pid* is a holder, running (not a zombie). Its command line is checked too: a pid freed
    by a holder that ended can be another process's seconds later on a busy machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"ddpfab.remote.holdserver" in cmdline


#: Runs ddpfab's command line in this process, then prints which SSH libraries it loaded.
LOADED = ("import sys; from ddpfab.cli import main; code = main(sys.argv[1:]); "
          "print('loaded:', sorted(m for m in ('fabric', 'invoke', 'paramiko') if m in sys.modules)); sys.exit(code)")


def loaded_by(*args: str, cwd: Path) -> list[str]:
    res = subprocess.run([sys.executable, "-c", LOADED, *args], capture_output=True, text=True, cwd=cwd, timeout=180,
                         env={**os.environ, "NO_COLOR": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    return [ln for ln in res.stdout.splitlines() if ln.startswith("loaded:")]


def test_a_command_over_held_connections_loads_no_ssh_library(lab, inventory3, held, tmp_path):
    """Fabric and paramiko (0.1 s to import) are loaded where a connection is opened: check and run
    over the holder's load neither; the same commands on a copy of the inventory (cold) do."""
    (tmp_path / "train.py").write_text("print('ran', flush=True)\n")
    cold = tmp_path / "cold.yml"
    cold.write_text(inventory3.read_text())
    for inv, loaded in ((inventory3, "loaded: []"), (cold, "loaded: ['fabric', 'invoke', 'paramiko']")):
        assert loaded_by("check", "-i", str(inv), "--fast", cwd=tmp_path) == [loaded]
        assert loaded_by("run", "-i", str(inv), "--runs-dir", str(tmp_path / "runs"), "train.py", cwd=tmp_path) == [loaded]



def test_an_ssh_config_broken_after_hold_is_refused_as_without_a_holder(lab, inventory3, tmp_path):
    """The held connections were made with the ssh_config as it was; a command reading it now
    (sync renders every node's target first) refuses it as it does cold: the same words, no traceback."""
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  ServerAliveInterval 5\n")
    inv, cold = str(inventory3), tmp_path / "cold.yml"
    cold.write_text(inventory3.read_text())
    res = ddpfab("hold", "-i", inv, "--ssh-config", str(config), timeout=120)
    assert res.returncode == 0 and "holding 3/3" in res.stderr, res.stderr
    try:
        config.write_text("Host *\n  Port notaport\n")
        proj = tmp_path / "proj"
        proj.mkdir()
        (proj / "train.py").write_text("print('ran', flush=True)\n")
        said = []
        for i in (inv, str(cold)):
            res = ddpfab("sync", "-i", i, "--ssh-config", str(config), cwd=proj, timeout=120)
            assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
            said.append(res.stderr.replace(i, "INV"))
        assert said[0] == said[1] and "host node1: Port 'notaport'" in said[0], said
    finally:
        ddpfab("hold", "-i", inv, "--ssh-config", str(config), "--stop")


@pytest.fixture
def held(inventory3):
    res = ddpfab("hold", "-i", str(inventory3), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "holding 3/3 connections" in res.stderr
    pid = holder_pid(inventory3)
    assert pid and alive(pid) and holders_of(inventory3) == [pid]  # (what the no-holder-left check finds)
    try:
        yield pid
    finally:
        ddpfab("hold", "-i", str(inventory3), "--stop")
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            pytest.fail("the holder outlived hold --stop")


def block_new_ssh(lab, block: bool) -> None:
    """New SSH connections to every node dropped (or let through again): what still reaches the
    nodes goes over connections made before."""
    for n in NODES:
        lab.netns_exec(n, ["iptables", "-I" if block else "-D", "INPUT", "-p", "tcp", "--dport", "22", "--syn",
                           "-j", "DROP"], check=True)


def exec_lines(inventory: Path, *args: str) -> tuple[int, set[str], str]:
    res = ddpfab("exec", "-i", str(inventory), *args)
    return res.returncode, set(res.stdout.splitlines()) | {f"ERR {ln}" for ln in res.stderr.splitlines()
                                                            if " | " in ln}, res.stderr


def test_exec_over_held_connections_is_the_cold_exec_without_the_handshakes(lab, inventory3, held):
    assert connections(lab) == {n: 1 for n in NODES}  # the holder's, one per node
    cmd = "hostname; echo to-stderr >&2; echo $DDPFAB_PYTHON | grep -c python; exit 3"
    code, lines, err = exec_lines(inventory3, "--", cmd)
    assert code == 3 and "over the connections `ddpfab hold` keeps open" in err, err
    for _ in range(5):  # repeated commands: still the same one connection per node
        assert exec_lines(inventory3, "--", "true")[0] == 0
        assert connections(lab) == {n: 1 for n in NODES}
    # a node limited with --nodes, and a node whose command fails: as cold
    code, one, err = exec_lines(inventory3, "--nodes", "node2", "--", "hostname")
    assert code == 0 and one == {"node2 | node2"} and "over the connections" in err, err
    # the command's text is in no process's argv on the node: `pgrep -f` finds only itself (which it
    # leaves out), as over plain ssh; it found ddpfab's guard shells, 3 a node
    seek = "pgrep -af ddpfab-argv-marker"
    assert exec_lines(inventory3, "--", seek)[:2] == (1, set())
    ddpfab("hold", "-i", str(inventory3), "--stop")
    assert connections(lab) == {n: 0 for n in NODES}
    cold_code, cold, err = exec_lines(inventory3, "--", cmd)
    assert "over the connections" not in err
    assert (cold_code, cold) == (3, lines), (cold, lines)
    assert exec_lines(inventory3, "--", seek)[:2] == (1, set())


def test_a_closed_stdout_and_an_interrupt_end_the_commands_on_every_node(lab, inventory3, held):
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "exec", "-i", str(inventory3), "--", "yes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.readline().endswith(b"| y\n")
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "exec", "-i", str(inventory3), "--",
                             "echo started; sleep 300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert b"started" in proc.stdout.readline()
    assert connections(lab) == {n: 1 for n in NODES}  # over the held connections (cold would add one)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = {n: [c for _, c in lab.processes(n) if c.startswith(("yes", "sleep 300"))] for n in NODES}
        if not any(left.values()):
            break
        time.sleep(0.2)
    assert not any(left.values()), left
    assert alive(held)  # the holder serves on
    assert exec_lines(inventory3, "--", "true")[0] == 0


def test_a_broken_connection_is_made_again_and_a_changed_inventory_runs_cold(lab, inventory3, held):
    # node2's sshd session for the holder ends (a reboot, a network blip ended it)
    assert end_sessions(lab, "node2") >= 1
    time.sleep(0.5)
    code, lines, err = exec_lines(inventory3, "--", "hostname")
    assert code == 0 and {"node1 | node1", "node2 | node2", "node3 | node3"} <= lines, err
    assert connections(lab) == {n: 1 for n in NODES}
    # the same inventory with a node's variables changed (-e): not what the holder connected; cold
    code, lines, err = exec_lines(inventory3, "-e", "ddpfab_python=/usr/bin/python3", "--", "echo $DDPFAB_PYTHON")
    assert code == 0 and "over the connections" not in err and "node1 | /usr/bin/python3" in lines, (lines, err)


def test_the_holder_ends_when_idle_and_stop_leaves_nothing(lab, inventory3, tmp_path):
    # the same hold again is answered by the running holder (an idle limit of minutes: a loaded
    # machine can take seconds between two commands); another --idle replaces it
    res = ddpfab("hold", "-i", str(inventory3), "--idle", "600", timeout=120)
    assert res.returncode == 0, res.stderr
    first = holder_pid(inventory3)
    assert first and alive(first)
    res = ddpfab("hold", "-i", str(inventory3), "--idle", "600", timeout=60)
    assert res.stderr.startswith("ddpfab: already held") and holder_pid(inventory3) == first, res.stderr
    res = ddpfab("hold", "-i", str(inventory3), "--idle", "2", timeout=120)
    assert res.returncode == 0 and f"stopped the holder (pid {first})" in res.stderr, res.stderr
    assert not alive(first)
    pid = int(re.search(r"holding 3/3 connections \(pid (\d+)\)", res.stderr).group(1))  # (may be idle already)
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid), "the holder outlived its idle limit"
    assert connections(lab) == {n: 0 for n in NODES}
    res = ddpfab("hold", "-i", str(inventory3), "--status")
    assert res.returncode == 1 and "no holder" in res.stderr


def test_another_user_can_neither_use_the_holder_nor_pose_as_it(lab, inventory3, tmp_path):
    # the holder closes another user's connection at once, unread: the probe's send or read fails
    # (a broken pipe, a reset) or reads nothing; never an answer
    probe = ("import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect(chr(0)+sys.argv[1]);s.settimeout(5)\n"
             "try:\n s.sendall(b'{\"op\": \"status\"}\\n');print(repr(s.recv(100)))\n"
             "except (BrokenPipeError, ConnectionResetError): print(repr(b''))")
    squat = ("import socket,sys;s=socket.socket(socket.AF_UNIX);s.bind(chr(0)+sys.argv[1]);s.listen();"
             "print('bound',flush=True)\n"
             "while True:\n c,_=s.accept()\n try: c.sendall(b'{\"done\": true}\\n')\n except OSError: pass\n c.close()")
    # another user binds the name first: exec does not talk to it (its uid is not ours), runs cold
    cluster = Cluster.load(str(inventory3))
    real = holder.address(cluster.inventory, cluster.ssh_config, cluster.policy)
    proc = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-c", squat, real[1:]], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "bound"
        code, lines, err = exec_lines(inventory3, "--", "hostname")
        assert code == 0 and "node2 | node2" in lines and "over the connections" not in err, err
        res = ddpfab("hold", "-i", str(inventory3), timeout=60)
        assert res.returncode == 2 and "socket name is taken" in res.stderr, res.stderr
    finally:
        proc.kill()
        proc.wait()
    # ours, held: another user connecting gets not a word
    assert ddpfab("hold", "-i", str(inventory3), timeout=120).returncode == 0
    pid = holder_pid(inventory3)
    try:
        res = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", probe, real[1:]],
                             capture_output=True, text=True, timeout=30)
        assert res.stdout.strip() == "b''", res.stdout + res.stderr
    finally:
        ddpfab("hold", "-i", str(inventory3), "--stop")
    deadline = time.monotonic() + 10
    while pid and alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def left_running(lab, *commands: str) -> dict[str, list[str]]:
    return {n: [c for _, c in lab.processes(n) if c.startswith(commands)] for n in NODES}


def wait_nothing_left(lab, *commands: str, timeout: float = 15) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout
    while any((left := left_running(lab, *commands)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_timeout_and_a_stop_end_the_held_commands_as_cold_ones_end(lab, inventory3, held):
    t0 = time.monotonic()
    code, lines, err = exec_lines(inventory3, "--timeout", "2", "--", "sleep 30")
    assert code == 124 and time.monotonic() - t0 < 20, err  # as timeout(1); 255 said "could not connect"
    assert err.count("no output and no exit within 2 s (--timeout)") == 3 and "over the connections" in err, err
    assert "node[1-3]=timeout" in err, err
    assert not any(wait_nothing_left(lab, "sleep 30").values())
    # a stop while a command runs: the command ends on every node, the holder's process ends
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "exec", "-i", str(inventory3), "--",
                             "echo started; sleep 300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert b"started" in proc.stdout.readline()
    res = ddpfab("hold", "-i", str(inventory3), "--stop")
    assert res.returncode == 0 and f"stopped the holder (pid {held})" in res.stderr, res.stderr
    assert not alive(held)
    assert proc.wait(timeout=60) == 255  # each node's command ended without an exit status
    assert not any(wait_nothing_left(lab, "sleep 300").values())
    assert connections(lab) == {n: 0 for n in NODES}


def test_hold_with_other_variables_replaces_the_holder(lab, inventory3, held):
    res = ddpfab("hold", "-i", str(inventory3), "-e", "ddpfab_python=/usr/bin/python3", timeout=120)
    assert res.returncode == 0 and "holds these nodes otherwise" in res.stderr, res.stderr
    assert not alive(held)
    code, lines, err = exec_lines(inventory3, "-e", "ddpfab_python=/usr/bin/python3", "--", "echo $DDPFAB_PYTHON")
    assert code == 0 and "over the connections" in err and "node3 | /usr/bin/python3" in lines, err
    code, lines, err = exec_lines(inventory3, "--", "hostname")  # as the inventory says: not held so, cold
    assert code == 0 and "over the connections" not in err, err
    assert ddpfab("hold", "-i", str(inventory3), "-e", "ddpfab_python=/usr/bin/python3", "--stop").returncode == 0


def test_every_node_command_runs_over_the_held_connections(lab, inventory3, held, tmp_path):
    """With new SSH connections dropped at the nodes, check, plan, sync, run (its sync, probe,
    supervisors), a detached run, queue, ps, logs, fetch, doctor and stop still work: each goes
    over the holder's connections."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("import os\nprint('rank', os.environ['RANK'], 'ready', flush=True)\n")
    runs, inv = tmp_path / "runs", str(inventory3)
    block_new_ssh(lab, True)
    try:
        res = ddpfab("check", "-i", inv, "--fast", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        res = ddpfab("run", "-i", inv, "--runs-dir", str(runs), "--run-id", "warm-1", "train.py", cwd=proj,
                     timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        assert sorted(ln.split("| ", 1)[1] for ln in res.stdout.splitlines() if " ready" in ln) == [
            f"rank {r} ready" for r in range(3)], res.stdout
        listed = ddpfab("ps", "-i", inv, "--runs-dir", str(runs))
        assert listed.returncode == 0 and any(ln.startswith("warm-1 ") and " exited " in ln
                                              for ln in listed.stdout.splitlines()), listed.stdout + listed.stderr
        for args in (("logs", "warm-1"), ("doctor", "warm-1"), ("stop", "warm-1")):
            res = ddpfab(*args, "-i", inv, "--runs-dir", str(runs), timeout=60)
            assert res.returncode == 0, (args, res.stdout + res.stderr)
        assert (runs / "warm-1" / "node2.log").read_text().count("ready") == 1
        got = tmp_path / "got"
        for args in (("plan", "-i", inv, "train.py"), ("sync", "-i", inv), ("queue", "-i", inv),
                     ("fetch", "-i", inv, "--node", "node2", "train.py", str(got))):
            res = ddpfab(*args, cwd=proj, timeout=120)
            assert res.returncode == 0, (args, res.stdout + res.stderr)
        assert (got / "train.py").read_text() == (proj / "train.py").read_text()
        res = ddpfab("run", "-i", inv, "--runs-dir", str(runs), "--run-id", "warm-2", "--detach", "train.py", cwd=proj,
                     timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        deadline = time.monotonic() + 60
        while not any(ln.startswith("warm-2 ") and " exited " in ln
                      for ln in ddpfab("ps", "-i", inv, "--runs-dir", str(runs)).stdout.splitlines()):
            assert time.monotonic() < deadline, "the detached run did not end"
            time.sleep(0.5)
        assert connections(lab) == {n: 1 for n in NODES}  # the holder's, still
    finally:
        block_new_ssh(lab, False)


def start_run(inventory: Path, tmp_path: Path, then: str) -> tuple[subprocess.Popen, str]:
    """``ddpfab run`` of a script whose ranks say they are up, then do *then*; once every rank
    is up: the process and what it printed so far."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("import os, time\nprint('rank', os.environ['RANK'], 'up', flush=True)\n" + then)
    run = subprocess.Popen([sys.executable, "-m", "ddpfab", "run", "-i", str(inventory), "--runs-dir",
                            str(tmp_path / "runs"), "train.py"], cwd=proj, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, "NO_COLOR": "1"})
    seen = ""
    while seen.count(" up") < 3:
        line = run.stdout.readline()
        if not line:
            run.kill()
            pytest.fail(f"the run ended before every rank was up:\n{seen}")
        seen += line
    return run, seen


def test_a_run_over_the_held_connections_ends_when_the_holder_does(lab, inventory3, held, tmp_path):
    """The holder's end closes its connections: the run's supervisors see their link end, the run
    ends (not a wait for ever on a channel whose holder is gone) and nothing is left on the nodes."""
    run, seen = start_run(inventory3, tmp_path, "time.sleep(300)\n")
    try:
        assert ddpfab("hold", "-i", str(inventory3), "--stop").returncode == 0
        out = run.communicate(timeout=90)[0]
    finally:
        if run.poll() is None:
            run.kill()
    # the holder's end, said as such: no node blamed for it (node2 was: "failed: node2 ... without an
    # exit status (killed?)"), and the nodes' records read over their own connections
    assert run.returncode == 1, seen + out
    assert "the connection holder ended while this run followed the job" in out and "failed" not in out, seen + out
    assert "could not check the node afterwards" not in out and "left no record" not in out, seen + out
    assert not any(wait_nothing_left(lab, "train.py").values())


#: A command on one held channel, from a process of its own: "early" prints how long the exit
#: status took while a descendant keeps stdout open; "gone" starts a command that ignores its
#: input's end and writes nothing for 3 s, says so, and waits to be killed.
HELD_CHANNEL = """
import sys, time
from ddpfab.api import Cluster
from ddpfab.remote import heldconn, ssh
cluster = Cluster.load(sys.argv[1])
with cluster.held_connections():
    conn = ssh.connect(cluster.parsed.nodes[0], cluster.policy, cluster.ssh_config)
assert isinstance(conn, heldconn.HeldConnection), conn
chan = conn.transport.open_session()
if sys.argv[2] == "early":
    began = time.monotonic()
    chan.exec_command("(sleep 6 &); echo hi; exit 3")
    code = chan.recv_exit_status()
    print(code, round(time.monotonic() - began, 2), chan.eof_received, flush=True)
else:
    chan.exec_command("sleep 3; echo late; exec sleep 300")
    print("started", flush=True)
    time.sleep(600)
"""


def test_a_held_channel_tells_what_a_channel_of_its_own_tells(lab, inventory3, held):
    """The exit status as sshd sends it (before the EOF a descendant holds back), and a client
    gone: its channel closed at once, so the command's next write ends it (as when a cold
    client's connection is gone), not the holder kept reading for nobody."""
    res = subprocess.run([sys.executable, "-c", HELD_CHANNEL, str(inventory3), "early"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    code, took, eof = res.stdout.split()
    assert (code, eof) == ("3", "False") and float(took) < 4, res.stdout + res.stderr
    client = subprocess.Popen([sys.executable, "-c", HELD_CHANNEL, str(inventory3), "gone"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert client.stdout.readline() == "started\n"
    finally:
        client.kill()
        client.wait()
    time.sleep(5)  # past the command's write
    assert not left_running(lab, "sleep 300")["node1"]
    assert connections(lab) == {n: 1 for n in NODES}


def test_two_terminals_share_the_holder_each_with_its_own_output(lab, inventory3, held, tmp_path):
    """A run in one terminal and an exec in another at once, over the one held connection per
    node: each gets its own output and exit status, nothing of the other's."""
    run, seen = start_run(inventory3, tmp_path, "time.sleep(6)\nprint('rank', os.environ['RANK'], 'done', flush=True)\n")
    try:
        code, lines, err = exec_lines(inventory3, "--", "echo other-$(hostname)")
        during = connections(lab)
        out = seen + run.communicate(timeout=120)[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert code == 0 and {f"{n} | other-{n}" for n in NODES} <= lines and "over the connections" in err, (lines, err)
    assert not any("rank" in ln for ln in lines), lines
    assert run.returncode == 0 and out.count(" done") == 3 and "other-" not in out, out
    assert during == {n: 1 for n in NODES}


STARTS = "/root/.ddpfab-test-starts"  # in each host's own overlay of /root (checked)
PYTHON_LOGGED = "/root/.ddpfab-test-python"  # the nodes' python: logs its pid, then is python


def program_starts(lab) -> dict[str, list[int]]:
    """node -> the pids of the pythons started there for ddpfab, in order."""
    return {n: [int(x) for x in host_sh(lab, n, f"cat {STARTS} 2>/dev/null").stdout.split()] for n in NODES}


def running_programs(lab) -> dict[str, set[int]]:
    """node -> the pids of its node programs running now (python), as the host numbers them."""
    got = {}
    for n in NODES:
        pids = host_sh(lab, n, "for p in /proc/[0-9]*; do grep -qa ddpfab-node $p/cmdline 2>/dev/null && "
                               "readlink $p/exe | grep -q python && echo ${p#/proc/}; done").stdout.split()
        got[n] = {int(p) for p in pids if int(p) > 1}
    return got


def wait_for_one_waiting(lab, starts: int, timeout: float = 60) -> tuple[dict, dict]:
    """Wait until each node has had *starts* starts and runs only the last: the spare, waiting
    (the commands' own programs have ended); (starts, running) as they are then."""
    deadline = time.monotonic() + timeout
    while True:
        begun, running = program_starts(lab), running_programs(lab)
        if all(len(begun[n]) == starts and running[n] == {begun[n][-1]} for n in NODES) \
                or time.monotonic() > deadline:
            return begun, running
        time.sleep(0.2)


def test_a_node_program_is_started_ahead_and_the_next_check_takes_it(lab, tmp_path):
    """After a check, the holder starts each node's program again once idle (a spare, waiting for
    its first request); the next check takes it and starts none of its own; hold --stop ends the
    spares. Proof by the starts themselves: the nodes' python is a script that logs its pid (then
    execs python, which keeps it)."""
    for n in NODES:
        assert host_sh(lab, n, "stat -f -c %T /root").stdout.strip() == "overlayfs", n
        host_sh(lab, n, f"printf '#!/bin/sh\\necho $$ >> {STARTS}\\nexec {sys.executable} \"$@\"\\n' "
                        f"> {PYTHON_LOGGED} && chmod +x {PYTHON_LOGGED}", check=True)
    inv = tmp_path / "logged.yml"
    inv.write_text(labmod.render_inventory(lab, PYTHON_LOGGED))
    res = ddpfab("hold", "-i", str(inv), timeout=120)
    assert res.returncode == 0, res.stderr
    try:
        res = ddpfab("check", "-i", str(inv), "--fast", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        first, running = wait_for_one_waiting(lab, 2)  # the check's own start, then the spare's
        assert all(len(first[n]) == 2 and running[n] == {first[n][1]} for n in NODES), (first, running)
        res = ddpfab("check", "-i", str(inv), "--fast", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        # the spare served the check and ended; the one start since is the next spare's
        after, running = wait_for_one_waiting(lab, 3)
        assert all(after[n][:2] == first[n] and running[n] == {after[n][2]} for n in NODES), (first, after, running)
        assert connections(lab) == {n: 1 for n in NODES}  # the spares' sessions are the held connection's
    finally:
        res = ddpfab("hold", "-i", str(inv), "--stop")
        for n in NODES:
            host_sh(lab, n, f"rm -f {STARTS} {PYTHON_LOGGED}")
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 15
    while any(running_programs(lab).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running_programs(lab).values())
