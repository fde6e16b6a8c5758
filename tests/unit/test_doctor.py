"""The doctor's grouping and verdict (ddpfab/health/doctor.py), its node side on real processes
(ddpfab/node/stacks.py: /proc and a real py-spy), the flight recorder's plumbing in the plan, and
the hang watch's options."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab.api import Options, planner_options
from ddpfab.health import doctor
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch.replay import recorded_options, validate
from ddpfab.node import stacks
from ddpfab.planning.plan import (FLIGHT_RECORDER_PREFIX, Facts, PlanError, Plan, RunOptions, make_plan)

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"


def stack(collective: str, line: int, user_fn: str = "sync_loss") -> dict:
    """A py-spy thread (as the node sends it) waiting in *collective* called from train.py:*line*."""
    return {"threads": [{"thread": None, "tid": None, "active": False, "frames": [
        {"name": collective, "file": TORCH, "line": 3252},
        {"name": "_exception_logger.<locals>.wrapper", "file": LOGGER, "line": 83},
        {"name": user_fn, "file": "/work/train.py", "line": line},
        {"name": "main", "file": "/work/train.py", "line": 60}]}]}


def node_reply(ranks: list[dict], ended: list[dict] | None = None, exit_code: int | None = None) -> dict:
    return {"job": {"pid": 10, "alive": True}, "exit_code": exit_code, "ranks": ranks, "ended": ended or [],
            "dumps": [], "py_spy": "/venv/bin/py-spy"}


def rank(r: int, local: int, state: str = "S", where: tuple[str, int] = ("all_reduce", 42), pid: int | None = None,
         cpu: int = 0) -> dict:
    return {"pid": pid or 1000 + r, "rank": r, "local_rank": local, "state": state, "cpu_ticks": cpu,
            "stack": stack(*where)}


def cluster_replies(nodes: int = 4, nproc: int = 2, **special) -> dict:
    """nodes x nproc ranks all in all_reduce (train.py:42); *special*: global rank -> dict of changes."""
    out = {}
    for n in range(nodes):
        ranks = []
        for local in range(nproc):
            r = n * nproc + local
            ranks.append({**rank(r, local), **special.get(f"r{r}", {})})
        out[f"node{n + 1}"] = node_reply([x for x in ranks if x.get("state") != "gone"])
    return out


EXPECTED = {f"node{n + 1}": 2 for n in range(4)}


def test_ranks_still_joining_the_group_are_named_not_the_one_that_moved_on():
    """node2 and node3 cannot connect to each other (a firewall between them, a new user's pass):
    both wait in init_process_group, while rank 0, connected to both, went on into DDP's
    construction, whose parameter check is a collective. The doctor called rank 0 "outside any
    collective" and the job waiting for it; the ranks still joining are named, with the network."""
    venv = "/venv/lib/python3.11/site-packages/torch"
    ddp = {"threads": [{"thread": None, "tid": None, "active": False, "frames": [
        {"name": "_verify_param_shape_across_processes", "file": f"{venv}/distributed/utils.py", "line": 294},
        {"name": "__init__", "file": f"{venv}/nn/parallel/distributed.py", "line": 1064},
        {"name": "main", "file": "/work/train.py", "line": 42}]}]}
    replies = cluster_replies(nodes=3, nproc=1, r0={"stack": ddp}, r1={"stack": stack("init_process_group", 37, "main")},
                              r2={"stack": stack("init_process_group", 37, "main")})
    v = doctor.analyze(replies, {f"node{n + 1}": 1 for n in range(3)})
    assert v.lines[0].startswith("node2 rank 1 (pid 1001), node3 rank 2 (pid 1002) are still in init_process_group "
                                 "(train.py:37), which the others have left: they cannot connect to some peer"), v.lines
    assert "ddpfab check" in v.lines[0] and "node1 rank 0" not in v.lines[0]
    assert v.lines[1] == "the other rank waits in _verify_param_shape_across_processes (train.py:42)", v.lines
    assert v.hung


def test_a_rank_that_passed_new_group_alone_is_the_odd_one_not_the_others():
    """new_group has no barrier: a rank may pass it alone into another collective. The seven in
    new_group are where the job should be; the one elsewhere is named (a review found the joining
    rule naming the seven, and the network)."""
    replies = cluster_replies(nodes=4, nproc=2, **{f"r{r}": {"stack": stack("new_group", 30, "main")}
                                                     for r in range(7)})
    v = doctor.analyze(replies, EXPECTED)
    assert v.lines[0] == "node4 rank 7 (pid 1007) is in all_reduce (train.py:42), not in new_group like the others", \
        v.lines
    assert "connect" not in " ".join(v.lines)


def test_a_group_of_ranks_beyond_16_nodes_is_one_folded_line():
    """24 nodes, rank 5 stopped: the group of the other 23 listed every node and rank (430
    characters on a 24-node lab); folded, as every other answer beyond 16 nodes."""
    replies = cluster_replies(nodes=24, nproc=1, r5={"state": "T", "pid": 777, "stack": stack("", 55, "main")})
    shown = doctor.render(doctor.analyze(replies, {f"node{n + 1}": 1 for n in range(24)}))
    group = next(line for line in shown if line.startswith("-- 23 ranks"))
    assert group == "-- 23 ranks in all_reduce (train.py:42): node[1-5,7-24] (23 nodes): ranks 0-4, 6-23", group


def test_a_stopped_rank_is_named_first_and_the_others_wait_in_the_collective():
    replies = cluster_replies(r5={"state": "T", "pid": 777, "stack": stack("", 55, "main")})
    v = doctor.analyze(replies, EXPECTED)
    assert v.lines[0] == "node3 rank 5 (pid 777) is stopped (SIGSTOP, state T)"
    assert v.lines[1] == "the other 7 ranks wait in all_reduce (train.py:42)"
    assert v.hung and [o["what"] for o in v.odd] == ["state"]
    shown = "\n".join(doctor.render(v))
    assert "-- 7 ranks in all_reduce (train.py:42): node1 ranks 0, 1; node2 ranks 2, 3" in shown
    assert f"all_reduce ({TORCH}:3252)" in shown  # the stack itself, innermost first



def test_behind_a_stopped_rank_the_waiters_at_two_call_sites_of_one_collective_are_not_odd_ones():
    """A ring all_reduce lets some ranks through to the next all_reduce of the step before the stopped
    rank's share is missing: they wait at another line, for the same cause (seen on the lab)."""
    replies = cluster_replies(r5={"state": "T", "pid": 777, "stack": stack("", 55, "main")},
                              r0={"stack": stack("all_reduce", 24, "average_gradients")},
                              r6={"stack": stack("all_reduce", 24, "average_gradients")},
                              r7={"stack": stack("all_reduce", 24, "average_gradients")})
    v = doctor.analyze(replies, EXPECTED)
    assert v.lines[0] == "node3 rank 5 (pid 777) is stopped (SIGSTOP, state T)"
    assert v.lines[1] == "the other 7 ranks wait in all_reduce (train.py:24, train.py:42)"
    assert v.hung and [o["what"] for o in v.odd] == ["state"]
    shown = "\n".join(doctor.render(v))  # the stacks stay grouped by their own place
    assert "-- 4 ranks in all_reduce (train.py:42)" in shown and "-- 3 ranks in all_reduce (train.py:24)" in shown
    # without a stopped rank, the same split is a difference worth naming (no cause seen)
    v = doctor.analyze(cluster_replies(r0={"stack": stack("broadcast", 24, "odd_call")}), EXPECTED)
    assert v.odd[0]["what"] == "site"

def test_a_rank_in_another_collective_is_the_odd_one_out():
    replies = cluster_replies(r3={"stack": stack("broadcast", 50, "odd_call")})
    v = doctor.analyze(replies, EXPECTED)
    assert v.lines[0] == ("node2 rank 3 (pid 1003) is in broadcast (train.py:50), not in all_reduce like the "
                          "others")
    assert v.lines[1] == "the other 7 ranks wait in all_reduce (train.py:42)"
    assert v.odd[0]["what"] == "site" and v.odd[0]["ranks"] == [3]


def test_a_rank_elsewhere_but_using_cpu_is_busy_not_hung():
    # a rank still importing (lazily, on a loaded machine) while the others wait for it
    replies = cluster_replies(r4={"state": "R", "cpu_ticks": 3, "stack": stack("_path_split", 134, "_get_cached")})
    v = doctor.analyze(replies, EXPECTED)
    assert v.odd[0]["what"] == "site" and not v.hung
    assert v.lines[-1] == "not a hang: node3 rank 4 (pid 1004) is using CPU (busy: still importing, or computing)"



def test_a_tick_or_two_in_the_sample_is_a_blocked_rank_not_a_busy_one():
    """Ranks blocked in gloo collectives used 0-2 ticks of 100 a second on the lab (its threads): the
    odd rank in broadcast is a hang, not "busy" (the hang watch then kept waiting for ever)."""
    ticks = {f"r{r}": {"cpu_ticks": r % 3} for r in range(8)}
    ticks["r6"] = {"cpu_ticks": 1, "stack": stack("broadcast", 33, "odd_call")}
    v = doctor.analyze(cluster_replies(**ticks), EXPECTED)
    assert v.hung and v.odd[0]["what"] == "site" and not v.lines[-1].startswith("not a hang")
    ticks["r2"] = {"cpu_ticks": 30}  # 30 % of a CPU: computing
    assert not doctor.analyze(cluster_replies(**ticks), EXPECTED).hung

def test_the_same_collective_at_another_call_site_is_odd_too():
    v = doctor.analyze(cluster_replies(r6={"stack": stack("all_reduce", 99)}), EXPECTED)
    assert v.lines[0].startswith("node4 rank 6 (pid 1006) is in all_reduce (train.py:99)")


def test_d_state_missing_ranks_and_a_silent_node_are_each_named():
    replies = cluster_replies(r1={"state": "D"}, r4={"state": "gone"})
    replies["node4"] = "timed out after 30 s"
    v = doctor.analyze(replies, EXPECTED)
    texts = [o["text"] for o in v.odd]
    assert "node4 did not answer: timed out after 30 s" in texts
    assert any(t.startswith("node1 rank 1 (pid 1001) is in uninterruptible sleep (state D") for t in texts)
    assert "node3 local rank 0 is gone" in texts
    assert v.hung


def test_a_rank_that_finished_is_not_gone_and_one_that_failed_says_its_code():
    replies = cluster_replies(r2={"state": "gone"}, r3={"state": "gone"})
    replies["node2"]["ended"] = [{"rank": 2, "local_rank": 0, "pid": 5, "code": 0, "restart": 0},
                                 {"rank": 3, "local_rank": 1, "pid": 6, "code": 1, "restart": 0}]
    v = doctor.analyze(replies, EXPECTED)
    assert [o["text"] for o in v.odd] == ["node2 rank 3 is gone (its exit code 1)"]


def test_all_ranks_in_one_place_using_cpu_is_not_a_hang():
    replies = cluster_replies(**{f"r{r}": {"cpu_ticks": 40} for r in range(8)})
    v = doctor.analyze(replies, EXPECTED)
    assert not v.odd and not v.hung
    assert v.lines == ["no rank stands out: all 8 ranks are in all_reduce (train.py:42) and use CPU (busy, not hung?)"]
    idle = doctor.analyze(cluster_replies(), EXPECTED)
    assert idle.hung and not idle.odd  # all waiting, none using CPU: a hang nobody stands out in


def test_nodes_whose_ranks_have_not_started_are_not_missing_ranks():
    replies = cluster_replies()
    replies["node3"]["ranks"] = []  # torchrun alive (job.alive), its ranks not started: rendezvous
    replies["node4"] = node_reply([])
    v = doctor.analyze(replies, EXPECTED)
    assert not v.odd and v.lines[-1] == ("not started yet on node3, node4 (torchrun has not started the ranks there: "
                                         "rendezvous, or still importing)")
    everywhere = doctor.analyze({n: node_reply([]) for n in EXPECTED}, EXPECTED)
    assert not everywhere.hung and not everywhere.odd  # a slow start is not a hang to stop


def test_without_py_spy_the_fix_is_named():
    replies = cluster_replies()
    for r in replies["node2"]["ranks"]:
        r["stack"] = {"error": "py-spy is not installed", "fix": "pip install py-spy"}
    v = doctor.analyze(replies, EXPECTED)
    assert "no stack from node2: py-spy is not installed; fix: pip install py-spy" in v.lines


def test_a_hostile_reply_is_data_checked_never_trusted():
    replies = cluster_replies()
    replies["node1"]["ranks"] = [{"pid": "1; rm -rf /", "state": "T"}, "junk", {"pid": 5, "state": 3},
                                 {"pid": 6, "rank": True, "local_rank": 0, "state": "S", "stack": {"threads": "x"}}]
    replies["node2"] = {"ranks": "nope", "ended": 7}
    v = doctor.analyze(replies, EXPECTED)
    ranks = doctor.ranks_of("node1", replies["node1"])
    assert [(r.pid, r.rank, r.frames) for r in ranks] == [(6, None, ())]
    assert any(o["text"] == "node2 local rank 0 is gone" for o in v.odd)


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 6), nproc=st.integers(1, 4), data=st.data())
def test_exactly_the_odd_rank_is_named_whatever_the_shape(nodes, nproc, data):
    world = nodes * nproc
    if world < 3:
        return  # an odd one out needs a majority of at least two others
    odd = data.draw(st.integers(0, world - 1))
    kind = data.draw(st.sampled_from(["T", "D", "site"]))
    change = {"state": kind} if kind != "site" else {"stack": stack("barrier", 7, "elsewhere")}
    replies = cluster_replies(nodes, nproc, **{f"r{odd}": change})
    v = doctor.analyze(replies, {f"node{n + 1}": nproc for n in range(nodes)})
    assert len(v.odd) == 1 and f"rank {odd} (pid {1000 + odd})" in v.odd[0]["text"]
    assert v.odd[0]["node"] == f"node{odd // nproc + 1}"
    assert v.lines[1] == f"the other {world - 1} rank{'s' if world > 2 else ''} wait" \
                         f"{'' if world > 2 else 's'} in all_reduce (train.py:42)"


