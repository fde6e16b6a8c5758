"""One exit-code table (ddpfab/cli/errors.py, EXIT_CODES; the docs render it), followed by every command: the
parser is walked and each subcommand's error paths (no inventory, bad option values, a missing
lab or run record, ...) must end with the table's code, one clear line and no traceback. The cases
a host causes (an sshd that never greets, a reader that closes stdout) run ddpfab as a process,
where a traceback would be printed rather than raised."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ddpfab import cli
from ddpfab.cli.errors import EXIT_CLOSED_STDOUT, EXIT_FAILED, EXIT_USAGE

from .test_cli_defaults import DEFAULT_VARS, clean, leaf_parsers  # noqa: F401 - clean is a fixture

REPO = Path(__file__).resolve().parents[2]
IPS = "10.0.0.1,10.0.0.2,"
SPARES_INV = """all:
  children:
    trainers:
      hosts:
        n1: {ansible_host: 10.0.0.1}
        n2: {ansible_host: 10.0.0.2}
    standby:
      hosts:
        n2:
        n3: {ansible_host: 10.0.0.3}
"""
OFFLINE = ["--dry-run", "--offline"]

#: command -> its error paths: (argv, exit code, words the error names). FILE: an existing file.
CASES: dict[str, list[tuple[list[str], int, str]]] = {
    "run": [(["run", "t.py"], EXIT_USAGE, "DDPFAB_INVENTORY"),
            (["run", "-i", IPS, *OFFLINE, "--master-port", "0", "t.py"], EXIT_USAGE, "--master-port 0"),
            (["run", "-i", IPS, "--max-restarts", "x", "t.py"], EXIT_USAGE, "--max-restarts"),
            (["run", "-i", IPS, *OFFLINE, "--ssh-config", "FILE", "t.py"], EXIT_USAGE, "cannot be parsed"),
            (["run", "-i", IPS, *OFFLINE, "--max-job-restarts", "1", "--min-nodes", "5", "t.py"], EXIT_USAGE,
             "--min-nodes 5"),
            (["run", "-i", "SPARES", "--group", "trainers", "--spares", "standby", "--max-job-restarts", "1",
              *OFFLINE, "t.py"], EXIT_USAGE, "host n2 is in the nodes' group 'trainers' and in the spares group")],
    "plan": [(["plan", "t.py"], EXIT_USAGE, "DDPFAB_INVENTORY"),
             (["plan", "-i", IPS, "--offline", "--master-port", "70000", "t.py"], EXIT_USAGE, "--master-port 70000")],
    "lab up": [(["lab", "up"], EXIT_USAGE, "--dir"),
               (["lab", "up", "--dir", "LAB", "--hosts", "0"], EXIT_USAGE, "--hosts"),
               (["lab", "up", "--dir", "LAB", "--subnet", "bogus"], EXIT_USAGE, "--subnet")],
    "lab down": [(["lab", "down"], EXIT_USAGE, "--dir")],
    "lab status": [(["lab", "status", "--dir", "LAB"], EXIT_USAGE, "no lab in")],
    "provision": [(["provision"], EXIT_USAGE, "DDPFAB_INVENTORY"),
                  (["provision", "-i", "missing.yml"], EXIT_USAGE, "missing.yml")],
    "completion": [(["completion", "fish"], EXIT_USAGE, "fish")],
    "ps": [(["ps"], EXIT_USAGE, "DDPFAB_INVENTORY")],
    "queue": [(["queue"], EXIT_USAGE, "DDPFAB_INVENTORY"), (["queue", "-i", "missing.yml"], EXIT_USAGE, "missing.yml")],
    "stop": [(["stop", "r1"], EXIT_USAGE, "and no inventory to ask the nodes"),
             (["stop", "-i", IPS, "bad"], EXIT_USAGE, "cannot be read as a run record"),
             (["stop", "-i", IPS, "odd"], EXIT_USAGE, "is not a ddpfab run record")],
    "attach": [(["attach", "r1"], EXIT_USAGE, "no local record of run r1"),
               (["attach", "bad"], EXIT_USAGE, "cannot be read as a run record"),
               (["attach", "odd"], EXIT_USAGE, "is not a ddpfab run record"),
               (["attach", "nullrec"], EXIT_USAGE, "cannot be read as a run record")],  # was "no local record"
    "doctor": [(["doctor", "r1"], EXIT_USAGE, "no local record of run r1"),
               (["doctor", "bad"], EXIT_USAGE, "cannot be read as a run record"),
               (["doctor", "odd"], EXIT_USAGE, "is not a ddpfab run record"),
               (["doctor", "--timeout", "0", "r1"], EXIT_USAGE, "--timeout 0")],
    "debug": [(["debug", "--rank", "0", "r1"], EXIT_USAGE, "no local record of run r1"),
              (["debug", "--rank", "0", "bad"], EXIT_USAGE, "cannot be read as a run record"),
              (["debug", "r1"], EXIT_USAGE, "--rank")],
    "shell": [(["shell"], EXIT_USAGE, "which node"),
              (["shell", "n1"], EXIT_USAGE, "DDPFAB_INVENTORY"),
              (["shell", "--rank", "1", "n1"], EXIT_USAGE, "--rank and --run-id go together"),
              (["shell", "--run-id", "r1", "--rank", "0"], EXIT_USAGE, "no local record of run r1"),
              (["shell", "-i", IPS, "--env", "1X=y", "n1"], EXIT_USAGE, "1X"),
              # the workdir as run and sync read it (it was cd'd into as written), before any connection
              (["shell", "-i", "n1,", "-e", "ddpfab_workdir=~/a/..", "n1"], EXIT_USAGE, "holds '..'")],
    "logs": [(["logs", "r1"], EXIT_USAGE, "and no inventory to ask the nodes"),
             (["logs", "-i", IPS, "bad"], EXIT_USAGE, "cannot be read as a run record")],
    "export slurm": [(["export", "slurm", "t.py"], EXIT_USAGE, "DDPFAB_INVENTORY"),
                     (["export", "slurm", "-i", IPS, "--master-port", "0", "t.py"], EXIT_USAGE, "--master-port 0")],
    "export pytorchjob": [(["export", "pytorchjob", "--image", "i", "t.py"], EXIT_USAGE, "DDPFAB_INVENTORY"),
                          (["export", "pytorchjob", "-i", IPS, "t.py"], EXIT_USAGE, "--image")],
    "export trainjob": [(["export", "trainjob", "--image", "i", "t.py"], EXIT_USAGE, "DDPFAB_INVENTORY"),
                        (["export", "trainjob", "-i", IPS, "t.py"], EXIT_USAGE, "--image")],
    "check": [(["check"], EXIT_USAGE, "DDPFAB_INVENTORY"),
              (["check", "--perf"], EXIT_USAGE, "DDPFAB_INVENTORY"),
              (["check", "-i", IPS, "--max-skew", "x"], EXIT_USAGE, "--max-skew"),
              (["check", "-i", IPS, "--master-port", "99999"], EXIT_USAGE, "--master-port 99999"),
              # run's rule, before any host (check passed with 0 processes a node)
              (["check", "-i", IPS, "--nproc-per-node", "0"], EXIT_USAGE, "must be >= 1, got 0")],
    "sync": [(["sync"], EXIT_USAGE, "DDPFAB_INVENTORY")],
    "fetch": [(["fetch", "ckpt.pt"], EXIT_USAGE, "DDPFAB_INVENTORY"),
              (["fetch", "-i", IPS, "--node-rank", "5", "ckpt.pt"], EXIT_USAGE, "--node-rank 5: the inventory has node ranks 0..1"),
              (["fetch", "-i", IPS, "--rank", "5", "ckpt.pt"], EXIT_USAGE, "--node-rank 5"),
              (["fetch", "-i", IPS, "ckpt.pt", "FILE"], EXIT_USAGE, "exists and is not a directory")],
    "exec": [(["exec", "--", "true"], EXIT_USAGE, "DDPFAB_INVENTORY"),
             (["exec", "-i", IPS], EXIT_USAGE, "no command given"),
             (["exec", "-i", IPS, "--nodes", "zz", "--", "true"], EXIT_USAGE, "--nodes: zz"),
             (["exec", "-i", IPS, "--nodes", ",,", "--", "true"], EXIT_USAGE, "--nodes names no node"),
             (["exec", "-i", IPS, "--nodes", "", "--", "true"], EXIT_USAGE, "--nodes names no node"),
             (["exec", "-i", IPS, "--timeout", "-1", "--", "true"], EXIT_USAGE, "-1 is not above 0"),
             (["exec", "-i", IPS, "--timeout", "nan", "--", "true"], EXIT_USAGE, "nan is not above 0")],
    "hold": [(["hold"], EXIT_USAGE, "DDPFAB_INVENTORY"),
             (["hold", "-i", IPS, "--stop", "--status"], EXIT_USAGE, "not allowed with argument"),
             (["hold", "-i", "nope.yml"], EXIT_USAGE, "nope.yml")],
    "replay": [(["replay", "r1"], EXIT_USAGE, "no run record"),
               (["replay", "bad"], EXIT_USAGE, "not a ddpfab run manifest")],
}


def test_every_commands_error_paths_end_with_the_tables_code_and_no_traceback(clean, capsys):
    commands = {name for name, _ in leaf_parsers(cli.build_parser())}
    assert set(CASES) == commands, "every command needs its error paths here"
    (clean / "spares.yml").write_text(SPARES_INV)
    (clean / "t.py").write_text("print('train')\n")  # the dry runs' script: a missing one is refused first
    (clean / "existing").write_text("mine")  # (also an ssh_config that is not one)
    (clean / "runs" / "bad").mkdir(parents=True)
    (clean / "runs" / "bad" / "manifest.json").write_text("{not json")
    (clean / "runs" / "odd").mkdir()
    (clean / "runs" / "odd" / "manifest.json").write_text('{"run_id": "odd", "plan": 3}')
    (clean / "runs" / "nullrec").mkdir()
    (clean / "runs" / "nullrec" / "manifest.json").write_text("null")
    fill = {"SPARES": str(clean / "spares.yml"), "LAB": str(clean / "nolab"), "FILE": str(clean / "existing")}
    for command, cases in CASES.items():
        for argv, code, says in cases:
            argv = [fill.get(a, a) for a in argv]
            try:
                got = cli.main(argv)
            except SystemExit as exc:  # argparse's own refusal of a value (its usage line, exit 2)
                got = exc.code
            out, err = capsys.readouterr()
            assert got == code, (argv, got, err)
            errors = [ln for ln in err.splitlines() if "error:" in ln]
            assert errors and says in err and "Traceback" not in err, (argv, err)
    assert (clean / "existing").read_text() == "mine" and not (clean / "nolab").exists()


def test_a_refused_min_nodes_is_about_the_size_only(clean, capsys):
    (clean / "t.py").write_text("print('train')\n")
    # the same options with a size the job has pass the dry run: the refusal above is the size's
    assert cli.main(["run", "-i", IPS, *OFFLINE, "--max-job-restarts", "1", "--min-nodes", "2", "t.py"]) == 0
    assert "# ddpfab plan" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["check", "--json"], ["check", "--perf", "--json"], ["ps", "--json"],
                                  ["queue", "--json"], ["sync", "--json"], ["check", "-i", "nowhere.yml", "--json"],
                                  ["run", "-i", IPS, *OFFLINE, "--json", "--master-port", "0", "t.py"],
                                  ["plan", "-i", IPS, "--offline", "--json", "--master-port", "0", "t.py"],
                                  ["replay", "r1", "--dry-run", "--json"]])
def test_json_asked_for_is_json_when_refused_too(argv, clean, capsys):
    assert cli.main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["problems"]) == 1 and doc["problems"][0]["text"] in err, (out, err)


@pytest.mark.parametrize("argv, says", [(["check", "-i", IPS, "--json", "--max-skew", "x"], "--max-skew"),
                                        (["ps", "--json", "--bogus", "node1"], "unrecognized arguments: --bogus node1"),
                                        (["run", "-i", IPS, "--dry-run", "--json", "--nproc-per-node"], "expected one")])
def test_json_asked_for_is_json_when_argparse_refuses_too(argv, says, clean, capsys):
    # argparse's own refusals (usage, exit 2) wrote no JSON on stdout
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert exit_.value.code == EXIT_USAGE and doc["ok"] is False and says in doc["problems"][0]["text"], (out, err)
    assert "usage:" in err and says in err
    # without --json, stdout stays empty
    with pytest.raises(SystemExit):
        cli.main([a for a in argv if a != "--json"])
    assert capsys.readouterr().out == ""


# -- what a host or a reader causes: as a process, where paramiko's logging and a closed pipe print ------
def _ddpfab(*args: str, cwd: Path, stdout=subprocess.PIPE, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DDPFAB_CONFIG": ""}
    for var in DEFAULT_VARS:
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "ddpfab", *args], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, timeout=timeout)


@pytest.fixture
def silent_sshd(tmp_path):
    """A listener on 127.0.0.1 that accepts connections and never says a word (no SSH banner), and
    an inventory (host `quiet`) plus ssh_config (ConnectTimeout 1) that point at it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    (tmp_path / "inv.yml").write_text(f"all:\n  hosts:\n    quiet:\n      ansible_host: 127.0.0.1\n"
                                      f"      ansible_port: {port}\n")
    (tmp_path / "ssh_config").write_text("Host *\n  ConnectTimeout 1\n")
    (tmp_path / "known_hosts").write_text("")
    yield port, ["-i", str(tmp_path / "inv.yml"), "--ssh-config", str(tmp_path / "ssh_config"),
                 "--known-hosts", str(tmp_path / "known_hosts")]
    stop.set()
    thread.join()
    for s in held:
        s.close()
    server.close()


