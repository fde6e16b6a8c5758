"""`--pdb` without hosts: the ranks it names, how the command line reads it, the line a waiting rank
prints and how ddpfab reads it back, the node supervisor's setup, and a real python process whose
breakpoint() and uncaught exception wait in pdb on the socket (the relay's end played here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpfab.cli import build_parser
from ddpfab.cli.run import spell_pdb
from ddpfab.launch import debugger
from ddpfab.node import agent, rankpdb
from ddpfab.planning.plan import PlanError, pdb_ranks

NODE = Path(rankpdb.__file__).parent


@pytest.mark.parametrize("spec, world, ranks", [
    ("", 4, ""), ("all", 4, "all"), ("3", 4, "3"), ("0,2-3", 4, "0,2,3"), ("3,1,1-2", 8, "1,2,3"), (" 5 ", 6, "5")])
def test_pdb_ranks_are_normalised(spec, world, ranks):
    assert pdb_ranks(spec, world) == ranks


@pytest.mark.parametrize("spec, world, words", [
    ("x", 4, "ranks and ranges"), ("3-1", 4, "ranks and ranges"), ("1,,2", 4, "ranks and ranges"),
    ("4", 4, "rank 4 is not in this job (its ranks are 0-3)"), ("2-9", 4, "rank 4 is not in this job")])
def test_pdb_ranks_refuse_what_is_not_a_rank_of_the_job(spec, world, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        pdb_ranks(spec, world)


@pytest.mark.parametrize("argv, spelled", [
    (["run", "-i", "inv", "--pdb", "train.py", "--pdb"], ["run", "-i", "inv", "--pdb=all", "train.py", "--pdb"]),
    (["run", "--pdb", "5", "train.py"], ["run", "--pdb", "5", "train.py"]),
    (["run", "--pdb", "0,2-3", "train.py"], ["run", "--pdb", "0,2-3", "train.py"]),
    (["run", "--env", "--pdb", "--pdb", "t.py"], ["run", "--env", "--pdb", "--pdb=all", "t.py"]),  # an option's value
    (["plan", "--pdb", "--nproc-per-node", "2", "t.py"], ["plan", "--pdb=all", "--nproc-per-node", "2", "t.py"]),
    (["run", "t.py", "--pdb", "x"], ["run", "t.py", "--pdb", "x"]),  # the script's own
    (["run", "--pdb"], ["run", "--pdb=all"]),
    (["exec", "--pdb", "x"], ["exec", "--pdb", "x"]),
])
def test_a_pdb_without_ranks_is_every_rank_and_never_takes_the_script(argv, spelled):
    assert spell_pdb(argv) == spelled


def test_the_parser_reads_pdb_before_the_script():
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--pdb", "train.py", "--steps", "1"]))
    assert (args.pdb, args.script, args.args) == ("all", "train.py", ["--steps", "1"])
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--pdb", "3", "train.py"]))
    assert (args.pdb, args.script) == ("3", "train.py")
    assert build_parser().parse_args(["run", "-i", "a,b,", "train.py"]).pdb == ""


def test_the_waiting_line_is_read_back_as_the_rank_prints_it():
    line = rankpdb.WAITS % (5, 1, "/w/my dir (x)/train.py:12", "post-mortem: ValueError", 4242)
    m = debugger.WAITS.match(line)
    assert m and (m["rank"], m["local"], m["where"], m["kind"], m["pid"]) == (
        "5", "1", "/w/my dir (x)/train.py:12", "post-mortem: ValueError", "4242")
    assert debugger.WAITS.match("ddpfab-pdb: rank x waits") is None
    assert rankpdb.wanted("all", 7) and rankpdb.wanted("1,7", 7) and not rankpdb.wanted("1,17", 7)


def test_the_supervisor_installs_the_hooks_with_the_exit_guard_off(tmp_path):
    spec = {"exit_guard": {"mode": "off", "source": "# guard\n"},
            "pdb": {"ranks": "1,5", "node": "node3", "source": "# hooks\n"}}
    env = agent.exit_guard_env(spec, str(tmp_path), {"PYTHONPATH": "/x"})
    guard = tmp_path / agent.GUARD_DIR
    assert env["PYTHONPATH"] == f"{guard}:/x"
    assert (env["DDPFAB_PDB"], env["DDPFAB_PDB_DIR"], env["DDPFAB_PDB_NODE"]) == ("1,5", str(tmp_path / "pdb"), "node3")
    assert "DDPFAB_EXIT_GUARD" not in env  # off: no done records, no os._exit
    assert (guard / "sitecustomize.py").read_text() == "# guard\n"
    assert (guard / "ddpfab_rankpdb.py").read_text() == "# hooks\n"
    assert oct((tmp_path / "pdb").stat().st_mode & 0o777) == "0o700"  # a debugger is code execution: ours only
    # neither asked for: nothing installed
    assert agent.exit_guard_env({"exit_guard": {"mode": "off", "source": "#"}}, str(tmp_path / "b"), {}) == {}


SCRIPT = '''
import os
x = 6
if os.environ["MODE"] == "stop":
    breakpoint()
    print("after the breakpoint", x, flush=True)
elif os.environ["MODE"] == "raise":
    raise ValueError("bad batch")
else:  # raised inside a collective: the module's name says so
    exec(compile("raise RuntimeError('Connection closed by peer')", "c10d.py", "exec"),
         {"__name__": "torch.distributed.distributed_c10d"})
'''


def _rank(tmp_path: Path, mode: str) -> subprocess.Popen:
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text((NODE / "exitguard.py").read_text())
    (guard / "ddpfab_rankpdb.py").write_text((NODE / "rankpdb.py").read_text())
    (tmp_path / "pdb").mkdir(mode=0o700)
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(guard), "DDPFAB_PDB": "all", "DDPFAB_PDB_DIR": str(tmp_path / "pdb"),
           "DDPFAB_PDB_NODE": "node9", "RANK": "3", "LOCAL_RANK": "1", "MODE": mode}
    return subprocess.Popen([sys.executable, "-u", str(tmp_path / "job.py")], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _talk(path: Path, lines: list[str], until: bytes) -> bytes:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "the rank never listened"
        time.sleep(0.05)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.settimeout(30)
        out = b""
        for line in lines:
            while not out.endswith(b"(Pdb) "):
                out += s.recv(4096)
            s.sendall(line.encode() + b"\n")
            out = out.replace(b"(Pdb) ", b"(Pdb)> ")  # one prompt answered
        while until not in out:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
        return out


def test_a_breakpoint_waits_on_the_socket_and_continue_goes_on(tmp_path):
    proc = _rank(tmp_path, "stop")
    out = _talk(tmp_path / "pdb" / "rank-3.sock", ["p x * 7", "c"], b"")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert b"node9 rank 3 (Pdb)" in out and b"42" in out
    assert "after the breakpoint 6" in stdout
    assert debugger.WAITS.match(stderr.splitlines()[0])["kind"] == "breakpoint"
    assert not (tmp_path / "pdb" / "rank-3.sock").exists()  # the session closed with `c`


def test_an_uncaught_exception_waits_post_mortem_then_the_rank_fails_with_it(tmp_path):
    proc = _rank(tmp_path, "raise")
    out = _talk(tmp_path / "pdb" / "rank-3.sock", ["p x", "q"], b"")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert b"-> raise ValueError" in out and b"(Pdb)> 6\n" in out
    assert "post-mortem: ValueError" in stderr and "ValueError: bad batch" in stderr


def test_an_exception_raised_inside_a_collective_gets_no_post_mortem(tmp_path):
    proc = _rank(tmp_path, "collective")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "RuntimeError: Connection closed by peer" in stderr
    assert "waits in pdb" not in stderr and not list((tmp_path / "pdb").iterdir())


# -- --debugpy: the same ranks' spelling, its own line, the supervisor's setup ----------------------
def test_debugpy_ranks_are_read_as_pdb_ranks_and_refusals_name_debugpy():
    assert pdb_ranks("1,3-4", 6, "--debugpy") == "1,3,4"
    with pytest.raises(PlanError, match="--debugpy 9: rank 9 is not in this job"):
        pdb_ranks("9", 4, "--debugpy")
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--debugpy", "train.py", "--debugpy"]))
    assert (args.debugpy, args.script, args.args) == ("all", "train.py", ["--debugpy"])
    args = build_parser().parse_args(spell_pdb(["run", "-i", "a,b,", "--debugpy", "2", "train.py"]))
    assert (args.debugpy, args.pdb, args.script) == ("2", "", "train.py")


def test_the_listening_line_is_read_back_as_the_rank_prints_it():
    from ddpfab.launch import dapforward
    from ddpfab.node import rankdebugpy

    m = dapforward.LISTENS.match(rankdebugpy.LISTENS % (5, 1, 40123, 4242))
    assert m and (m["rank"], m["local"], m["port"], m["pid"]) == ("5", "1", "40123", "4242")
    assert rankdebugpy.wanted("all", 3) and rankdebugpy.wanted("1,3", 3) and not rankdebugpy.wanted("13", 3)
    # not a named rank, or a process the rank started (its DataLoader workers): nothing listens
    assert not rankdebugpy.install({"DDPFAB_DEBUGPY": "1", "RANK": "2", "LOCAL_RANK": "0"})
    assert not rankdebugpy.install({"DDPFAB_DEBUGPY": "2", "RANK": "2", "LOCAL_RANK": "0",
                                    rankdebugpy.OWNER_VAR: "77"})


def test_the_supervisor_installs_debugpy_in_the_ranks_it_names(tmp_path):
    spec = {"exit_guard": {"mode": "off", "source": "# guard\n"}, "debugpy": {"ranks": "3", "source": "# dap\n"}}
    env = agent.exit_guard_env(spec, str(tmp_path), {})
    guard = tmp_path / agent.GUARD_DIR
    assert env["PYTHONPATH"] == str(guard) and env["DDPFAB_DEBUGPY"] == "3" and "DDPFAB_PDB" not in env
    assert (guard / "ddpfab_rankdebugpy.py").read_text() == "# dap\n"


def test_pdb_and_debugpy_together_and_debugpy_detached_are_refused(tmp_path, monkeypatch):
    from ddpfab.api import Cluster

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print(1)\n")
    cluster = Cluster.load("a,b,")
    with pytest.raises(PlanError, match="a rank is debugged one way"):
        cluster.run("t.py", pdb="all", debugpy="1")
    with pytest.raises(PlanError, match="--debugpy with --detach"):
        cluster.run("t.py", debugpy="1", detach=True)
