"""The preflight's data plane as the backends use it, without hosts: the node's bulk transfer
(real sockets on this machine), which pairs carry one, how stalled transfers and unreachable
advertised addresses are explained and named, and the default interface choice."""

from __future__ import annotations

import socket

import pytest

from ddpfab.health import mesh
from ddpfab.health.check import CheckOptions, evaluate, grouped_lines
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.node import ops as program
from ddpfab.planning.plan import Facts, PlanError, RunOptions, make_plan, socket_ifname_for, socket_ifname_warnings


def names(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def cluster(n: int, **env) -> Inventory:
    return Inventory("inv.yml", "all", tuple(Node(name, f"10.0.0.{i}", data_addr=f"10.0.0.{i}", env=dict(env)) for i, name in enumerate(names(n), 1)))


def black_hole(nodes: list[str], master: str, bad: str) -> dict[str, list[dict]]:
    """What the probes report when *bad*'s port drops full-size frames: its connects pass, every
    bulk transfer into or out of it stalls."""
    out: dict[str, list[dict]] = {n: [] for n in nodes}
    for src, t in mesh.bulk_pairs(nodes, master):
        out[src].append({"target": t, "kind": "bulk", "result": "stalled" if bad in (src, t) else "ok"})
    for src in nodes:
        out[src] += [{"target": t, "kind": "ephemeral", "result": "ok"} for t in nodes if t != src]
    return out


def test_a_bulk_transfer_is_ok_only_when_the_listener_counts_every_byte():
    session: dict = {}
    ports = program.op_mesh_listen({}, session)
    deaf = socket.socket()  # accepts (the kernel does) but never reads nor answers: what a lost segment looks like
    deaf.bind(("127.0.0.1", 0))
    deaf.listen(1)
    try:
        got = program.op_mesh_connect({"targets": [
            {"target": "me", "kind": "bulk", "addr": "127.0.0.1", "port": ports["ephemeral"],
             "bytes": mesh.BULK_BYTES, "timeout": 5.0},
            {"target": "deaf", "kind": "bulk", "addr": "127.0.0.1", "port": deaf.getsockname()[1],
             "bytes": mesh.BULK_BYTES, "timeout": 1.0},
            {"target": "me", "kind": "ephemeral", "addr": "127.0.0.1", "port": ports["ephemeral"]}],
            "attempts": [1.0], "concurrency": 3, "deadline": 10}, session)["probes"]
    finally:
        deaf.close()
    assert [p["result"] for p in got] == ["ok", "stalled", "ok"]
    assert got[0]["sent"] == mesh.BULK_BYTES
    lo, hi = ports["ephemeral_range"]
    assert lo <= ports["ephemeral"] <= hi  # the backends' range, as gloo's own listeners


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_every_node_sends_and_receives_a_bulk_transfer_and_the_master_gets_one_from_each(n):
    nodes = names(n)
    pairs = mesh.bulk_pairs(nodes, "node1")
    assert {s for s, _ in pairs} == set(nodes) and {t for _, t in pairs} == set(nodes)
    assert {s for s, t in pairs if t == "node1"} == set(nodes) - {"node1"}
    assert len(pairs) == len(set(pairs)) <= 2 * n  # O(N): bounded growth


@pytest.mark.parametrize("n", [3, 4, 8, 64])
def test_a_black_holed_node_is_named_and_only_it_master_or_not(n):
    nodes = names(n)
    for bad in (nodes[0], nodes[1], nodes[-1]):
        problems = mesh.classify_bulk(nodes, black_hole(nodes, nodes[0], bad), {bad: 9000})
        assert [p.nodes for p in problems] == [[bad]], bad
        assert "interface MTU 9000" in problems[0].summary and "small packets pass" in problems[0].summary
        assert mesh.classify(nodes, black_hole(nodes, nodes[0], bad)) == []  # connects pass: no firewall blamed


def test_a_failed_connect_is_not_a_path_mtu_problem_and_a_lone_stalled_pair_is_reported():
    nodes = names(4)
    probes = black_hole(nodes, "node1", "none")
    probes["node2"][0]["result"] = "timed out"  # a firewall: the connect probes explain it
    assert mesh.classify_bulk(nodes, probes) == []
    probes["node2"][0]["result"] = "stalled"  # node2 -> node3 alone: no node is to blame, the pair is named
    (problem,) = mesh.classify_bulk(nodes, probes)
    assert problem.kind == "bulk-pairs" and "node2->node3" in problem.summary


def node_facts(n: int, **extra) -> dict[str, dict]:
    return {name: {"hostname": name, "python": "3.11.2", "torch": True, "torch_version": "2.3.0", "launcher": True,
                   "hostname_addr": f"10.0.0.{i}", "routes": {p: "eth0" for p in names(n) if p != name},
                   "mtus": {"eth0": 9000}, **extra.get(name, {})}
            for i, name in enumerate(names(n), 1)}


def mesh_of(probes: dict[str, list[dict]], nodes: list[str]) -> dict:
    return {"ports": {n: {"ephemeral": 40000} for n in nodes}, "results": probes, "errors": {}}


def test_check_names_the_black_holed_node_with_its_mtu_and_the_fix_and_passes_the_others():
    c = cluster(4)
    nodes = names(4)
    results = evaluate(c, "node1", node_facts(4), {}, mesh_of(black_hole(nodes, "node1", "node3"), nodes),
                       CheckOptions(full=False), {n: 1 for n in nodes})
    bulk = {r.node: r for r in results if r.check == "bulk"}
    assert {n for n, r in bulk.items() if r.status == "fail"} == {"node3"}
    assert all(bulk[n].status == "pass" for n in ("node1", "node2", "node4"))
    (line,) = grouped_lines(results)
    assert line.startswith("host node3: bulk:") and "interface MTU 9000 on node3" in line
    assert "same MTU on every node" in line


def test_an_advertised_address_no_peer_reaches_is_named_with_its_interface_and_the_fix():
    c = cluster(4)
    nodes = names(4)
    probes = black_hole(nodes, "node1", "none")
    for src in nodes:
        if src != "node2":
            probes[src].append({"target": "node2", "kind": "advertised", "result": "Network is unreachable"})
    facts = node_facts(4, node2={"hostname_addr": "10.99.0.2", "hostname_iface": "side0"})
    results = evaluate(c, "node1", facts, {}, mesh_of(probes, nodes), CheckOptions(full=False), {n: 1 for n in nodes})
    assert {(r.node, r.check) for r in results if r.status == "fail"} == {("node2", "advertised")}
    (line,) = grouped_lines(results)
    assert "resolves to 10.99.0.2 (interface side0), which 3 of 3 peers cannot reach" in line
    assert "socket_ifname='auto'" in line and "10.0.0.2" in line


def test_an_advertised_address_every_peer_reaches_passes():
    nodes = names(3)
    probes = black_hole(nodes, "node1", "none")
    probes["node1"].append({"target": "node2", "kind": "advertised", "result": "ok"})
    assert mesh.classify_advertised(nodes, probes, {}) == []


# -- the interface choice ------------------------------------------------------------------
def probed(c: Inventory, ifnames: dict[str, str | None]) -> Facts:
    return Facts(addresses={n.name: n.host for n in c.nodes}, master_port=29500, cwd="/w",
                 homes={n.name: "/root" for n in c.nodes}, ifnames=ifnames)


def test_the_interface_is_chosen_by_default_and_shown_in_the_plan():
    c = cluster(2)
    plan = make_plan(c, RunOptions("train.py"), probed(c, {"node1": "eth0", "node2": "ens5"}))
    assert [(n.env.get("GLOO_SOCKET_IFNAME"), n.env.get("NCCL_SOCKET_IFNAME")) for n in plan.nodes] == [
        ("eth0", "eth0"), ("ens5", "ens5")]


@pytest.mark.parametrize("options,env,want", [
    (RunOptions("t.py", socket_ifname="none"), {}, None),
    (RunOptions("t.py", socket_ifname="off"), {}, None),
    (RunOptions("t.py", env=(("NCCL_SOCKET_IFNAME", "ib0"),)), {}, None),  # the user's choice stands
    (RunOptions("t.py"), {"GLOO_SOCKET_IFNAME": "bond0"}, None),  # the inventory's too
    (RunOptions("t.py", socket_ifname="ens9"), {}, "ens9"),
])
def test_the_default_steps_aside_for_the_users_choice(options, env, want):
    c = cluster(2, **env)
    assert socket_ifname_for(c.nodes[0], options, probed(c, {"node1": "eth0", "node2": "eth0"})) == (want, None)


def test_a_node_without_one_interface_warns_by_default_and_refuses_only_when_auto_was_asked():
    c = cluster(2)
    facts = probed(c, {"node1": "eth0", "node2": None})
    plan = make_plan(c, RunOptions("t.py"), facts)
    assert "GLOO_SOCKET_IFNAME" not in plan.nodes[1].env and plan.nodes[0].env["GLOO_SOCKET_IFNAME"] == "eth0"
    (warning,) = socket_ifname_warnings(c, RunOptions("t.py"), facts)
    assert warning.startswith("host node2: no single interface reaches all its peers")
    with pytest.raises(PlanError, match="host node2: socket_ifname='auto'"):
        make_plan(c, RunOptions("t.py", socket_ifname="auto"), facts)
    offline = probed(c, {})  # nothing probed: nothing to choose from, nothing to warn about
    assert socket_ifname_warnings(c, RunOptions("t.py"), offline) == []
