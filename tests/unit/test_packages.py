"""The odd node out in installed packages (ddpfab.health.packages), the node program's listing of
them, and what check and a failed run's closing lines say of it."""

from __future__ import annotations

import io
import os
import queue
import types

from ddpfab.health import packages
from ddpfab.health.check import CheckOptions, Report, evaluate, render
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import execute
from ddpfab.node import ops
from tests.unit.test_check_eval import fact, results
from tests.unit.test_failure_story import CULPRIT, plan3, reader

BASE = {"torch": "2.13.0", "numpy": "2.1.0", "requests": "2.32.0", "pip": "24.0"}


def test_a_node_that_lacks_a_package_or_has_another_version_is_odd_the_rest_are_not():
    odd = packages.compare({"a": BASE, "b": {**BASE, "pip": "23.0"}, "c": {k: v for k, v in BASE.items() if k != "numpy"},
                            "d": {**BASE, "requests": "2.31.0", "tqdm": "4.66.0"}})
    assert set(odd) == {"c", "d"}  # pip is the venv's own tool, as pip freeze leaves it out
    assert odd["c"].missing == {"numpy": "2.1.0"} and odd["c"].harmful
    assert odd["d"].text() == "has requests 2.31.0 (most nodes: 2.32.0); has also tqdm 4.66.0"
    assert odd["d"].requirements() == ["requests==2.32.0"]


def test_only_packages_of_its_own_are_odd_but_not_harmful_and_bad_facts_are_left_out():
    odd = packages.compare({"a": BASE, "b": BASE, "c": {**BASE, "apex": None}, "d": ["numpy"], "e": {"x": 1}})
    assert set(odd) == {"c"} and not odd["c"].harmful and odd["c"].text() == "has also apex"
    assert packages.compare({"a": BASE}) == {}  # one node compares nothing


def test_nodes_that_differ_the_same_way_share_one_warning_line_and_fix():
    names = ["n1", "n2", "n3", "n4", "n5"]
    five = Inventory("inv.yml", "all", tuple(Node(n, f"10.0.0.{i}") for i, n in enumerate(names, 1)))
    lacking = {k: v for k, v in BASE.items() if k != "numpy"}
    facts = {n: fact(packages=lacking if n in ("n2", "n4") else BASE) for n in names}
    res = evaluate(five, "n1", facts, {}, None, CheckOptions(), dict.fromkeys(names, 1))
    assert sorted(r.node for r in res if r.check == "packages" and r.status == "warn") == ["n2", "n4"]
    text = render(Report(nodes=names, results=res))
    assert ("warn packages: 2 nodes: expected the packages most nodes have, in their versions, found lacks numpy "
            "2.1.0: n2, n4; fix: provision again (`ddpfab provision -l n2,n4 -t python` installs the pinned set), "
            "or install them there: `ddpfab exec -l n2,n4 -- python3 -m pip install numpy==2.1.0`") in text


def test_check_names_what_one_node_lacks_and_how_to_install_it():
    lacking = {k: v for k, v in BASE.items() if k != "numpy"}
    res = results({"a": fact(packages=BASE), "b": fact(packages=lacking), "c": fact(packages=BASE)})
    text = render(Report(nodes=["a", "b", "c"], results=res))
    assert "all checks passed" in text  # a warning: a package no job imports fails nothing
    assert ("warn host b: packages: expected the packages most nodes have, in their versions, found lacks numpy "
            "2.1.0; fix: provision again (`ddpfab provision -l b -t python` installs the pinned set), or install "
            "them there: `ddpfab exec -l b -- python3 -m pip install numpy==2.1.0`") in text
    assert [r.found for r in res if r.check == "packages" and r.node == "a"] == ["3 packages, as most nodes"]


def test_a_list_cut_at_the_node_programs_cap_is_said_so_and_compared_with_nothing(tmp_path, monkeypatch):
    """A python with more packages than the node program lists (a system or base python): its cut
    list would "lack" whatever sorts after the cut. It gets a warning of its own, and the others are
    compared among themselves (before, the cut was silent)."""
    for i in range(5):
        (tmp_path / f"pkg{i}-1.0.dist-info").mkdir()
    monkeypatch.setattr(ops, "_package_dirs", lambda: [str(tmp_path)])
    monkeypatch.setattr(ops, "MAX_PACKAGES", 3)
    got = ops.op_facts({"packages": True, "workdir": str(tmp_path)}, {})
    assert len(got["packages"]) == 3 and got["packages_capped"] is True
    monkeypatch.setattr(ops, "MAX_PACKAGES", 10)
    assert "packages_capped" not in ops.op_facts({"packages": True, "workdir": str(tmp_path)}, {})
    monkeypatch.undo()
    lacking = {k: v for k, v in BASE.items() if k != "numpy"}
    res = results({"a": fact(packages=BASE), "b": fact(packages=lacking), "c": fact(packages=BASE, packages_capped=True)})
    assert [(r.node, r.status) for r in res if r.check == "packages"] == [("a", "pass"), ("b", "warn"), ("c", "warn")]
    capped = next(r for r in res if r.check == "packages" and r.node == "c")
    assert capped.found == f"its python lists at least {ops.MAX_PACKAGES} packages: not compared with the other nodes'"
    assert packages.failure_hints({"a": {"packages": BASE}, "b": {"packages": BASE},
                                   "c": {"packages": lacking, "packages_capped": True}}, {"c": "python3"}) == {}


