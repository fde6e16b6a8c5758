"""`stop`, `logs` and `ps` answer many nodes in a line per distinct answer (jobs.grouped), and so
does every command's error (cli.errors.folded); how `ps`, `attach` and `logs` end (the run's
state, attach's exit code, logs' report)."""

from __future__ import annotations

import pytest

from ddpfab.launch.cause import Cause, CauseKind
from ddpfab.launch.execute import stop_signal_of
from ddpfab.launch.hangwatch import EXIT_HUNG
from ddpfab.cli.errors import die, folded
from ddpfab.hostlist import FOLD_ABOVE
from ddpfab.problems import Problem
from ddpfab.launch.jobs import (attach_end, grouped, line_count, list_runs, logs_report, node_state_text,
                                ps_record, run_state)


def test_up_to_the_limit_every_node_keeps_its_line_in_order():
    answers = {f"node{i}": "stopped" for i in range(1, FOLD_ABOVE + 1)}
    assert grouped(answers) == [f"node{i}: stopped" for i in range(1, FOLD_ABOVE + 1)]


def test_beyond_the_limit_identical_answers_share_one_line_naming_their_nodes():
    answers = {f"node{i}": ("absent" if i in (7, 90) else "stopped") for i in range(1, 129)}
    assert grouped(answers) == ["node[1-6,8-89,91-128] (126 nodes): stopped", "node7, node90: absent"]


def test_a_distinct_answer_is_never_merged_into_another():
    answers = {f"n{i}": f"exit {i % 3}" for i in range(1, 41)}
    lines = grouped(answers)
    assert len(lines) == 3
    assert sorted(line.rsplit(": ", 1)[1] for line in lines) == ["exit 0", "exit 1", "exit 2"]


def test_ps_shows_a_stopped_job_as_stopped_and_a_failure_as_exited():
    """The run's state from its nodes' (``ddpfab ps``): after ``ddpfab stop`` it said exited, each
    node ``exited(143)``."""
    stopped = {"node1": {"state": "stopped", "exit_code": 143}, "node2": {"state": "stopped", "exit_code": 137}}
    assert run_state(stopped) == "stopped"
    assert [node_state_text(s) for s in stopped.values()] == ["stopped", "stopped"]
    # a node whose job ended by itself (0) before the stop: still a stopped run
    assert run_state({**stopped, "node3": {"state": "exited", "exit_code": 0}}) == "stopped"
    # a node that failed on its own, the others stopped by ddpfab for it: a failure
    failed = {**stopped, "node3": {"state": "exited", "exit_code": 3}}
    assert run_state(failed) == "exited" and node_state_text(failed["node3"]) == "exited(3)"
    assert run_state({**stopped, "node3": {"state": "running", "exit_code": None}}) == "running"
    assert run_state({"n": {"state": "cancelled", "exit_code": 143}}) == "cancelled"


def test_attach_ends_as_run_would_have():
    """attach's exit code and closing line (run's policy, ddpfab/cli/errors.py): a hang stop is
    124 whatever the stopped nodes exited with (it was 137: the node's code after the stop)."""
    assert attach_end({"node1": 137, "node2": 143}, {}, ["node2 rank 3 (pid 9) is stopped (SIGSTOP, state T)"]) == (
        EXIT_HUNG, "hung: node2 rank 3 (pid 9) is stopped (SIGSTOP, state T); the job was stopped on every node "
                   "(on_hang='stop')", False)
    assert attach_end({"node1": 0, "node2": 3}, {}) == (3, "failed on node2 (exit code 3)", False)
    assert attach_end({"node1": 0, "node2": 0}, {}) == (0, "all nodes exited 0", False)
    code, line, warned = attach_end({"node1": 0, "node2": 134}, {"node2": {"aborted": [{"rank": 3, "signal": 6}]}})
    assert (code, warned) == (0, True) and "rank 3 (node2) aborted at exit (signal 6)" in line
    # `ddpfab stop` from elsewhere: a stop (128 + its signal), no node named as failed; a failure of
    # a rank's own that came first still tells the story
    assert attach_end({"node1": 1, "node2": 1}, {}, outside={"node1": 15, "node2": 15}) == (
        143, "stopped from outside on node1, node2 (SIGTERM to their supervisors: `ddpfab stop`, or a kill); the "
             "job was stopped on every node", False)
    assert attach_end({"node1": 1, "node2": 1}, {}, None, "rank 1 ... failed", {"node1": 15})[:2] == (1, "rank 1 ... failed")
    # a Ctrl-C in the terminal of a node started by hand (plan --emit) is no `ddpfab stop`
    assert attach_end({"node1": 1, "node2": 130}, {}, outside={"node2": 2})[:2] == (
        130, "stopped from outside on node2 (SIGINT to its supervisor: Ctrl-C in its terminal, or a kill); the job "
             "was stopped on every node")


