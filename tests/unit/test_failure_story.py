"""The failure's story (ddpfab.launch.cause, ddpfab.launch.story): the rank that failed on its own is
named, however late its node reports; victims (ranks that lost their peer, ranks that were
stopped) are counted, never named; torchrun's reports and the victims' tracebacks are folded.

The node outputs below are what torch 2.13's torchrun relays (--tee=3) on a 3-node gloo job whose
rank 1 raised after an all_reduce (captured on the lab), shortened where it repeats."""

from __future__ import annotations

import io
import os
import queue
import time
import types
from dataclasses import replace
from pathlib import Path

from ddpfab.cli.run import own_options_hint
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.health import doctor
from ddpfab.launch import execute, story
from ddpfab.launch.hangwatch import HangWatch
from ddpfab.launch.cause import (Blame, Cause, CauseKind, CauseReader, Fold, NodeFailure, blame, kind_of_exception,
                                 worker_cause)
from ddpfab.node.agent import oom_kill_in
from ddpfab.planning.plan import Facts, RunOptions, make_plan

GLOO_CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [10.0.0.12]:50096. This is typically caused by a remote worker crashing. Check the "
               "logs of the remote worker before reporting an error. GLHF!")

VICTIM = f"""\
[default0]:rank 0 step 0 ok
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "/w/crash.py", line 16, in <module>
[default0]:[rank0]:     dist.all_reduce(t)
[default0]:[rank0]:   File "/v/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[default0]:[rank0]:     work.wait()
[default0]:[rank0]: {GLOO_CLOSED}
W1204 17:17:19.074000 4653 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 4658 closing signal SIGTERM
E1204 17:17:19.274000 4653 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 4659) of binary: /v/bin/python
Traceback (most recent call last):
  File "/v/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
crash.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_17:17:19
  host      : node1
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4659)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""

CULPRIT = """\
[W1204 17:24:54.267612704 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
[default0]:rank 1 step 0 ok
[default0]:[rank1]: Traceback (most recent call last):
[default0]:[rank1]:   File "/w/crash.py", line 12, in <module>
[default0]:[rank1]:     raise ValueError("bad batch shape (3, 4)")
[default0]:[rank1]: ValueError: bad batch shape (3, 4)"""

USAGE = """\
[default0]:usage: train.py [-h] [--steps STEPS]
[default0]:train.py: error: unrecognized arguments: --nproc-per-node 2"""


def reader(text: str) -> CauseReader:
    r = CauseReader()
    for line in text.splitlines():
        r.feed(line)
    return r


def plan3():
    nodes = tuple(Node(f"node{i}", f"10.0.0.1{i}", nproc=1) for i in (1, 2, 3))
    return make_plan(Inventory("inv.yml", "all", nodes), RunOptions("crash.py"),
                     Facts({n.name: n.host for n in nodes}, 29500, "/w"))


def test_peer_loss_words_are_secondary_and_anything_else_is_the_ranks_own():
    for line in (GLOO_CLOSED, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:5: "
                 "Connection reset by peer",
                 "torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, remote process "
                 "exited or there was a network error, NCCL version 2.21.5",
                 "RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                 "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
                 "torch.distributed.DistStoreError: failed to recv, got 0 bytes",
                 "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
                 "operation to complete"):
        assert kind_of_exception(line) is CauseKind.PEER_LOST, line
    for line in ("ValueError: bad batch shape (3, 4)", "torch.OutOfMemoryError: CUDA out of memory.",
                 "RuntimeError: Expected all tensors to be on the same device", "KeyError: 'lr'"):
        assert kind_of_exception(line) is CauseKind.EXCEPTION, line


def test_the_crashed_rank_is_named_though_its_victims_reported_first():
    victim, culprit = reader(VICTIM), reader(CULPRIT)
    assert victim.cause().kind is CauseKind.PEER_LOST and victim.cause().peer == "10.0.0.12"
    assert culprit.cause().kind is CauseKind.EXCEPTION
    # the victims' supervisors saw their ranks fail first (they often do): the crash is still named
    nodes = [NodeFailure("node1", 0, 100.0, victim.cause(), victim.rank_kinds(), victim.peers()),
             NodeFailure("node2", 1, 100.4, culprit.cause(), culprit.rank_kinds(), culprit.peers()),
             NodeFailure("node3", 2, 100.1, victim.cause(), victim.rank_kinds(), victim.peers())]
    verdict = blame(nodes, {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"})
    assert (verdict.node, verdict.own, verdict.lost_peer) == ("node2", True, 2)
    assert verdict.cause.exception == "ValueError: bad batch shape (3, 4)"
    assert verdict.victims() == "2 other ranks lost their peer"
    # the last lines of its traceback, for the record
    assert verdict.cause.traceback[-1].endswith("ValueError: bad batch shape (3, 4)")


def test_a_second_rank_failing_another_way_on_the_named_node_is_in_the_closing_line():
    """Two ranks of node2 raised at once, each its own error (a new user's pass: the closing line
    named rank 2's and said nothing of rank 3's); a third rank with rank 2's own error, and a
    fourth that lost its peer, add nothing."""
    text = CULPRIT.replace("rank1", "rank2") + "\n" + "\n".join([
        "[default1]:[rank3]: Traceback (most recent call last):",
        "[default1]:[rank3]:   File \"/w/crash.py\", line 14, in <module>",
        "[default1]:[rank3]:     raise KeyError('missing')",
        "[default1]:[rank3]: KeyError: 'missing'",
        "[default2]:[rank4]: ValueError: bad batch shape (3, 4)",
        f"[default3]:[rank5]: {GLOO_CLOSED}"])
    r = reader(text)
    cause = r.cause({"pid": 71, "exit": 1, "rank": 2, "local_rank": 0})  # (the global rank: its supervisor's record)
    assert cause.local_rank == 0 and cause.rank == 2
    out = execute.NodeOutcome("node2", 1, exit_code=1, cause=cause, causes=r)
    verdict = blame([NodeFailure("node2", 1, 100.0, cause, r.rank_kinds(), r.peers())], {"node2": "10.0.0.12"})
    line = story.closing_line(verdict, out, "", {"node2": "10.0.0.12"})
    assert line == ("failed: node2 (node_rank 1) exit code 1; rank 2 (local rank 0): ValueError: bad batch shape (3, 4); "
                    "also on node2: rank 3 (local rank 1): KeyError: 'missing'; the others were stopped"), line
    # a rank number no torchrun gives (a record read back) is left out, not made negative
    assert story.own_beside(out, replace(cause, rank=0, local_rank=1, exception="OSError: x")).startswith(
        "local rank 0: ValueError")
    # after torchrun's restarts another rank's error is of a later attempt, in the first one's wake
    r.restarted = True
    assert story.own_beside(out, cause) == ""
    assert r.cause("garbage").exception is not None  # (a record that is no dict is no cause, and no crash)


def test_with_only_victims_the_node_their_errors_name_is_pointed_at():
    victim = reader(VICTIM)
    nodes = [NodeFailure("node1", 0, 100.0, victim.cause(), victim.rank_kinds(), victim.peers()),
             NodeFailure("node2", 1, None, None, failed=False)]
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12"}
    verdict = blame(nodes, addresses)
    assert (verdict.node, verdict.own, verdict.pointed) == ("node1", False, "node2")
    out = execute.NodeOutcome("node1", 0, exit_code=1, cause=victim.cause())
    line = story.closing_line(verdict, out, "", addresses)
    assert "only secondary failures were seen" in line and "their errors name node2 (10.0.0.12)" in line
    assert "ValueError" not in line and GLOO_CLOSED not in line


def test_a_rank_killed_by_a_signal_is_its_own_failure_a_sigterm_is_a_stop():
    killed = worker_cause({"pid": 57, "signal": 9, "rank": 1, "local_rank": 0})
    assert (killed.kind, killed.rank, killed.signal) == (CauseKind.SIGNAL, 1, 9)
    assert killed.text() == "rank 1 (local rank 0) was killed by signal 9 (SIGKILL)"
    oom = worker_cause({"pid": 57, "signal": 9, "rank": 1, "local_rank": 0, "oom": True})
    assert oom.kind is CauseKind.OOM and oom.text() == "rank 1 (local rank 0) was killed by the OOM killer (SIGKILL)"
    assert worker_cause({"pid": 57, "signal": 15}).kind is CauseKind.STOPPED
    for bad in (None, [], {"pid": "57", "signal": 9}, {"pid": 57}, {"pid": 57, "exit": 0}):
        assert worker_cause(bad) is None
    # the killed rank printed nothing; its peers on the same node lost it: the signal is the node's cause
    node = reader(VICTIM.replace("[default0]", "[default1]").replace("(local_rank: 0)", "(local_rank: 1)"))
    assert node.cause({"pid": 57, "signal": 9, "rank": 0, "local_rank": 0}).kind is CauseKind.SIGNAL
    # ... but a worker record of a rank that said it lost its peer does not make it its own
    assert node.cause({"pid": 58, "exit": 1, "rank": 1, "local_rank": 1}).kind is CauseKind.PEER_LOST


def test_a_sigkill_hint_says_the_oom_killer_is_ruled_out_only_where_the_log_was_read(monkeypatch):
    """As root the supervisor reads the kernel log: a SIGKILL it finds no OOM kill of is said not
    to be the OOM killer's (a new user's pass: the hint said the log "may be closed" even to root).
    Where the log cannot be opened, the record says nothing and the hint stays open."""
    import ddpfab.node.agent as agent
    killed = worker_cause({"pid": 57, "signal": 9, "rank": 1, "local_rank": 0})
    read = {"failed_worker": {"pid": 57, "signal": 9, "rank": 1, "local_rank": 0, "oom": False}}
    assert execute.no_oom_seen(read, killed)
    assert story.signal_hint(killed, "node2", no_oom=True).startswith(
        "no OOM kill of it is in node2's kernel log, so not the kernel's OOM killer: SIGKILL then comes from a user-space")
    closed = {"failed_worker": {"pid": 57, "signal": 9, "rank": 1, "local_rank": 0}}
    other_rank = {"failed_worker": {**read["failed_worker"], "local_rank": 1}}
    not_killed = {"failed_worker": {**read["failed_worker"], "signal": 6}}
    bool_rank = {"failed_worker": {**read["failed_worker"], "local_rank": False}}
    for remote in (closed, other_rank, not_killed, bool_rank, None, "x", {"failed_worker": "x"},
                   {"failed_worker": {"oom": "false"}}):
        assert not execute.no_oom_seen(remote, killed), remote
    assert "may be closed to this user" in story.signal_hint(killed, "node2")
    real_open = os.open
    def no_kmsg(path, *a, **k):
        if path == "/dev/kmsg":
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, *a, **k)
    monkeypatch.setattr(agent.os, "open", no_kmsg)
    assert agent.oom_killed(57, "python3", time.time()) is None
    monkeypatch.undo()
    # a log that is no kernel log (a container's /dev/null) ends, and answers nothing
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        assert list(agent._kmsg_records(null)) == []
    finally:
        os.close(null)
    # in a PID namespace the log's pids are not ours: without its name nothing can be matched
    monkeypatch.setattr(agent, "in_init_pid_namespace", lambda: False)
    assert agent.oom_killed(57, None, time.time()) is None
    # an OOM kill of it shortly before the window (a slow exit after the kill) leaves it open
    now_us = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    log = [f"6,1,{now_us - 20_000_000},-;Out of memory: Killed process 57 (python3) total-vm:1kB"]
    monkeypatch.setattr(agent, "_kmsg_oom", lambda pid, comm, by_name, since: tuple(
        agent.oom_kill_in(log, pid, comm, s, by_name) for s in since))
    assert agent.oom_killed(57, "python3", time.time()) is None
    assert agent.oom_killed(57, "python3", time.time() - 18) is True
    assert agent.oom_killed(58, "other", time.time()) is False


def test_the_kernels_oom_record_is_matched_by_pid_or_by_name_and_time():
    records = ["6,10,5000000,-;Memory cgroup out of memory: Killed process 4242 (pt_main_thread) total-vm:1kB",
               "6,11,9000000,-;Out of memory: Killed process 77 (python3) total-vm:1kB"]
    assert oom_kill_in(records, 4242, None, 1_000_000, by_name=False)
    assert oom_kill_in(records, 12, "pt_main_thread", 1_000_000, by_name=True)  # in a PID namespace: the host's pid
    assert not oom_kill_in(records, 12, "pt_main_thread", 1_000_000, by_name=False)  # the kernel's pids are ours
    assert not oom_kill_in(records, 12, "pt_main_thread", 6_000_000, by_name=True)  # too old
    assert not oom_kill_in(records, 12, "other", 0, by_name=True) and not oom_kill_in(["garbage", "1,2;x"], 12, None, 0)


def test_a_usage_error_is_quoted_and_ddpfabs_own_options_are_pointed_out():
    cause = reader(USAGE).cause()
    assert cause.kind is CauseKind.USAGE
    assert cause.exception == "train.py: error: unrecognized arguments: --nproc-per-node 2"
    # torchrun was stopped before its report: the supervisor's record of the same rank gives its exit code
    recorded = reader(USAGE).cause({"pid": 5, "exit": 2, "rank": 3, "local_rank": 0})
    assert (recorded.kind, recorded.rank, recorded.exit_code) == (CauseKind.USAGE, 3, 2)
    hint = own_options_hint({"node1": execute.NodeOutcome("node1", 0, exit_code=1, cause=cause)})
    assert "--nproc-per-node" in hint and "before the script" in hint
    other = reader(USAGE.replace("--nproc-per-node 2", "--bogus")).cause()
    assert own_options_hint({"node1": execute.NodeOutcome("node1", 0, cause=other)}) == ""


def test_the_folded_note_names_only_what_was_folded():
    # a run that succeeded folds torchrun's notices, and no rank lost a peer: the note says so
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    r = CauseReader()
    for line in ("", "*" * 41, "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default",
                 "*" * 41, "[default0]:rank 0 up"):
        printer.line("node1", line, *r.feed(line))
    printer.folded_note()
    note = out.getvalue().splitlines()[-1]
    assert "lines folded (torchrun's reports, tracebacks and notices)" in note, note


def test_torchrun_s_own_traceback_folded_is_not_called_a_victim_s():
    """Every rank failed on its own (a usage error): the note said it folded "the tracebacks of
    ranks that lost their peer", of which there were none: torchrun's own was folded."""
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    r = CauseReader()
    for line in (USAGE + "\n" + VICTIM.split("\n", 7)[7]).splitlines():  # the rank's error, then torchrun's report
        printer.line("node1", line, *r.feed(line))
    printer.flush("node1")
    printer.folded_note()
    note = out.getvalue().splitlines()[-1]
    assert "folded (torchrun's reports, tracebacks and notices)" in note and "lost their peer" not in note, note