def test_the_node_program_lists_its_pythons_packages_by_their_metadata_dirs(tmp_path, monkeypatch):
    for entry in ("NumPy-2.1.0.dist-info", "zope.interface-7.0.dist-info", "old_pkg-1.0-py3.11.egg-info",
                  "numpy", "README.txt", "numpy-1.0.dist-info"):
        (tmp_path / entry).mkdir()
    other = tmp_path / "later"
    other.mkdir()
    (other / "numpy-0.9.dist-info").mkdir()
    monkeypatch.setattr(ops, "_package_dirs", lambda: [str(tmp_path), str(other), str(tmp_path / "absent")])
    # names as pip compares them; in one directory the first in sorted order, then the first directory wins
    assert ops.installed_packages() == {"numpy": "2.1.0", "old-pkg": "1.0", "zope-interface": "7.0"}


def test_the_node_program_finds_this_pythons_own_packages():
    found = ops.installed_packages()
    assert "pytest" in found and found["pytest"]  # this venv's, with a version
    assert os.path.basename(ops._package_dirs()[0]) in ("site-packages", "dist-packages")


def test_a_failed_run_whose_named_node_lacks_a_package_says_so_with_the_fix():
    """A rank of node2 fails on its own; node2's python lacks numpy, which the others have: the
    closing lines say so, with the install line (before, only the error and `fetch`)."""
    plan = plan3()
    lacking = {k: v for k, v in BASE.items() if k != "numpy"}
    hints = packages.failure_hints({"node1": {"packages": BASE}, "node2": {"packages": lacking},
                                    "node3": {"packages": BASE}}, {n.name: n.python for n in plan.nodes})
    assert set(hints) == {"node2"}
    outcomes = {"node1": execute.NodeOutcome("node1", 0, exit_code=1, stopped_by_ddpfab=True),
                "node2": execute.NodeOutcome("node2", 1, exit_code=1, remote={"failed_at": 5.0},
                                             cause=reader(CULPRIT).cause()),
                "node3": execute.NodeOutcome("node3", 2, exit_code=1, stopped_by_ddpfab=True)}
    jobs = {n: types.SimpleNamespace(outcome=o, plan=plan) for n, o in outcomes.items()}
    out = io.StringIO()
    monitor = execute._Monitor(jobs, queue.SimpleQueue(), execute.Printer(plan, stream=out, color=False),
                               lambda fast=False, why=b"": None, lambda: None, node_hints=hints)
    for name in ("node2", "node1", "node3"):
        monitor.ended(name)
    result = monitor.result()
    assert result.first_failure == "node2"
    assert "hint: node2's python (" in out.getvalue() and "lacks numpy 2.1.0, unlike most nodes" in out.getvalue()
    assert "-m pip install numpy==2.1.0`" in out.getvalue()


def test_of_two_nodes_the_one_that_lacks_a_package_is_odd_and_names_are_checked():
    """Of two nodes, the one that has a package more was called odd ("has also numpy") and the one
    that lacks it, whose ranks fail at the import, was not (a review)."""
    lacking = {k: v for k, v in BASE.items() if k != "numpy"}
    odd = packages.compare({"a": BASE, "b": lacking})
    assert set(odd) == {"b"} and odd["b"].missing == {"numpy": "2.1.0"}
    assert set(packages.failure_hints({"a": {"packages": BASE}, "b": {"packages": lacking}}, {"a": "py", "b": "py"})) \
        == {"b"}
    # a name or version no node program sends (a terminal escape) makes the fact no fact
    assert packages.valid({"numpy\x1b[31m": "1"}) is None and packages.valid({"numpy": "1\n2"}) is None
    # one entry no pip would list (an interrupted uninstall's '~umpy') is dropped, not the node
    assert packages.valid({"~umpy": "1.26.0", "torch": "2.13.0"}) == {"torch": "2.13.0"}


def test_what_node_records_say_is_bounded_in_the_lines_it_makes():
    """An attacker's pass: a node lacking 300 packages made a 3.8 kB pip line; 100k ended_0
    entries a 2 MB line; a launcher record's signal -9 or pid -5 was printed as given."""
    many = {f"pkg{i}": "1.0" for i in range(300)}
    odd = packages.compare({"a": many, "b": many, "c": {}})
    assert packages.fix(["c"], "python3", odd["c"]) == \
        "provision again (`ddpfab provision -l c -t python` installs the pinned set)"
    out = execute.NodeOutcome("x", 0, remote={"ended_0": [{"rank": i, "local_rank": i} for i in range(10)]})
    from ddpfab.launch import story
    assert story.ended_0_text(out).endswith("rank 2 (local rank 2) and 7 more exited 0")
    assert execute.launcher_text({"pid": 5, "signal": -9}) == "" == execute.launcher_text({"pid": -5, "signal": 9})
    assert execute.launcher_text({"pid": 5, "signal": 9}).startswith("torchrun (pid 5) was killed by signal 9")
