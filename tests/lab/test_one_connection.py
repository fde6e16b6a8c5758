"""One SSH connection per node: `ddpfab run` (with a sync of changed code), `ddpfab sync` and
`ddpfab fetch` each hold exactly one TCP connection to every node's sshd, rsync included.

Counted inside each lab host (its network namespace) with ``ss``, sampled repeatedly while the
command runs; a sample also notes whether rsync's remote side was running on that node then, so
the test proves it looked during the copy and not only before or after it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .helpers import ddpfab
from .test_sync import NODES, on_node, write_inventory
from .test_sync_ownership import _slow_links


class Sampler:
    """Established connections to port 22 in every node, sampled until stopped."""

    def __init__(self, lab, nodes=NODES):
        self.lab, self.nodes = lab, nodes
        self.samples: list[tuple[str, int, bool]] = []  # node, connections, rsync running there
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def count(self, node: str) -> int:
        out = self.lab.netns_exec(node, ["ss", "-Htn", "state", "established", "( sport = :22 )"],
                                  capture_output=True, text=True, check=True).stdout
        return len([ln for ln in out.splitlines() if ln.strip()])

    def _loop(self) -> None:
        while not self._stop.is_set():
            for n in self.nodes:
                rsync = any("rsync --server" in cmd for _, cmd in self.lab.processes(n))
                self.samples.append((n, self.count(n), rsync))
            time.sleep(0.02)

    def __enter__(self) -> Sampler:
        assert all(self.count(n) == 0 for n in self.nodes), "a connection to a node before the command started"
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def most(self) -> dict[str, int]:
        return {n: max([c for m, c, _ in self.samples if m == n], default=0) for n in self.nodes}

    def during_copy(self) -> dict[str, set[int]]:
        """Per node, the counts seen while rsync's remote side ran there."""
        return {n: {c for m, c, r in self.samples if m == n and r} for n in self.nodes}


@pytest.fixture
def bigproj(tmp_path) -> Path:
    """A project whose copy takes a moment (a few MB of incompressible data) and whose script runs ~2 s."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text("import time\ntime.sleep(2)\nprint('training')\n")
    (root / "data.bin").write_bytes(os.urandom(24 * 2**20))
    return root


@pytest.fixture
def slow_links(lab):
    """What the controller sends to each node at 64 Mbit/s: a copy of the project takes ~3 s."""
    _slow_links(lab, "64mbit")
    yield
    _slow_links(lab, None)


def test_a_run_that_syncs_changed_code_holds_one_connection_per_node(lab, tmp_path, bigproj, slow_links,
                                                                     no_leftovers):
    workdir = f"/opt/ddpfab/oneconn-{tmp_path.name}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    runs = tmp_path / "runs"
    with Sampler(lab) as seen:
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=bigproj, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("training") == len(NODES), res.stdout
    (manifest,) = runs.glob("*/manifest.json")
    code = json.loads(manifest.read_text())["code"]
    assert {n["source"] for n in code["nodes"].values()} == {"controller"}, code  # it did copy
    assert seen.most() == {n: 1 for n in NODES}, seen.most()
    assert seen.during_copy() == {n: {1} for n in NODES}, seen.during_copy()


def test_sync_alone_holds_one_connection_per_node_and_a_no_change_sync_copies_nothing(lab, tmp_path, bigproj):
    workdir = f"/opt/ddpfab/oneconn-sync-{tmp_path.name}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    _slow_links(lab, "64mbit")
    try:
        with Sampler(lab) as seen:
            res = ddpfab("sync", "-i", str(inv), "--json", str(bigproj), timeout=300)
    finally:
        _slow_links(lab, None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert {n["source"] for n in json.loads(res.stdout)["nodes"].values()} == {"controller"}
    assert seen.most() == {n: 1 for n in NODES}, seen.most()
    assert seen.during_copy() == {n: {1} for n in NODES}, seen.during_copy()

    again = ddpfab("sync", "-i", str(inv), "--json", str(bigproj))  # nothing changed: the hash-only path
    assert again.returncode == 0, again.stdout + again.stderr
    out = json.loads(again.stdout)
    assert out["fanout"] == "none" and {n["source"] for n in out["nodes"].values()} == {"unchanged"}, out
    assert all(n["bytes_sent"] is None and n["transfer_s"] is None for n in out["nodes"].values()), out

    on_node(lab, "node2", f"echo changed there > {workdir}/train.py")  # a placed file differs: a real sync
    third = ddpfab("sync", "-i", str(inv), "--json", str(bigproj))
    assert third.returncode == 0, third.stdout + third.stderr
    nodes = json.loads(third.stdout)["nodes"]
    assert nodes["node2"]["source"] == "controller" and nodes["node2"]["updated"] == 1, nodes
    assert on_node(lab, "node2", f"cat {workdir}/train.py").stdout.startswith("import time")


def test_a_no_change_check_is_not_unchanged_while_another_sync_holds_the_workdir(lab, tmp_path, bigproj):
    """While a sync holds a workdir's lock (it is changing it), the hash-only check must not call
    that workdir unchanged, even while its files still hash to the old tree (rsync has not yet
    renamed its copy into place): a sync of the old tree with --no-wait is refused as busy, naming
    the holder; once the first sync is done, a sync of its tree finds it unchanged."""
    workdir = f"/opt/ddpfab/oneconn-lock-{tmp_path.name}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    res = ddpfab("sync", "-i", str(inv), str(bigproj), timeout=300)
    assert res.returncode == 0, res.stderr
    old = tmp_path / "old"  # the tree the nodes hold now
    shutil.copytree(bigproj, old)
    (bigproj / "data.bin").write_bytes(os.urandom(4 * 2**20))  # the first sync changes it, slowly (~16 s)
    _slow_links(lab, "2mbit")
    try:
        first = subprocess.Popen([sys.executable, "-m", "ddpfab", "sync", "-i", str(inv), str(bigproj)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "NO_COLOR": "1"})
        deadline = time.monotonic() + 240  # (a loaded machine starts a sync slowly)
        while not any("rsync --server" in cmd for n in NODES for _, cmd in lab.processes(n)):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = ddpfab("sync", "-i", str(inv), "--no-wait", str(old), timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr  # refused as busy, not "unchanged"
        assert "is being changed by a sync by" in second.stderr, second.stderr
        _slow_links(lab, None)  # proven: the first sync may finish at full speed now
        out, err = first.communicate(timeout=180)
        assert first.returncode == 0, out + err
    finally:
        _slow_links(lab, None)
    after = ddpfab("sync", "-i", str(inv), "--json", str(bigproj))
    assert after.returncode == 0 and json.loads(after.stdout)["fanout"] == "none", after.stdout + after.stderr


def test_fetch_holds_one_connection_to_the_node(lab, tmp_path, bigproj):
    workdir = f"/opt/ddpfab/oneconn-fetch-{tmp_path.name}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert ddpfab("sync", "-i", str(inv), str(bigproj), timeout=300).returncode == 0
    dest = tmp_path / "got"
    with Sampler(lab) as seen:
        res = ddpfab("fetch", "-i", str(inv), "--node", "node2", "data.bin", str(dest))
    assert res.returncode == 0, res.stdout + res.stderr
    assert (dest / "data.bin").read_bytes() == (bigproj / "data.bin").read_bytes()
    assert seen.most() == {"node1": 0, "node2": 1, "node3": 0}, seen.most()
