"""`stop`, `logs` and `ps` answer many nodes in a line per distinct answer (jobs.grouped)."""

from __future__ import annotations

from ddpfab.launch.jobs import FOLD_ABOVE, grouped


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