def test_the_printer_folds_victims_and_torchruns_reports_and_shows_noise_once():
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    for node, text in (("node1", VICTIM), ("node2", CULPRIT), ("node3", VICTIM), ("node3", CULPRIT.splitlines()[0])):
        r = CauseReader()
        for line in text.splitlines():
            printer.line(node, line, *r.feed(line))
        printer.flush(node)
    printer.folded_note()
    shown = out.getvalue().splitlines()
    assert sum("ValueError: bad batch shape" in ln for ln in shown) == 1
    assert not any("Connection closed" in ln or "ChildFailedError" in ln or "Root Cause" in ln for ln in shown)
    assert sum("[c10d] The hostname" in ln for ln in shown) == 1
    assert any("step 0 ok" in ln for ln in shown)
    assert "lines folded" in shown[-1] and "verbose=True shows them" in shown[-1]
    assert "torchrun's reports" in shown[-1] and "lost their peer" in shown[-1]
    assert len(shown) <= 10, shown
    # --verbose: every line, in order
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False, verbose=True)
    r = CauseReader()
    for line in VICTIM.splitlines():
        printer.line("node1", line, *r.feed(line))
    assert len(out.getvalue().splitlines()) == len(VICTIM.splitlines())


#: What python writes when torchrun's logger is interrupted by the stop signal while it reports its
#: worker's failure (logging.Handler.handleError, python 3.11; seen on the lab's CI).
LOGGING_ERROR = """\
--- Logging error ---
Traceback (most recent call last):
  File "/usr/lib/python3.11/logging/__init__.py", line 1113, in emit
    stream.write(msg + self.terminator)
  File "/v/torch/distributed/elastic/multiprocessing/api.py", line 82, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 59 got signal: 15
Call stack:
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/v/torch/distributed/elastic/multiprocessing/api.py", line 1002, in _poll
    logger.error(
Message: 'failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s'
Arguments: (1, 0, 59, '/v/bin/python')"""


