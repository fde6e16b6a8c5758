"""The data-plane probe's pure parts: which pairs are probed, how failures are explained and
grouped. Faults are simulated on the probe graph (no hosts): a node whose firewall drops members,
a node on the wrong subnet, OUTPUT rules, a one-way pair rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab import hostlist
from ddpfab.health import mesh
from ddpfab.health.check import CheckOptions, CheckResult, evaluate, grouped_lines
from ddpfab.hosts.inventory import Inventory, Node


def names(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def simulate(plan: mesh.MeshPlan, drop_in=(), drop_out=(), isolated=(), pairs=()) -> dict[str, list[dict]]:
    """The results the probe would report under these faults (isolated = no route: unreachable)."""
    out: dict[str, list[dict]] = {}
    for src in plan.nodes:
        out[src] = []
        for t in plan.targets_of(src):
            if src in isolated or t in isolated:
                r = "No route to host"
            elif t in drop_in or src in drop_out or (src, t) in pairs:
                r = "timed out"
            else:
                r = "ok"
            out[src].append({"target": t, "kind": "ephemeral", "result": r})
    return out


def test_small_clusters_are_probed_exhaustively_large_ones_sampled_with_equal_degrees():
    small = mesh.plan_targets(names(32))
    assert small.exhaustive and small.pairs == 32 * 31 and small.coverage == 1.0
    big = mesh.plan_targets(names(128), seed=7)
    assert not big.exhaustive and big.pairs == 128 * mesh.DEFAULT_DEGREE
    indegree = {n: 0 for n in big.nodes}
    for src in big.nodes:
        targets = big.targets_of(src)
        assert len(set(targets)) == mesh.DEFAULT_DEGREE and src not in targets
        for t in targets:
            indegree[t] += 1
    assert set(indegree.values()) == {mesh.DEFAULT_DEGREE}
    assert abs(big.coverage - mesh.DEFAULT_DEGREE / 127) < 1e-9
    assert mesh.plan_targets(names(128), exhaustive=True).pairs == 128 * 127
    # fresh offsets each check (different pairs over repeated checks), reproducible from the seed
    assert mesh.plan_targets(names(128), seed=7).offsets == big.offsets
    assert mesh.plan_targets(names(128), seed=8).offsets != big.offsets


def test_deadline_grows_with_the_work():
    assert mesh.deadline_for(127) > mesh.deadline_for(17) > mesh.deadline_for(16) == mesh.deadline_for(1)
    assert mesh.deadline_for(16, concurrency=16) == mesh.DEADLINE_BASE_S + sum(mesh.ATTEMPT_TIMEOUTS_S)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(3, 200), bad=st.integers(0, 199), fault=st.sampled_from(["in", "out", "isolated"]),
       seed=st.integers(0, 1000))
def test_a_node_wide_fault_is_blamed_on_exactly_that_node_at_any_size(n, bad, fault, seed):
    plan = mesh.plan_targets(names(n), seed=seed)
    node = plan.nodes[bad % n]
    results = simulate(plan, drop_in={node} if fault == "in" else (), drop_out={node} if fault == "out" else (),
                       isolated={node} if fault == "isolated" else ())
    problems = mesh.classify(plan.nodes, results)
    kind = {"in": "no-inbound", "out": "no-outbound", "isolated": "isolated"}[fault]
    assert [(p.kind, p.nodes) for p in problems] == [(kind, [node])]


def test_three_firewalled_nodes_of_64_are_one_problem():
    plan = mesh.plan_targets(names(64), exhaustive=True)
    bad = ["node7", "node9", "node12"]
    problems = mesh.classify(plan.nodes, simulate(plan, drop_in=set(bad)))
    assert len(problems) == 1
    p = problems[0]
    assert p.kind == "no-inbound" and p.nodes == bad
    assert p.summary == "unreachable from 63 peers (timed out)" and "firewall" in p.fix


def test_one_way_pair_rule_is_reported_as_pairs_not_as_a_node():
    plan = mesh.plan_targets(names(8))
    problems = mesh.classify(plan.nodes, simulate(plan, pairs={("node2", "node5")}))
    assert [(p.kind, p.nodes) for p in problems] == [("pairs", ["node5"])]
    assert "node2->node5 (timed out)" in problems[0].summary


def test_two_nodes_one_way_blames_the_node_that_does_not_accept():
    plan = mesh.plan_targets(names(2))
    problems = mesh.classify(plan.nodes, simulate(plan, drop_in={"node1"}))
    assert [(p.kind, p.nodes) for p in problems] == [("no-inbound", ["node1"])]


def test_master_port_from_every_node():
    results = {f"node{i}": [{"target": "node1", "kind": "master", "result": "ok" if i != 3 else "refused"}]
               for i in range(2, 6)}
    p = mesh.master_port_problem("node1", 29500, names(5), results)
    assert p.nodes == ["node1"] and "from 1 of 4 nodes (refused): node3" in p.summary
    assert mesh.master_port_problem("node1", 29500, names(5), {"node2": [
        {"target": "node1", "kind": "master", "result": "ok"}]}) is None


def test_compact_names():
    assert hostlist.compact(["node7", "node9", "node12"]) == "node7, node9, node12"
    assert hostlist.compact(names(40) + ["node42", "gpu-a"]) == "node[1-40,42], gpu-a (42 nodes)"
    # a few that fold are folded, a few that do not are listed
    eight = [f"node{i}" for i in (11, 12, 13, 14, 15, 16, 17, 19)]
    assert hostlist.compact(eight) == "node[11-17,19] (8 nodes)"
    assert hostlist.compact(["gpu-a", "gpu-b", "cpu", "edge"]) == "gpu-a, gpu-b, cpu, edge"
    assert hostlist.compact(["node1", "node2"]) == "node1, node2"


def test_grouped_output_for_64_failing_nodes_is_a_few_lines():
    cluster = Inventory("inv.yml", "all", tuple(Node(n, f"10.0.0.{i}") for i, n in enumerate(names(64), 1)))
    plan = mesh.plan_targets(names(64))
    results = simulate(plan, drop_in={"node7", "node9", "node12"})
    for src, probes in results.items():  # the master port is open to every other node
        if src != "node1":
            probes.append({"target": "node1", "kind": "master", "result": "ok"})
    m = {"ports": {n: {"ephemeral": 40000} for n in names(64)}, "results": results}
    m["ports"]["node1"]["master"] = 29500
    fact = {"hostname": "h", "python": "3.11.7", "torch": True, "torch_version": "2.13.0+cpu", "launcher": True,
            "hostname_addr": "10.0.0.9", "routes": {"x": "eth0"}}
    facts = {n: dict(fact, torch_version="2.12.0" if n in ("node3", "node4") else "2.13.0+cpu") for n in names(64)}
    res = evaluate(cluster, "node1", facts, {}, m, CheckOptions(full=False), {n: 1 for n in names(64)})
    lines = grouped_lines(res)
    assert lines == [  # the odd nodes of a mismatch fail, one line per distinct value (sampled plan: 16 peers)
        "torch: 2 nodes: expected the same torch on every node (most have 2.13.0+cpu), found torch 2.12.0: "
        "node3, node4; fix: install one pinned torch everywhere (ddpfab provision)",
        "mesh: 3 nodes unreachable from 16 peers (timed out): node7, node9, node12; likely their firewall: "
        "connects to them are dropped (a firewall DROP rule); " + mesh.FIREWALL_FIX,
    ]
    assert {r.node for r in res if r.status == "fail" and r.check == "mesh"} == {"node7", "node9", "node12"}
    assert CheckResult("a", "x", "fail", found="y").line() == grouped_lines([CheckResult("a", "x", "fail", found="y")])[0]


def test_a_waiting_run_names_its_nodes_by_state():
    from ddpfab.launch.execute import NodeOutcome, waiting_report

    outs = {f"node{i}": NodeOutcome(f"node{i}", i - 1) for i in range(1, 41)}
    for i in range(1, 31):  # torchrun spoke, no rank yet
        outs[f"node{i}"].lines = 2
    outs["node31"].lines, outs["node31"].rank_lines, outs["node31"].last_line = 5, 3, 100.0
    outs["node32"].ended, outs["node32"].exit_code = 5.0, 0
    text = waiting_report(outs, now=190.0, quiet_s=90)
    assert text == ("waiting: no rank has printed for 90 s; in rendezvous (no rank has printed yet): "
                    "node[1-30] (30 nodes); quiet: node31; silent since start: node[33-40] (8 nodes)")
    assert outs["node31"].to_dict()["last_state"].startswith("quiet for")
    assert outs["node32"].to_dict()["last_state"] == "ended"
