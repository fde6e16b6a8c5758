"""The facts ``--socket-ifname IFACE`` is checked against: each node's own list of its
interfaces (up, operstate, addresses), validated on the controller."""

from __future__ import annotations

import pytest

from ddpfab.hosts.inventory import Node
from ddpfab.node import NodeProgramError
from ddpfab.node import ops as program
from ddpfab.planning import probe
from ddpfab.planning.plan import Interface


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