def test_a_log_record_torchrun_could_not_write_is_folded_whole():
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    r = CauseReader()
    for line in [*LOGGING_ERROR.splitlines(), "[default0]:rank 0 after"]:
        printer.line("node1", line, *r.feed(line))
    printer.flush("node1")
    shown = out.getvalue().splitlines()
    assert len(shown) == 1 and "rank 0 after" in shown[0], shown  # the line after the report is shown
    assert printer.folded == len(LOGGING_ERROR.splitlines())
    assert r.cause() is None or r.cause().exception is None  # torchrun's words name no rank's cause
    # a report cut off (torchrun killed while writing it): what comes after it is read as ever
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    r = CauseReader()
    cut = LOGGING_ERROR.splitlines()[:9]  # up to "Call stack:" and one frame
    for line in [*cut, "ddpfab-agent: node supervisor ending the job", "[default0]:rank 0 after"]:
        printer.line("node1", line, *r.feed(line))
    printer.flush("node1")
    shown = out.getvalue().splitlines()
    assert [ln.split("| ", 1)[1] for ln in shown] == ["ddpfab-agent: node supervisor ending the job",
                                                      "rank 0 after"], shown
    assert printer.folded == len(cut)


def test_a_traceback_cut_off_by_the_end_of_the_stream_is_shown():
    out = io.StringIO()
    printer = execute.Printer(plan3(), stream=out, color=False)
    r = CauseReader()
    for line in CULPRIT.splitlines()[:4]:  # no exception line: the rank was killed while printing
        fold, local = r.feed(line)
        printer.line("node2", line, fold, local)
        if line.endswith("Traceback (most recent call last):"):
            assert fold is Fold.HOLD
    printer.flush("node2")
    assert "line 12, in <module>" in out.getvalue()


def test_torchruns_traceback_cut_off_by_ddpfabs_stop_is_folded_a_ranks_is_shown():
    """ddpfab stops a node (another node failed); its torchrun, killed while it printed the
    traceback of the stop signal, never wrote the SignalException line that folds it: the held
    lines were shown at the stream's end (16 lines of torchrun's frames under the closing story,
    seen in 1 of 11 runs). On a stopped node they are folded; on a node that was not stopped, and a
    rank's on any node, the cut-off traceback is shown (it may be the failure's only trace)."""
    launcher = ["Traceback (most recent call last):", '  File "<frozen runpy>", line 198, in _run_module_as_main',
                '  File "/v/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 374, in launch_agent']
    for stopped, shown in ((True, False), (False, True)):
        out = io.StringIO()
        printer = execute.Printer(plan3(), stream=out, color=False)
        r = CauseReader()
        for line in launcher + CULPRIT.splitlines()[:4]:
            printer.line("node2", line, *r.feed(line))
        printer.flush("node2", stopped=stopped)
        assert ("launch_agent" in out.getvalue()) is shown, out.getvalue()
        assert "line 12, in <module>" in out.getvalue()  # the rank's
        assert printer.folded == (0 if shown else len(launcher))


def test_the_story_lines():
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12"}
    victim = execute.NodeOutcome("node1", 0, exit_code=1, cause=reader(VICTIM).cause())
    assert story.live_line("node1", victim, addresses, settled=3.0) == (
        "node1 (node_rank 0) failed (exit code 1; rank 0 (local rank 0) lost its peer (its peer: node2); "
        "no rank failed on its own within 3 s); stopping the other nodes")
    culprit = execute.NodeOutcome("node2", 1, exit_code=1, cause=Cause(1, 0, 1, "ValueError: x", CauseKind.EXCEPTION))
    assert story.live_line("node2", culprit, addresses) == (
        "node2 (node_rank 1) failed (exit code 1; rank 1 (local rank 0): ValueError: x); stopping the other nodes")
    stopped = execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True)
    assert story.other_nodes({"node1": stopped, "node2": culprit}, "node2", addresses) == \
        ["  node1 (node_rank 0): stopped by ddpfab"]
    verdict = Blame("node2", culprit.cause, True, 1)
    assert story.closing_line(verdict, culprit, "", addresses) == (
        "failed: node2 (node_rank 1) exit code 1; rank 1 (local rank 0): ValueError: x; 1 other rank lost its peer; "
        "the others were stopped")
    many = {f"node{i}": execute.NodeOutcome(f"node{i}", i, exit_code=143, stopped_by_ddpfab=True) for i in range(40)}
    assert story.other_nodes(many, "node0", addresses) == ["  node[1-39] (39 nodes): stopped by ddpfab"]


def test_a_rank_that_ended_early_is_where_the_victims_point():
    """Rank 1 exits 0 before the all_reduce rank 0 waits in (a new user's pass, 2 of 2): the
    closing line counted the one victim named as "1 other rank lost its peer" and said "the others
    were stopped" of a node that had exited 0; it points there, and says what that node did."""
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12"}
    victim = execute.NodeOutcome("node1", 0, exit_code=1, causes=reader(VICTIM), cause=reader(VICTIM).cause())
    early = execute.NodeOutcome("node2", 1, exit_code=0)
    outcomes = {"node1": victim, "node2": early}
    verdict = execute.blame_outcomes(outcomes, addresses, "node1")
    assert (verdict.node, verdict.lost_peer, verdict.pointed) == ("node1", 0, "node2")
    # the node that ended early leads the line (the new-user pass after: a victim led it)
    assert story.closing_line(verdict, victim, "", addresses, outcomes) == (
        "failed: node2 (node_rank 1) exited 0 while the others still waited for it (10.0.0.12, named by their "
        "errors): look there for a rank that ends before the others; then node1 (node_rank 0) exit code 1: rank 0 "
        "(local rank 0) lost its peer (its peer: node2)")