def test_flight_recorder_dumps_are_kept_as_bytes_never_loaded(tmp_path):
    replies = cluster_replies(1, 2)
    pickle_bytes = b"\x80\x04\x95cos\nsystem\n."  # a pickle that would run a command if loaded
    replies["node1"]["dumps"] = [{"name": "nccl_trace_rank_0", "size": len(pickle_bytes), "truncated": False,
                                  "b64": base64.b64encode(pickle_bytes).decode()},
                                 {"name": "../escape", "b64": ""}]
    plan = _plan(tmp_path, gpus=0)
    verdict, path = doctor.diagnose(plan, lambda node, req, t: replies[node.name], tmp_path, timeout=5)
    assert (tmp_path / "nccl-trace" / "node1" / "nccl_trace_rank_0").read_bytes() == pickle_bytes
    assert not (tmp_path / "escape").exists() and not (tmp_path / "nccl-trace" / "escape").exists()
    record = json.loads(path.read_text())
    assert record["kind"] == "ddpfab-doctor" and record["verdict"] == verdict.lines
    assert record["nccl_trace"] == [{"node": "node1", "file": "nccl-trace/node1/nccl_trace_rank_0",
                                     "size": len(pickle_bytes)}]


def test_a_node_that_raises_or_hangs_is_its_reason_not_the_doctors_failure(tmp_path):
    plan = _plan(tmp_path, gpus=0)

    def call(node, req, timeout):
        raise TimeoutError(f"no answer in {timeout:g} s")
    verdict, _ = doctor.diagnose(plan, call, None, timeout=2)
    assert verdict.odd[0]["text"] == "node1 did not answer: no answer in 2 s"


