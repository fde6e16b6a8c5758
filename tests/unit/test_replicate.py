"""``--replicate``: the node program's side (through ``python -c`` of the very program the nodes
run, on local directories) and the decisions made from what the nodes hold: fast, no hosts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import replicate
from ddpfab.planning.plan import PlanError


def program(*requests: dict, after: bytes = b"") -> tuple[list[bytes], int]:
    """The node program with *requests* (and raw bytes *after* them); its stdout lines, exit code."""
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"),
                          input=nodeprog.stdin_for(*nodeprog.numbered(*requests)) + after,
                          capture_output=True, timeout=60)
    return proc.stdout.split(b"\n"), proc.returncode


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_stat_hashes_the_paths_and_scans_resume_files_at_the_top_only(tmp_path):
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    (wd / "snapshot.pt").write_bytes(b"s" * 10)
    (wd / "model.CKPT").write_bytes(b"c")
    (wd / "sub" / "checkpoint_1.pt").write_bytes(b"deep")
    (wd / "train.py").write_text("x")
    (wd / "checkpoints").mkdir()  # a directory named like one: not a file to compare
    lines, _ = program({"op": "replica_stat", "workdir": str(wd), "paths": ["snapshot.pt", "gone.pt", "../x"],
                        "hash": True, "scan": True})
    out = json.loads(lines[0])["result"]
    assert out["files"]["snapshot.pt"] == {"kind": "file", "bytes": 10, "mtime": out["files"]["snapshot.pt"]["mtime"],
                                           "sha256": sha(b"s" * 10)}
    assert out["files"]["gone.pt"] == {"kind": "missing"}
    assert out["files"]["../x"]["kind"] == "error" and "'..'" in out["files"]["../x"]["error"]
    assert sorted(out["scan"]) == ["model.CKPT"]  # snapshot.pt is asked for by name; sub/ is not scanned
    assert "sha256" not in out["scan"]["model.CKPT"]  # the scan stays cheap
    lines, _ = program({"op": "replica_stat", "workdir": str(tmp_path / "none"), "paths": ["a.pt"], "scan": True})
    assert json.loads(lines[0])["result"] == {"files": {"a.pt": {"kind": "missing"}}, "scan": {}}


def test_send_then_receive_replaces_only_the_path_and_checks_the_hash(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (dst / "ckpt").mkdir(parents=True)
    data = os.urandom(3 * (1 << 20) + 7)
    (src / "ckpt").mkdir()
    (src / "ckpt" / "last.pt").write_bytes(data)
    (dst / "ckpt" / "last.pt").write_bytes(b"old")
    (dst / "ckpt" / "other.pt").write_bytes(b"mine")  # the user's: never touched
    lines, code = program({"op": "replica_send", "workdir": str(src), "path": "ckpt/last.pt"})
    raw = b"\n".join(lines)
    head, _, body = raw.partition(b"\n")
    assert code == 0 and json.loads(head)["result"] == {"bytes": len(data)} and body == data

    # a copy whose hash is not the sender's leaves the old file as it was, and no temp file behind
    lines, code = program({"op": "replica_receive", "workdir": str(dst), "path": "ckpt/last.pt",
                           "bytes": len(data), "sha256": sha(b"other")}, after=data)
    reply = json.loads(lines[0])
    assert code == 1 and not reply["ok"] and "the old file is left as it was" in reply["error"]
    assert (dst / "ckpt" / "last.pt").read_bytes() == b"old"
    assert sorted(os.listdir(dst / "ckpt")) == ["last.pt", "other.pt"]

    # a short stream: refused the same way
    lines, code = program({"op": "replica_receive", "workdir": str(dst), "path": "ckpt/last.pt",
                           "bytes": len(data), "sha256": sha(data)}, after=data[:100])
    assert code == 1 and "ended after 100 of" in json.loads(lines[0])["error"]

    lines, code = program({"op": "replica_receive", "workdir": str(dst), "path": "ckpt/last.pt",
                           "bytes": len(data), "sha256": sha(data)}, after=data)
    assert code == 0 and json.loads(lines[0])["result"]["sha256"] == sha(data)
    assert (dst / "ckpt" / "last.pt").read_bytes() == data
    assert (dst / "ckpt" / "other.pt").read_bytes() == b"mine"
    assert sorted(os.listdir(dst / "ckpt")) == ["last.pt", "other.pt"]


def test_receive_never_writes_through_a_symlink_out_of_the_workdir(tmp_path):
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    dst.mkdir()
    outside.mkdir()
    (dst / "ckpt").symlink_to(outside)  # a parent that leads out
    (dst / "link.pt").symlink_to(outside / "target.pt")  # the path itself a link: replaced, not followed
    (outside / "target.pt").write_bytes(b"theirs")
    lines, code = program({"op": "replica_receive", "workdir": str(dst), "path": "ckpt/a.pt", "bytes": 2,
                           "sha256": sha(b"ab")}, after=b"ab")
    assert code == 1 and "leads out of the workdir" in json.loads(lines[0])["error"]
    assert os.listdir(outside) == ["target.pt"]
    lines, code = program({"op": "replica_receive", "workdir": str(dst), "path": "link.pt", "bytes": 2,
                           "sha256": sha(b"ab")}, after=b"ab")
    assert code == 0 and not (dst / "link.pt").is_symlink() and (dst / "link.pt").read_bytes() == b"ab"
    assert (outside / "target.pt").read_bytes() == b"theirs"
    # and a send refuses to read through the link
    (dst / "link2.pt").symlink_to(outside / "target.pt")
    lines, code = program({"op": "replica_send", "workdir": str(dst), "path": "link2.pt"})
    assert code == 1 and not json.loads(lines[0])["ok"]


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../b", "./a", ".ddpfab/sync.json", "a\nb", "", "a//b"])
def test_paths_are_checked_like_workdir_paths_before_any_host(path):
    cluster = Inventory("inv", "all", (Node("n1", "10.0.0.1"),))
    with pytest.raises(PlanError, match="^replicate: "):
        replicate.wanted(cluster, [path])
    bad = Inventory("inv", "all", (Node("n1", "10.0.0.1", replicate=(path,)),))
    with pytest.raises(PlanError, match="host n1: ddpfab_replicate"):
        replicate.wanted(bad, [])


def test_wanted_merges_the_inventory_and_the_command_line_once_each():
    cluster = Inventory("inv", "all", (Node("n1", "a", replicate=("snapshot.pt",)),
                                     Node("n2", "b", replicate=("snapshot.pt", "ckpt/x.pt"))))
    assert replicate.wanted(cluster, ["opt.pt", "snapshot.pt"]) == ("snapshot.pt", "ckpt/x.pt", "opt.pt")


def f(data: bytes) -> dict:
    return {"kind": "file", "bytes": len(data), "sha256": sha(data)}


def test_decide_copies_to_nodes_that_lack_or_differ_and_skips_those_that_match():
    stats = {"n1": {"files": {"s.pt": f(b"new"), "first.pt": {"kind": "missing"}}, "scan": {}},
             "n2": {"files": {"s.pt": {"kind": "missing"}, "first.pt": {"kind": "missing"}}, "scan": {}},
             "n3": {"files": {"s.pt": f(b"new"), "first.pt": {"kind": "missing"}}, "scan": {}},
             "n4": {"files": {"s.pt": f(b"old"), "first.pt": {"kind": "missing"}}, "scan": {}}}
    d = replicate.decide(["n1", "n2", "n3", "n4"], ("s.pt", "first.pt"), stats)
    assert not d.problems and d.missing == ["first.pt"]
    [copy] = d.copies
    assert (copy.source, copy.to, copy.had_it, copy.sha256) == ("n1", ["n2", "n4"], ["n3"], sha(b"new"))
    assert "would copy s.pt (3 bytes" in replicate.describe(copy, dry_run=True)
    assert replicate.record(d, [])["copies"][0]["to"] == ["n2", "n4"]


def test_decide_refuses_a_directory_at_the_source_or_in_the_way_and_an_unreadable_node():
    stats = {"n1": {"files": {"d": {"kind": "dir"}, "s.pt": f(b"x")}},
             "n2": {"files": {"d": {"kind": "missing"}, "s.pt": {"kind": "dir"}}}}
    d = replicate.decide(["n1", "n2"], ("d", "s.pt"), stats)
    assert [(p.node, p.check) for p in d.problems] == [("n1", "replicate"), ("n2", "replicate")]
    assert "rank 0's node" in str(d.problems[0]) and "move it away" in str(d.problems[1])
    d = replicate.decide(["n1", "n2"], ("s.pt",), {"n1": stats["n1"], "n2": {"error": "no python"}})
    assert [str(p) for p in d.problems] == ["host n2: replicate: cannot read the workdir's files: no python"]


def test_warnings_name_the_nodes_lacking_a_resume_file_and_the_fix():
    stats = {"n1": {"files": {}, "scan": {"snapshot.pt": f(b"a"), "same.ckpt": f(b"c")}},
             "n2": {"files": {}, "scan": {"same.ckpt": f(b"c")}},
             "n3": {"files": {}, "scan": {"same.ckpt": f(b"c")}}}
    [w] = replicate.warnings(["n1", "n2", "n3"], (), stats)
    assert w.node == "n2" and w.check == "resume_file"
    assert "snapshot.pt is in the workdir of n1 but not of n2, n3" in str(w)
    assert "run with replicate snapshot.pt" in w.fix
    # replicated: no warning, the copy fixes it
    assert replicate.warnings(["n1", "n2", "n3"], ("snapshot.pt",), stats) == []
    # differing sizes, and a file rank 0's node lacks (replicating cannot help: delete it there)
    stats = {"n1": {"files": {"s.pt": {"kind": "missing"}}, "scan": {"c.ckpt": f(b"aaaa")}},
             "n2": {"files": {"s.pt": f(b"b")}, "scan": {"c.ckpt": f(b"a")}}}
    ws = {w.found.split()[0]: w for w in replicate.warnings(["n1", "n2"], ("s.pt",), stats)}
    assert "differs between nodes (n1: 4 bytes, n2: 1 bytes)" in ws["c.ckpt"].found
    assert ws["s.pt"].fix.startswith("delete it on n2")


def test_the_command_line_refuses_a_bad_path_before_any_host_and_the_offline_dry_run_names_the_copy(
        tmp_path, monkeypatch, capsys):
    from ddpfab import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # hosts that do not exist: the refusal comes before any connection is tried, in the real run too
    for extra in ([], ["--dry-run"]):
        assert cli.main(["run", "-i", "nohost1.invalid,nohost2.invalid,", *extra, "--replicate", "../snap.pt",
                         "train.py"]) == 2
        err = capsys.readouterr().err
        assert err.count("ddpfab: error:") == 1 and "--replicate: '../snap.pt' is refused" in err, err
    assert cli.main(["run", "-i", "10.0.0.1,10.0.0.2,", "--dry-run", "--offline", "--replicate", "snapshot.pt",
                     "train.py"]) == 0
    err = capsys.readouterr().err
    assert "replicate (offline, not looked at on the hosts): snapshot.pt from 10.0.0.1 (rank 0's node)" in err


def test_the_fix_a_warning_prints_is_a_command_line_word_for_any_name():
    # a resume file whose name has a space: the fix's replicate word is quoted for the shell
    stats = {"n1": {"files": {}, "scan": {"my snap.pt": f(b"a")}}, "n2": {"files": {}, "scan": {}}}
    [w] = replicate.warnings(["n1", "n2"], (), stats)
    assert "replicate 'my snap.pt' " in w.fix
