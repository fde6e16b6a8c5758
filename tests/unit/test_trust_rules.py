"""Trust rules that need no network: masking by key, input checks, the supervisor's marker and
record, a remote command that ends with its connection."""

from __future__ import annotations

import json
import os
import signal
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hosts.inventory import Inventory, InventoryError, Node, _check_duplicates
from ddpfab.launch.runs import MASK, mask_argv, mask_plan
from ddpfab.node import agent
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, Plan, PlanError, RunOptions, check_run_id, make_plan, parse_env
from ddpfab.remote import command as commandmod

C = Inventory("inv.yml", "all", (Node("a", "10.0.0.1"), Node("b", "10.0.0.2")))
F = Facts(addresses={"a": "10.0.0.1", "b": "10.0.0.2"}, master_port=29500, cwd="/w")


@given(st.text(min_size=1, max_size=12))
def test_masking_is_by_key_whatever_the_value(secret):
    plan = make_plan(C, RunOptions("t.py", env=(("HF_TOKEN", secret), ("PLAIN", "1"))), F)
    masked = mask_plan(plan.to_dict())
    shown = render.masked(plan)
    assert Plan.from_dict(masked) == shown  # the manifest's masked plan is the plan that is shown
    for node, plan_node in zip(masked["nodes"], plan.nodes):
        assert node["env"]["HF_TOKEN"] == MASK and node["env"]["PLAIN"] == "1"
        line = render.shell_line(shown, shown.node(node["name"]))
        assert "HF_TOKEN=***" in line
        # the rest of the line is untouched: rendered from the masked env, not edited by text
        assert line == render.shell_line(plan, plan_node).replace(shlex.quote(f"HF_TOKEN={secret}"), shlex.quote("HF_TOKEN=***"), 1)
        assert "--nproc-per-node=1" in line and "--master-port=29500" in line


def test_the_recorded_argv_masks_secret_env_values_only():
    argv = ["ddpfab", "run", "--env", "HF_TOKEN=a'b", "--env=API_KEY=1", "--env", "N=1", "--env", "MY_TOKEN",
            "t.py", "--lr", "1"]
    assert mask_argv(argv) == ["ddpfab", "run", "--env", "HF_TOKEN=***", "--env=API_KEY=***", "--env", "N=1",
                               "--env", "MY_TOKEN", "t.py", "--lr", "1"]


def test_a_bare_env_key_comes_from_this_shell_or_is_an_error():
    assert parse_env(["HF_TOKEN", "A=1"], {"HF_TOKEN": "x'y"}) == (("HF_TOKEN", "x'y"), ("A", "1"))
    with pytest.raises(PlanError, match="not set in this shell"):
        parse_env(["HF_TOKEN"], {})
    with pytest.raises(PlanError):
        parse_env(["HF_TOKEN"])  # no environment given: KEY=VALUE only


@pytest.mark.parametrize("bad", ["../..", "..", "a/b", "", "-x", "a b", "x;rm", "a" * 81, "a..b", ".hidden"])
def test_run_ids_are_a_safe_charset(bad):
    with pytest.raises(PlanError, match="run_id "):
        check_run_id(bad)
    with pytest.raises(PlanError, match="run_id "):
        make_plan(C, RunOptions("t.py", run_id=bad), F)


def test_run_ids_that_are_fine():
    for good in ("20260101-120000-ab12cd", "exp_1.2", "A"):
        assert check_run_id(good) == good


def test_a_machine_listed_twice_is_an_error_naming_it():
    with pytest.raises(InventoryError, match="host b is listed twice.*10.0.0.1:22 as a"):
        _check_duplicates(Path("inv.yml"), [Node("a", "10.0.0.1"), Node("b", "10.0.0.1", port=22)])
    _check_duplicates(Path("inv.yml"), [Node("a", "10.0.0.1"), Node("b", "10.0.0.1", port=2222)])


def _frame(spec: dict) -> bytes:
    """The supervisor's stdin: the node program, then its ``supervise`` request."""
    return nodeprog.supervisor_input(spec)


def _supervisor(run_id: str) -> list[str]:
    return nodeprog.argv(sys.executable, *nodeprog.supervisor_words(run_id))