# -- the plan: the flight recorder where NCCL runs, the hang watch's options ---------------------
def _plan(tmp_path: Path, gpus: int, **opts) -> Plan:
    cluster = Inventory(str(tmp_path / "inv.yml"), "all", (Node("node1", "10.0.0.1", gpus=gpus),))
    return make_plan(cluster, RunOptions("t.py", run_id="r1", nproc_per_node=2, **opts),
                     Facts(addresses={"node1": "10.0.0.1"}, master_port=29500, cwd=str(tmp_path),
                           homes={"node1": "/home/u"}))


def test_the_flight_recorder_is_on_where_nccl_runs_and_dumps_into_the_run_dir(tmp_path):
    env = _plan(tmp_path, gpus=2).nodes[0].env
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"/home/u/.ddpfab/runs/r1/{FLIGHT_RECORDER_PREFIX}"
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert stacks.TRACE_PREFIX == FLIGHT_RECORDER_PREFIX  # the node looks where the plan points
    assert not any(k.startswith(("TORCH_FR_", "TORCH_NCCL_")) for k in _plan(tmp_path, gpus=0).nodes[0].env)
    mine = _plan(tmp_path, gpus=2, env=(("TORCH_FR_BUFFER_SIZE", "0"),)).nodes[0].env
    assert mine["TORCH_FR_BUFFER_SIZE"] == "0"  # the user's --env wins