def _one_banner_problem(problems: list[dict], port: int, check: str) -> None:
    assert len(problems) == 1 and problems[0]["node"] == "quiet" and problems[0]["check"] == check, problems
    assert problems[0]["found"].startswith("no SSH banner within 1 s") and f"port {port}" in problems[0]["found"]


def test_check_json_names_a_host_that_never_sends_a_banner_without_a_traceback(silent_sshd, tmp_path):
    port, how = silent_sshd
    res = _ddpfab("check", *how, "--json", "--fast", cwd=tmp_path)
    assert res.returncode == EXIT_FAILED and res.stderr == "", res.stderr  # paramiko's thread says nothing
    report = json.loads(res.stdout)
    assert report["ok"] is False
    _one_banner_problem(report["problems"], port, "ssh")  # check's key for reaching a host


def test_ps_json_writes_json_with_the_unreachable_host_as_data(silent_sshd, tmp_path):
    port, how = silent_sshd
    res = _ddpfab("ps", *how, "--json", cwd=tmp_path)
    assert res.returncode == EXIT_FAILED, res.stderr
    listing = json.loads(res.stdout)
    assert listing["ok"] is False and listing["runs"] == []
    _one_banner_problem(listing["problems"], port, "no-banner")
    # on stderr: one warning naming the host, nothing of paramiko's
    assert res.stderr.startswith("ddpfab: warning: host quiet") and res.stderr.count("\n") == 1, res.stderr