def test_a_stop_signal_counts_only_before_a_failure_of_the_node_s_own():
    """The supervisor's ``stop_signal`` (data, not its reason's words) makes a node stopped from
    outside, unless its job failed on its own first or it exited 0."""
    own = Cause(None, 1, 1, "RuntimeError: boom", CauseKind.EXCEPTION)
    assert stop_signal_of(1, {"stop_signal": 15, "stopped": "signal 15"}, None) == 15
    assert stop_signal_of(1, {"stop_signal": 15, "failed_at": 12.0}, None) is None
    assert stop_signal_of(1, {"stop_signal": 15}, own) is None
    assert stop_signal_of(0, {"stop_signal": 15}, None) is None
    assert stop_signal_of(1, {"stopped": "signal 15"}, None) is None  # words are not data
    assert stop_signal_of(1, {"stop_signal": "15"}, None) is None
    assert stop_signal_of(143, None, None) is None


def test_logs_says_where_each_node_s_output_went_and_how_many_lines(tmp_path):
    dest = tmp_path / "runs" / "r1"
    fetched = {"node1": (dest / "node1.remote.log", 42, ""), "node2": (dest / "node2.remote.log", 1, "")}
    assert logs_report("r1", dest, fetched, 3) == [
        f"node1: {dest}/node1.remote.log (42 lines)", f"node2: {dest}/node2.remote.log (1 line)",
        f"logs of run r1: 2 of 3 nodes' output in {dest}; 1 could not be fetched (above)"]
    assert logs_report("r1", dest, {}, 1) == []  # the errors alone say it
    many = {f"n{i}": (dest / f"n{i}.remote.log", 10, "") for i in range(FOLD_ABOVE + 1)}
    assert logs_report("r1", dest, many, len(many))[0] == (f"{len(many)} nodes' output in {dest}/<node>.remote.log "
                                                           f"({10 * len(many)} lines in all)")
    assert [line_count(t) for t in ("", "a\n", "a\nb", "a\nb\n")] == [0, 1, 2, 2]


def test_a_follow_that_breaks_under_the_hang_watch_is_raised_not_read_as_success():
    from ddpfab.launch.jobs import _watched

    class Watch:
        stop_now, verdict = None, None

    def broken():
        raise OSError("channel closed")

    with pytest.raises(OSError, match="channel closed"):
        _watched(broken, Watch(), [0.0], lambda: None, None)


def test_a_tmux_launch_is_a_run_of_its_own_kind_in_ps():
    rec = {"run_id": "t1", "state": "running", "exit_code": None, "started": 5.0, "tmux": True}
    assert ps_record(rec)["tmux"] is True
    assert "tmux" not in ps_record({**rec, "tmux": "yes"})  # records are data: only a true True
    (row,) = list_runs({"node1": (9.0, [ps_record(rec)]), "node2": (9.0, [ps_record(rec)])}, lambda run_id: {})
    assert (row["state"], row["tmux"], row["age_s"]) == ("running", True, 4.0)


def test_an_error_many_nodes_share_is_one_line_and_the_odd_node_keeps_its_own():
    def workdir(i: int, where: str = "/w") -> Problem:
        return Problem(f"node{i}", "workdir", text=f"host node{i}: workdir {where} does not exist there; create it")

    few = [workdir(i) for i in range(1, FOLD_ABOVE + 1)]
    assert folded(few) == few  # up to the limit, every node its own line
    many = [workdir(i) for i in range(1, 33) if i != 7] + [workdir(7, "/other"), "nothing was started"]
    assert [str(x) for x in folded(many)] == [
        "host node[1-6,8-32] (31 nodes): workdir /w does not exist there; create it",
        "host node7: workdir /other does not exist there; create it",
        "nothing was started"]
    assert die(many) == 2
    twice = [workdir(i) for i in range(1, FOLD_ABOVE + 2)] + [workdir(1)]  # a node said twice counts once
    assert [str(x) for x in folded(twice)] == [
        f"host node[1-{FOLD_ABOVE + 1}] ({FOLD_ABOVE + 1} nodes): workdir /w does not exist there; create it"]


def test_the_folded_error_is_what_stderr_gets(capsys):
    die([Problem(f"n{i}", "ssh", text=f"host n{i}: unreachable") for i in range(FOLD_ABOVE + 1)])
    assert capsys.readouterr().err == f"ddpfab: error: host n[0-{FOLD_ABOVE}] ({FOLD_ABOVE + 1} nodes): unreachable\n"