def test_hang_options_are_checked_planned_and_replayed(tmp_path):
    plan = _plan(tmp_path, gpus=0, hang_timeout=20, on_hang="stop")
    assert (plan.hang_timeout, plan.on_hang) == (20.0, "stop")
    assert Plan.from_dict(json.loads(plan.to_json())).hang_timeout == 20.0
    for bad in ({"hang_timeout": -1}, {"hang_timeout": float("nan")}, {"on_hang": "kill"}):
        with pytest.raises(PlanError, match="hang_timeout must|on_hang must"):
            _plan(tmp_path, gpus=0, **bad)
    ropts = planner_options("t.py", (), Options(hang_timeout=20, on_hang="stop", run_id="r1"))
    assert (ropts.hang_timeout, ropts.on_hang) == (20, "stop")
    manifest = {"kind": "ddpfab-run-manifest", "schema_version": 3, "options": recorded_options(ropts, "/w"),
                "plan": json.loads(plan.to_json())}
    again, _ = validate(json.loads(json.dumps(manifest)), "m.json")
    assert (again.hang_timeout, again.on_hang) == (20, "stop")


# -- the node side, on real processes ------------------------------------------------------------
PY_SPY = stacks.find_py_spy(sys.executable)


def test_a_real_stopped_process_reads_as_state_t_with_its_stack():
    code = "import time\ndef waits_here():\n    print('ready', flush=True)\n    time.sleep(60)\nwaits_here()\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"  # in waits_here by now (a loaded machine starts slowly)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert stacks.proc_stat(proc.pid)[0] == "T"
        got = stacks.dump_stack(PY_SPY, proc.pid)
        assert PY_SPY, "py-spy is in the node extra and the test extra: pip install -e '.[test]'"
        names = [f["name"] for f in got["threads"][0]["frames"]]
        assert names[:1] == ["waits_here"], got
    finally:
        proc.kill()
        proc.wait()
    assert stacks.proc_stat(proc.pid) is None


