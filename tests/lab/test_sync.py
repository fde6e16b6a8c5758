"""`ddpfab sync` on real lab hosts: exact trees, ownership, tamper detection, tree fan-out, playbook.

Lab hosts have private overlays on /opt, /root, /tmp..., so each test syncs into its own dir under
/opt/ddpfab/ (ddpfab_workdir in the test inventory) and reads the result back with plain ssh. The
workdir rules, refusals, kills and fetch are in test_sync_ownership.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod
from ddpfab.transfer import sync

from .helpers import REPO

NODES = ("node1", "node2", "node3")

LISTING = r"""
import hashlib, json, os, stat, sys
root, out = sys.argv[1], {}
for dp, dns, fns in os.walk(root):
    for n in dns + fns:
        p = os.path.join(dp, n)
        rel, st = os.path.relpath(p, root), os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ["l", os.readlink(p)]
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ["d", oct(stat.S_IMODE(st.st_mode))]
        else:
            out[rel] = ["f", oct(stat.S_IMODE(st.st_mode)), hashlib.sha256(open(p, "rb").read()).hexdigest()]
print(json.dumps(out))
"""


TAMPER = r"""
import os, sys
p = sys.argv[1]
st = os.stat(p)
data = open(p, "rb").read()
open(p, "wb").write(data.upper())
os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
"""


def listing_here(root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", LISTING, str(root)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def on_node(lab, node: str, command: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(lab.ssh_config), node, command], capture_output=True, text=True,
                          timeout=60, check=check, input=stdin)


def listing_there(lab, node: str, root: str, state: bool = False) -> dict:
    """The node's tree under *root*; without *state*, less ddpfab's own record dir."""
    out = json.loads(on_node(lab, node, f"/usr/bin/python3 -c {shlex.quote(LISTING)} {shlex.quote(root)}").stdout)
    return out if state else {k: v for k, v in out.items() if k.split("/")[0] != ".ddpfab"}


def expected_listing(root: Path, files: list[str]) -> dict:
    """What a node must hold: the selected files with their dirs, as the local tree has them."""
    wanted = set(files)
    for rel in files:
        parts = rel.split("/")
        wanted.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return {rel: v for rel, v in listing_here(root).items() if rel in wanted}


def write_inventory(lab, path: Path, workdir: str | None, known_hosts: Path | None = None) -> Path:
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable))
    if workdir:
        inv["all"]["vars"]["ddpfab_workdir"] = workdir
    if known_hosts:
        inv["all"]["vars"]["ansible_ssh_common_args"] = inv["all"]["vars"]["ansible_ssh_common_args"].replace(
            str(lab.known_hosts), str(known_hosts))
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path, monkeypatch):
    """The controller's digest cache goes to a temp dir, not the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run_sync(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The real command line (`python -m ddpfab sync`), as a user runs it."""
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "ddpfab", "sync", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def project(tmp_path) -> Path:
    """A small git project with everything sync must get right."""
    root = tmp_path / "proj"
    files = {
        "train.py": "print('training')\n",
        "pkg/__init__.py": "",
        "pkg/deep/nested/mod.py": "VALUE = 42\n",
        "data dir/ünïcödé naïve file.txt": "non-ASCII name with spaces\n",
        "run.sh": "#!/bin/sh\necho run\n",
        "ignored.log": "ignored by .gitignore\n",
        "build/out.o": "ignored dir\n",
        "secret.env": "TOKEN=do-not-send\n",
        "runs/old/manifest.json": "{}\n",
        ".venv/pyvenv.cfg": "home = /usr/bin\n",
        ".venv/bin/python": "",
        ".gitignore": "*.log\nbuild/\n.venv/\n",
        ".ddpfabignore": "secret.env\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "run.sh").chmod(0o755)
    (root / "link.py").symlink_to("pkg/deep/nested/mod.py")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    (root / "notes.txt").write_text("untracked, not ignored: sent\n")
    return root


def assert_exact(lab, root: Path, workdir: str, nodes=NODES) -> None:
    sel = sync.select(root)
    want = expected_listing(root, sel.files)
    for node in nodes:
        assert listing_there(lab, node, workdir) == want, node


def test_sync_puts_exactly_the_tree_on_every_node(lab, tmp_path, project):
    workdir = "/opt/ddpfab/exact"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    res = run_sync("-i", str(inv), "--json", str(project))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    local = sync.local_tree(sync.select(project))
    assert out["tree_hash"] == local["tree_hash"]
    assert out["git_commit"] == git(project, "rev-parse", "HEAD") and out["git_dirty"] is True
    assert out["selection"] == "git" and out["fanout"] == "star"
    for node in NODES:
        rec = out["nodes"][node]
        assert rec["ok"] and rec["source"] == "controller" and rec["tree_hash"] == local["tree_hash"]
        assert rec["workdir"] == workdir
    assert_exact(lab, project, workdir)
    there = listing_there(lab, "node1", workdir)
    assert there["run.sh"][1] == "0o755" and there["link.py"] == ["l", "pkg/deep/nested/mod.py"]
    assert "data dir/ünïcödé naïve file.txt" in there
    for absent in ("ignored.log", "build", "secret.env", "runs", ".venv", ".git"):
        assert absent not in there


def test_deleted_or_renamed_files_go_and_what_the_node_made_stays(lab, tmp_path, project):
    """Deletions are limited to files ddpfab placed and that are gone here; a file the node made,
    even with a name an ignore pattern matches, and a placed file that became ignored, stay."""
    workdir = "/opt/ddpfab/deletions"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(project)).returncode == 0
    for node in NODES:  # what the nodes made themselves
        on_node(lab, node, f"cd {workdir} && mkdir -p runs/r1 checkpoints pkg/__pycache__ build && "
                           "touch runs/r1/log checkpoints/c.pt pkg/__pycache__/mod.pyc build/out.o debug.log")
    git(project, "mv", "pkg/deep/nested/mod.py", "pkg/deep/nested/renamed.py")
    (project / "link.py").unlink()
    (project / "link.py").symlink_to("pkg/deep/nested/renamed.py")
    git(project, "rm", "-q", "run.sh")
    (project / "train.py").write_text("print('changed')\n")
    with open(project / ".gitignore", "a") as fh:
        fh.write("notes.txt\n")  # placed before, still here, now ignored: released, not deleted
    dry = run_sync("-i", str(inv), "--dry-run", str(project))
    assert dry.returncode == 0, dry.stderr
    for node in NODES:
        block = dry.stdout.split(f"{node}: ")[1].split("\nnode")[0]
        assert "1 to copy, 3 to update, 2 to delete" in block, dry.stdout
        assert "delete  pkg/deep/nested/mod.py" in block and "delete  run.sh" in block
        assert "copy    pkg/deep/nested/renamed.py" in block and "update  train.py" in block
        assert "update  link.py" in block and "update  .gitignore" in block
    assert "pkg/deep/nested/mod.py" in listing_there(lab, "node1", workdir)  # a dry run changes nothing
    res = run_sync("-i", str(inv), "--json", str(project))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert all(out["nodes"][n]["deleted"] == 2 for n in NODES)
    for node in NODES:
        there = listing_there(lab, node, workdir)
        assert "pkg/deep/nested/mod.py" not in there and "run.sh" not in there
        assert {"runs/r1/log", "checkpoints/c.pt", "pkg/__pycache__/mod.pyc", "build/out.o", "debug.log",
                "notes.txt"} <= set(there)
    synced = {k: v for k, v in listing_there(lab, "node2", workdir).items()
              if k.split("/")[0] not in ("runs", "checkpoints", "build", "debug.log", "notes.txt")
              and "__pycache__" not in k}
    assert synced == expected_listing(project, sync.select(project).files)