def test_the_supervisor_refuses_a_run_dir_it_cannot_record_in_and_starts_nothing(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a dir")
    marker = tmp_path / "started"
    spec = {"run_id": "t", "dir": str(blocked / "run"), "argv": ["touch", str(marker)], "workdir": str(tmp_path)}
    res = subprocess.run(_supervisor(spec["run_id"]), input=_frame(spec), capture_output=True, timeout=30)
    assert res.returncode == agent.CANNOT_START and b"was not started" in res.stdout
    assert not marker.exists()


def test_a_reused_run_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "agent.json").write_text("{}")
    spec = {"run_id": "t", "dir": str(tmp_path / "run"), "argv": ["true"], "workdir": str(tmp_path)}
    res = subprocess.run(_supervisor(spec["run_id"]), input=_frame(spec), capture_output=True, timeout=30)
    assert res.returncode == agent.CANNOT_START and b"used on this node already" in res.stdout


def test_job_processes_carry_the_marker_and_stop_ends_orphans(tmp_path):
    """SIGKILL the supervisor: its job lives on (an orphan) until stop_job finds it by marker."""
    spec = {"run_id": "orph-1", "dir": str(tmp_path / "orph-1"), "workdir": str(tmp_path), "grace": 1,
            "argv": [sys.executable, "-c", "import subprocess,time;subprocess.Popen(['sleep','60']);time.sleep(60)"],
            "env": {"SECRET_TOKEN": "x"}}
    proc = subprocess.Popen(_supervisor(spec["run_id"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(_frame(spec))
    proc.stdin.flush()
    deadline = time.monotonic() + 20
    while len(agent.marked_processes("orph-1")) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    record = json.loads((tmp_path / "orph-1" / "agent.json").read_text())
    assert record["pid"] and "command" not in record and "SECRET" not in json.dumps(record)
    proc.kill()
    proc.wait()
    assert len(agent.marked_processes("orph-1")) == 2  # orphans now
    said, code = agent.stop_job(str(tmp_path / "orph-1"), 1.0)
    assert code == 0 and said == "its supervisor was gone: ended 2 orphaned job processes"
    assert agent.marked_processes("orph-1") == []


def test_two_stops_at_once_both_say_stopped(tmp_path, monkeypatch):
    """Two ``ddpfab stop`` of one run at once: the supervisor one of them looked at alive may be
    gone by the time the other's signal reaches it (it said ``node4: : No such process``, exit 1)."""
    run_id = f"race-{os.getpid()}"
    run_dir = tmp_path / run_id
    run_dir.mkdir()
    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", run_id])
    (run_dir / "agent.json").write_text(json.dumps({"agent_pid": sup.pid}))
    cmdline = Path(f"/proc/{sup.pid}/cmdline")
    deadline = time.monotonic() + 10
    while run_id.encode() not in cmdline.read_bytes().split(b"\0"):  # as stop_job finds a supervisor
        assert time.monotonic() < deadline, cmdline.read_bytes()
        time.sleep(0.01)
    real_kill = os.kill

    def the_other_stop_first(pid, sig):
        real_kill(pid, signal.SIGKILL)  # the other stop's signal, and its end, came in between
        sup.wait()
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(agent.os, "kill", the_other_stop_first)
    try:
        said = agent.stop_job(str(run_dir), 1.0)
        assert said == ("stopped", 0), said
    finally:
        if sup.poll() is None:
            sup.kill()
        sup.wait()


def guarded(command: str) -> str:
    """The guard with *command* in its variable, set inline (a node's session reads it from stdin
    first: test_the_command_is_read_from_stdin_and_in_no_processs_argv)."""
    return f"{commandmod.COMMAND_VAR}={shlex.quote(command)}; {commandmod.guarded()}"


@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_a_guarded_command_ends_when_its_stdin_closes(tmp_path, leader):
    """sshd starts the shell as a session leader: the command runs in that group (no setsid) and a
    shell loop watches; elsewhere the command gets a session of its own and a `cat` watches."""
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen(["sh", "-c", guarded(f"sleep 60 & echo $! > {pidfile}; wait")], stdin=subprocess.PIPE,
                            start_new_session=leader)
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    group = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    assert (group == proc.pid) if leader else (group not in (proc.pid, os.getpgid(0)))
    proc.stdin.close()  # what sshd does when ddpfab's connection goes
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the command outlived its connection"
        time.sleep(0.02)


def _session_members(sid: int) -> list[str]:
    """The live processes of session *sid*: their command lines."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_a_guarded_command_ended_by_its_stdin_leaves_nothing_behind(tmp_path, leader):
    """`exec` interrupted with Ctrl-C left the watcher's `sleep 2` on the node for up to 2 s after
    the command had ended. The guard runs in a session of its own (as sshd's shell, or below one
    that is not its group), so whatever is left of it is in that session."""
    pidfile = tmp_path / "pid"
    guard = guarded(f"sleep 60 & echo $! > {pidfile}; wait")
    argv = ["sh", "-c", guard] if leader else ["sh", "-c", 'sh -c "$0"; exit $?', guard]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.stdin.close()  # what sshd does when ddpfab's connection goes
    proc.wait(timeout=10)
    ended = time.monotonic()
    while left := _session_members(proc.pid):
        assert time.monotonic() - ended < 0.5, f"left after the command ended: {left}"
        time.sleep(0.02)


@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_a_guarded_command_keeps_its_output_and_exit_code(leader):
    proc = subprocess.Popen(["sh", "-c", guarded("echo out; echo err >&2; exit 3")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=leader)
    out, err = proc.stdout.read(), proc.stderr.read()  # stdin stays open, as ddpfab keeps it
    assert (proc.wait(timeout=10), out, err) == (3, b"out\n", b"err\n")
    proc.stdin.close()


@pytest.mark.parametrize("shell", ["sh", "bash"])
@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_a_guarded_command_sees_none_of_the_guards_variables(leader, shell):
    """What the command finds in its shell is a plain ``sh -c``'s: ${g}, ${w}, ${p}, ${c} and the
    command's own variable unset."""
    var = commandmod.COMMAND_VAR
    proc = subprocess.Popen([shell, "-c", guarded(f'echo "[${{g-}}${{w-}}${{p-}}${{c-}}${{{var}-}}]"; '
                                                  f'set | grep -c "^[gwpc]=\\|^{var}=" || :')],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=leader)
    out = proc.stdout.read()
    assert (proc.wait(timeout=10), out) == (0, b"[]\n0\n")
    proc.stdin.close()


@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_a_command_that_signals_its_own_group_ends_itself_only_and_stays_guarded(tmp_path, leader):
    """`kill 0` in the command (a `trap 'kill 0' EXIT` script): its exit code is reported, and
    one that ignores the TERM and goes on still ends when the connection closes."""
    proc = subprocess.Popen(["sh", "-c", guarded("kill 0; echo never")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=leader)
    assert (proc.stdout.read(), proc.wait(timeout=10)) == (b"", 143)
    proc.stdin.close()
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen(["sh", "-c", guarded(f"trap '' TERM; kill 0; sleep 60 & echo $! > {pidfile}; wait")],
                            stdin=subprocess.PIPE, start_new_session=leader)
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, "the guard ended with the command's kill 0"
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    time.sleep(0.3)
    assert proc.poll() is None  # the guard waits on
    proc.stdin.close()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 6
    while os.path.exists(f"/proc/{pid}") and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "a command that ignores TERM outlived its connection"
        time.sleep(0.05)


@pytest.mark.parametrize("leader", [True, False], ids=["sshd-session", "not-a-group-leader"])
def test_the_command_is_read_from_stdin_and_in_no_processs_argv(leader):
    """`ddpfab exec -- pgrep -af torch` found ddpfab's own guard shells on every node (their argv
    held the command's text), and another user's `ps` showed a token typed into a command. The
    session's command line is the bootstrap and the guard only; the command comes on stdin after
    the node's setup, and what it runs is all that `pgrep -f` finds of it."""
    node = Node("n1", "10.0.0.1", python="/usr/bin/python3", python_from="inventory")
    marker = "ddpfab-argv-marker-4711"
    bootstrap, head = commandmod.stdin_for(node, f"echo {marker}-ran; pgrep -f {marker} || echo none-found")
    line = bootstrap + commandmod.guarded()
    assert marker not in line
    proc = subprocess.Popen(["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=leader)
    proc.stdin.write(head)
    proc.stdin.flush()
    out = proc.stdout.read()  # our end of stdin stays open, as ddpfab keeps it
    assert (proc.wait(timeout=10), out) == (0, f"{marker}-ran\nnone-found\n".encode()) if leader else \
        out.startswith(f"{marker}-ran\n".encode())  # (elsewhere the setsid shell's argv holds it)
    proc.stdin.close()


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_command_of_many_lines_is_one_line_on_stdin_and_runs_as_sh_c_runs_it(shell):
    """The bootstrap joins what it reads a line at a time (a shell's string grows by a copy each:
    2,000 lines took bash 1.5 s): a command's newlines travel as ``$__nl`` in one line. Quotes,
    a here-doc, blank lines, a CR and a trailing backslash run as ``sh -c`` runs them."""
    node = Node("n1", "10.0.0.1", python="/usr/bin/python3", python_from="inventory")
    cmd = ("echo 'a b'\n\n   \nprintf '%s\\n' \"x  y\" 'it''s' \\\\back\r\ncat <<'EOF'\nhere $x 'q'\nEOF\n"
           + "\n".join(f"echo line{i}" for i in range(2000)) + "\necho \"[${__nl-unset}]\" \\\n  end")
    bootstrap, head = commandmod.stdin_for(node, cmd)
    lines = head.decode().split("\n")
    assert int(lines[0]) == len(lines) - 2 and "echo line1999" in lines[-2]  # N, N lines, the command the last
    proc = subprocess.Popen([shell, "-c", bootstrap + commandmod.guarded()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    proc.stdin.write(head)
    proc.stdin.flush()
    out = proc.stdout.read()
    code = proc.wait(timeout=20)
    proc.stdin.close()
    plain = subprocess.run([shell, "-c", cmd], capture_output=True, stdin=subprocess.DEVNULL)
    assert (out, code) == (plain.stdout, plain.returncode) and out.endswith(b"[unset] end\n"), out[-200:]


def test_the_watchers_pause_is_one_2_s_sleep_where_sleep_takes_whole_seconds_only(tmp_path):
    """A `sleep` that refuses 0.1 (an old busybox) made the 2 s between TERM and KILL nothing."""
    calls = tmp_path / "calls"
    fake = tmp_path / "sleep"
    fake.write_text(f'#!/bin/sh\necho "$1" >> {calls}\ncase $1 in *.*) exit 1;; esac\n')
    fake.chmod(0o755)
    subprocess.run(["sh", "-c", commandmod.PAUSE], env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}, check=True)
    assert calls.read_text().split() == ["0.1", "2"]
    started = time.monotonic()
    subprocess.run(["sh", "-c", commandmod.PAUSE], check=True)  # the real one: 2 s in short sleeps
    assert 1.9 < time.monotonic() - started < 10


def test_the_guarded_commands_watcher_retries_a_missing_group_after_a_pause():
    # the watcher's TERM, as guarded() writes it, run by a real sh on a process group that does not
    # exist: it must wait 0.2 s and try once more (a brace group, not a command named `{{`)
    watcher = guarded("true").split("cat <&3 >/dev/null; ", 1)[1].split(f"; {commandmod.PAUSE};", 1)[0]
    start = time.monotonic()
    res = subprocess.run(["sh", "-xc", f"p=2147480000; {watcher}"], capture_output=True, text=True)
    took = time.monotonic() - start
    trace = [ln for ln in res.stderr.splitlines() if ln.startswith("+")]
    assert [ln.split()[1] for ln in trace] == ["p=2147480000", "kill", "sleep", "kill"], res.stderr
    assert took >= 0.2 and "not found" not in res.stderr and res.returncode != 0
    assert subprocess.run(["sh", "-n", "-c", guarded("echo hi")]).returncode == 0


@pytest.mark.parametrize("name, text", [
    ("dup.yml", "all:\n  hosts:\n    node1:\n      ansible_host: 10.0.0.1\n    node1:\n      ansible_host: 10.0.0.2\n"),
    ("dup.ini", "[all]\nnode1 ansible_host=10.0.0.1\nnode1 ansible_host=10.0.0.2\n"),
    ("alias.ini", "[all]\nnode1 ansible_host=10.0.0.1\nnode2 ansible_host=10.0.0.1\n"),
])
def test_a_host_listed_twice_in_an_inventory_is_an_error_naming_it(tmp_path, name, text):
    from ddpfab.hosts import inventory

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InventoryError, match="node[12]"):
        inventory.load(path)
