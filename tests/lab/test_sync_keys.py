"""Private keys stay home, on real lab hosts: `ddpfab sync`, its dry run and a run's sync leave a
project's OpenSSH and PEM private keys out and say so in one line; the nodes never receive them
(read back on each node); a key a node has of its own stays; `--include-keys` sends them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod

from .helpers import ddpfab
from .test_sync import git, on_node, run_sync

NODES = ("node1", "node2")
KEYS = ["certs/server.pem", "lab/id_ed25519"]


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path, monkeypatch):
    """The controller's digest cache goes to a temp dir, not the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def keyed_project(root: Path, in_git: bool) -> Path:
    """A project with an OpenSSH private key (and its .pub) and a PEM private key beside its code."""
    (root / "lab").mkdir(parents=True)
    (root / "certs").mkdir()
    (root / "train.py").write_text("print('training')\n")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab", "-f", str(root / "lab/id_ed25519")],
                   check=True, capture_output=True)
    (root / "certs/server.pem").write_text("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n"
                                           "-----END PRIVATE KEY-----\n")
    if in_git:
        git(root, "init", "-q")
        git(root, "add", "-A")
        git(root, "commit", "-qm", "init")
    return root


def two_node_inventory(lab, path: Path, workdir: str) -> Path:
    """node1 and node2 (the session lab's), syncing into *workdir* (under /opt: each node's own overlay)."""
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=list(NODES)))
    inv["all"]["vars"]["ddpfab_workdir"] = workdir
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def there(lab, node: str, workdir: str, rels: list[str]) -> dict[str, str | None]:
    """Each of *rels* under the node's *workdir*, as the node sees it: its content, or None."""
    script = "; ".join(f"if [ -e {workdir}/{rel} ]; then echo '== {rel}'; cat {workdir}/{rel}; fi" for rel in rels)
    out = on_node(lab, node, script).stdout
    found = {chunk.split("\n", 1)[0]: chunk.split("\n", 1)[1] for chunk in out.split("== ")[1:]}
    return {rel: found.get(rel) for rel in rels}


def left_out_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "left out" in ln]


@pytest.mark.parametrize("in_git", [True, False], ids=["git", "no-git"])
def test_keys_never_reach_the_nodes_unless_asked_and_a_nodes_own_key_stays(lab, tmp_path, in_git):
    proj = keyed_project(tmp_path / "proj", in_git)
    workdir = f"/opt/ddpfab/keys-{tmp_path.name}"
    inv = two_node_inventory(lab, tmp_path / "inv.yml", workdir)
    line = "sync: left out 2 private keys (certs/server.pem, lab/id_ed25519): they never leave this machine; " \
           "--include-keys sends them"

    dry = run_sync("-i", str(inv), "--dry-run", str(proj))
    assert dry.returncode == 0, dry.stderr
    assert [ln.split("ddpfab: ", 1)[-1][:len(line)] for ln in left_out_lines(dry.stderr)] == [line], dry.stderr
    listed = {ln.split()[-1] for ln in dry.stdout.splitlines() if ln.startswith("  copy")}
    assert listed == {"train.py", "lab/id_ed25519.pub"}, dry.stdout

    res = run_sync("-i", str(inv), str(proj))
    assert res.returncode == 0, res.stderr
    assert len(left_out_lines(res.stderr)) == 1 and line in res.stderr, res.stderr
    for node in NODES:
        got = there(lab, node, workdir, ["train.py", "lab/id_ed25519.pub", *KEYS])
        assert got["train.py"] == "print('training')\n" and got["lab/id_ed25519.pub"], (node, got)
        assert got["lab/id_ed25519"] is None and got["certs/server.pem"] is None, (node, got)

    # node1 has a key of its own where the project's would go: not ddpfab's, so never touched
    on_node(lab, "node1", f"echo node1-own-key > {workdir}/lab/id_ed25519")
    (proj / "train.py").write_text("print('training', 2)\n")  # a change: the next sync copies
    runs = tmp_path / "runs"
    dry_run = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "--dry-run", "train.py", cwd=proj)
    assert dry_run.returncode == 0 and len(left_out_lines(dry_run.stderr)) == 1, dry_run.stderr
    assert line in dry_run.stderr
    if in_git:  # one real run (in the case, no git) is enough: a run's sync selects as sync does
        res = run_sync("-i", str(inv), str(proj))
        assert res.returncode == 0 and line in res.stderr, res.stderr
    else:
        ran = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=proj)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert ran.stdout.count("training 2") == len(NODES), ran.stdout
        assert len(left_out_lines(ran.stderr)) == 1 and line in ran.stderr, ran.stderr
        (manifest,) = runs.glob("*/manifest.json")
        code = json.loads(manifest.read_text())["code"]
        assert code["left_out"] == KEYS and code["include_keys"] is False
        assert {n["source"] for n in code["nodes"].values()} == {"controller"}, code
    assert there(lab, "node1", workdir, KEYS) == {"certs/server.pem": None, "lab/id_ed25519": "node1-own-key\n"}
    assert there(lab, "node2", workdir, KEYS) == {"certs/server.pem": None, "lab/id_ed25519": None}
    assert on_node(lab, "node2", f"cat {workdir}/train.py").stdout == "print('training', 2)\n"

    sent = run_sync("-i", str(inv), "--include-keys", str(proj))  # on purpose: every key goes
    assert sent.returncode == 0 and not left_out_lines(sent.stderr), sent.stderr
    for node in NODES:
        assert there(lab, node, workdir, KEYS) == {k: (proj / k).read_text() for k in KEYS}, node