def test_without_py_spy_the_node_says_so_and_how_to_fix_it():
    got = stacks.dump_stack(None, os.getpid())
    assert got["error"] == "py-spy is not installed" and "pip install py-spy" in got["fix"]


def test_a_run_dir_without_a_job_record_is_an_answer_not_a_crash(tmp_path):
    out = stacks.node_stacks(str(tmp_path))
    assert out["job"] is None and "no job record" in out["error"] and out["ranks"] == []
    (tmp_path / "nccl_trace_rank_3").write_bytes(b"\x00\x01")
    os.symlink("/etc/passwd", tmp_path / "nccl_trace_rank_4")  # a link is not a dump: not followed
    assert [(d["name"], base64.b64decode(d["b64"])) for d in stacks.trace_dumps(str(tmp_path))] == [
        ("nccl_trace_rank_3", b"\x00\x01")]


def test_a_script_that_works_at_module_level_keeps_its_frames():
    """py-spy marks each thread's outermost frame ``is_shim_entry`` (entered from C): for a script
    without a main() that frame is the script's own ``<module>``, and dropping it left the
    doctor with 'unknown place (no stack)' and 'no rank stands out'."""
    def spy(*frames):  # py-spy's JSON, innermost first, the outermost marked as py-spy marks it
        out = [{"name": n, "filename": f, "line": ln, "is_entry": False, "is_shim_entry": False}
               for n, f, ln in frames]
        out[-1]["is_shim_entry"] = True
        return [{"thread_name": None, "os_thread_id": 7, "active": False, "frames": out}]

    waiting = {"threads": stacks.frames_of(spy(("all_reduce", TORCH, 3252), ("<module>", "/work/hang.py", 9)))}
    sleeping = {"threads": stacks.frames_of(spy(("<module>", "/work/hang.py", 7)))}
    assert sleeping["threads"][0]["frames"] == [{"name": "<module>", "file": "/work/hang.py", "line": 7}]
    replies = {"node1": node_reply([{**rank(0, 0), "stack": waiting}, {**rank(1, 1), "stack": sleeping},
                                    {**rank(2, 2), "stack": waiting}])}
    v = doctor.analyze(replies, {"node1": 3})
    assert "node1 rank 1 (local rank 1, pid 1001) is outside any collective, in <module> (hang.py:7)" in v.lines[0], \
        v.lines
    assert v.odd and "unknown place" not in "\n".join(doctor.render(v))


# -- a rank outside any collective: the one the others wait for, however many ranks --------------
TORCH_FUTURES = "/venv/lib/python3.11/site-packages/torch/futures/__init__.py"


def spy_stack(*frames: tuple[str, str, int], pid: int = 7) -> dict:
    """A rank's stack as the node sends it: py-spy's JSON (innermost first, the outermost marked
    ``is_shim_entry`` as py-spy marks it) through the node's own reader (stacks.frames_of)."""
    out = [{"name": n, "filename": f, "line": ln, "is_entry": False, "is_shim_entry": False} for n, f, ln in frames]
    out[-1]["is_shim_entry"] = True
    return {"threads": stacks.frames_of([{"thread_name": None, "os_thread_id": pid, "active": False,
                                          "frames": out}])}


#: hang_train.py's ranks as py-spy showed them on the lab: rank 0 waits in all_reduce (sync_loss),
#: rank 1 sleeps in its own code (stall: time.sleep in a loop, a C call py-spy does not show).
WAITS = spy_stack(("all_reduce", TORCH, 3252), ("_exception_logger.<locals>.wrapper", LOGGER, 83),
                  ("sync_loss", "/work/hang_train.py", 32), ("main", "/work/hang_train.py", 78),
                  ("<module>", "/work/hang_train.py", 86))
SLEEPS = spy_stack(("stall", "/work/hang_train.py", 42), ("main", "/work/hang_train.py", 74),
                   ("<module>", "/work/hang_train.py", 86))


def two_nodes(stack0: dict, stack1: dict, **rank1) -> dict:
    """2 nodes x 1 process (global ranks 0 and 1, each local rank 0)."""
    return {"node1": node_reply([{**rank(0, 0, pid=53), "stack": stack0}]),
            "node2": node_reply([{**rank(1, 0, pid=52), "stack": stack1, **rank1}])}


