"""The plan rules, pure and fast: no host, no network."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, Plan, PlanError, RunOptions, make_plan, master_port, parse_env


def cluster(*nodes: Node) -> Inventory:
    return Inventory(source="inv.yml", group="all", nodes=tuple(nodes))


def facts(c: Inventory, port: int = 29501, **addr) -> Facts:
    addresses = {n.name: addr.get(n.name, f"10.0.0.{i + 1}") for i, n in enumerate(c.nodes)}
    return Facts(addresses=addresses, master_port=port, cwd="/work/proj", homes={n.name: "/root" for n in c.nodes})


C3 = cluster(Node("a", "10.0.0.1"), Node("b", "10.0.0.2", nproc=4), Node("c", "10.0.0.3", gpus=8))


def test_node_rank_follows_inventory_order_and_first_is_master():
    p = make_plan(C3, RunOptions("train.py", run_id="r1"), facts(C3))
    assert [(n.name, n.node_rank) for n in p.nodes] == [("a", 0), ("b", 1), ("c", 2)]
    assert (p.master, p.master_addr, p.master_port) == ("a", "10.0.0.1", 29501)
    assert p.nnodes == 3


def test_master_flag_moves_that_node_to_rank_zero_keeping_the_rest_in_order():
    c = cluster(Node("a", "10.0.0.1"), Node("b", "10.0.0.2"), Node("c", "10.0.0.3", master=True))
    p = make_plan(c, RunOptions("t.py"), facts(c))
    assert [(n.name, n.node_rank) for n in p.nodes] == [("c", 0), ("a", 1), ("b", 2)]
    assert p.master_addr == "10.0.0.3"
    assert all("--master-addr=10.0.0.3" in render.argv(p, n) for n in p.nodes)


def test_nproc_precedence_cli_then_inventory_then_gpus_then_one():
    p = make_plan(C3, RunOptions("t.py"), facts(C3))
    assert [n.nproc for n in p.nodes] == [1, 4, 8]
    assert p.world_size == 13
    p = make_plan(C3, RunOptions("t.py", nproc_per_node=2), facts(C3))
    assert [n.nproc for n in p.nodes] == [2, 2, 2] and p.world_size == 6


def test_every_node_gets_one_consistent_master_and_its_own_rank():
    p = make_plan(C3, RunOptions("t.py", args=("--epochs", "3")), facts(C3))
    for n in p.nodes:
        argv = render.argv(p, n)
        assert argv[:3] == ("python3", "-m", "torch.distributed.run")
        assert "--nnodes=3" in argv
        assert f"--node-rank={n.node_rank}" in argv
        assert "--master-port=29501" in argv
        assert argv[-3:] == ("t.py", "--epochs", "3")


def test_master_address_must_not_be_loopback_for_multi_node():
    with pytest.raises(PlanError, match="loopback"):
        make_plan(C3, RunOptions("t.py"), facts(C3, a="127.0.1.1"))
    single = cluster(Node("a", "localhost"))
    p = make_plan(single, RunOptions("t.py"), facts(single, a="127.0.0.1"))
    assert p.master_addr == "127.0.0.1"


def test_master_address_must_be_an_ip_literal():
    with pytest.raises(PlanError, match="IP literal"):
        make_plan(C3, RunOptions("t.py"), facts(C3, a="gpu1.example"))


@pytest.mark.parametrize("port", [0, 70000, -1, True, "29500", 29500.5])
def test_bad_port(port):
    with pytest.raises(PlanError, match="TCP port"):
        make_plan(C3, RunOptions("t.py"), facts(C3, port=port))


@pytest.mark.parametrize("style", [{}, {"rdzv": "c10d", "launcher": "legacy", "init_method": "tcp", "debug": True}])
def test_plan_json_round_trip_is_exact(style):
    p = make_plan(C3, RunOptions("t.py", args=("x y", "", "é"), env=(("K", "v w"),), run_id="rid", **style),
                  facts(C3))
    again = Plan.from_json(p.to_json())
    assert again == p
    assert json.loads(again.to_json()) == json.loads(p.to_json())
    assert {k: getattr(again, k) for k in style} == style


def test_plan_is_deterministic():
    a = make_plan(C3, RunOptions("t.py", run_id="x"), facts(C3))
    b = make_plan(C3, RunOptions("t.py", run_id="x"), facts(C3))
    assert a.to_json() == b.to_json()


def test_workdir_defaults_to_controller_cwd_and_relative_paths_anchor_at_home():
    c = cluster(Node("a", "10.0.0.1", workdir="/srv/code"), Node("b", "10.0.0.2"),
                Node("c", "10.0.0.3", workdir="~/code"))
    p = make_plan(c, RunOptions("t.py", run_id="rid"), facts(c))
    assert [n.workdir for n in p.nodes] == ["/srv/code", "/work/proj", "/root/code"]
    assert p.nodes[0].remote_dir == "/root/.ddpfab/runs/rid"
    assert f"--log-dir={p.nodes[0].remote_dir}/torchrun" in render.argv(p, p.nodes[0])


def test_command_is_the_argv_env_and_workdir_exactly():
    p = make_plan(C3, RunOptions("t.py", args=("a b", "$X"), env=(("FOO", "1 2"),), run_id="rid"), facts(C3))
    n = p.nodes[1]
    words = shlex.split(render.shell_line(p, n))
    assert words[:3] == ["cd", "/work/proj", "&&"]
    env_end = words.index(n.python)
    assert words[3] == "env"
    assert dict(w.split("=", 1) for w in words[4:env_end]) == n.env
    assert tuple(words[env_end:]) == render.argv(p, n)
    assert n.env["FOO"] == "1 2" and n.env["DDPFAB_RUN_ID"] == "rid"


@pytest.mark.parametrize("bad", ["NOEQUALS", "1X=2", "A-B=3", "=v"])
def test_env_keys_are_validated(bad):
    with pytest.raises(PlanError, match="KEY=VALUE"):
        parse_env([bad])


def test_env_values_keep_everything_after_the_first_equals():
    assert parse_env(["A=b=c", "E="]) == (("A", "b=c"), ("E", ""))


# -- the master port: one decision ------------------------------------------------------------------
@pytest.mark.parametrize("asked, kw, port", [
    (None, {"found": 29577}, 29577),                                               # run: a free one
    (29600, {"found": None, "asked_free": True}, 29600),                           # run --master-port
    (29600, {"asked_free": False}, 29600),                     # taken: kept, the probe's problem stops the run
    (29600, {"asked_free": False, "found": 29577, "replace_taken": True}, 29577),  # replay: another one
    (29600, {"asked_free": True, "found": 29577, "replace_taken": True}, 29600),   # replay: the recorded one
    (None, {"found": None}, None),                                                 # none free: the probe says so
    (None, {"offline": True}, 29500),                                              # offline: torchrun's default
    (29600, {"offline": True}, 29600),
])
def test_master_port_is_decided_in_one_place(asked, kw, port):
    assert master_port(asked, **kw) == port


@given(st.integers().filter(lambda p: not 1 <= p <= 65535), st.booleans())
def test_a_master_port_outside_tcp_is_an_error_whatever_else(port, offline):
    with pytest.raises(PlanError, match=f"master_port={port} is not a TCP port"):
        master_port(port, offline=offline)