def test_the_closing_line_says_which_others_exited_0_and_that_the_rest_were_stopped():
    """node2 failed on its own; node3 had already exited 0, node1 was stopped: the line said "the
    others were stopped" of both."""
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"}
    culprit = execute.NodeOutcome("node2", 1, exit_code=1, causes=reader(CULPRIT), cause=reader(CULPRIT).cause())
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True), "node2": culprit,
                "node3": execute.NodeOutcome("node3", 2, exit_code=0)}
    verdict = execute.blame_outcomes(outcomes, addresses, "node2")
    line = story.closing_line(verdict, culprit, "", addresses, outcomes)
    assert line.startswith("failed: node2 (node_rank 1) exit code 1; ") and \
        line.endswith("; node3 exited 0; the others were stopped"), line


def test_a_second_rank_that_failed_on_its_own_is_said_and_not_counted_as_stopped():
    """Rank 1 (node1) raised ValueError, rank 4 (node3) KeyError at about the same time, the rest
    lost their peer (a new user's pass, 3 x 2). The line named rank 1 and ended "the others were
    stopped": rank 4's own failure was in no closing word, and nobody had been stopped."""
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"}
    first = execute.NodeOutcome("node1", 0, exit_code=1, remote={"failed_at": 5.0},
                                cause=Cause(1, 1, 1, "ValueError: rank 1 got a bad value", CauseKind.EXCEPTION))
    second = execute.NodeOutcome("node3", 2, exit_code=1, remote={"failed_at": 5.1},
                                 cause=Cause(4, 0, 1, "KeyError: 'missing'", CauseKind.EXCEPTION))
    victim = execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.05}, causes=reader(VICTIM),
                                 cause=reader(VICTIM).cause())
    outcomes = {"node1": first, "node2": victim, "node3": second}
    verdict = execute.blame_outcomes(outcomes, addresses, "node1")
    line = story.closing_line(verdict, first, "", addresses, outcomes)
    assert line == ("failed: node1 (node_rank 0) exit code 1; rank 1 (local rank 1): ValueError: rank 1 got a bad "
                    "value; also on its own: node3 (node_rank 2) rank 4 (local rank 0): KeyError: 'missing'; "
                    "1 other rank lost its peer"), line
    # one node stopped by ddpfab beside them: named as such, not "the others"
    outcomes["node4"] = execute.NodeOutcome("node4", 3, exit_code=143, stopped_by_ddpfab=True)
    line = story.closing_line(verdict, first, "", addresses, outcomes)
    assert line.endswith("; 1 other rank lost its peer; node4 was stopped"), line


def test_torchrun_s_failed_exit_barrier_on_a_node_whose_job_ended_well_is_folded():
    """torchrun's exit barrier on the node whose rank had ended (exit 0) fails once the master's
    store is gone: a c10d warning, a C++ stack and a logged traceback (24 lines on the lab). The
    warning stays; the stack and the record are folded (the node's log keeps them)."""
    prefix = "E1207 02:31:29.111000 1077 torch/distributed/elastic/agent/server/api.py:1008]"
    lines = ["[W1207 02:31:29.898241648 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=4): "
             "Failed to recv, got 0 bytes. Connection was likely closed.",
             "Exception raised from recvBytes at /__w/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent "
             "call first):",
             "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f76 in /v/torch/lib/libc10.so)",
             "frame #1: <unknown function> + 0x674888d (0x7f76dd94888d in /v/torch/lib/libtorch_cpu.so)",
             "<omitting python frames>", "frame #34: _start + 0x21 (0x55eab8262081 in /v/bin/python)", "",
             f"{prefix} Error waiting on exit barrier. Elapsed: 0.1097 seconds",
             f"{prefix} Traceback (most recent call last):", f'{prefix}   File "/v/api.py", line 994, in _exit_barrier',
             f"{prefix}     store_util.barrier(", f"{prefix} torch.distributed.DistNetworkError: Failed to recv",
             "[default0]:rank 1 up"]
    reader_ = CauseReader()
    folds = [reader_.feed(line)[0] for line in lines]
    assert folds[0] is Fold.SHOW and folds[-1] is Fold.SHOW
    assert all(f is Fold.FOLD for f in folds[1:-1]), folds
    assert reader_.cause() is None


def _monitor_ends(outcomes: dict[str, execute.NodeOutcome], order: list[str],
                  hang: HangWatch | None = None) -> tuple[execute.RunResult, str]:
    """The run's monitor told of each node's end in *order* (as its events come), then its result."""
    plan = plan3()
    jobs = {n: types.SimpleNamespace(outcome=o, plan=plan) for n, o in outcomes.items()}
    stopped: list[float] = []
    out = io.StringIO()
    monitor = execute._Monitor(jobs, queue.SimpleQueue(), execute.Printer(plan, stream=out, color=False),
                               lambda fast=False, why=b"": stopped.append(1.0), lambda: stopped[0] if stopped else None,
                               hang=hang)
    for name in order:
        monitor.ended(name)
    return monitor.result(), out.getvalue()


def test_a_stop_from_elsewhere_is_a_stop_even_when_a_victim_reports_first():
    """``ddpfab stop`` reached node2 first: node1's rank lost its peer (its node failed, on its own
    clock) and reached the controller before the stopped nodes did. The stop's victims are the
    stop's: 143, no node blamed, no restart (a review found it blamed node1, exit 1)."""
    def outside(name: str, rank: int) -> execute.NodeOutcome:
        return execute.NodeOutcome(name, rank, exit_code=1, remote={"stop_signal": 15, "stopped": "signal 15"})
    victim = execute.NodeOutcome("node1", 0, exit_code=1, remote={"failed_at": 10.0}, causes=reader(VICTIM),
                                 cause=reader(VICTIM).cause())
    outcomes = {"node1": victim, "node2": outside("node2", 1), "node3": outside("node3", 2)}
    result, printed = _monitor_ends(outcomes, ["node1", "node2", "node3"])
    assert (result.exit_code, result.interrupted, result.first_failure) == (143, "SIGTERM", None), printed
    assert result.summary.startswith("stopped from outside on node2, node3 (SIGTERM to their supervisors"), result.summary


def test_a_stop_of_a_job_still_waiting_for_gpus_is_a_cancelled_stop_not_a_failure():
    """``ddpfab stop`` of a ``--wait`` job still in the queue: every supervisor records the cancel
    with its signal. The run ends as a stop (143, nothing blamed, no restart) that says the job
    never started (it ended "node1 (node_rank 0) failed (exit code 143)")."""
    def queued(name: str, rank: int) -> execute.NodeOutcome:
        return execute.NodeOutcome(name, rank, exit_code=143, remote={
            "cancelled": True, "failed_at": None, "stop_signal": 15,
            "stopped": "cancelled while waiting for GPUs (signal 15)"})
    outcomes = {f"node{i + 1}": queued(f"node{i + 1}", i) for i in range(3)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert (result.exit_code, result.interrupted, result.first_failure) == (143, "SIGTERM", None), printed
    assert result.summary == ("stopped from outside on node1, node2, node3 (SIGTERM to their supervisors: `ddpfab "
                              "stop`, or a kill); the job was cancelled while it waited for GPUs (it never started)"), \
        result.summary
    assert "failed" not in printed


def test_the_end_of_the_connection_holder_is_said_as_such_and_blames_no_node():
    """`ddpfab hold --stop` while a run followed its job over the holder's connections: every link
    ended without an exit status at once; the first to reach the monitor was blamed ("failed:
    node2 ... (killed?)"). It is the holder's end: exit 1, no node named, no restart."""
    gone = "its link went through the connection holder, which ended (`ddpfab hold --stop`, or it died)"
    outcomes = {f"node{i + 1}": execute.NodeOutcome(f"node{i + 1}", i, error=gone, holder_gone=True) for i in range(3)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert (result.exit_code, result.interrupted, result.first_failure) == (1, execute.HOLDER_GONE, None), printed
    assert result.summary.startswith("the connection holder ended while this run followed the job"), result.summary
    assert "failed" not in printed + result.summary


def test_a_rank_s_own_failure_before_a_stop_from_elsewhere_is_still_named():
    """A rank of node2 failed on its own; a ``ddpfab stop`` came just after, and the nodes it
    stopped reached the controller first. The rank that failed is named, whatever the order (a
    review found it hidden behind "stopped from outside", exit 143)."""
    culprit = execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0, "stop_signal": None},
                                  causes=reader(CULPRIT), cause=reader(CULPRIT).cause())
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=1, remote={"stop_signal": 15}),
                "node2": culprit, "node3": execute.NodeOutcome("node3", 2, exit_code=1, remote={"stop_signal": 15})}
    for order in (["node1", "node3", "node2"], ["node2", "node1", "node3"]):
        result, printed = _monitor_ends(outcomes, order)
        assert (result.exit_code, result.interrupted, result.first_failure) == (1, None, "node2"), (order, printed)
        assert result.summary.startswith("failed: node2 (node_rank 1) exit code 1; ") and \
            "ValueError: bad batch shape (3, 4)" in result.summary, result.summary