def test_stop_and_logs_name_a_host_that_never_sends_a_banner(silent_sshd, tmp_path):
    port, how = silent_sshd
    for command in ("stop", "logs"):
        res = _ddpfab(command, *how, "--runs-dir", str(tmp_path / "runs"), "r1", cwd=tmp_path)
        assert res.returncode == EXIT_FAILED, res.stderr
        said = res.stdout + res.stderr
        assert "quiet: " in said and "no SSH banner within 1 s" in said and "Traceback" not in said, said
        assert said.count("\n") == 1 and "host quiet: host quiet" not in said, said
    assert not (tmp_path / "runs" / "r1").exists()  # logs that fetched nothing leaves no empty record dir


def test_shell_on_a_host_that_never_sends_a_banner_is_one_line(silent_sshd, tmp_path):
    port, how = silent_sshd
    res = _ddpfab("shell", "quiet", *how, cwd=tmp_path)
    assert res.returncode == EXIT_FAILED and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("ddpfab: error: host quiet") and "no SSH banner within 1 s" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


def test_a_closed_stdout_ends_quietly(tmp_path):
    (tmp_path / "t.py").write_text("")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before ddpfab writes a line (`| head` that has had enough)
    try:
        res = _ddpfab("run", "-i", IPS, "--dry-run", "--offline", "t.py", cwd=tmp_path, stdout=write)
    finally:
        os.close(write)
    assert res.returncode == EXIT_CLOSED_STDOUT and res.stderr == "", res.stderr


