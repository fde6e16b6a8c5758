"""Folded host lists (pdsh/clush syntax) and nodes folded by what they said (exec --fold)."""

from __future__ import annotations

import io
import re

from hypothesis import given, strategies as st

from ddpfab.hostlist import fold_by, fold_names
from ddpfab.remote.output import FoldPrinter, HostResult, fold_report, summary


def test_names_fold_into_ranges_of_their_last_number():
    assert fold_names([f"node{i}" for i in range(1, 129)]) == "node[1-128]"
    assert fold_names(["node01", "node02", "node03", "node05", "node31", "node33"]) == "node[01-03,05,31,33]"
    assert fold_names(["node09", "node10", "node11"]) == "node[09-11]"
    assert fold_names(["node8", "node09"]) == "node[8,09]"  # two spellings: not one range
    assert fold_names(["node7"]) == "node7"
    assert fold_names(["gpu-a", "rack1-node2", "rack1-node3", "login"]) == "gpu-a,rack1-node[2-3],login"
    assert fold_names(["n3.lab", "n1.lab", "n2.lab", "10.0.0.7"]) == "n[1-3].lab,10.0.0.7"
    assert fold_names([]) == ""


def expand(folded: str) -> list[str]:
    """pdsh's reading of a folded list (the test's own, to check the folding round-trips)."""
    names = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\])?[^,\[]*", folded):
        if not part:
            continue
        m = re.match(r"^(.*)\[(.*)\](.*)$", part)
        if not m:
            names.append(part)
            continue
        for piece in m.group(2).split(","):
            lo, _, hi = piece.partition("-")
            width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
            names += [f"{m.group(1)}{i:0{width}d}{m.group(3)}" for i in range(int(lo), int(hi or lo) + 1)]
    return names


@given(st.lists(st.tuples(st.sampled_from(["node", "gpu-", "r1n"]), st.integers(0, 40), st.booleans()),
                unique=True, max_size=40))
def test_folding_loses_no_name_and_adds_none(specs):
    names = list(dict.fromkeys(f"{p}{i:02d}" if pad else f"{p}{i}" for p, i, pad in specs))
    assert sorted(expand(fold_names(names))) == sorted(names)


def test_groups_come_largest_first_the_odd_ones_last():
    said = {f"node{i}": "A100" for i in range(1, 129)}
    said["node32"] = "A10"
    assert fold_by(said) == [([f"node{i}" for i in range(1, 129) if i != 32], "A100"), (["node32"], "A10")]


def test_fold_report_prints_each_output_once_under_its_nodes():
    printer = FoldPrinter([f"node{i}" for i in range(1, 5)])
    for name in printer.lines:
        printer.line(name, "GPU 0: A100")
    printer.line("node3", "GPU 1: A100", stderr=True)
    results = {f"node{i}": HostResult(f"node{i}", 0) for i in range(1, 5)}
    results["node4"] = HostResult("node4", None, error="Connection refused")
    text = fold_report(printer.lines, results, printer.errs)
    assert text.splitlines() == ["---------------", "node[1-2] (2)", "---------------", "GPU 0: A100",
                                 "---------------", "node3", "---------------", "GPU 0: A100", "GPU 1: A100",
                                 "-" * 19, "node4 (unreachable)", "-" * 19, "GPU 0: A100"]


def test_nodes_that_said_the_same_fold_whichever_stream_came_first():
    """stdout and stderr reach the controller on two channels: node1's err came before its out,
    node2's after; they said the same and fold together (one stood apart as a false odd box in 3
    of 5 tries), stdout's lines first. An interrupt shows what came before it."""
    printer = FoldPrinter(["node1", "node2"])
    printer.line("node1", "err", stderr=True)
    printer.line("node1", "out")
    printer.line("node2", "out")
    printer.line("node2", "err", stderr=True)
    out = io.StringIO()
    printer.out = out
    printer.report({n: HostResult(n, 0) for n in ("node1", "node2")})
    assert out.getvalue().splitlines()[1:] == ["node[1-2] (2)", "---------------", "out", "err"]
    out.truncate(0)
    out.seek(0)
    printer.report_interrupted()
    assert out.getvalue().splitlines()[1] == "node[1-2] (2, interrupted)"
    # a node whose command had ended by the interrupt is reported as it ended, not interrupted
    printer.ended(HostResult("node1", 0))
    out.truncate(0)
    out.seek(0)
    printer.report_interrupted()
    assert "node1" in out.getvalue().splitlines() and "node2 (interrupted)" in out.getvalue().splitlines(), \
        out.getvalue()


def test_the_closing_summary_folds_nodes_by_how_they_ended():
    results = {f"node{i}": HostResult(f"node{i}", 0) for i in range(1, 129)}
    results["node7"] = HostResult("node7", 1)
    code, text = summary(results, 1.5)
    assert code == 1 and text == "127/128 nodes exited 0 in 1.50 s: node[1-6,8-128]=0 node7=1"


def test_a_node_that_ran_but_gave_no_exit_code_is_not_unreachable():
    """A command silent past --timeout, and one whose session closed with no exit status (its shell
    killed), ran on a reachable node: they said ``unreachable`` (exit 255, "could not connect")."""
    results = {"node1": HostResult("node1", 0),
               "node2": HostResult("node2", error="no output and no exit within 2 s (--timeout)", end="timeout"),
               "node3": HostResult("node3", error="the SSH session ended without an exit status",
                                   end="no exit status"),
               "node4": HostResult("node4", error="Connection refused")}
    code, text = summary(results, 1.5)
    assert code == 124 and text.endswith("node1=0 node2=timeout node3=no exit status node4=unreachable"), text
    assert [r.code for r in results.values()] == [0, 124, 255, 255]
    lines = fold_report({"node2": ["started"]}, {"node2": results["node2"]}).splitlines()
    assert lines[1] == "node2 (timeout)" and lines[3] == "started"