def test_summary_line_per_node_counts_deletions(lab, tmp_path, project):
    workdir = "/opt/ddpfab/summary"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(project)).returncode == 0
    (project / "notes.txt").unlink()
    res = run_sync("-i", str(inv), str(project))
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("node")]
    assert sorted(ln.split(":")[0] for ln in lines) == list(NODES)
    assert all(f"{workdir}: 0 copied, 0 updated, 1 deleted" in ln for ln in lines), lines


def test_tampering_on_one_node_is_caught_by_the_hash(lab, tmp_path, project):
    workdir = "/opt/ddpfab/tamper"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(project)).returncode == 0
    # same size, same mtime: rsync's quick check cannot see it, the hash must
    on_node(lab, "node2", f"/usr/bin/python3 - {workdir}/train.py", stdin=TAMPER)
    verify = run_sync("-i", str(inv), "--verify-only", str(project))
    errors = [ln for ln in verify.stderr.splitlines() if ln.startswith("ddpfab: error:")]
    assert verify.returncode == 1 and len(errors) == 1 and "host node2" in errors[0] and "train.py (differs)" in errors[0]
    assert "train.py has the same size here and there: run `ddpfab sync --checksum`" in errors[0], errors
    # a sync sees the file its copy skipped and sends exactly it again, by content, on that node only
    res = run_sync("-i", str(inv), str(project))
    assert res.returncode == 0, res.stderr
    resent = [ln for ln in res.stderr.splitlines() if "sending again, compared by content" in ln]
    assert resent == ["node2: train.py: the same size and mtime there but other contents; sending again, "
                      "compared by content"], res.stderr
    assert_exact(lab, project, workdir)
    on_node(lab, "node2", f"/usr/bin/python3 - {workdir}/train.py", stdin=TAMPER)
    repaired = run_sync("-i", str(inv), "--checksum", str(project))  # --checksum compares every file's contents
    assert repaired.returncode == 0 and "sending again" not in repaired.stderr, repaired.stderr
    assert_exact(lab, project, workdir)
    # a size change: a plain sync copies it (rsync's quick check sees sizes), and the advice says so
    on_node(lab, "node2", f"echo '# more' >> {workdir}/train.py")
    verify = run_sync("-i", str(inv), "--verify-only", str(project))
    errors = [ln for ln in verify.stderr.splitlines() if ln.startswith("ddpfab: error:")]
    assert verify.returncode == 1 and len(errors) == 1 and "train.py (differs)" in errors[0], verify.stderr
    assert "run `ddpfab sync` to copy this tree there" in errors[0] and "--checksum" not in errors[0], errors
    assert run_sync("-i", str(inv), str(project)).returncode == 0
    assert_exact(lab, project, workdir)