def test_a_signal_while_the_nodes_are_waited_for_interrupts_at_once():
    """SIGINT while the main thread waits for the nodes' threads (ssh.parallel): a signal taken on
    another thread, or just before the wait began, ran its handler but did not wake the wait, and
    the command went on until every node was done (a `ddpfab exec -- sleep 60` ignored Ctrl-C for
    a minute, seen in the lab's SIGINT test). Here the signal lands on a node's thread."""
    import signal
    import time

    from ddpfab.hosts.inventory import Node
    from ddpfab.launch.interrupt import Interrupted, signals_raise
    from ddpfab.remote import ssh

    def node(n: Node) -> None:
        if n.name == "a":
            time.sleep(0.3)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        time.sleep(4)

    started = time.monotonic()
    with signals_raise(), pytest.raises(Interrupted):
        ssh.parallel([Node("a", "10.0.0.1"), Node("b", "10.0.0.2")], node)
    assert time.monotonic() - started < 2


def test_what_the_nodes_opened_before_and_after_an_interrupt_is_released():
    """A Ctrl-C while ssh.parallel waits: the caller gets Interrupted and none of the results, so
    each result made is handed to ``release`` (a connection closed): node a's, made before the
    signal, at once; node b's, made by a call still running, when it ends. Node c, queued behind
    them (a window of 1), never starts."""
    import signal
    import time

    from ddpfab.hosts.inventory import Node
    from ddpfab.launch.interrupt import Interrupted, signals_raise
    from ddpfab.remote import ssh

    started, released = [], []
    b_may_end = threading.Event()

    def node(n: Node) -> str:
        started.append(n.name)
        if n.name == "b":
            time.sleep(0.3)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            b_may_end.wait(10)
        return f"conn-{n.name}"

    with signals_raise(), pytest.raises(Interrupted):
        ssh.parallel([Node(x, f"10.0.0.{i}") for i, x in enumerate("abc", 1)], node, window=1,
                     release=released.append)
    assert released == ["conn-a"]  # b's call is still running
    b_may_end.set()
    deadline = time.monotonic() + 5
    while len(released) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert released == ["conn-a", "conn-b"] and "c" not in started


