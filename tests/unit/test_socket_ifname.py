"""``--socket-ifname IFACE`` checked against each node's interfaces when the plan is made: a node
that lacks one, has it down or without an address is refused before anything starts, named with
what it has and the fix; the forms the backends read differently are refused or checked as they
match them; an offline plan (no facts) is not checked. And the facts it is checked against: the
node's own list of interfaces, validated on the controller."""

from __future__ import annotations

import pytest

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.remote.nodeprogram import NodeProgramError
from ddpfab.node import ops as program
from ddpfab.health import probe
from ddpfab.planning.plan import Facts, Interface, PlanError, RunOptions, make_plan, socket_ifname_problems

UP = Interface(up=True, state="up", addrs=("10.0.0.9",))
LO = Interface(up=True, state="unknown", addrs=("127.0.0.1", "::1"))


def cluster(n: int, **env) -> Inventory:
    return Inventory("inv.yml", "all", tuple(Node(f"node{i}", f"10.0.0.{i}", data_addr=f"10.0.0.{i}", env=dict(env))
                                           for i in range(1, n + 1)))


def eth0(i: int, **more: Interface) -> dict[str, Interface]:
    return {"lo": LO, "eth0": Interface(up=True, state="up", addrs=(f"10.0.0.{i}",)), **more}


def facts(c: Inventory, interfaces: dict[str, dict[str, Interface]] | None = None) -> Facts:
    if interfaces is None:
        interfaces = {n.name: eth0(i) for i, n in enumerate(c.nodes, 1)}
    return Facts(addresses={n.name: n.host for n in c.nodes}, master_port=29500, cwd="/w",
                 homes={n.name: "/root" for n in c.nodes}, ifnames={n.name: "eth0" for n in c.nodes},
                 interfaces=interfaces)


def refusal(c: Inventory, ifname: str, f: Facts, **options) -> PlanError:
    with pytest.raises(PlanError) as err:
        make_plan(c, RunOptions("t.py", socket_ifname=ifname, **options), f)
    assert all(p.check == "socket_ifname" for p in err.value.problems)
    return err.value


def test_a_node_without_the_interface_is_refused_naming_it_its_interfaces_and_the_fix():
    c = cluster(2)
    f = facts(c, {"node1": eth0(1, ib0=UP), "node2": eth0(2)})
    err = refusal(c, "ib0", f)
    (p,) = err.problems
    assert p.node == "node2" and err.nodes() == ["node2"]
    assert p.found == "no interface ib0; it has lo (127.0.0.1, ::1), eth0 (10.0.0.2)"
    assert p.fix == "use socket_ifname='auto' (which chooses eth0), or name one of its interfaces: eth0"
    assert str(p) == f"host node2: socket_ifname='ib0': {p.found}; {p.fix}"
    assert p.expected == "interface ib0 there, up, with an IP address"


@pytest.mark.parametrize("iface,why", [
    (Interface(up=False, state="down", addrs=("10.1.0.2",)), "ib0 is down"),
    (Interface(up=True, state="down", addrs=("10.1.0.2",)), "ib0 is up but has no link (operstate down)"),
    (Interface(up=True, state="lowerlayerdown", addrs=()), "ib0 is up but has no link (operstate lowerlayerdown)"),
    (Interface(up=True, state="up", addrs=()), "ib0 has no IP address"),
])
def test_an_interface_that_is_down_or_has_no_address_is_refused(iface, why):
    c = cluster(2)
    f = facts(c, {"node1": eth0(1, ib0=UP), "node2": eth0(2, ib0=iface)})
    (p,) = refusal(c, "ib0", f).problems
    assert p.node == "node2" and p.found.startswith(why + "; it has lo (127.0.0.1, ::1), eth0 (10.0.0.2), ib0")
    assert p.fix.endswith("name one of its interfaces: eth0")  # not the one that is down, nor loopback


