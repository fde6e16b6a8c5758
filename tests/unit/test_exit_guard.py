"""The ranks' exit guard (ddpfab/node/exitguard.py) in real interpreters, and what the supervisor and
the controller make of its done records (a job that failed only after every rank finished)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import execute as launch
from ddpfab.node import agent
from ddpfab.node import exitguard
from ddpfab.planning.plan import Facts, PlanError, RunOptions, make_plan

#: A libc exit handler that aborts: runs after the interpreter finalised, as gloo's race does.
ABORT_AT_EXIT = ("import ctypes\nlibc = ctypes.CDLL('libc.so.6')\n"
                 "libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]\n"
                 "libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)\n")


def guarded(tmp_path: Path, body: str, mode: str = "on", env: dict | None = None,
            relative: bool = False) -> tuple[int, dict | None]:
    """Run *body* as a script under the guard (a rank: LOCAL_RANK set); (exit status, done record)."""
    guard, ranks = tmp_path / "guard", tmp_path / "ranks"
    guard.mkdir(exist_ok=True)
    ranks.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(launch.exitguard_source())
    for old in ranks.iterdir():
        old.unlink()
    script = tmp_path / "script.py"
    script.write_text(body)
    full = {k: v for k, v in os.environ.items() if not k.startswith("DDPFAB_EXIT_GUARD")}
    full.update({"PYTHONPATH": str(guard), exitguard.MODE_VAR: mode, exitguard.DIR_VAR: str(ranks),
                 "LOCAL_RANK": "1", "RANK": "3", **(env or {})})
    res = subprocess.run([sys.executable, script.name if relative else str(script)], env=full, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    records = list(ranks.glob("rank-*.json"))
    return res.returncode, (json.loads(records[0].read_text()) if records else None)


@pytest.mark.parametrize("body, code, certain", [
    ("x = 1\n", 0, True),
    ("import sys\nsys.exit(0)\n", 0, True),
    ("import sys\nsys.exit()\n", 0, True),
    ("import sys\ndef main():\n    sys.exit(3)\nmain()\n", 3, True),
    ("import sys\nsys.exit('a message')\n", 1, True),
    ("raise RuntimeError('boom')\n", 1, True),
    ("raise SystemExit(4)\n", 4, False),  # by name: not seen, so not certain: the interpreter exits itself
    ("import sys\ntry:\n    sys.exit(5)\nexcept SystemExit:\n    pass\n", 0, True),  # caught: a normal end
])
def test_the_exit_status_is_kept_and_recorded_only_when_certain(tmp_path, body, code, certain):
    status, record = guarded(tmp_path, body)
    assert status == code
    assert record is not None and record["rank"] == "3" and record["local_rank"] == "1"
    assert record["code"] == (code if certain else None)


def test_on_skips_the_teardown_where_a_finished_rank_aborts(tmp_path):
    body = ABORT_AT_EXIT + "print('work done', flush=True)\n"
    status, record = guarded(tmp_path, body, mode="on")
    assert status == 0 and record["code"] == 0
    # record only: the abort still happens, after the record says the work ended with 0
    status, record = guarded(tmp_path, body, mode="record")
    assert status == -6 and record["code"] == 0
    # a failure stays one, and leaves no "finished" record behind
    status, record = guarded(tmp_path, ABORT_AT_EXIT + "raise RuntimeError('boom')\n", mode="on")
    assert status == 1 and record["code"] == 1
    status, record = guarded(tmp_path, "import os\nos.abort()\n", mode="on")
    assert status == -6 and record is None


def test_a_file_the_script_never_closed_is_still_written(tmp_path):
    out = tmp_path / "out.txt"
    status, _ = guarded(tmp_path, f"fh = open({str(out)!r}, 'w')\nfh.write('all of it')\n")
    assert status == 0 and out.read_text() == "all of it"


def test_only_the_rank_process_is_guarded(tmp_path):
    # not a rank (torchrun itself has no LOCAL_RANK): no guard, no record
    status, record = guarded(tmp_path, "x = 1\n", env={"LOCAL_RANK": ""})
    assert status == 0 and record is None
    # a python the rank starts (a spawned DataLoader worker) inherits the env but is not guarded:
    # its abort at exit still happens (the parent exits 0 only if it saw the child abort)
    child = (f"import subprocess, sys\nr = subprocess.run([sys.executable, '-c', {ABORT_AT_EXIT!r}]).returncode\n"
             "sys.exit(0 if r == -6 else 7)\n")
    status, record = guarded(tmp_path, child)
    assert status == 0 and record["code"] == 0


def test_a_sitecustomize_it_shadows_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "theirs-ran"
    (theirs / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    guard, ranks = tmp_path / "guard", tmp_path / "ranks"
    guard.mkdir()
    ranks.mkdir()
    (guard / "sitecustomize.py").write_text(launch.exitguard_source())
    env = {**os.environ, "PYTHONPATH": f"{guard}{os.pathsep}{theirs}", exitguard.MODE_VAR: "on",
           exitguard.DIR_VAR: str(ranks), "LOCAL_RANK": "0", "RANK": "0"}
    (tmp_path / "s.py").write_text("x = 1\n")
    assert subprocess.run([sys.executable, str(tmp_path / "s.py")], env=env, timeout=60).returncode == 0
    assert marker.exists() and (ranks / "rank-0.json").exists()


# --- the supervisor's side ------------------------------------------------------------------

def write_done(run_dir: Path, local: int, rank: int, pid: int, code: int | None, restart: str = "0") -> None:
    ranks = run_dir / agent.RANKS_DIR
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank-{local}.json").write_text(json.dumps(
        {"rank": str(rank), "local_rank": str(local), "pid": pid, "code": code, "restart": restart, "time": 1.0}))


SPEC = {"nproc": 2, "exit_guard": {"mode": "record", "source": ""}}


def test_a_job_that_failed_after_every_rank_finished_is_an_exit_race(tmp_path):
    write_done(tmp_path, 0, 2, 100, 0)
    write_done(tmp_path, 1, 3, 101, 0)
    race = agent.exit_race(SPEC, str(tmp_path), 1, [], [(101, ("signal", 6))])
    assert race == {"ranks": [2, 3], "aborted": [{"rank": 3, "local_rank": 1, "signal": 6}]}
    # the node ended 0, or was stopped: nothing to explain
    assert agent.exit_race(SPEC, str(tmp_path), 0, [], []) is None
    assert agent.exit_race(SPEC, str(tmp_path), 143, ["stopped by ddpfab: another node failed"], []) is None


@pytest.mark.parametrize("records", [
    [(0, 2, 100, 0)],  # one rank never finished
    [(0, 2, 100, 0), (1, 3, 101, 1)],  # one rank's work failed
    [(0, 2, 100, 0), (1, 3, 101, None)],  # one rank's exit status was not certain
])
def test_a_rank_that_did_not_finish_keeps_the_failure(tmp_path, records):
    for local, rank, pid, code in records:
        write_done(tmp_path, local, rank, pid, code)
    assert agent.exit_race(SPEC, str(tmp_path), 1, [], []) is None


def test_done_records_are_validated_as_data(tmp_path):
    write_done(tmp_path, 0, 2, 100, 0)
    ranks = tmp_path / agent.RANKS_DIR
    (ranks / "rank-1.json").write_text('{"rank": "3", "local_rank": "1", "pid": "101", "code": 0, "restart": "0"}')
    (ranks / "rank-2.json").write_text("not json")
    (ranks / "rank-3.json").write_text('{"rank": "5", "local_rank": "0", "pid": 7, "code": 0, "restart": "0"}')
    (ranks / "notes.txt").write_text("x")
    assert list(agent.ranks_done(str(tmp_path))) == [0]
    write_done(tmp_path, 1, 3, 101, 0, restart="1")  # another attempt's record: not the same run of ranks
    assert agent.exit_race(SPEC, str(tmp_path), 1, [], []) is None


def test_the_guard_goes_first_on_the_ranks_pythonpath(tmp_path):
    spec = {**SPEC, "exit_guard": {"mode": "on", "source": "# guard\n"}}
    env = agent.exit_guard_env(spec, str(tmp_path), {"PYTHONPATH": "/theirs", "A": "1"})
    assert env["PYTHONPATH"] == f"{tmp_path}/{agent.GUARD_DIR}{os.pathsep}/theirs" and env["A"] == "1"
    assert env[exitguard.MODE_VAR] == "on" and env[exitguard.DIR_VAR] == f"{tmp_path}/{agent.RANKS_DIR}"
    assert (tmp_path / agent.GUARD_DIR / "sitecustomize.py").read_text() == "# guard\n"
    assert agent.exit_guard_env({}, str(tmp_path), {"A": "1"}) == {"A": "1"}  # --exit-guard off


# --- the controller's verdict ---------------------------------------------------------------

def test_a_node_that_aborted_after_finishing_is_not_a_failure_and_is_named():
    out = launch.NodeOutcome("node2", 1, exit_code=1)
    assert out.failed and out.exit_race is None
    out.remote = {"exit_code": 1, "exit_race": {"ranks": [2, 3], "aborted": [{"rank": 3, "local_rank": 1, "signal": 6}]}}
    assert not out.failed and out.to_dict()["exit_race"]["ranks"] == [2, 3]
    assert launch.exit_race_summary({"node2": out.exit_race}) == (
        "all ranks finished their work; rank 3 (node2) aborted at exit (signal 6) (known upstream race)")
    assert launch.exit_race_summary({"node2": {"ranks": [2, 3], "aborted": [
        {"rank": 3, "local_rank": 1, "status": "unseen"}]}}) == (
        "all ranks finished their work; rank 3 (node2) aborted at exit (its exit status was reaped before it was "
        "seen) (known upstream race)")
    assert launch.exit_race_summary({"node2": {"ranks": [2, 3], "aborted": []}}) == (
        "all ranks finished their work; a rank of node2 aborted at exit (known upstream race)")
    lost = launch.NodeOutcome("node2", 1, exit_code=None, error="lost", remote=out.remote)
    assert lost.failed  # a record never outweighs a node that was lost


def test_the_spec_carries_the_guard_unless_it_is_off():
    c = Inventory("inv.yml", "all", (Node("node1", "10.0.0.1", nproc=2), Node("node2", "10.0.0.2", nproc=3)))
    facts = Facts({"node1": "10.0.0.1", "node2": "10.0.0.2"}, 29500, "/w")
    plan = make_plan(c, RunOptions("t.py"), facts)
    assert plan.exit_guard == "on"
    spec = launch.agent_spec(plan, plan.nodes[1])
    assert spec["nproc"] == 3 and spec["exit_guard"]["mode"] == "on"
    assert spec["exit_guard"]["source"] == Path(exitguard.__file__).read_text()
    off = make_plan(c, RunOptions("t.py", exit_guard="off"), facts)
    assert "exit_guard" not in launch.agent_spec(off, off.nodes[0])
    with pytest.raises(PlanError, match="exit_guard must be one of on, record, off"):
        make_plan(c, RunOptions("t.py", exit_guard="maybe"), facts)


def test_the_flush_at_exit_never_reads_a_live_objects_class_attribute(tmp_path):
    """torch.distributed.reduce_op warns when its ``__class__`` is read: the guard's walk over live
    objects must not read it (every rank printed a FutureWarning at exit)."""
    touched = tmp_path / "touched"
    body = ("class Loud:\n"
            "    @property\n"
            "    def __class__(self):\n"
            f"        open({str(touched)!r}, 'w').close()\n"
            "        return Loud\n"
            "keep = Loud()\n")
    status, record = guarded(tmp_path, body)
    assert status == 0 and record["code"] == 0
    assert not touched.exists()


@pytest.mark.parametrize("argv, python_says", [
    (["-m", "nosuchpkg.train"], 1),  # the module is not found: sys.argv[0] stays '-m'
    (["{tmp}/no-such-script.py"], 2),  # the script cannot be opened: no __file__, as after a return
])
def test_code_python_never_ran_keeps_python_s_failure(tmp_path, argv, python_says):
    """A rank whose code never ran is no finished rank: `ddpfab run -m nosuchpkg.train` exited 0 on
    every node, the guard taking "no __file__ and no exception" for a script that returned."""
    guard, ranks = tmp_path / "guard", tmp_path / "ranks"
    guard.mkdir()
    ranks.mkdir()
    (guard / "sitecustomize.py").write_text(launch.exitguard_source())
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DDPFAB_EXIT_GUARD")},
           "PYTHONPATH": str(guard), exitguard.MODE_VAR: "on", exitguard.DIR_VAR: str(ranks), "LOCAL_RANK": "0",
           "RANK": "0"}
    res = subprocess.run([sys.executable, *(a.format(tmp=tmp_path) for a in argv)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == python_says, res.stderr
    (record,) = ranks.glob("rank-*.json")
    assert json.loads(record.read_text())["code"] is None


def test_a_script_that_changed_directory_still_finished(tmp_path):
    """The script's path is taken at the start: a script that chdir'd elsewhere and returned is
    still a finished rank (its relative path no longer names it from where it ended)."""
    status, record = guarded(tmp_path, "import os\nos.chdir('/')\n", relative=True)
    assert status == 0 and record["code"] == 0


def test_a_script_python_cannot_read_is_not_finished(tmp_path, monkeypatch):
    """A script that is there but cannot be opened (its mode) exits 2 without a __file__, as one
    that returned does: not certain. (In process: root opens any file, so the mode is stood in for
    by os.access.)"""
    import types

    script = tmp_path / "script.py"
    script.write_text("x = 1\n")
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__, no __spec__
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setitem(exitguard._seen, "script", str(script))
    monkeypatch.delattr(sys, "last_value", raising=False)
    assert exitguard.final_code() == 0  # there and readable: a script that returned
    monkeypatch.setattr(exitguard.os, "access", lambda path, mode: False)
    assert exitguard.final_code() is None