def test_a_launch_placed_after_an_interrupt_is_never_kept_on_its_node():
    """``run --tmux`` places each node's launch (it holds the env's secrets) on every node at
    once, and the end removes only the nodes in ``placed``. A node keeps its copy only when the
    keep line follows it, sent once the placing has kept the node. SIGINT while node2's copy is
    still being written: the interrupt reaches the caller at once; node2's copy, finished after
    it, gets no keep line (its node removes it at the input's end) and is not in ``placed``;
    node1's, placed before, is kept and in ``placed``. Each node played by its channel here; the
    node's side (the shell) on lab hosts: tests/lab/test_tmux.py."""
    import signal
    import time

    from ddpfab.hosts.inventory import Inventory, Node
    from ddpfab.launch import tmuxrun
    from ddpfab.launch.interrupt import Interrupted, signals_raise
    from ddpfab.planning.plan import Facts, RunOptions, make_plan

    inv = Inventory("inv.yml", "all", (Node("node1", "10.0.0.1"), Node("node2", "10.0.0.2")))
    plan = make_plan(inv, RunOptions("t.py", run_id="r1"), Facts({"node1": "10.0.0.1", "node2": "10.0.0.2"}, 29500, "/w"))
    placing = tmuxrun.Placing()
    kept: dict[str, bool] = {}

    class Chan:
        """The node's shell for the placing command: says it created the file, takes the launch,
        keeps it only if its input ends with the keep line."""

        def __init__(self, name: str):
            self.name, self.stdin, self.out, self.code = name, b"", b"", None

        def settimeout(self, timeout):
            pass

        def exec_command(self, command: str) -> None:
            self.mark = re.search(r"ddpfab-created ([0-9a-f]{16})", command)[1]
            self.out = f"ddpfab-created {self.mark}\n".encode()

        def recv(self, n: int) -> bytes:
            data, self.out = self.out[:n], self.out[n:]
            return data

        def sendall(self, data: bytes) -> None:
            if self.name == "node2" and not self.stdin:
                deadline = time.monotonic() + 10
                while "node1" not in placing.placed and time.monotonic() < deadline:  # (node1's copy first)
                    time.sleep(0.01)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                time.sleep(1.0)
            self.stdin += data

        def shutdown_write(self) -> None:
            kept[self.name] = self.stdin.endswith(f"\n# kept {self.mark}\n".encode())
            self.code = 0 if kept[self.name] else 1

        def exit_status_ready(self) -> bool:
            return self.code is not None

        def recv_exit_status(self) -> int:
            return self.code

        def recv_stderr(self, n: int) -> bytes:
            return b""

        def close(self) -> None:
            pass

    class Conn:
        def __init__(self, name: str):
            self.name = name
            self.transport = self

        def open_session(self, timeout=None):
            return Chan(self.name)

        def run(self, command: str, **_kw):  # the extra removal of a copy whose answer was lost
            pass

    started = time.monotonic()
    with signals_raise(), pytest.raises(Interrupted):
        tmuxrun.place_launches(plan, {n: Conn(n) for n in ("node1", "node2")}, placing)
    assert time.monotonic() - started < 0.8  # at once, not after node2's write
    placed = placing.placed
    deadline = time.monotonic() + 5
    while "node2" not in kept and time.monotonic() < deadline:
        time.sleep(0.05)
    assert placed == ["node1"] and kept == {"node1": True, "node2": False}, (placed, kept)