@pytest.mark.parametrize("state", ["up", "unknown", "dormant", None])
def test_an_interface_that_is_up_is_set_in_both_variables(state):
    c = cluster(2)
    ib0 = Interface(up=True, state=state, addrs=("10.1.0.1",))
    plan = make_plan(c, RunOptions("t.py", socket_ifname="ib0"), facts(c, {n.name: eth0(1, ib0=ib0) for n in c.nodes}))
    assert [(n.env["GLOO_SOCKET_IFNAME"], n.env["NCCL_SOCKET_IFNAME"]) for n in plan.nodes] == [("ib0", "ib0")] * 2


def test_every_node_without_it_is_named_each_with_its_own_addresses():
    c = cluster(3)
    err = refusal(c, "nosuchif0", facts(c))
    assert err.nodes() == ["node1", "node2", "node3"]
    assert [p.found for p in err.problems] == [f"no interface nosuchif0; it has lo (127.0.0.1, ::1), eth0 (10.0.0.{i})"
                                               for i in (1, 2, 3)]


def test_many_nodes_with_the_same_problem_are_one_line_and_the_others_their_own():
    c = cluster(40)
    interfaces = {n.name: eth0(i) for i, n in enumerate(c.nodes, 1)}
    interfaces["node7"] = eth0(7, ib0=Interface(up=False, state="down", addrs=()))
    interfaces["node9"] = eth0(9, ib0=UP)
    err = refusal(c, "ib0", facts(c, interfaces))
    grouped, own = err.problems
    assert grouped.node is None
    assert str(grouped) == ("socket_ifname='ib0': 38 nodes: no interface ib0; each has lo, eth0: node[1-6,8,10-40] "
                            "(38 nodes); use socket_ifname='auto' (which chooses eth0), or name one of their "
                            "interfaces: eth0")
    assert own.node == "node7" and own.found.startswith("ib0 is down")


def test_a_list_needs_every_name_on_every_node():
    c = cluster(2)
    both = {"eth1": Interface(up=True, state="up", addrs=("10.2.0.1",))}
    plan = make_plan(c, RunOptions("t.py", socket_ifname="eth0,eth1"), facts(c, {"node1": eth0(1, **both),
                                                                                   "node2": eth0(2, **both)}))
    assert {n.env["GLOO_SOCKET_IFNAME"] for n in plan.nodes} == {"eth0,eth1"}
    (p,) = refusal(c, "eth0,eth1", facts(c, {"node1": eth0(1, **both), "node2": eth0(2)})).problems
    assert p.node == "node2" and p.found.startswith("no interface eth1;")
    assert p.expected == "interfaces eth0,eth1 there, up, with an IP address"


def test_a_prefix_nccl_would_match_is_refused_since_gloo_takes_exact_names():
    c = cluster(2)
    (p, _) = refusal(c, "eth", facts(c)).problems
    assert p.found.startswith("no interface eth (NCCL would match it as a prefix of eth0, but GLOO_SOCKET_IFNAME "
                              "takes exact names)")


@pytest.mark.parametrize("value", ["^docker0,lo", "=eth0", "^=eth0"])
def test_nccls_own_forms_are_refused_even_offline(value):
    c = cluster(2)
    for f in (facts(c), facts(c, {})):
        err = refusal(c, value, f)
        assert "NCCL_SOCKET_IFNAME's own syntax" in str(err) and "env NCCL_SOCKET_IFNAME=" in str(err)


@pytest.mark.parametrize("value", ["eth0,", ",eth0", "a/b", "eth0 eth1", "eth0:1", "x" * 16, ".."])
def test_what_is_no_interface_name_is_refused(value):
    c = cluster(1)
    assert "is no interface name" in str(refusal(c, value, facts(c, {})))


def test_an_offline_plan_is_not_checked():
    c = cluster(2)
    plan = make_plan(c, RunOptions("t.py", socket_ifname="nosuchif0"), facts(c, {}))
    assert {n.env["NCCL_SOCKET_IFNAME"] for n in plan.nodes} == {"nosuchif0"}


