"""The pure parts of recovery: who runs the next attempt, what a script learns, how failures read."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab.cli import recover as recover_cli
from ddpfab.hosts.inventory import InventoryError, Node
from ddpfab.launch import recover
from ddpfab.launch.runner import RunError
from ddpfab.planning.plan import PlanError, RunOptions
from ddpfab.problems import Problem


def nodes(*names: str) -> tuple[Node, ...]:
    return tuple(Node(name=n, host=n) for n in names)


def names(ns) -> list[str]:
    return [n.name for n in ns]


def test_a_lost_node_is_replaced_by_the_first_healthy_spare():
    nxt = recover.next_nodes(nodes("a", "b", "c"), {"b"}, nodes("s1", "s2"), excluded={"s1"}, min_nodes=None)
    assert names(nxt.nodes) == ["a", "c", "s2"]
    assert nxt.replaced == {"b": "s2"} and nxt.dropped == ()


def test_a_lost_master_leaves_the_first_survivor_first():
    nxt = recover.next_nodes(nodes("m", "b"), {"m"}, nodes("s"), excluded=set(), min_nodes=None)
    assert names(nxt.nodes) == ["b", "s"]  # choose_master: the first node, b


def test_without_a_spare_the_lost_node_is_named():
    with pytest.raises(recover.NoRecovery, match=r"lost b; 0 healthy spares left, no min_nodes"):
        recover.next_nodes(nodes("a", "b"), {"b"}, (), excluded=set(), min_nodes=None)


def test_min_nodes_shrinks_but_not_below():
    nxt = recover.next_nodes(nodes("a", "b", "c"), {"c"}, (), excluded=set(), min_nodes=2)
    assert names(nxt.nodes) == ["a", "b"] and nxt.dropped == ("c",)
    with pytest.raises(recover.NoRecovery, match="below min_nodes=3"):
        recover.next_nodes(nodes("a", "b", "c"), {"c"}, (), excluded=set(), min_nodes=3)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), n_spares=st.integers(0, 4), data=st.data())
def test_next_nodes_invariants(n, n_spares, data):
    current = nodes(*[f"n{i}" for i in range(n)])
    spares = nodes(*[f"s{i}" for i in range(n_spares)])
    failed = set(data.draw(st.lists(st.sampled_from(names(current)), min_size=1, unique=True)))
    excluded = set(data.draw(st.lists(st.sampled_from(names(spares)), unique=True))) if spares else set()
    min_nodes = data.draw(st.one_of(st.none(), st.integers(1, n)))
    try:
        nxt = recover.next_nodes(current, failed, spares, excluded, min_nodes)
    except recover.NoRecovery as exc:
        healthy = [s for s in names(spares) if s not in excluded]
        assert len(healthy) < len(failed)  # only when spares run out ...
        assert min_nodes is None or n - len(failed) + len(healthy) < min_nodes  # ... and no shrink is allowed
        assert "lost " in str(exc)
        return
    got = names(nxt.nodes)
    assert not failed & set(got) and not excluded & set(got), "a failed or excluded node came back"
    assert len(set(got)) == len(got)
    survivors = [x for x in names(current) if x not in failed]
    assert got[:len(survivors)] == survivors, "survivors keep their order"
    assert set(nxt.replaced) | set(nxt.dropped) == failed
    assert len(got) == n - len(nxt.dropped)
    assert min_nodes is None and not nxt.dropped or len(got) >= (min_nodes or 0)


def test_each_attempt_has_its_id_and_the_lineage_in_the_env():
    opts = RunOptions(script="t.py", run_id="R", env=(("A", "1"),))
    lineage = ("R", "R-r1", "R-r2")
    o2 = recover.attempt_options(opts, 2, lineage)
    assert o2.run_id == "R-r2"
    env = dict(o2.env)
    assert env["A"] == "1" and env["DDPFAB_RESTART_COUNT"] == "2"
    assert env["DDPFAB_ROOT_RUN_ID"] == "R" and env["DDPFAB_RUN_LINEAGE"] == "R,R-r1,R-r2"
    assert recover.attempt_options(opts, 0, ("R",)).run_id == "R"
    # a user's own value of these keys cannot contradict the attempt
    again = recover.attempt_options(RunOptions(script="t.py", run_id="R", env=(("DDPFAB_RESTART_COUNT", "9"),)),
                                    1, ("R", "R-r1"))
    assert [v for k, v in again.env if k == "DDPFAB_RESTART_COUNT"] == ["1"]


def test_problems_name_their_hosts_as_data():
    """A RunError's problems blame the nodes they are about (a sync failure included); a line of
    text blames no one, whatever host it mentions: no text is searched."""
    err = RunError([Problem("node3", "ssh", text="host node3: unreachable, no answer within 5 s"),
                    Problem("node4", "sync", text="sync: host node4: rsync failed"),
                    "host node9: not in this attempt", "preflight checks failed (details: ...)"])
    assert recover.problem_hosts(err.problems, {"node3", "node4", "node1", "node9"}) == {"node3", "node4"}
    assert str(err.problems[1]) == "sync: host node4: rsync failed" and err.problems[1].about("node4", "sync")


def test_a_problem_is_about_its_own_node_never_a_name_it_contains():
    """node1's problems are not node10's: the node travels as data, no text is searched."""
    problems = [Problem("node10", "script", text="host node10: script t.py not found in /w; sync the code first"),
                Problem(None, "mesh", text="mesh: 2 nodes unreachable: node1, node10"),
                Problem("node1", "ssh", text="host node1: unreachable")]
    assert recover.problem_hosts(problems, {"node1", "node10"}) == {"node1", "node10"}
    assert [p.node for p in problems] == ["node10", None, "node1"]
    assert not problems[0].about("node1") and problems[0].about("node10", "script")


def test_the_script_error_is_the_blamed_ranks_own_cause(tmp_path):
    """Recovery reads the one classifier's verdict (the run's blamed node and its cause), not the
    logs again: a victim's "connection closed" is never the script's error."""
    from ddpfab.launch.cause import Cause, CauseKind
    from ddpfab.launch.execute import NodeOutcome, RunResult

    outcomes = {"node1": NodeOutcome("node1", 0, exit_code=1, cause=Cause(0, 0, 1, "RuntimeError: Connection closed "
                                                                           "by peer", CauseKind.PEER_LOST)),
                "node2": NodeOutcome("node2", 1, exit_code=1, cause=Cause(1, 0, 1, "ValueError: boom",
                                                                          CauseKind.EXCEPTION))}
    result = RunResult(1, outcomes, first_failure="node2")
    failure = recover.classify(result, (), tmp_path, None, None)
    assert (failure.kind, failure.nodes) == ("script", ("node2",))
    assert failure.error == "rank 1 (local rank 0), exit code 1: ValueError: boom"
    outcomes["node2"].cause = None
    assert recover.classify(result, (), tmp_path, None, None).error == "exit code 1"


def _args(**kw) -> argparse.Namespace:
    base = {"max_job_restarts": 0, "spares": None, "retry_on": None, "min_nodes": None}
    return argparse.Namespace(**{**base, **kw})


def test_options_from_the_command_line_and_the_inventory():
    from ddpfab.hosts.inventory import Inventory

    cl = Inventory("inv.yml", "all", (Node("a", "a", spares_group="standby"), Node("b", "b", spares_group="standby")))
    o = recover_cli.recovery_options(_args(max_job_restarts=2), cl)
    assert o.spares_group == "standby" and o.retry_on == frozenset({"node"})
    assert recover_cli.recovery_options(_args(spares="other"), cl).spares_group == "other"
    assert recover_cli.recovery_options(_args(retry_on=["script"]), cl).retry_on == frozenset({"script"})
    with pytest.raises(PlanError, match="max_job_restarts must be >= 0"):
        recover_cli.recovery_options(_args(max_job_restarts=-1), cl)
    mixed = Inventory("inv.yml", "all", (Node("a", "a", spares_group="x"), Node("b", "b", spares_group="y")))
    with pytest.raises(PlanError, match="disagree on ddpfab_spares_group"):
        recover_cli.recovery_options(_args(), mixed)


INVENTORY = """
all:
  hosts:
    n1: {ansible_host: 10.0.0.1}
    n2: {ansible_host: 10.0.0.2}
    s1: {ansible_host: 10.0.0.3}
  vars:
    ddpfab_spares_group: standby
  children:
    standby:
      hosts:
        s1:
