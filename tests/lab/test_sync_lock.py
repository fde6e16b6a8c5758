"""One writer per workdir: concurrent syncs of different trees into one node workdir, and a sync
killed mid-copy, on real lab hosts.

Each sync holds a lock on the nodes for as long as it changes the workdir, so concurrent syncs
run one after another: every round ends with exactly one tree there (the one that synced last)
and a record that lists exactly it; what the nodes made stays. Workdirs are under /opt on the
nodes (an overlay: checked first, since a lab host's `/` is the real machine's).
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpfab.transfer import sync

from .helpers import wait_no_processes
from .test_sync import NODES, expected_listing, listing_there, on_node, write_inventory
from .test_sync_ownership import _slow_links, overlay

#: What the nodes make in the workdir themselves: never placed by ddpfab, never to be deleted.
NODE_MADE = "mkdir -p {w}/outputs && echo ckpt > {w}/outputs/ckpt.pt && echo mine > {w}/notes.txt"


def make_tree(root: Path, i: int) -> Path:
    """Tree *i*: files every tree has (different content and size in each), files of its own.
    (Files of the same name, size and mtime would pass rsync's quick check; the hash would catch
    them and ``--checksum`` repair them: docs/sync.md. Not what this test is about.)"""
    pad = "#" * i  # a size of its own: trees made in the same second must not pass rsync's quick check
    files = {"train.py": f"print('tree {i}')\n{pad}", "pkg/__init__.py": f"TREE = {i}\n{pad}",
             f"only{i}/mod.py": f"X = {i}\n", f"only{i}/deep/data.txt": f"{i}\n" * (i + 1)}
    files.update({f"pkg/m{k}.py": f"V = {k}\n{pad}" for k in range(40 + 10 * i)})
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def start_sync(inv: Path, src: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpfab", "sync", "-i", str(inv), *extra, str(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_COLOR": "1"})


def record(lab, node: str, workdir: str) -> list[str]:
    return json.loads(on_node(lab, node, f"cat {workdir}/.ddpfab/sync.json").stdout)["files"]


def assert_holds(lab, workdir: str, src: Path, made: dict[str, dict]) -> None:
    """Every node holds exactly *src*'s selection plus what it made, and its record lists exactly
    the selection."""
    files = sync.select(src).files
    want = expected_listing(src, files)
    for node in NODES:
        there = listing_there(lab, node, workdir)
        assert there == {**want, **made[node]}, (node, sorted(set(there) ^ set({**want, **made[node]})))
        assert record(lab, node, workdir) == sorted(files, key=os.fsencode), node


def node_made(lab, workdir: str) -> dict[str, dict]:
    out = {}
    for node in NODES:
        on_node(lab, node, NODE_MADE.format(w=workdir))
        out[node] = {k: v for k, v in listing_there(lab, node, workdir).items() if k in
                     ("outputs", "outputs/ckpt.pt", "notes.txt")}
        assert len(out[node]) == 3, out[node]
    return out


def test_concurrent_syncs_of_different_trees_end_with_the_last_one_exactly(lab, tmp_path):
    workdir = "/opt/ddpfab/locked"
    for node in NODES:
        overlay(lab, node, workdir)
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    trees = [make_tree(tmp_path / f"tree{i}", i) for i in range(4)]
    first = start_sync(inv, trees[0])
    assert first.wait(timeout=180) == 0, first.communicate()
    made = node_made(lab, workdir)
    waited = 0
    for n in (2, 2, 2, 4, 4, 4):
        procs = [start_sync(inv, t) for t in trees[:n]]
        ended: dict[int, float] = {}
        deadline = time.monotonic() + 300
        while len(ended) < n and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.02)
        outs = [p.communicate(timeout=30) for p in procs]
        assert [p.returncode for p in procs] == [0] * n, outs
        waited += sum("is being changed by a sync by " in err for _, err in outs)
        last = max(ended, key=ended.get)
        assert_holds(lab, workdir, trees[last], made)
        # the record is consistent with the files: a plain verification of that tree passes
        check = start_sync(inv, trees[last], "--verify-only")
        assert check.wait(timeout=120) == 0, check.communicate()
    # the syncs did meet (one waited for another, and said for whom) in these rounds
    assert waited >= 1
    # a plain sync afterwards succeeds, of any of the trees
    plain = start_sync(inv, trees[1])
    assert plain.wait(timeout=180) == 0, plain.communicate()
    assert_holds(lab, workdir, trees[1], made)


def test_no_wait_refuses_and_a_killed_sync_is_repaired_by_the_next(lab, tmp_path):
    workdir = "/opt/ddpfab/killed-lock"
    for node in NODES:
        overlay(lab, node, workdir)
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    a, b = make_tree(tmp_path / "a", 1), make_tree(tmp_path / "b", 2)
    (b / "weights.bin").write_bytes(os.urandom(12 * 2**20))  # ~12 s at 8 Mbit/s
    plain = start_sync(inv, a)
    assert plain.wait(timeout=180) == 0, plain.communicate()
    made = node_made(lab, workdir)
    _slow_links(lab, "8mbit")
    try:
        slow = start_sync(inv, b)
        deadline = time.monotonic() + 60
        while not any("rsync --server" in cmd for n in NODES for _, cmd in lab.processes(n)):
            assert time.monotonic() < deadline, "the copy never started"
            assert slow.poll() is None, slow.communicate()
            time.sleep(0.05)
        # a second sync meanwhile, told not to wait: refused (exit 2), naming the holder
        refused = start_sync(inv, a, "--no-wait")
        _, err = refused.communicate(timeout=120)
        assert refused.returncode == 2, err
        assert f"is being changed by a sync by {getpass.getuser()}@{socket.gethostname()} (pid {slow.pid}, " \
               f"since " in err and f"from {b})" in err, err
        assert "--no-wait" in err and "Traceback" not in err, err
        slow.send_signal(signal.SIGKILL)
        slow.communicate(timeout=30)
        wait_no_processes(lab, timeout=10, names=list(NODES))  # the node's rsync ends with its connection
    finally:
        _slow_links(lab, None)
    # what was placed is recorded: every file there that ddpfab put there is in the record
    for node in NODES:
        there = {k for k, v in listing_there(lab, node, workdir).items() if v[0] != "d"}
        placed = set(record(lab, node, workdir))
        assert there - placed == {"outputs/ckpt.pt", "notes.txt"}, (node, there - placed)
        assert set(sync.select(a).files) <= placed and "weights.bin" in placed, node
    # the next sync (of the other tree) repairs the workdir: b's own files go, the node's stay
    again = start_sync(inv, a)
    out = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert_holds(lab, workdir, a, made)