def test_of_two_ranks_the_one_outside_any_collective_is_the_one_the_other_waits_for():
    """2 ranks: no majority to go by. Rank 1 sleeps in its own code while rank 0 waits in all_reduce:
    rank 1 is named (node, global and local rank, pid, its top frame), rank 0 is not (the doctor
    printed both stacks, named no one and exited 0)."""
    v = doctor.analyze(two_nodes(WAITS, SLEEPS), {"node1": 1, "node2": 1})
    assert v.lines[:2] == ["node2 rank 1 (local rank 0, pid 52) is outside any collective, in stall (hang_train.py:42)",
                           "the other rank waits for it in all_reduce (hang_train.py:32)"], v.lines
    assert v.hung and len(v.odd) == 1
    odd = v.odd[0]
    assert (odd["what"], odd["place"], odd["node"], odd["rank"], odd["local_rank"], odd["pid"]) == (
        "site", "outside", "node2", 1, 0, 52)
    assert odd["frame"] == {"file": "/work/hang_train.py", "line": 42, "function": "stall"}
    assert json.loads(json.dumps(v.odd))[0]["what"] == "site"  # the record keeps the word
    shown = "\n".join(doctor.render(v))
    assert "-- 1 rank in all_reduce (hang_train.py:32): node1 rank 0" in shown
    assert "-- 1 rank in stall (hang_train.py:42): node2 rank 1" in shown
    # the same with the ranks the other way round, and on one node (1 waiting vs 1 outside)
    v = doctor.analyze(two_nodes(SLEEPS, WAITS), {"node1": 1, "node2": 1})
    assert v.lines[0].startswith("node1 rank 0 (local rank 0, pid 53) is outside any collective") and v.hung
    one = {"node1": node_reply([{**rank(0, 0), "stack": SLEEPS}, {**rank(1, 1), "stack": WAITS}])}
    assert doctor.analyze(one, {"node1": 2}).odd[0]["rank"] == 0


def test_a_rank_waiting_in_pdb_is_said_to_be_there_with_how_to_attach_and_is_no_hang():
    """A --pdb rank at its breakpoint (or post-mortem) waits for a user on its socket: the doctor
    named it "outside any collective, in Session.wait (ddpfab_rankpdb.py:79) calling accept" and
    called the job hung. It says where the user's code stopped and how to attach."""
    guard = "/home/u/.ddpfab/runs/r1/exitguard/ddpfab_rankpdb.py"
    lib = "/usr/lib/python3.11"
    hook = [{"name": "accept", "file": f"{lib}/socket.py", "line": 294},
            {"name": "wait", "file": guard, "line": 79},
            {"name": "session_for", "file": guard, "line": 180},
            {"name": "breakpointhook", "file": guard, "line": 188}]
    at_breakpoint = {"threads": [{"tid": None, "frames": hook + [{"name": "step", "file": "/work/bp.py", "line": 9},
                                                                 {"name": "<module>", "file": "/work/bp.py", "line": 20}]}]}
    v = doctor.analyze(cluster_replies(r2={"stack": at_breakpoint}), EXPECTED, run_id="np-4n")
    assert v.lines[0] == ("node2 rank 2 (local rank 0, pid 1002) waits in pdb at step (bp.py:9): "
                          "`ddpfab debug np-4n --rank 2` attaches to it"), v.lines
    assert v.lines[1] == "the other 7 ranks wait for it in all_reduce (train.py:42)" and not v.hung
    # its stack's group is named by where the user's code stopped, with the hook's frames left out
    # (it was "1 rank in socket.accept (socket.py:294)", then ddpfab_rankpdb.py's frames)
    group = next(g for g in v.groups if any(r["rank"] == 2 for r in g["ranks"]))
    assert group["site"] == "pdb at step (bp.py:9)" and [f["name"] for f in group["frames"]] == ["step", "<module>"]
    # post-mortem: the hook runs after the user's frames ended
    post = {"threads": [{"tid": None, "frames": hook[:3] + [{"name": "excepthook", "file": guard, "line": 200}]}]}
    v = doctor.analyze(cluster_replies(r2={"stack": post}), EXPECTED, run_id="np-4n")
    assert v.lines[0].startswith("node2 rank 2 (local rank 0, pid 1002) waits in pdb (post-mortem): ") and not v.hung


def test_ranks_outside_any_collective_are_named_whatever_the_majority():
    """7 ranks in all_reduce and 1 asleep: the sleeper, as the one they wait for. 1 rank in
    all_reduce and 2 asleep: the 2 sleepers, never the one that waits (it was the odd one out)."""
    sleeping = {"stack": SLEEPS}
    v = doctor.analyze(cluster_replies(r5=sleeping), EXPECTED)
    assert v.lines == ["node3 rank 5 (local rank 1, pid 1005) is outside any collective, in stall (hang_train.py:42)",
                       "the other 7 ranks wait for it in all_reduce (train.py:42)"]
    v = doctor.analyze(cluster_replies(1, 3, r1=sleeping, r2=sleeping), {"node1": 3})
    assert [o["rank"] for o in v.odd] == [1, 2] and all(o["place"] == "outside" for o in v.odd)
    assert v.lines[1] == "the other rank waits for them in all_reduce (train.py:42)" and v.hung