"""


def test_spares_are_never_in_the_first_set(tmp_path: Path):
    from ddpfab.hosts import inventory

    path = tmp_path / "inv.yml"
    path.write_text(INVENTORY)
    cluster = inventory.load(path, "all")
    assert {n.spares_group for n in cluster.nodes} == {"standby"}
    active, spares = recover.split_spares(cluster, "standby")
    assert names(active.nodes) == ["n1", "n2"] and names(spares) == ["s1"]
    with pytest.raises(InventoryError, match="every host of group 'standby' is a spare|is the group of the nodes"):
        recover.split_spares(inventory.load(path, "standby"), "standby")
    with pytest.raises(InventoryError, match="no group 'nope'"):
        recover.split_spares(cluster, "nope")


def test_attempt_records_are_plain_data():
    a = recover.Attempt("R-r1", 1, ["a", "s"], 1.0, replaced={"b": "s"}, recovery_s=2.5)
    d = a.to_dict()
    assert d["replaced"] == {"b": "s"} and d["recovery_s"] == 2.5 and d["ranks"] == {}


def test_a_restart_whose_run_id_is_on_a_node_already_blames_no_node(tmp_path: Path):
    """Restart 1 runs as R-r1; a node that has R-r1's dir already (an earlier run of the same
    --run-id whose first attempt's records were pruned) fails the probe with a ``run_id`` problem:
    that is the run's naming, not a fault of the node, so it is neither left out nor replaced by a
    spare (it was: the spare then met the same refusal); the restart fails naming the dir."""
    def prepare(cluster, options):
        assert options.run_id == "R-r1"
        raise RunError([Problem("a", "run_id", expected="no ~/.ddpfab/runs/R-r1 there", found="exists",
                                text="host a: ~/.ddpfab/runs/R-r1 exists there: this run id was used on this "
                                     "node already; pick another --run-id (or leave it out)")])

    rec = recover.Recovery(recover.Inventory("inv.yml", "all", nodes("a", "b")), nodes("s1"), RunOptions(script="t.py", run_id="R"),
                           recover.RecoveryOptions(max_job_restarts=2, spares_group="standby"), None, None,
                           str(tmp_path), prepare, None)
    attempt = recover.Attempt("R-r1", 1, [], 0.0)
    with pytest.raises(RunError, match="R-r1 exists there"):
        rec._prepare(attempt, nodes("a", "b"), 1, ("R", "R-r1"))
    assert attempt.skipped == {} and rec.excluded == set()