def test_a_node_where_the_user_set_both_variables_is_not_checked():
    c = Inventory("inv.yml", "all", (Node("node1", "10.0.0.1", data_addr="10.0.0.1"),
                                   Node("node2", "10.0.0.2", data_addr="10.0.0.2",
                                        env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"})))
    assert [p.node for p in socket_ifname_problems(c, RunOptions("t.py", socket_ifname="ib0"), facts(c))] == ["node1"]
    # one variable left to the flag: checked there
    only_nccl = RunOptions("t.py", socket_ifname="ib0", env=(("NCCL_SOCKET_IFNAME", "eth0"),))
    assert [p.node for p in socket_ifname_problems(c, only_nccl, facts(c))] == ["node1"]
    both = RunOptions("t.py", socket_ifname="ib0", env=(("NCCL_SOCKET_IFNAME", "eth0"), ("GLOO_SOCKET_IFNAME", "e")))
    assert socket_ifname_problems(c, both, facts(c)) == []


@pytest.mark.parametrize("value", [None, "auto", "none", "off"])
def test_the_words_are_not_interface_names(value):
    c = cluster(2)
    assert socket_ifname_problems(c, RunOptions("t.py", socket_ifname=value), facts(c, {"node1": {}, "node2": {}})) == []


# -- the facts -------------------------------------------------------------------------------
def test_the_node_lists_its_interfaces_with_state_and_addresses():
    got = program.interfaces()
    assert got["lo"]["up"] is True and "127.0.0.1" in got["lo"]["addrs"]
    assert all(set(v) == {"up", "state", "addrs"} for v in got.values())
    reply = program.op_facts({"workdir": "/", "interfaces": True}, {})
    assert set(reply["interfaces"]) == set(got)
    assert probe.interfaces_of(reply["interfaces"])["lo"] == Interface(up=True, state=got["lo"]["state"],
                                                                       addrs=tuple(got["lo"]["addrs"]))


def test_the_probe_asks_for_the_interfaces():
    assert probe.facts_request(Node("node1", "h"), workdir="/w", script=None)["interfaces"] is True


@pytest.mark.parametrize("value,why", [
    ([], "expected an object"),
    ({"": {"up": True, "state": "up", "addrs": []}}, "interface name"),
    ({"x" * 16: {"up": True, "state": "up", "addrs": []}}, "interface name"),
    ({"eth\n0": {"up": True, "state": "up", "addrs": []}}, "interface name"),
    ({"eth0": "up"}, "expected an object"),
    ({"eth0": {"up": "yes", "state": "up", "addrs": []}}, "up 'yes'"),
    ({"eth0": {"up": True, "state": 1, "addrs": []}}, "state 1"),
    ({"eth0": {"up": True, "state": "up", "addrs": "10.0.0.1"}}, "expected a list"),
    ({"eth0": {"up": True, "state": "up", "addrs": ["10.0.0.300"]}}, "expected an IP address"),
])
def test_interfaces_a_node_program_never_reports_are_refused_as_data(value, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        probe.interfaces_of(value)
    data = {"hostname": "h", "python": "3.12", "home": "/root", "torch": True, "workdir_exists": True,
            "interfaces": value}
    with pytest.raises(NodeProgramError, match="its facts give interface"):
        probe.to_facts(Node("node1", "h"), data, 0.0, 0.0)


def test_facts_without_interfaces_are_not_checked():
    data = {"hostname": "h", "python": "3.12", "home": "/root", "torch": True, "workdir_exists": True}
    assert probe.to_facts(Node("node1", "h"), data, 0.0, 0.0).interfaces is None
    data["interfaces"] = {"eth0": {"up": None, "state": None, "addrs": ["fe80::1"]}}
    assert probe.to_facts(Node("node1", "h"), data, 0.0, 0.0).interfaces == {
        "eth0": Interface(up=None, state=None, addrs=("fe80::1",))}


def test_the_problems_come_in_inventory_order():
    c = cluster(3)
    interfaces = {n.name: eth0(i) for i, n in enumerate(c.nodes, 1)}
    interfaces["node2"] = eth0(2, ib0=Interface(up=False, state="down", addrs=()))
    assert refusal(c, "ib0", facts(c, interfaces)).nodes() == ["node1", "node2", "node3"]
