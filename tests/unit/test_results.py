"""Per-host results and per-node errors as data: a :class:`GroupResult` says which hosts
succeeded and which failed without a caller testing types, and a node's error says what was
found without anyone cutting the node's name off its text."""

from __future__ import annotations

import json
import os
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.cli.errors import print_problems
from ddpfab.health import check
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.problems import Problem
from ddpfab.remote import ssh
from ddpfab.results import GroupResult

hosts = st.text("abcdefghijklmnop0123456789-", min_size=1, max_size=8)
outcomes = st.one_of(st.integers(), st.builds(RuntimeError, st.text(max_size=10)),
                     st.builds(ValueError, st.text(max_size=10)))


@given(st.dictionaries(hosts, outcomes, max_size=20))
def test_every_host_is_either_succeeded_or_failed_in_the_group_order(data):
    group = GroupResult(data)
    ok, failed = group.succeeded, group.failed
    assert set(ok).isdisjoint(failed) and set(ok) | set(failed) == set(data)
    assert all(isinstance(e, Exception) for e in failed.values())
    assert all(ok[h] == data[h] for h in ok) and all(failed[h] is data[h] for h in failed)
    assert list(ok) == [h for h in data if h in ok] and list(failed) == [h for h in data if h in failed]


@given(st.dictionaries(hosts, outcomes, max_size=20))
def test_map_changes_the_results_and_leaves_the_failures_as_they_are(data):
    group = GroupResult(data)
    mapped = group.map(lambda v: v + 1)
    assert isinstance(mapped, GroupResult) and list(mapped) == list(data)
    assert mapped.succeeded == {h: v + 1 for h, v in group.succeeded.items()}
    assert all(mapped.failed[h] is e for h, e in group.failed.items()) and len(mapped.failed) == len(group.failed)


def test_a_failure_on_one_host_is_data_next_to_the_others_results():
    nodes = [Node(f"n{i}", "127.0.0.1") for i in range(1, 6)]

    def work(node: Node) -> str:
        if node.name in ("n2", "n4"):
            raise ssh.SSHError(node.name, f"host {node.name}: down", "unreachable", found="down")
        return node.name.upper()

    results = ssh.parallel(nodes, work, window=2)
    assert isinstance(results, GroupResult) and list(results) == ["n1", "n2", "n3", "n4", "n5"]
    assert results.succeeded == {"n1": "N1", "n3": "N3", "n5": "N5"}
    assert {n: e.found for n, e in results.failed.items()} == {"n2": "down", "n4": "down"}


def test_the_node_programs_exchange_is_a_group_result_too():
    # no session for n1 (it never opened): its answer is a NodeProgramError naming it, as data
    answers = nodeprog.exchange({}, {"n1": [{"op": "facts"}]}, timeout=1)
    assert isinstance(answers, GroupResult) and not answers.succeeded
    err = answers.failed["n1"]
    assert isinstance(err, nodeprog.NodeProgramError) and err.node == "n1"
    assert str(err) == f"host n1: {err.found}" and err.found.startswith("the node program's session broke")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("jump", [False, True])
def test_an_ssh_error_says_what_was_found_without_the_nodes_name(tmp_path, jump):
    port = _closed_port()
    node = (Node("n1", "127.0.0.1", ssh_options={"proxyjump": f"127.0.0.1:{port}"}) if jump
            else Node("n1", "127.0.0.1", port=port))
    with pytest.raises(ssh.SSHError) as got:
        ssh.connect(node, ssh.HostKeyPolicy(known_hosts=str(tmp_path / "known_hosts")), os.devnull)
    err = got.value
    assert err.node == "n1" and err.kind == "unreachable" and "Connection refused" in err.found
    hop = f"jump host 127.0.0.1:{port} (127.0.0.1:{port})" if jump else f"(127.0.0.1:{port})"
    assert str(err).startswith(f"host n1: {hop}: " if jump else f"host n1 {hop}: ")
    # the jump host stays named in what was found; the node itself is named by whoever reports it
    assert err.found.startswith(f"{hop}: unreachable" if jump else "unreachable") and "n1" not in err.found