def test_a_node_whose_copy_failed_after_it_was_kept_is_taken_back_until_the_caller_has_gone():
    """A node's script that fails after the keep (it removed the copy) leaves nothing of this run
    there: the end must not remove or signal anything there, so the node leaves ``placed``; once
    the caller has abandoned the placing (it may have read ``placed``), the list stays as read."""
    from ddpfab.launch import tmuxrun

    placing = tmuxrun.Placing()
    assert placing.keep("node1") and placing.keep("node2")
    placing.unkeep("node2")
    assert placing.placed == ["node1"]
    placing.abandon()
    placing.unkeep("node1")
    assert placing.placed == ["node1"] and not placing.keep("node3")


def test_a_run_s_monitor_takes_signals_in_its_loop_never_inside_a_lock():
    """`ddpfab run`'s monitor waits on a queue the nodes' threads put to. A handler that raised
    could raise inside the queue's lock and leave it held: the next wait never returned (a run
    hung for good after Ctrl-C, 1 time in 15). Under ``signals_queued`` the first signal is an item
    of the queue, taken in the loop between the nodes' items; a second raises at once (the way out
    of a main thread blocked elsewhere)."""
    import queue
    import signal
    import time

    from ddpfab.launch.interrupt import Interrupted, signals_queued

    events: queue.SimpleQueue = queue.SimpleQueue()
    main = threading.main_thread().ident
    sent = 300

    def nodes() -> None:
        for i in range(sent):
            events.put(i)
            if i == sent // 2:
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.0005)

    got, signals = [], 0
    before = signal.getsignal(signal.SIGINT)
    with signals_queued(events):
        t = threading.Thread(target=nodes)
        t.start()
        deadline = time.monotonic() + 30
        while (len(got) < sent or not signals) and time.monotonic() < deadline:
            try:
                item = events.get(timeout=0.001)
            except queue.Empty:
                continue
            if isinstance(item, Interrupted):
                signals += 1
            else:
                got.append(item)
        t.join()
        assert got == list(range(sent)) and signals == 1
        with pytest.raises(Interrupted):
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(5)  # (a blocked main thread: the second signal ends the wait)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("closed, code, says", [
    (1, EXIT_CLOSED_STDOUT, "ddpfab: stdout is closed (>&-): nothing was started\n"),  # `>&-`: nothing starts
    (2, 0, None),  # `2>&-`: the command runs; its messages go nowhere
    (0, 0, ""),  # `<&-`
])
def test_a_stream_the_shell_closed_is_no_traceback(tmp_path, closed, code, says):
    """`ddpfab ... >&-` printed an AttributeError traceback ('NoneType' object has no attribute
    'isatty'/'flush'/'write') in every command."""
    (tmp_path / "t.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DDPFAB_CONFIG": ""}
    for entry in ([sys.executable, "-m", "ddpfab"], [sys.executable, "-c", "import sys; from ddpfab.cli import main; "
                                                                           "sys.exit(main())"]):
        res = subprocess.run([*entry, "plan", "-i", IPS, "--offline", "t.py"], cwd=tmp_path, env=env, text=True,
                             capture_output=closed != 1, stderr=subprocess.PIPE if closed == 1 else None,
                             preexec_fn=lambda: os.close(closed), timeout=120)
        assert res.returncode == code, res.stderr
        if says is not None:
            assert res.stderr == says
        if closed != 1:
            assert "torchrun" in res.stdout  # the plan was printed