def test_tree_fanout_forwards_from_node_to_node(lab, tmp_path, project):
    workdir = "/opt/ddpfab/tree"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    staged = f"ls -A {workdir}/.ddpfab/stage 2>/dev/null"
    res = run_sync("-i", str(inv), "--fanout", "tree", "--json", str(project))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["fanout"] == "tree"
    assert [out["nodes"][n]["source"] for n in NODES] == ["controller", "node1", "node1"]
    assert all(out["nodes"][n]["ok"] for n in NODES)
    assert_exact(lab, project, workdir)
    # nothing left behind: no staging dir on the forwarder, no agent here
    assert on_node(lab, "node1", staged, check=False).stdout == ""
    agents = subprocess.run(["pgrep", "-f", "ssh-agent -D -a /tmp/ddpfab-sync-"], capture_output=True, text=True)
    assert agents.stdout == ""


def test_tree_fanout_falls_back_to_this_machine_when_a_hop_fails(lab, tmp_path, project):
    workdir = "/opt/ddpfab/tree-fallback"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    block = ["iptables", "-I", "INPUT", "-s", lab.host("node1").address, "-p", "tcp", "--dport", "22", "-j", "REJECT"]
    lab.netns_exec("node2", block, check=True)
    try:
        res = run_sync("-i", str(inv), "--fanout", "tree", "--json", str(project))
    finally:
        lab.netns_exec("node2", ["iptables", "-D", *block[2:]], check=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [out["nodes"][n]["source"] for n in NODES] == ["controller", "controller", "node1"]
    notes = " ".join(out["notes"])
    assert "node2: copy from node1 failed" in notes and "copying from this machine instead" in notes
    assert_exact(lab, project, workdir)


def test_unknown_host_key_is_refused_and_named(lab, tmp_path, project):
    known = tmp_path / "known_hosts"
    known.write_text("".join(ln + "\n" for ln in lab.known_hosts.read_text().splitlines() if "node3" not in ln))
    inv = write_inventory(lab, tmp_path / "inv.yml", "/opt/ddpfab/hostkey", known_hosts=known)
    res = run_sync("-i", str(inv), "--json", str(project))
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ddpfab: error:")]
    assert len(errors) == 1 and "host node3" in errors[0] and "host key not in" in errors[0]
    out = json.loads(res.stdout)
    assert out["nodes"]["node1"]["ok"] and not out["nodes"]["node3"]["ok"]
    assert on_node(lab, "node3", "test -e /opt/ddpfab/hostkey", check=False).returncode != 0


def test_a_node_sharing_the_directory_is_never_synced_into_itself(lab, tmp_path, project):
    """No ddpfab_workdir: the nodes use the same path, which in the lab (like on a shared
    filesystem) is the controller's own directory; sync must notice, write nothing and only
    verify."""
    inv = write_inventory(lab, tmp_path / "inv.yml", None)
    res = run_sync("-i", str(inv), "--json", str(project))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert all(out["nodes"][n]["source"] == "shared" and out["nodes"][n]["ok"] for n in NODES)
    assert (project / "ignored.log").exists() and (project / "build/out.o").exists()
    assert not (project / ".ddpfab").exists()


def test_a_shared_directory_that_cannot_be_proven_is_refused(lab, tmp_path, project):
    """The probe file cannot be written into the source (read-only): a node whose workdir exists
    might be this very directory, so sync refuses instead of guessing."""
    inv = write_inventory(lab, tmp_path / "inv.yml", None)
    before = listing_here(project)
    # root ignores file modes: a read-only bind mount makes the source read-only for real (the lab
    # hosts' mount namespaces are private: they still see the directory, through their overlays)
    subprocess.run(["mount", "--bind", str(project), str(project)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(project)], check=True)
        out = run_sync("-i", str(inv), str(project))
    finally:
        subprocess.run(["umount", str(project)], check=True)
    assert out.returncode == 1
    assert "cannot tell whether" in out.stderr and "Read-only file system" in out.stderr, out.stderr
    assert listing_here(project) == before


def test_playbook_syncs_with_the_same_rules_and_is_idempotent(lab, tmp_path, project):
    workdir = "/opt/ddpfab/playbook"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    on_node(lab, "node1", f"mkdir -p {workdir}/runs && touch {workdir}/stale.py {workdir}/runs/keep")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv), str(REPO / "playbooks/sync.yml"),
            "-e", f"ddpfab_sync_src={project}"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert refused.returncode != 0 and "--adopt" in refused.stdout, refused.stdout[-3000:]
    first = subprocess.run(argv + ["-e", "ddpfab_sync_adopt=true"], capture_output=True, text=True, timeout=300,
                           env=env, cwd=REPO)
    assert first.returncode == 0, first.stdout[-3000:]
    assert_exact(lab, project, workdir, nodes=("node2", "node3"))
    there = listing_there(lab, "node1", workdir)
    assert "stale.py" in there and "runs/keep" in there  # adopted: nothing that was there is deleted
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert second.returncode == 0, second.stdout[-3000:]
    recap = [ln for ln in second.stdout.splitlines() if ln.startswith("node")]
    assert recap and all("changed=0" in ln and "failed=0" in ln for ln in recap), recap
    assert not list(project.glob(".ddpfab-sync-probe-*"))


