"""`ddpfab shell` without hosts: which node runs a rank, the rank's environment from a recorded
plan (a masked value left out and named), and the start file the shell runs (run here by a real
sh, with a stand-in HOME)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import termios
import threading
import types

import pytest

from ddpfab.hosts import inventory
from ddpfab.launch import shell
from ddpfab.remote import command
from ddpfab.masking import MASK
from ddpfab.planning.plan import Facts, RunOptions, make_plan


@pytest.fixture
def plan():
    cluster = inventory.load("a,b,c,")
    options = RunOptions("t.py", nproc_per_node=2, env=(("HF_TOKEN", MASK), ("OMP_NUM_THREADS", "1")))
    return make_plan(cluster, options, Facts({"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}, 29500, "/w"))


def test_each_rank_is_on_its_node_in_node_rank_order(plan):
    assert [(n.name, local) for n, local in (plan.node_of_rank(r) for r in range(6))] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    with pytest.raises(ValueError, match=r"rank 6 is not in run run \(its ranks are 0-5\)"):
        plan.node_of_rank(6)


def test_a_ranks_environment_is_what_torchrun_gave_it_with_the_masked_values_named(plan):
    env, masked = shell.rank_env(plan, 3)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}
    assert "HF_TOKEN" not in env and masked == ["HF_TOKEN"]
    env, masked = shell.rank_env(plan, 3, {"HF_TOKEN": "hunter2"})
    assert env["HF_TOKEN"] == "hunter2" and masked == []
    assert "unset" not in (shell.masked_note(["A", "B"]) or "") and shell.masked_note([]) is None


def test_torchrun_s_thread_default_is_in_the_rank_s_environment_unless_the_run_set_one():
    """torchrun sets OMP_NUM_THREADS=1 for its workers when several share a node (and the run did
    not set it): a shell that is such a rank has it too; one rank per node, none."""
    cluster = inventory.load("a,b,")
    facts = Facts({"a": "10.0.0.1", "b": "10.0.0.2"}, 29500, "/w")
    for nproc, given, want in ((2, (), "1"), (2, (("OMP_NUM_THREADS", "8"),), "8"), (1, (), None)):
        env, _ = shell.rank_env(make_plan(cluster, RunOptions("t.py", nproc_per_node=nproc, env=given), facts), 1)
        assert env.get("OMP_NUM_THREADS") == want, (nproc, given)


def test_the_start_file_removes_itself_then_sets_up_the_node_and_the_rank(plan, tmp_path):
    node = inventory.Node("a", "10.0.0.1", setup=("export SITE=on",), python="/usr/bin/python3",
                          python_from="inventory")
    home = tmp_path / "home"
    (home / ".ddpfab" / "shell").mkdir(parents=True)
    path = "~/.ddpfab/shell/rc-1"
    env = {"RANK": "3", "QUOTED": "a b'c $HOME"}
    text = shell.start_file(node, str(tmp_path), env, "[ddpfab a rank 3] ", path)
    (home / ".ddpfab" / "shell" / "rc-1").write_text(text)
    out = subprocess.run(["sh", "-c", '. "$HOME/.ddpfab/shell/rc-1"; echo "$SITE|$RANK|$QUOTED|$(pwd)|$PS1"; '
                                      'echo "${PATH%%:*}"; ls -A "$HOME/.ddpfab/shell"'],
                         env={"HOME": str(home), "PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"on|3|a b'c $HOME|{tmp_path}|[ddpfab a rank 3] ", "/usr/bin"]
    assert text.splitlines()[0] == 'rm -f "$HOME/.ddpfab/shell/rc-1"'
    assert "hunter2" not in shell.write_command(path) + shell.shell_command(path)  # only paths in command lines
    assert shell.shell_command(path).count('"$HOME/.ddpfab/shell/rc-1"') == 2


def test_a_missing_workdir_with_a_quote_in_its_name_is_said_and_runs_nothing(tmp_path):
    node = inventory.Node("a", "10.0.0.1", python="/usr/bin/python3", python_from="inventory")
    home = tmp_path / "home"
    (home / ".ddpfab" / "shell").mkdir(parents=True)
    workdir = f"{tmp_path}/it's'; touch {tmp_path}/pwned; echo '"
    text = shell.start_file(node, workdir, {"RANK": "1"}, "> ", "~/.ddpfab/shell/rc-2")
    (home / ".ddpfab" / "shell" / "rc-2").write_text(text)
    out = subprocess.run(["sh", "-c", '. "$HOME/.ddpfab/shell/rc-2"; echo "rank $RANK"'],
                         env={"HOME": str(home), "PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert out.stdout.strip() == "rank 1", out.stdout + out.stderr  # the exports after it still ran
    assert f"ddpfab: the workdir {workdir} is not there" in out.stderr and not (tmp_path / "pwned").exists()


class _LockedChannel:
    """A pty channel whose resize takes its lock, as paramiko's does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sizes: list[tuple[int, int]] = []

    def resize_pty(self, width: int, height: int) -> None:
        with self.lock:
            self.sizes.append((width, height))