def test_with_a_rank_outside_the_waiters_at_two_call_sites_or_in_another_collective():
    """The waiters at two call sites of all_reduce wait for the same rank (merged, as behind a
    stopped one); a waiter in another collective than the majority is still named as one."""
    v = doctor.analyze(cluster_replies(r0={"stack": stack("all_reduce", 24, "average_gradients")},
                                       r7={"stack": SLEEPS}), EXPECTED)
    assert [o["rank"] for o in v.odd] == [7]
    assert v.lines[1] == "the other 7 ranks wait for it in all_reduce (train.py:24, train.py:42)"
    v = doctor.analyze(cluster_replies(r3={"stack": stack("broadcast", 50, "odd_call")}, r7={"stack": SLEEPS}),
                       EXPECTED)
    assert [(o["ranks"], o["place"]) for o in v.odd] == [([7], "outside"), ([3], "collective")], v.odd
    assert v.lines[0].endswith("; node2 rank 3 (pid 1003) is in broadcast (train.py:50), not in all_reduce like "
                               "the others")
    assert v.lines[1] == "the other 6 ranks wait for it in all_reduce (train.py:42)"


def test_two_ranks_in_two_collectives_name_no_one_and_two_elsewhere_name_no_one():
    """Which of 2 ranks in different collectives is wrong, or of 2 ranks both outside any, the stacks
    cannot say: every place is listed, no one named (as before)."""
    v = doctor.analyze(two_nodes(WAITS, stack("broadcast", 50, "odd_call")), {"node1": 1, "node2": 1})
    assert not v.odd and v.lines == ["the ranks are in all_reduce (hang_train.py:32): rank 0; "
                                     "broadcast (train.py:50): rank 1"]
    v = doctor.analyze(two_nodes(SLEEPS, spy_stack(("load", "/work/data.py", 9))), {"node1": 1, "node2": 1})
    assert not v.odd


def test_a_wait_on_an_async_collective_is_in_one_and_threadings_wait_is_not():
    asynchronous = spy_stack(("wait", TORCH_FUTURES, 61), ("sync_loss", "/work/train.py", 40))
    condition = spy_stack(("wait", "/usr/lib/python3.11/threading.py", 327),
                          ("get", "/usr/lib/python3.11/queue.py", 171), ("next_batch", "/work/train.py", 12))
    assert doctor.site_of(doctor.ranks_of("n", node_reply([{**rank(0, 0), "stack": asynchronous}]))[0].frames) \
        == doctor.Site("wait", "train.py:40", "wait")
    v = doctor.analyze(two_nodes(asynchronous, condition), {"node1": 1, "node2": 1})
    assert v.lines == ["node2 rank 1 (local rank 0, pid 52) is outside any collective, in next_batch (train.py:12) "
                       "calling get (queue.py:171)", "the other rank waits for it in wait (train.py:40)"]
    assert v.odd[0]["frame"] == {"file": "/work/train.py", "line": 12, "function": "next_batch"}


def test_a_rank_outside_that_uses_cpu_is_named_but_busy_not_hung():
    v = doctor.analyze(two_nodes(WAITS, SLEEPS, state="R", cpu_ticks=60), {"node1": 1, "node2": 1})
    assert v.odd[0]["rank"] == 1 and not v.hung
    assert v.lines[-1] == "not a hang: node2 rank 1 (pid 52) is using CPU (busy: still importing, or computing)"


# -- the hang watch: what each look prints ----------------------------------------------------------
def watch(tmp_path: Path, monkeypatch, verdicts: list, on_hang: str = "stop"):
    """A HangWatch (--hang-timeout 10) whose doctor returns *verdicts* in turn; its notes."""
    from types import SimpleNamespace

    from ddpfab.launch.hangwatch import HangWatch

    looks = iter(verdicts)
    monkeypatch.setattr(doctor, "diagnose", lambda plan, call, run_dir: (next(looks), tmp_path / "doctor-x.json"))
    notes: list[str] = []
    hw = HangWatch(SimpleNamespace(hang_timeout=10.0, on_hang=on_hang, run_id="r1"), {}, tmp_path, notes.append)

    def tick(quiet_since: float, now: float) -> None:
        hw.tick(quiet_since, now)
        if hw._thread is not None:
            hw._thread.join(timeout=10)
    return hw, tick, notes


def stack_lines(notes: list[str]) -> list[str]:
    return [n for n in notes if n.startswith("-- ")]


def test_the_hang_watch_prints_the_stacks_once_busy_looks_then_a_hang(tmp_path, monkeypatch):
    """Two looks at a busy job, the third finds the sleeper: the stacks come once, with the hang
    verdict (every look printed them: three times), and no look starts after the stop."""
    busy = doctor.analyze(two_nodes(WAITS, SLEEPS, state="R", cpu_ticks=60), {"node1": 1, "node2": 1})
    hung = doctor.analyze(two_nodes(WAITS, SLEEPS), {"node1": 1, "node2": 1})
    assert not busy.hung and hung.hung
    hw, tick, notes = watch(tmp_path, monkeypatch, [busy, busy, hung])
    for now in (10, 20, 30):
        tick(0, now)
    assert hw.stop_now.is_set() and hw.verdict is hung
    assert stack_lines(notes) == ["-- 1 rank in all_reduce (hang_train.py:32): node1 rank 0",
                                  "-- 1 rank in stall (hang_train.py:42): node2 rank 1"], notes
    assert notes.index("hang: " + hung.lines[0]) < notes.index(stack_lines(notes)[0])
    assert sum(n.startswith("hang watch: no rank has printed") for n in notes) == 3
    tick(0, 40)
    tick(0, 50)  # the monitor is stopping the job: no further look
    assert sum(n.startswith("hang watch: no rank has printed") for n in notes) == 3