def test_an_ssh_option_error_says_what_was_found_without_the_nodes_name(tmp_path):
    node = Node("n1", "127.0.0.1", ssh_options={"stricthostkeychecking": "no"})
    with pytest.raises(ssh.SSHError) as got:
        ssh.connect(node, ssh.HostKeyPolicy(known_hosts=str(tmp_path / "known_hosts")), os.devnull)
    assert got.value.kind == "ssh-option" and str(got.value) == f"host n1: {got.value.found}"
    assert "StrictHostKeyChecking" in got.value.found and not got.value.found.startswith("host")


def test_check_reports_an_unreachable_node_once_by_name(tmp_path):
    port = _closed_port()
    cluster = Inventory("test", "all", (Node("n1", "127.0.0.1", port=port),))
    report = check.check_cluster(cluster, ssh.HostKeyPolicy(known_hosts=str(tmp_path / "known_hosts")),
                                 check.CheckOptions(), os.devnull)
    [ssh_result] = [r for r in report.results if r.check == "ssh"]
    assert ssh_result.status == "fail" and ssh_result.found.startswith("unreachable: ")
    assert ssh_result.line().startswith("host n1: ssh: unreachable: ") and ssh_result.line().count("n1") == 1
    # --json: the failure as a problem record too
    assert report.to_dict()["problems"] == [{"node": "n1", "check": "ssh", "expected": "", "found": ssh_result.found,
                                             "fix": "", "text": ssh_result.line()}]


def test_json_problems_are_records_and_a_line_of_text_is_about_no_one_node(capsys):
    print_problems([Problem("node10", "script", "train.py in /w", "missing", "sync the code first"),
                    "sync: host node1: rsync failed"], "run")
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and [Problem.from_dict(p) for p in out["problems"]] == [
        Problem("node10", "script", "train.py in /w", "missing", "sync the code first",
                text="host node10: script: expected train.py in /w, found missing; sync the code first"),
        Problem(None, "run", text="sync: host node1: rsync failed")]


def test_every_result_says_ok_and_its_problems_about_the_nodes():
    """One success test for every result the API returns: ``.ok``, and ``.problems`` naming nodes."""
    from ddpfab.api import Diagnosis, RunOutcome
    from ddpfab.problems import DdpfabError
    from ddpfab.remote.output import HostResult

    # exec: a host that exited non-zero and one that could not be reached are problems, by host
    ran = GroupResult({"a": HostResult("a", 0), "b": HostResult("b", 3),
                       "c": DdpfabError(Problem("c", "ssh", text="host c: connection refused"))})
    assert not ran.ok and [(p.node, p.check) for p in ran.problems] == [("b", "exit"), ("c", "ssh")]
    assert str(ran.problems[0]) == "host b: exit code 3"
    assert GroupResult({"a": HostResult("a", 0)}).ok and GroupResult({"a": 7}).ok  # values without `ok`
    assert GroupResult({"a": RuntimeError("x")}).problems == [Problem("a", "error", text="host a: x")]
    # check: its failures, warnings allowed
    report = check.Report(["n1", "n2"], [check.CheckResult("n1", "ssh", "pass"),
                                         check.CheckResult("n2", "torch", "fail", expected="2.13", found="none")])
    assert not report.ok and [p.node for p in report.problems] == ["n2"]
    assert report.to_dict()["ok"] is False and report.to_dict()["problems"][0]["node"] == "n2"
    # run: the failure is about the node that failed on its own, in the closing line's words
    failed = RunOutcome("r", 1, None, summary="failed: node2 (node_rank 1) exit code 1", failed_node="node2")
    assert not failed.ok and failed.problems == [Problem("node2", "run", text=failed.summary)]
    assert RunOutcome("r", 0, None).ok and RunOutcome("r", 0, None).problems == []
    # doctor: the odd ones out
    found = Diagnosis("r", ["a hang"], True, False, [{"node": "n3", "what": "gone", "text": "n3 rank 5 is gone"}], None)
    assert not found.ok and found.problems == [Problem("n3", "doctor.gone", text="n3 rank 5 is gone")]