@pytest.mark.parametrize("argv", [["exec", "-i", IPS, "--", ""], ["exec", "-i", IPS, "--", " "],
                                  ["fetch", "-i", IPS, "--rank", "0", ""], ["fetch", "-i", IPS, "--rank", "0", "."]])
def test_an_empty_command_or_path_is_refused_before_any_host(argv, clean, capsys):
    """`exec -- ''` ran nothing and said every node exited 0; `fetch ''` copied the whole workdir."""
    assert cli.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no command given" in err or "name what to copy" in err


def test_ids_read_from_a_run_record_never_name_a_path_outside_the_runs(tmp_path):
    """A record's attempts and final_run_id become paths (logs writes runs/<attempt>/): like the
    RUN_ID argument, each must be a run id, and the record there must be that run's."""
    from ddpfab.launch.recover import attempt_manifests, current_manifest, next_attempt

    runs = tmp_path / "runs"
    (runs / "root").mkdir(parents=True)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "manifest.json").write_text(json.dumps({"run_id": "x", "plan": {"nodes": []}}))
    (runs / "other").mkdir()
    (runs / "other" / "manifest.json").write_text(json.dumps({"run_id": "not-other"}))
    root = {"run_id": "root", "recovery": {"attempts": [{"run_id": "root"}, {"run_id": "../x"}, {"run_id": "other"},
                                                        "junk"], "final_run_id": "../x", "state": "ended"}}
    (runs / "root" / "manifest.json").write_text(json.dumps(root))
    assert attempt_manifests(str(runs), root) == [root]
    assert current_manifest(str(runs), root) is root
    assert next_attempt(str(runs), root, "root", wait_s=1) is None