def test_run_checks_the_code_by_hash_and_copies_only_when_it_changed(lab, tmp_path, project):
    """`ddpfab run` syncs first: a full sync the first time, then only a hash check over its own
    connections while nothing changed, and a full sync again when a node's tree differs."""
    from .helpers import ddpfab

    workdir = f"/opt/ddpfab/run-{tmp_path.name}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    runs = tmp_path / "runs"

    def run_and_manifest() -> dict:
        before = set(runs.glob("*/manifest.json")) if runs.exists() else set()
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=project)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count("training") == len(NODES), res.stdout
        (new,) = set(runs.glob("*/manifest.json")) - before
        return json.loads(new.read_text())["code"]

    first = run_and_manifest()
    assert {n["source"] for n in first["nodes"].values()} == {"controller"}, first
    assert_exact(lab, project, workdir)

    second = run_and_manifest()  # nothing changed: verified by hash, nothing copied
    assert {n["source"] for n in second["nodes"].values()} == {"unchanged"}, second
    assert all(n["tree_hash"] == first["tree_hash"] and n["ok"] for n in second["nodes"].values())
    assert second["tree_hash"] == first["tree_hash"]

    on_node(lab, "node2", f"echo the node made this > {workdir}/pkg/output.txt")  # not ddpfab's: no re-sync
    assert {n["source"] for n in run_and_manifest()["nodes"].values()} == {"unchanged"}
    on_node(lab, "node2", f"echo changed there > {workdir}/pkg/__init__.py")  # a placed file differs: copy again
    third = run_and_manifest()
    assert {n["source"] for n in third["nodes"].values()} == {"controller"}, third
    assert on_node(lab, "node2", f"cat {workdir}/pkg/output.txt").stdout == "the node made this\n"
    assert_exact(lab, project, workdir, nodes=("node1", "node3"))

    (project / "train.py").write_text("print('training', 'v2')\n")  # the code changed here: copy again
    fourth = run_and_manifest()
    assert {n["source"] for n in fourth["nodes"].values()} == {"controller"}, fourth
    assert fourth["tree_hash"] != first["tree_hash"]
    assert_exact(lab, project, workdir, nodes=("node1", "node3"))
    assert on_node(lab, "node2", f"cat {workdir}/pkg/output.txt").stdout == "the node made this\n"


def test_run_from_a_directory_the_nodes_share_verifies_it_and_writes_nothing_into_it(lab, tmp_path, project):
    """No ddpfab_workdir: the nodes' workdir is this very directory (a shared filesystem; the lab's
    /tmp), which has no record of ddpfab's: `run` proves it by hashing exactly this tree's paths
    over its own sessions, copies nothing and starts the job. (Its second question, the paths'
    hash, once raised a TypeError there.)"""
    from .helpers import ddpfab

    inv = write_inventory(lab, tmp_path / "inv.yml", None)
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=project)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("training") == len(NODES), res.stdout
    (manifest,) = runs.glob("*/manifest.json")
    code = json.loads(manifest.read_text())["code"]
    assert {n["source"] for n in code["nodes"].values()} == {"unchanged"} and all(
        n["ok"] for n in code["nodes"].values()), code
    assert not (project / ".ddpfab").exists()
