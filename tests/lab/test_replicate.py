"""Checkpoints without a shared filesystem, on real lab hosts: a script with multinode.py's own
checkpoint behaviour (tests/lab/scripts/snapshot_trainer.py: rank 0 alone saves snapshot.pt, every
rank loads it at start) resumes on every rank with ``--replicate snapshot.pt``, and without it the
preflight names the node that lacks the file and the fix.

Each node's workdir is under /opt, inside the node's own overlay (checked): node-local, as on a
cluster without a shared filesystem.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ddpfab import lab as labmod

from .helpers import ddpfab
from .test_sync import on_node
from .test_sync_ownership import overlay

SCRIPT = Path(__file__).parent / "scripts" / "snapshot_trainer.py"


def resumed(stdout: str) -> dict[int, int]:
    """rank -> the epoch it started at, from each rank's RESUMED line."""
    out = {}
    for line in stdout.splitlines():
        if "RESUMED {" in line:
            data = json.loads(line.split("RESUMED ", 1)[1])
            out[data["rank"]] = data["epoch"]
    return out


def sha_there(lab, node: str, path: str) -> str | None:
    res = on_node(lab, node, f"sha256sum {path}", check=False)
    return res.stdout.split()[0] if res.returncode == 0 else None


def test_replicate_makes_a_rank_0_snapshot_resume_on_every_rank(lab, tmp_path):
    workdir = f"/opt/ddpfab/replicate-{tmp_path.name}"
    for node in ("node1", "node2"):
        overlay(lab, node, workdir)
    inv = tmp_path / "inv.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]).replace(
        "    ddpfab_nproc_per_node: 1\n", f"    ddpfab_nproc_per_node: 2\n    ddpfab_workdir: {workdir}\n"))
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(SCRIPT, proj / "train.py")
    runs = str(tmp_path / "runs")
    common = ("run", "-i", str(inv), "--runs-dir", runs)

    # the first run: nothing to replicate yet (said in one line); rank 0 saves on node1 only
    first = ddpfab(*common, "--replicate", "snapshot.pt", "train.py", "3", "1", cwd=proj, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert resumed(first.stdout) == {0: 0, 1: 0, 2: 0, 3: 0}, first.stdout
    assert [ln for ln in first.stderr.splitlines() if "ddpfab: replicate" in ln] == [
        "ddpfab: replicate: snapshot.pt is not in the workdir of node1 (rank 0's node): nothing to replicate "
        "(a first run?)"], first.stderr
    assert sha_there(lab, "node1", f"{workdir}/snapshot.pt") and not sha_there(lab, "node2", f"{workdir}/snapshot.pt")
    on_node(lab, "node2", f"echo mine > {workdir}/notes.txt")  # the user's: replicating leaves it alone

    # without --replicate the preflight names the node that lacks it and the fix (the dry run shows it)
    dry = ddpfab(*common, "--dry-run", "train.py", "5", "1", cwd=proj, timeout=180)
    assert dry.returncode == 0, dry.stderr
    assert ("ddpfab: warning: snapshot.pt is in the workdir of node1 but not of node2: a script that resumes from "
            "it would resume on some ranks and start over on others") in dry.stderr, dry.stderr
    assert "run with --replicate snapshot.pt (copies it from node1, rank 0's node)" in dry.stderr

    # the dry run with --replicate says what it would copy, and copies nothing
    dry = ddpfab(*common, "--dry-run", "--replicate", "snapshot.pt", "train.py", "5", "1", cwd=proj, timeout=180)
    assert dry.returncode == 0, dry.stderr
    assert "ddpfab: replicate: would copy snapshot.pt (" in dry.stderr and " from node1 to node2" in dry.stderr
    assert "warning" not in dry.stderr, dry.stderr
    assert not sha_there(lab, "node2", f"{workdir}/snapshot.pt")
    # what the real run would refuse, the dry run refuses: a path out of the workdir, before any host
    bad = ddpfab(*common, "--dry-run", "--replicate", "../snapshot.pt", "train.py", "5", "1", cwd=proj)
    assert bad.returncode == 2 and "--replicate: '../snapshot.pt' is refused" in bad.stderr, bad.stderr

    # the second run with --replicate: every rank resumes where rank 0 saved
    source_sha = sha_there(lab, "node1", f"{workdir}/snapshot.pt")
    second = ddpfab(*common, "--replicate", "snapshot.pt", "train.py", "5", "1", cwd=proj, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    epochs = resumed(second.stdout)
    assert sorted(epochs) == [0, 1, 2, 3] and set(epochs.values()) == {3}, second.stdout
    assert "ddpfab: replicate: copied snapshot.pt (" in second.stderr and "verified by hash on each" in second.stderr
    # node2 holds exactly what node1 had (rank 0 has overwritten node1's since), as recorded
    manifest = max(Path(runs).glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    record = json.loads(manifest.read_text())["replicate"]
    [copy] = record["copies"]
    assert (copy["path"], copy["source"], copy["to"], copy["sha256"]) == ("snapshot.pt", "node1", ["node2"], source_sha)
    assert sha_there(lab, "node2", f"{workdir}/snapshot.pt") == source_sha
    assert on_node(lab, "node2", f"cat {workdir}/notes.txt").stdout == "mine\n"
    assert on_node(lab, "node2", f"ls -A {workdir}").stdout.split() == [".ddpfab", "notes.txt", "snapshot.pt",
                                                                         "train.py"]
