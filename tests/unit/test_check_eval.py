"""The check evaluation, pure: collected facts in, per-node verdicts out (no hosts needed)."""

from __future__ import annotations

from ddpfab.health.check import CheckOptions, Report, evaluate, render
from ddpfab.hosts.inventory import Inventory, Node

C = Inventory("inv.yml", "all", (Node("a", "10.0.0.1"), Node("b", "10.0.0.2"), Node("c", "10.0.0.3")))


def fact(**over):
    base = {"hostname": "h", "python": "3.11.7", "torch": True, "torch_version": "2.13.0+cpu", "launcher": True,
            "hostname_addr": "10.0.0.9", "cuda": None, "cuda_available": False, "gpus": 0, "nccl": None,
            "routes": {"x": "eth0"}, "time": 1000.0, "controller_sent": 999.9, "controller_received": 1000.1}
    base.update(over)
    return base


def results(facts, mesh=None, unreachable=None, **opts):
    return evaluate(C, "a", facts, unreachable or {}, mesh, CheckOptions(**opts), {"a": 1, "b": 1, "c": 1})


def failing(res):
    return sorted((r.node, r.check) for r in res if r.status == "fail")


def test_healthy_cluster_passes_everything():
    res = results({n: fact(hostname=n) for n in "abc"})
    assert failing(res) == []


def test_mismatched_torch_fails_the_odd_node_and_every_node_where_no_version_has_a_majority():
    """The nodes that differ from what more than half have fail; that majority passes (a new
    user's pass: "FAIL python: 7 nodes: ... found python 3.11.7: node1, node2, ..." listed the
    healthy nodes as failing). Without such a majority every node fails, one line per value."""
    res = results({"a": fact(), "b": fact(torch_version="2.12.1+cpu"), "c": fact()})
    assert failing(res) == [("b", "torch")]
    assert [(r.node, r.found) for r in res if r.check == "torch" and r.status == "pass"] == [
        ("a", "2.13.0+cpu (as most nodes)"), ("c", "2.13.0+cpu (as most nodes)")]
    text = render(Report(nodes=["a", "b", "c"], results=res))
    assert "FAIL host b: torch: expected the same torch on every node (most have 2.13.0+cpu), found torch 2.12.1" in text
    assert "found torch 2.13.0+cpu" not in text
    split = results({"a": fact(), "b": fact(torch_version="2.12.1+cpu")}, unreachable={"c": "timed out"})
    assert [f for f in failing(split) if f[1] == "torch"] == [("a", "torch"), ("b", "torch")]
    three = results({"a": fact(), "b": fact(torch_version="2.12.1+cpu"), "c": fact(torch_version="2.11.0+cpu")})
    assert len(failing(three)) == 3  # (a plurality of one is no majority)


def test_mismatched_cuda_and_nccl():
    gpu = dict(cuda_available=True, gpus=8, cuda="12.4", nccl="2.21.5")
    res = results({"a": fact(**gpu), "b": fact(**{**gpu, "cuda": "12.1"}), "c": fact(**{**gpu, "nccl": "2.18.1"})})
    fails = failing(res)
    assert ("b", "cuda") in fails and ("c", "nccl") in fails
    assert not any(check in ("torch", "python") for _, check in fails)


def test_mismatched_driver_comes_from_nvidia_smi_even_in_fast_mode():
    res = results({"a": fact(driver="550.54"), "b": fact(driver="535.1"), "c": fact(driver="550.54")}, full=False)
    assert ("b", "driver") in failing(res)


def test_missing_torch_is_its_own_failure_not_a_version_mismatch():
    res = results({"a": fact(), "b": fact(), "c": fact(torch=False, torch_version=None)})
    assert failing(res) == [("c", "torch")]


def test_hostname_on_loopback_fails_with_the_fix():
    res = results({"a": fact(), "b": fact(hostname="b", hostname_addr="127.0.1.1"), "c": fact()})
    assert failing(res) == [("b", "hostname")]
    assert "GLOO_SOCKET_IFNAME" in next(r.fix for r in res if r.status == "fail")


def test_more_procs_than_gpus():
    res = evaluate(C, "a", {n: fact(gpus=2, cuda_available=True) for n in "abc"}, {}, None, CheckOptions(),
                   {"a": 4, "b": 2, "c": 2})
    assert failing(res) == [("a", "gpus")]


def test_clock_skew_beyond_the_bound():
    res = results({"a": fact(), "b": fact(time=1003.0), "c": fact()}, max_skew_s=1.0)
    assert failing(res) == [("b", "clock")]


def test_unreachable_node_only_fails_ssh():
    res = results({"a": fact(), "b": fact()}, unreachable={"c": "unreachable: timed out"})
    assert failing(res) == [("c", "ssh")]


def test_mesh_failures_are_blamed_on_the_node_that_does_not_accept():
    mesh = {"ports": {"a": {"ephemeral": 40000, "master": 29500}, "b": {"ephemeral": 40001},
                      "c": {"ephemeral": 40002}},
            "results": {
                "a": [{"target": "b", "kind": "ephemeral", "result": "ok"},
                      {"target": "c", "kind": "ephemeral", "result": "ok"}],
                "b": [{"target": "a", "kind": "ephemeral", "result": "timed out"},
                      {"target": "a", "kind": "master", "result": "ok"},
                      {"target": "c", "kind": "ephemeral", "result": "ok"}],
                "c": [{"target": "a", "kind": "ephemeral", "result": "timed out"},
                      {"target": "a", "kind": "master", "result": "ok"},
                      {"target": "b", "kind": "ephemeral", "result": "ok"}]}}
    res = results({n: fact() for n in "abc"}, mesh=mesh)
    assert failing(res) == [("a", "mesh")]
    text = render(Report(nodes=["a", "b", "c"], results=res))
    assert "FAIL host a: mesh: unreachable from 2 peers (timed out); fix: likely their firewall" in text
    assert "1 check(s) failed" in text


def test_master_port_in_use():
    mesh = {"ports": {"a": {"ephemeral": 1, "master_error": "[Errno 98] Address already in use"},
                      "b": {"ephemeral": 2}, "c": {"ephemeral": 3}}, "results": {}}
    res = results({n: fact() for n in "abc"}, mesh=mesh, master_port=29500)
    assert failing(res) == [("a", "master-port")]


def test_a_shell_that_prints_before_a_command_fails_with_the_fix():
    from ddpfab.health.check import SHELL_OUTPUT

    res = results({"a": fact(hostname="a"), "b": fact(hostname="b", **{SHELL_OUTPUT: "Welcome to b!\n"}),
                   "c": fact(hostname="c")})
    assert failing(res) == [("b", "shell")]
    (r,) = [r for r in res if r.check == "shell"]
    assert "'Welcome to b!'" in r.found and "[ -t 1 ]" in r.fix and "rsync" in r.fix