def test_attach_tells_the_same_story_as_run():
    """attach follows a detached job's output: the same classifier, the same closing line."""
    from ddpfab.launch import jobs

    readers = {"node1": reader(VICTIM), "node2": reader(CULPRIT),
               "node3": reader(VICTIM.replace("rank      : 0 (local_rank", "rank      : 2 (local_rank"))}
    plan = plan3()
    outcomes = jobs.ended_outcomes(plan, {}, {"node1": 1, "node2": 1, "node3": 1}, readers)
    closing, others, said = jobs.attach_story(plan, outcomes)
    assert closing.startswith("failed: node2 (node_rank 1) exit code 1; rank 1 (local rank 0): ValueError: bad batch")
    assert said == []  # (an exception: no hint)
    assert closing.endswith("2 other ranks lost their peer")  # (no record says anyone was stopped)
    assert others == ["  node1 (node_rank 0): rank 0 (local rank 0) lost its peer (its peer: node2)",
                      "  node3 (node_rank 2): rank 2 (local rank 0) lost its peer (its peer: node2)"]
    assert jobs.attach_end({"node1": 1, "node2": 1, "node3": 1}, {}, None, closing) == (1, closing, False)
    # and run's hints: a rank killed by SIGKILL (a new user's pass: attach gave none)
    worker = {"pid": 57, "signal": 9, "rank": 1, "local_rank": 0, "oom": False}
    outcomes["node2"] = execute.NodeOutcome("node2", 1, exit_code=137, remote={"failed_at": 5.0, "failed_worker": worker},
                                            cause=worker_cause(worker))
    closing, _, said = jobs.attach_story(plan, outcomes)
    assert "rank 1 (local rank 0) was killed by signal 9 (SIGKILL)" in closing, closing
    assert len(said) == 1 and said[0].startswith("no OOM kill of it is in node2's kernel log"), said


def test_attach_names_the_known_signatures_as_run_does():
    """A detached job's output showed CUDA's out-of-memory error: attach's closing line ends with
    run's "seen:" part and its hint (a review found attach without them)."""
    from ddpfab.launch import jobs

    oom = """\
[default0]:[rank1]: Traceback (most recent call last):
[default0]:[rank1]:   File "/w/train.py", line 40, in <module>
[default0]:[rank1]:     loss = model(batch)
[default0]:[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
capacity of 79.15 GiB of which 1.06 GiB is free."""
    readers = {"node1": reader(VICTIM), "node2": reader(oom),
               "node3": reader(VICTIM.replace("rank      : 0 (local_rank", "rank      : 2 (local_rank"))}
    plan = plan3()
    outcomes = jobs.ended_outcomes(plan, {}, {"node1": 1, "node2": 1, "node3": 1}, readers)
    closing, _, said = jobs.attach_story(plan, outcomes)
    assert closing.startswith("failed: node2 (node_rank 1) exit code 1; rank 1 (local rank 0): torch.OutOfMemoryError"), \
        closing
    assert closing.endswith("; seen: CUDA out of memory on node2"), closing
    assert len(said) == 1 and said[0].startswith("seen on node2: CUDA out of memory. "), said
    assert [s.key for s in outcomes["node2"].signatures] == ["cuda_oom"] and not outcomes["node1"].signatures


def test_a_node_that_says_nothing_of_its_cause_outranks_a_known_victim():
    victim = reader(VICTIM)
    nodes = [NodeFailure("node1", 0, 100.0, victim.cause(), victim.rank_kinds(), victim.peers()),
             NodeFailure("node2", 1, 100.5, None)]
    verdict = blame(nodes, {"node1": "10.0.0.11", "node2": "10.0.0.12"})
    assert (verdict.node, verdict.own, verdict.lost_peer) == ("node2", False, 1)


def _ring_victim(rank: int, peer: str) -> CauseReader:
    """Rank *rank*'s node: its rank lost its peer at address *peer* (gloo's ring: a neighbour)."""
    return reader(VICTIM.replace("[rank0]", f"[rank{rank}]").replace("[10.0.0.12]", f"[{peer}]"))


def _ring(culprit: int, culprit_outcome: execute.NodeOutcome, n: int = 24):
    """*n* nodes, one rank each, in gloo's ring; rank *culprit* left it: its neighbours name it,
    and each victim's other neighbour names that victim, as the failure spreads (the victims'
    supervisors' failed_at in that order: the culprit's neighbours first)."""
    addresses = {f"node{i + 1}": f"10.0.1.{i + 1}" for i in range(n)}
    outcomes = {}
    for rank in range(n):
        name = f"node{rank + 1}"
        if rank == culprit:
            outcomes[name] = culprit_outcome
            continue
        distance = min((rank - culprit) % n, (culprit - rank) % n)
        toward = (rank + 1) % n if (culprit - rank) % n == distance else (rank - 1) % n
        victim = _ring_victim(rank, f"10.0.1.{toward + 1}")
        outcomes[name] = execute.NodeOutcome(name, rank, exit_code=1, causes=victim, cause=victim.cause(),
                                             remote={"failed_at": 100.0 + distance})
    return addresses, outcomes


def test_a_rank_that_left_a_24_node_ring_early_is_where_the_victims_point():
    """Rank 9 leaves the group and exits 0 while the others wait in all_reduce; every other rank
    loses a peer, each naming a neighbour (a new user's pass at 24 nodes): the line pointed at
    node1, the first node any victim named, not at node10, the only one named that lost no peer."""
    early = execute.NodeOutcome("node10", 9, exit_code=0)
    addresses, outcomes = _ring(9, early)
    verdict = execute.blame_outcomes(outcomes, addresses, "node9")
    assert verdict.pointed == "node10" and verdict.lost_peer == 22, verdict
    line = story.closing_line(verdict, outcomes[verdict.node], "", addresses, outcomes)
    assert line.startswith("failed: node10 (node_rank 9) exited 0 while the others still waited for it "
                           "(10.0.1.10, named by their errors)"), line


def test_a_rank_that_crashed_in_a_finally_of_a_ring_is_where_the_victims_point():
    """Rank 17 raised, but waits in a ``finally`` (its traceback not printed yet) when ddpfab stops
    it: its node says nothing of its own; the victims point at it, not at node1."""
    quiet = execute.NodeOutcome("node18", 17, exit_code=143, stopped_by_ddpfab=True)
    addresses, outcomes = _ring(17, quiet)
    verdict = execute.blame_outcomes(outcomes, addresses, "node17")
    assert verdict.pointed == "node18", verdict