def test_a_window_size_change_inside_the_channels_lock_waits_for_the_loop():
    """SIGWINCH's handler runs in the main thread wherever it is, maybe inside paramiko with the
    channel's lock held: it must not resize there (it would wait for that lock for ever), only
    tell the loop, which resizes to the terminal's new size."""
    master, slave = pty.openpty()
    chan = _LockedChannel()
    size = shell._WindowSize(chan, slave)
    try:
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        returned = threading.Event()

        def land_inside_the_lock():
            with chan.lock:
                size.signalled()
            returned.set()

        threading.Thread(target=land_inside_the_lock, daemon=True).start()
        assert returned.wait(5), "the handler waited for the channel's lock"
        assert chan.sizes == []
        size.apply()
        assert chan.sizes == [(120, 40)]
    finally:
        size.close()
        os.close(master)
        os.close(slave)


def test_a_piped_script_keeps_its_bytes_and_runs_them_unchanged(tmp_path):
    """A script's undecodable bytes (a Latin-1 file) reach the node's shell as they were: the
    script is decoded with surrogateescape, and the command's stdin is encoded back the same way."""
    raw = b"printf %s '\xff\xfe' > out.bin\n"
    script = shell.piped_script(io.BytesIO(raw))
    node = inventory.Node("a", "10.0.0.1", python="/usr/bin/python3", python_from="inventory")
    bootstrap, head = command.stdin_for(node, shell.script_body(str(tmp_path), {"K": "v"}, script))
    out = subprocess.run(["sh", "-c", bootstrap + f'eval "${command.COMMAND_VAR}"'], input=head, capture_output=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.bin").read_bytes() == b"\xff\xfe"


def test_a_piped_script_over_the_bound_is_refused_before_anything_runs():
    assert shell.piped_script(io.BytesIO(b"#" * shell.MAX_SCRIPT_BYTES)) is not None
    with pytest.raises(ValueError, match="over 1 MiB"):
        shell.piped_script(io.BytesIO(b"#" * (shell.MAX_SCRIPT_BYTES + 1)))


def test_a_shell_that_fails_to_start_removes_its_start_file(plan, monkeypatch):
    """The start file (the rank's env, its secrets too) removes itself as the shell starts; when the
    shell's channel failed before that (a pty refused, a link cut), it stayed in ~/.ddpfab/shell."""
    commands: list[str] = []

    class Chan:
        def __init__(self, n):
            self.n = n

        def exec_command(self, command):
            commands.append(command)

        def sendall(self, data): pass
        def shutdown_write(self): pass
        def recv_exit_status(self): return 0
        def close(self): pass

        def get_pty(self, **kw):
            raise OSError("the server refused a pty")

    class Transport:
        opened = 0

        def open_session(self, timeout=None):
            Transport.opened += 1
            return Chan(Transport.opened)

    monkeypatch.setattr(shell, "terminal_size", lambda: (80, 24))
    conn = types.SimpleNamespace(transport=Transport())
    node = plan.nodes[1]
    with pytest.raises(OSError, match="refused a pty"):
        shell.run_shell(conn, node, node.workdir, {"HF_TOKEN": "x"}, "$ ")
    written = commands[0]
    start = re.search(r"\.ddpfab/shell/[^ '\"]+", written).group(0)
    assert len(commands) == 2 and commands[1].startswith("rm -f ") and start in commands[1], commands
