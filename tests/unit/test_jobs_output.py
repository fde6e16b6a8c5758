"""`stop`, `logs` and `ps` answer many nodes in a line per distinct answer (jobs.grouped)."""

from __future__ import annotations

from ddpfab.launch.jobs import FOLD_ABOVE, grouped, node_state_text, run_state


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