def test_when_every_named_node_is_a_victim_the_first_victim_in_time_points():
    """Every node named lost a peer itself: the node the first victim in time names."""
    victim_at = {"node1": ("10.0.1.3", 105.0), "node2": ("10.0.1.3", 101.0), "node3": ("10.0.1.1", 102.0)}
    addresses = {f"node{i}": f"10.0.1.{i}" for i in (1, 2, 3)}
    outcomes = {}
    for i, (name, (peer, at)) in enumerate(victim_at.items()):
        victim = _ring_victim(i, peer)
        outcomes[name] = execute.NodeOutcome(name, i, exit_code=1, causes=victim, cause=victim.cause(),
                                             remote={"failed_at": at})
    assert execute.blame_outcomes(outcomes, addresses, "node2").pointed == "node3"


def test_the_victims_of_a_24_node_ring_are_one_line():
    """Each victim names its own neighbour: grouped by their stories with the peer in them, 24
    nodes made 23 lines (a new user's pass); they are one, counted."""
    addresses, outcomes = _ring(9, execute.NodeOutcome("node10", 9, exit_code=0))
    verdict = execute.blame_outcomes(outcomes, addresses, "node9")
    lines = story.other_nodes(outcomes, verdict.node, addresses)
    assert lines == ["  node[1-8,11-24] (22 nodes): a rank lost its peer", "  node10: exited 0"], lines


def _reported_hang(at: float) -> HangWatch:
    """A hang watch (``--on-hang report``) that found node2's rank 1 outside any collective at *at*."""
    watch = HangWatch(plan3(), {}, Path("/nonexistent"), lambda line: None)
    lines = ["node2 rank 1 (local rank 0, pid 556) is outside any collective, in main (job.py:20)",
             "the other 2 ranks wait for it in all_reduce (job.py:25)"]
    watch.reported = (at, doctor.Verdict(lines, True, [{"what": "site", "node": "node2", "text": lines[0]}]))
    return watch


def test_a_job_that_fails_after_a_reported_hang_fails_of_the_hang():
    """With --hang-timeout and the default --on-hang report, the watch named node2's rank 1; gloo's
    timeout then ended the other ranks, node2 stopped: the closing line blamed a victim ("only
    secondary failures were seen", a new user's pass). It starts with the hang."""
    # the victims' tracebacks came after the report (their last lines), their own output before it;
    # node2's other rank, a victim too, printed its traceback late (several ranks per node)
    victims = {n: execute.NodeOutcome(n, r, exit_code=1, remote={"failed_at": 60.0 + r}, causes=reader(VICTIM),
                                      cause=reader(VICTIM).cause(), last_rank_line=70.0, last_progress=5.0)
               for n, r in (("node1", 0), ("node3", 2))}
    hung = execute.NodeOutcome("node2", 1, exit_code=143, stopped_by_ddpfab=True, last_rank_line=71.0,
                               last_progress=5.0)
    outcomes = {"node1": victims["node1"], "node2": hung, "node3": victims["node3"]}
    result, _ = _monitor_ends(outcomes, ["node1", "node3", "node2"], hang=_reported_hang(30.0))
    assert result.summary.startswith("failed after a hang: node2 rank 1 (local rank 0, pid 556) is outside any "
                                     "collective, in main (job.py:20); the other 2 ranks wait for it in all_reduce "
                                     "(job.py:25); then node1 (node_rank 0) exit code 1; "), result.summary
    assert result.exit_code == 1
    # a rank printed its own output after the report: the job moved on, the story is the failure's own
    outcomes["node3"] = execute.NodeOutcome("node3", 2, exit_code=1, remote={"failed_at": 62.0}, causes=reader(VICTIM),
                                            cause=reader(VICTIM).cause(), last_rank_line=70.0, last_progress=40.0)
    result, _ = _monitor_ends(outcomes, ["node1", "node3", "node2"], hang=_reported_hang(30.0))
    assert result.summary.startswith("failed: node1 (node_rank 0) exit code 1; only secondary"), result.summary



def test_a_later_look_that_finds_no_hang_clears_the_reported_one(monkeypatch):
    watch = _reported_hang(30.0)
    assert watch.standing(0.0) is not None
    calm = doctor.Verdict(["no rank stands out: all 3 ranks are in all_reduce (job.py:25)"], False)
    monkeypatch.setattr(doctor, "diagnose", lambda plan, call, run_dir: (calm, None))
    watch._diagnose(40.0)
    assert watch.reported is None and watch.standing(0.0) is None


def test_every_rank_failing_the_same_way_is_said_once_not_as_a_stop():
    """The guide's `train.py --epochs 3` with a script that takes no --epochs: every rank's usage
    error, on every node. The closing line said "the others were stopped"; they failed the same way."""
    addresses = {f"node{i}": f"10.0.0.1{i}" for i in (1, 2, 3, 4)}
    outcomes = {}
    for i, name in enumerate(addresses):
        usage = reader(USAGE.replace("[default0]", "[default0]"))
        outcomes[name] = execute.NodeOutcome(name, i, exit_code=1, remote={"failed_at": 10.0 + i},
                                             causes=usage, cause=usage.cause({"pid": 5, "exit": 2, "rank": i,
                                                                              "local_rank": 0}))
    verdict = execute.blame_outcomes(outcomes, addresses, "node1")
    line = story.closing_line(verdict, outcomes["node1"], "", addresses, outcomes)
    assert line.startswith("failed: node1 (node_rank 0) exit code 1; ") and \
        line.endswith("; node2, node3, node4 failed the same way"), line


def test_a_sigkill_without_an_oom_record_says_what_sends_one():
    """A rank killed by SIGKILL, no OOM kill recorded: the closing line said only "was killed by
    signal 9 (SIGKILL)" (a new user's pass); a hint says what sends it, and where to look."""
    killed = CauseReader().cause({"pid": 5, "signal": 9, "rank": 1, "local_rank": 0})
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True),
                "node2": execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0}, cause=killed),
                "node3": execute.NodeOutcome("node3", 2, exit_code=143, stopped_by_ddpfab=True)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert "was killed by signal 9 (SIGKILL)" in result.summary, result.summary
    assert "ddpfab: hint: SIGKILL comes from the kernel's OOM killer" in printed and "node2's kernel log" in printed
    oom = CauseReader().cause({"pid": 5, "signal": 9, "oom": True, "rank": 1, "local_rank": 0})
    outcomes["node2"] = execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0}, cause=oom)
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert "by the OOM killer" in result.summary and "hint: SIGKILL" not in printed, printed


def test_a_sigterm_from_outside_the_run_is_the_ranks_own_failure_with_where_it_came_from():
    """`kill <rank's pid>` (or of torchrun, which passes it on): the supervisor saw that worker end
    first, by SIGTERM, before any failure or stop. The line said "only secondary failures were
    seen: rank 3 ... was killed by signal 15 (SIGTERM)" (a new user's pass). A SIGTERM torchrun
    or ddpfab sent stays a stop."""
    record = {"pid": 5, "signal": 15, "rank": 3, "local_rank": 1, "outside": True}
    # torchrun's log confirms it: the first failure it observed is that rank's SIGTERM
    outside = reader(FAILED_LOG.format(code=-15, local=1)).cause(record)
    assert outside is not None and outside.own and outside.kind is CauseKind.SIGNAL
    assert reader("W1207 14:21:13.742000 98 /v/torch/distributed/elastic/agent/server/api.py:753] Received 15 death "
                  "signal, shutting down workers").cause(record).own  # ... or torchrun got it itself
    assert not CauseReader().cause({k: v for k, v in record.items() if k != "outside"}).own
    # unconfirmed (a rendezvous gone ends workers so; the first failure torchrun saw was another
    # rank's, unseen by the supervisor): a stop, as any SIGTERM
    assert not CauseReader().cause(record).own
    assert not reader(FAILED_LOG.format(code=-9, local=0)).cause(record).own
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True),
                "node2": execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0}, cause=outside),
                "node3": execute.NodeOutcome("node3", 2, exit_code=143, stopped_by_ddpfab=True)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert result.summary.startswith("failed: node2 (node_rank 1) exit code 1; rank 3 (local rank 1) was killed by "
                                     "signal 15 (SIGTERM)"), result.summary
    assert "hint: neither ddpfab nor torchrun sent the first SIGTERM on node2" in printed, printed