def test_a_signal_that_lands_while_a_class_is_created_is_still_one_line_and_130():
    """SIGINT while Ansible's imports create a class: Python raises a RuntimeError from the
    interrupt (``__set_name__``), which once ended the command with a traceback (found under load:
    Ctrl-C while the inventory loaded). A real class body, a real signal, the real entry point."""
    child = ("import os, signal\n"
             "from ddpfab.launch.interrupt import run_interruptible\n"
             "class Hook:\n"
             "    def __set_name__(self, owner, name):\n"
             "        os.kill(os.getpid(), signal.SIGINT)\n"
             "        [None for _ in range(10**6)]  # (the handler runs between bytecodes)\n"
             "def call():\n"
             "    type('Made', (), {'field': Hook()})\n"
             "    return 0\n"
             "run_interruptible(call)\n")
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130, res.stderr
    assert res.stderr == "ddpfab: interrupted by SIGINT; stopped\n", res.stderr
    from ddpfab.launch.interrupt import Interrupted, interrupt_in
    wrapped = RuntimeError("Error calling __set_name__")
    wrapped.__cause__ = Interrupted(15)
    assert interrupt_in(wrapped) is wrapped.__cause__
    assert interrupt_in(RuntimeError("KeyboardInterrupt")) is None  # by type, never by text


@pytest.mark.parametrize("argv", [["run", "-i", IPS, "train.py", "--dry-run"],
                                  ["run", "-i", IPS, "--pdb", "1", "train.py", "--epochs", "1", "--dry-run"],
                                  ["run", "-i", IPS, "--nproc-per-node", "2", "-m", "pkg.train", "--dry-run"]])
def test_a_dry_run_after_the_script_is_refused_before_any_host(argv, clean, capsys):
    """`ddpfab run train.py --dry-run` gave --dry-run to the script and started the job."""
    assert cli.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--dry-run comes after the script" in err and "nothing was started" in err
    assert argv[-2] in err or "train.py" in err


def test_a_dry_run_after_a_double_dash_is_the_script_s_own(clean, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert cli.main(["run", "-i", IPS, *OFFLINE, "--", "train.py", "--dry-run"]) == 0
    assert "train.py --dry-run" in capsys.readouterr().out
    assert cli.main(["run", "-i", IPS, *OFFLINE, "train.py", "--", "--dry-run"]) == 0  # torchrun drops that --
    assert "train.py --dry-run" in capsys.readouterr().out


@pytest.mark.parametrize("argv, usage, says", [
    (["exec", "--flod", "--", "hostname"], "usage: ddpfab exec", "unrecognized arguments: --flod (did you mean '--fold'"),
    (["run", "--dry-run-x", "t.py"], "usage: ddpfab run", "(did you mean '--dry-run'"),
    (["lab", "down", "--dir", "x", "--forse"], "usage: ddpfab lab down", "unrecognized arguments: --forse"),
    (["debug", "r1", "--rank", "1", "extra"], "usage: ddpfab debug", "unrecognized arguments: extra\n")])
def test_a_mistyped_option_is_refused_by_its_command_with_the_options_like_it(argv, usage, says, capsys):
    """`ddpfab exec --flod` printed the top-level usage (the list of commands) and no suggestion."""
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(usage) and says in err and "{run,plan" not in err, err


@pytest.mark.parametrize("flags, says", [(["--pdb", "1-0"], "takes 'all' or ranks and ranges"),
                                         (["--debugpy", "1,"], "takes 'all' or ranks and ranges"),
                                         (["--pdb", "1", "--debugpy", "1"], "a rank is debugged one way"),
                                         (["--max-restarts", "-1"], "must be >= 0")])
def test_an_option_s_bad_value_is_refused_before_the_copy_and_any_host(flags, says, clean, capsys):
    """`run --pdb 1-0 train.py` copied the code to every node first, then refused the value."""
    (clean / "t.py").write_text("print('train')\n")
    for argv in (["run", "-i", IPS, *flags, "t.py"], ["run", "-i", IPS, "--dry-run", *flags, "t.py"]):
        assert cli.main(argv) == EXIT_USAGE
        err = capsys.readouterr().err
        assert says in err and "sync" not in err and "unreachable" not in err, err