def test_with_on_hang_report_the_same_stacks_are_not_printed_again_in_one_spell(tmp_path, monkeypatch):
    hung = doctor.analyze(two_nodes(WAITS, SLEEPS), {"node1": 1, "node2": 1})
    hw, tick, notes = watch(tmp_path, monkeypatch, [hung, hung, hung], on_hang="report")
    tick(0, 10)
    tick(0, 20)
    assert len(stack_lines(notes)) == 2 and not hw.stop_now.is_set()
    assert any(n.startswith("the ranks are where they were at the last look") for n in notes)
    tick(25, 35)  # a rank printed at 25: a new quiet spell shows its stacks again
    assert len(stack_lines(notes)) == 4


def test_a_job_that_ended_on_every_node_is_said_to_have_ended_not_diagnosed():
    """``ddpfab doctor`` on a finished or stopped job: how each node's ended, nothing odd (the old
    verdict named each node's end as an odd one out, exit 1)."""
    replies = {"node1": {**node_reply([], exit_code=143), "how": "stopped", "stopped": "signal 15"},
               "node2": {**node_reply([], exit_code=137), "how": "stopped", "stopped": "signal 15"},
               "node3": node_reply([], exit_code=0)}
    v = doctor.analyze(replies, {"node1": 2, "node2": 2, "node3": 2})
    assert v.ended and not v.hung and v.odd == []
    assert v.lines == ["the job has ended on every node: node1, node2 stopped (signal 15); node3 exit code 0"]
    # one node still running (or silent) is no end: the analysis names what is there
    replies["node3"] = node_reply([rank(4, 0), rank(5, 1)])
    assert not doctor.analyze(replies, {"node1": 2, "node2": 2, "node3": 2}).ended
    replies["node3"] = "timed out after 30 s"
    assert not doctor.analyze(replies, {"node1": 2, "node2": 2, "node3": 2}).ended


def test_a_run_recorded_here_as_ended_whose_node_records_are_gone_has_ended(tmp_path):
    """The doctor on a finished run whose records on some nodes were pruned said ``node1 local rank
    0 is gone ... and 2 more`` (exit 1): with the run's record here saying it ended, those nodes
    ended as it says; without it (a run still going by its record) a node with no record is odd."""
    gone = stacks.node_stacks(str(tmp_path / "pruned"), sample_s=0)
    assert gone["job"] is None and "error" in gone
    replies = {"node1": gone, "node2": dict(gone),
               "node3": {**node_reply([], exit_code=143), "how": "stopped", "stopped": "signal 15"}}
    v = doctor.analyze(replies, {"node1": 1, "node2": 1, "node3": 1}, {"node1": 0, "node2": 0, "node3": 143})
    assert v.ended and not v.hung and v.odd == []
    assert v.lines == ["the job has ended on every node: node1, node2 exit code 0 (from the run's record here); "
                       "node3 stopped (signal 15)"]
    assert not doctor.analyze(replies, {"node1": 1, "node2": 1, "node3": 1}).ended
    assert not doctor.analyze({**replies, "node2": "timed out"}, {"node1": 1, "node2": 1, "node3": 1},
                              {"node1": 0, "node2": 0, "node3": 143}).ended


def test_an_ended_job_s_node_reply_says_how_it_ended(tmp_path):
    (tmp_path / "agent.json").write_text(json.dumps({"agent_pid": 1, "pid": 2 ** 22 + 7, "started": 1.0}))
    (tmp_path / "result.json").write_text(json.dumps({"exit_code": 143, "stopped": "signal 15", "failed_at": None}))
    (tmp_path / "exit_code").write_text("143\n")
    out = stacks.node_stacks(str(tmp_path), sample_s=0)
    assert (out["exit_code"], out["how"], out["stopped"]) == (143, "stopped", "signal 15")


def test_an_ended_job_is_told_node_by_node_and_a_tmux_launch_without_a_code_says_where_it_is():
    line = doctor.ended_line({"node1": ("exited", 0, None), "node2": ("stopped", 143, "signal 15"),
                              "node3": ("exited", None, None)})
    assert line == ("the job has ended on every node: node1 exit code 0; node2 stopped (signal 15); node3 ended "
                    "(its exit code is in the record of the machine that ran it)")