def test_torchrun_killed_by_sigkill_is_said_with_what_sends_one():
    """`kill -9` of node2's torchrun: no rank's cause; the line said only "exit code 137" (a new
    user's pass). The supervisor's record of torchrun's signal is the cause, with the SIGKILL hint."""
    remote = {"failed_at": 5.0, "launcher": {"pid": 812, "signal": 9}}
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True),
                "node2": execute.NodeOutcome("node2", 1, exit_code=137, remote=remote),
                "node3": execute.NodeOutcome("node3", 2, exit_code=143, stopped_by_ddpfab=True)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert result.summary == ("failed: node2 (node_rank 1) exit code 137; torchrun (pid 812) was killed by signal 9 "
                              "(SIGKILL); its ranks were ended with it; the others were stopped"), result.summary
    assert "hint: SIGKILL comes from the kernel's OOM killer" in printed, printed
    assert execute.launcher_text({"pid": "812", "signal": 9}) == ""  # records are data: a pid is an int


def victims_but_one_rank_of_node2(failed_at: dict[str, float]) -> dict[str, execute.NodeOutcome]:
    """3 x 2 nodes whose ranks all lost their peer (to node2), but node2's local rank 1, which
    said nothing; each node's supervisor saw its failure at *failed_at*."""
    outcomes = {}
    for rank, (name, at) in enumerate(failed_at.items()):
        r = CauseReader()
        for local in ((0, 1) if name != "node2" else (0,)):
            for line in VICTIM.splitlines()[:7]:
                r.feed(line.replace("[default0]", f"[default{local}]"))
        outcomes[name] = execute.NodeOutcome(name, rank, exit_code=1, causes=r, cause=r.cause(),
                                             remote={"failed_at": at})
    return outcomes


def test_torchrun_s_word_of_a_stop_signal_nobody_in_the_run_sent_is_the_cause():
    """`kill` (SIGTERM) of torchrun whose ranks end before its supervisor looks at them: nothing
    but torchrun's log says why ("Received 15 death signal"); the line said only "exit code 1"
    (seen in a lab test). Where its supervisor stopped nothing, that signal came from outside."""
    r = reader("W1207 14:21:13.742000 98 /v/torch/distributed/elastic/agent/server/api.py:753] Received 15 death "
               "signal, shutting down workers")
    assert r.death_signal == 15 and r.cause() is None  # (its supervisor's stop: no cause of its own)
    assert reader("W1207 14:21:13.742000 98 /v/torch/distributed/elastic/agent/server/api.py:7] Received "
                  "Signals.SIGTERM death signal, shutting down workers").death_signal == 15
    # the same words a rank printed (tagged), or inside another line, are no word of torchrun's
    assert reader("[default0]:W1207 14:21:13.742000 98 /v/torch/distributed/elastic/agent/server/api.py:7] Received "
                  "15 death signal").death_signal is None
    assert reader("  x W1207 14:21:13.742000 98 torch/distributed/elastic/agent/server/api.py:7] Received 15 "
                  "death signal").death_signal is None
    # the supervisor stopped nothing, or saw a rank end by SIGTERM before any stop: torchrun's, from outside
    assert r.cause({"pid": 5, "signal": 15, "local_rank": 0, "outside": True}).text() == r.cause(unstopped=True).text()
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True),
                "node2": execute.NodeOutcome("node2", 1, exit_code=1, causes=r, remote={"failed_at": 5.0,
                                                                                        "stopped": None},
                                             cause=r.cause(unstopped=True)),
                "node3": execute.NodeOutcome("node3", 2, exit_code=143, stopped_by_ddpfab=True)}
    result, printed = _monitor_ends(outcomes, ["node2", "node1", "node3"])
    assert result.summary == ("failed: node2 (node_rank 1) exit code 1; torchrun got signal 15 (SIGTERM) from outside "
                              "the run and ended its ranks; the others were stopped"), result.summary
    assert "hint: neither ddpfab nor torchrun sent the first SIGTERM on node2" in printed, printed


def test_where_the_victims_point_a_node_not_all_victim_leads_the_line():
    """3 x 2: rank 3 (node2's local rank 1) closed its connections and was to fail later; its
    sibling lost its peer, so torchrun ended rank 3 (SIGTERM) before it said why. Every printed
    error is a victim's; node3 ended first and led the line (a new user's pass). node2, where
    their errors point and not all of whose ranks lost their peer, leads, and is the run's first
    failure."""
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"}
    outcomes = victims_but_one_rank_of_node2({"node1": 5.2, "node2": 5.3, "node3": 5.0})
    verdict = execute.blame_outcomes(outcomes, addresses, "node3", {n: 2 for n in addresses})
    assert (verdict.node, verdict.pointed, verdict.pointed_alone) == ("node3", "node2", True), verdict
    line = story.closing_line(verdict, outcomes["node3"], "", addresses, outcomes)
    assert line.startswith("failed: node2 (node_rank 1) exit code 1, where the others' errors point (10.0.0.12): not "
                           "all its ranks lost their peer, and none said why it failed: look there first; first to "
                           "end: node3 (node_rank 2) exit code 1: local rank 0 lost its peer (its peer: node2)"), line
    jobs = {n: types.SimpleNamespace(outcome=o, plan=plan3()) for n, o in outcomes.items()}
    monitor = execute._Monitor(jobs, queue.SimpleQueue(), execute.Printer(plan3(), stream=io.StringIO(), color=False),
                               lambda fast=False, why=b"": None, lambda: None)
    monitor.nprocs = {n: 2 for n in addresses}
    for name in ("node3", "node1", "node2"):
        monitor.ended(name)
    assert monitor.result().first_failure == "node2"
    # a node stopped by ddpfab (a hang it was stopped for) does not lead: nothing of it failed first
    outcomes["node2"].stopped_by_ddpfab, outcomes["node2"].remote = True, {}
    verdict = execute.blame_outcomes(outcomes, addresses, "node3", {n: 2 for n in addresses})
    assert story.leading(verdict, {n: o for n, o in outcomes.items() if n != verdict.node}) is None


def test_a_rank_that_exited_0_early_on_a_victims_node_is_named():
    """3 x 2: rank 3 (node2's local rank 1) exited 0 while the others waited for it; rank 2, its
    sibling, lost its peer. The line read "only secondary failures were seen: rank 2 ... lost its
    peer" and rank 3 was in no word (a new user's pass). Its supervisor's record names it."""
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"}
    outcomes = victims_but_one_rank_of_node2({"node1": 5.2, "node2": 5.0, "node3": 5.3})
    outcomes["node2"].remote = {"failed_at": 5.0, "ended_0": [{"rank": 3, "local_rank": 1}]}
    verdict = execute.blame_outcomes(outcomes, addresses, "node2", {n: 2 for n in addresses})
    line = story.closing_line(verdict, outcomes["node2"], "", addresses, outcomes)
    assert line.startswith("failed: node2 (node_rank 1) exit code 1; rank 3 (local rank 1) exited 0 while the others "
                           "still waited: look there for a rank that ends before the others; then local rank 0 lost "
                           "its peer (its peer: node2)"), line
    # another node ended first: node2 still leads, with its rank that left
    outcomes["node2"].remote["failed_at"] = 5.5
    verdict = execute.blame_outcomes(outcomes, addresses, "node1", {n: 2 for n in addresses})
    line = story.closing_line(verdict, outcomes[verdict.node], "", addresses, outcomes)
    assert line.startswith("failed: node2 (node_rank 1) exit code 1, where the others' errors point (10.0.0.12): rank 3 "
                           "(local rank 1) exited 0 while the others still waited"), line
    assert story.ended_0_text(execute.NodeOutcome("x", 0, remote={"ended_0": [{"rank": "3"}, 7]})) is None


def test_many_other_own_failures_are_counted_beyond_a_few_and_mutual_pointing_leads_nobody():
    """A review: 128 nodes failing on their own with CUDA OOM messages that differ (free memory)
    would all be listed in one closing line; beyond a few they are counted. And two nodes whose
    victims each name the other (a link between them) say nothing of which failed first: the
    pointed one does not lead."""
    addresses = {f"node{i}": f"10.0.0.{i}" for i in range(1, 9)}
    outcomes = {n: execute.NodeOutcome(n, i, exit_code=1, remote={"failed_at": 5.0 + i},
                                       cause=Cause(i, 0, 1, f"OutOfMemoryError: {i} MiB free", CauseKind.EXCEPTION))
                for i, n in enumerate(addresses)}
    verdict = execute.blame_outcomes(outcomes, addresses, "node1")
    line = story.closing_line(verdict, outcomes["node1"], "", addresses, outcomes)
    assert line.count("OutOfMemoryError") == 1 + story.ALSO_SHOWN and line.endswith("and 4 more nodes"), line
    pair = {}
    for name, peer, at in (("node1", "10.0.0.12", 5.0), ("node2", "10.0.0.11", 5.1)):
        r = reader("\n".join(VICTIM.splitlines()[:7]).replace("10.0.0.12", peer))
        pair[name] = execute.NodeOutcome(name, int(name[-1]) - 1, exit_code=1, causes=r, cause=r.cause(),
                                         remote={"failed_at": at})
    pair_addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12"}
    verdict = execute.blame_outcomes(pair, pair_addresses, "node1", {"node1": 2, "node2": 2})
    assert (verdict.node, verdict.pointed, verdict.pointed_alone) == ("node1", "node2", False), verdict


def test_connect_errors_same_errors_and_victims_stopped_are_told_as_such():
    """A second new-user pass: a rank that could not reach a stopped peer at its rendezvous read as
    its own failure; the same SyntaxError split into two stories when one node's output carried
    torchrun's exit code; a node whose rank lost its peer was also called stopped."""
    assert kind_of_exception(CONNECT.format(local=0).split(":", 1)[1]) is CauseKind.PEER_LOST
    syntax = "SyntaxError: expected ':' (badmod.py, line 2)"
    with_code, without = (Cause(0, 0, code, syntax, CauseKind.EXCEPTION) for code in (1, None))
    assert with_code.same_failure(without)
    assert not with_code.same_failure(Cause(0, 0, 2, syntax, CauseKind.EXCEPTION))
    addresses = {"node1": "10.0.0.11", "node2": "10.0.0.12", "node3": "10.0.0.13"}
    culprit = execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0}, cause=reader(CULPRIT).cause())
    victim = execute.NodeOutcome("node1", 0, exit_code=143, stopped_by_ddpfab=True, causes=reader(VICTIM),
                                 cause=reader(VICTIM).cause())
    outcomes = {"node1": victim, "node2": culprit,
                "node3": execute.NodeOutcome("node3", 2, exit_code=143, stopped_by_ddpfab=True)}
    verdict = execute.blame_outcomes(outcomes, addresses, "node2")
    line = story.closing_line(verdict, culprit, "", addresses, outcomes)
    assert line.endswith("1 other rank lost its peer; node3 was stopped"), line


FAILED_LOG = ("E1207 14:05:49.378000 60 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {code}) "
              "local_rank: {local} (pid: 66) of binary: /v/bin/python3")
CONNECT = ("[default{local}]:RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/third_party/gloo/gloo/transport/"
           "tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[10.0.0.11]:36257$3")


def restarted(first: list[str], code: int, local: int) -> CauseReader:
    """A node's output with ``--max-restarts 1``: *first* (the first attempt's rank lines), torchrun's
    log of that failure, the second attempt's ranks failing to connect, torchrun's log of that."""
    r = reader("\n".join(first))
    r.feed(FAILED_LOG.format(code=code, local=local))
    for rank_local in (0, 1):
        for line in ("Traceback (most recent call last):", '  File "/w/crash.py", line 25, in <module>',
                     "    dist.init_process_group('gloo')"):
            r.feed(f"[default{rank_local}]:{line}")
        r.feed(CONNECT.format(local=rank_local))
    r.feed(FAILED_LOG.format(code=1, local=1))
    return r


def test_after_torchrun_restarted_the_first_failure_stays_the_nodes_cause():
    """--max-restarts 1, rank 3 (local rank 1) killed by SIGKILL: torchrun restarted the node's
    ranks, whose rendezvous then failed (the peers elsewhere were gone). The line named a restarted
    rank's "Gloo connectFullMesh failed" and the SIGKILL was nowhere (a new user's pass)."""
    r = restarted(["[default1]:rank 3 step 0 ok"], -9, 1)
    cause = r.cause()
    assert r.restarted and cause is not None and cause.own, cause
    assert (cause.local_rank, cause.kind, cause.signal) == (1, CauseKind.SIGNAL, 9), cause
    # a node whose first attempt only lost its peer stays a victim, whatever its restart said
    victim = restarted(VICTIM.splitlines()[:7], 1, 0).cause()
    assert victim is not None and victim.kind is CauseKind.PEER_LOST, victim
    # without a restart, nothing changes: the rank's own error
    once = reader(CULPRIT)
    once.feed(FAILED_LOG.format(code=1, local=0))
    assert not once.restarted and once.cause().exception == "ValueError: bad batch shape (3, 4)"


def test_the_culprit_s_node_with_a_victim_rank_beside_it_is_still_where_they_point():
    """Two ranks per node: rank 9 (node5's local rank 1) left the group early; its sibling, local
    rank 0, lost its peer like every rank elsewhere. node5 is not a victim as a whole: the victims
    point at it (a review found the first tier missed it, any victim rank making a node a victim)."""
    addresses = {f"node{i + 1}": f"10.0.1.{i + 1}" for i in range(8)}
    outcomes = {}
    for i, name in enumerate(addresses):
        ranks = [0, 1] if name != "node5" else [0]  # node5's rank 9 exited 0: it said nothing
        r = CauseReader()
        for local in ranks:
            peer = "10.0.1.5" if i in (3, 5) else f"10.0.1.{(i + 1) % 8 + 1}"
            for line in VICTIM.splitlines()[:7]:
                r.feed(line.replace("[default0]", f"[default{local}]").replace("[rank0]", f"[rank{2 * i + local}]")
                       .replace("[10.0.0.12]", f"[{peer}]"))
        outcomes[name] = execute.NodeOutcome(name, i, exit_code=1, causes=r, cause=r.cause(),
                                             remote={"failed_at": 100.0 + abs(i - 4)})
    verdict = execute.blame_outcomes(outcomes, addresses, "node4", {n: 2 for n in addresses})
    assert verdict.pointed == "node5", verdict
    # counted as a victim like the others (one rank per node assumed), node5 lost its place: the
    # answer then rests on the victims' clocks
    assert execute.blame_outcomes(outcomes, addresses, "node4").pointed != "node5"
