"""What sync sends, what it may delete, the workdir rules and the tree hash: fast, no hosts.

The gitignore reader is checked against git itself; the copy against a local rsync run (a local
copy runs the very same rsync options as a remote one); the node side through the very program
the nodes run (``python -c`` of the node program, :mod:`ddpfab.node`) on local directories.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from ddpfab import cli
from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.cli import sync as sync_cli
from ddpfab.hosts.inventory import Node
from ddpfab.node import treehash, workdir
from ddpfab.remote.ssh import HostKeyPolicy
from ddpfab.problems import Problem
from ddpfab.transfer import sync


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path, monkeypatch):
    """Digest caches go to a temp dir, not the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# scripts/setup.sh installs git and rsync: a missing one must fail these tests, not skip them
def needs_git(test):
    return test


needs_rsync = needs_git


def make_tree(root: Path, spec: dict) -> Path:
    """Files from {relpath: content}; content None = directory, ('link', target) = symlink,
    ('exec', text) = executable file."""
    for rel, content in spec.items():
        p = root / rel
        if content is None:
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, tuple) and content[0] == "link":
            p.symlink_to(content[1])
        elif isinstance(content, tuple) and content[0] == "exec":
            p.write_text(content[1])
            p.chmod(0o755)
        else:
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout


def git_listing(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sorted(os.fsdecode(p) for p in out.split(b"\0") if p)


# -- the gitignore reader, against git ------------------------------------------------------------
IGNORE_CASES = {
    "basics": ("*.log\n!keep.log\n/build/\n# comment\n\n", {}),
    "anchoring": ("/top.txt\nmid/x.txt\nany.txt\n", {}),
    "double-star": ("**/gen\nd/**/deep.tmp\nlogs/**\n!logs/**/\n", {}),
    "dir-only": ("out/\ncache\n", {}),
    "classes-escapes": ("*.py[cod]\n\\#hash\n\\!bang\ntrail\\ \n[!a]x.txt\nf?.md\n", {}),
    "nested": ("*.tmp\n", {"sub/.gitignore": "!keep.tmp\n/local.txt\n", "sub/deeper/.gitignore": "*.md\n"}),
    "reinclude-under-ignored-dir": ("ign/\n!ign/x.txt\n", {}),
}
FILES = ["a.log", "keep.log", "sub/keep.log", "build/o.o", "x/build/o2.o", "top.txt", "sub/top.txt",
         "mid/x.txt", "q/mid/x.txt", "any.txt", "deep/any.txt", "gen/a.c", "p/gen/b.c", "d/e/f/deep.tmp",
         "d/deep.tmp", "logs/a.txt", "logs/x/b.txt", "out/file", "x/out", "cache/f", "y/cache",
         "m.pyc", "m.pyo", "m.py", "#hash", "!bang", "trail ", "ax.txt", "bx.txt", "f1.md", "f12.md",
         "sub/a.tmp", "sub/keep.tmp", "sub/local.txt", "sub/deeper/local.txt", "sub/deeper/r.md", "r.md",
         "ign/x.txt", "ign/y.txt", "ünï cödé/ä b.txt", "sp ace/f i.txt"]


@needs_git
@pytest.mark.parametrize("case", sorted(IGNORE_CASES))
def test_ignore_rules_match_git(tmp_path, case):
    text, extra = IGNORE_CASES[case]
    root = make_tree(tmp_path / "t", {**{f: "x" for f in FILES}, ".gitignore": text, **extra})
    git(root, "init", "-q")
    files, _ = treehash.walk(str(root), treehash.Skipper(str(root)), treehash.IgnoreFiles(str(root), [".gitignore"]))
    assert sorted(files) == git_listing(root)


def test_compile_line_blank_comment_and_negation():
    assert treehash.compile_line("") is None
    assert treehash.compile_line("   ") is None
    assert treehash.compile_line("# c") is None
    regex, neg, dir_only = treehash.compile_line("!out/")
    assert neg and dir_only and regex.match("a/out")
    regex, neg, _ = treehash.compile_line("\\!x")
    assert not neg and regex.match("!x")


# -- the selection ------------------------------------------------------------------------------
TREE = {
    "train.py": "print('hi')\n",
    "pkg/__init__.py": "",
    "pkg/model.py": "m = 1\n",
    "pkg/__pycache__/model.cpython-311.pyc": b"\0",
    "pkg/data/ignored.bin": "big",
    "run.sh": ("exec", "#!/bin/sh\necho run\n"),
    "link.py": ("link", "pkg/model.py"),
    "spaced dir/ünïcode file.txt": "ü\n",
    "runs/old/manifest.json": "{}",
    ".venv/pyvenv.cfg": "home = /usr\n",
    ".venv/lib/site.py": "",
    "tools/env/pyvenv.cfg": "",
    "tools/env/bin/python": "",
    "tools/tool.py": "",
    "checkpoints/c1.pt": "w",
    "secret.env": "TOKEN=1",
    ".gitignore": "pkg/data/\n.venv/\n",
    ".ddpfabignore": "secret.env\n",
}
SENT = [".ddpfabignore", ".gitignore", "link.py", "pkg/__init__.py", "pkg/model.py", "run.sh",
        "spaced dir/ünïcode file.txt", "tools/tool.py", "train.py"]


@needs_git
def test_selection_in_git_repo(tmp_path):
    root = make_tree(tmp_path / "p", TREE)
    (root / ".ddpfabkeep").write_text("checkpoints/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "x")
    (root / "untracked.py").write_text("u")
    sel = sync.select(root)
    assert sel.source == "git"
    assert sel.files == sorted(SENT + [".ddpfabkeep", "untracked.py"], key=os.fsencode)
    assert sel.git_commit and len(sel.git_commit) == 40
    assert sel.git_dirty is True


@needs_git
def test_git_tracked_but_deleted_is_not_sent_and_tracked_ignored_is(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a", "b.py": "b", "gen.log": "tracked"})
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "x")
    (root / ".gitignore").write_text("*.log\n")
    (root / "b.py").unlink()
    (root / "new.log").write_text("ignored")
    assert sync.select(root).files == [".gitignore", "a.py", "gen.log"]


@needs_git
def test_nested_repo_and_subdir_of_repo(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a", "vendor/lib/x.py": "x", "vendor/lib/.gitignore": "*.o\n",
                                      "vendor/lib/y.o": "o", "sub/s.py": "s"})
    git(root, "init", "-q")
    git(root / "vendor" / "lib", "init", "-q")
    assert sync.select(root).files == ["a.py", "sub/s.py", "vendor/lib/.gitignore", "vendor/lib/x.py"]
    assert sync.select(root / "sub").files == ["s.py"]


def test_selection_without_git_matches_git(tmp_path):
    root = make_tree(tmp_path / "p", TREE)
    (root / ".ddpfabkeep").write_text("checkpoints/\n")
    sel = sync.select(root)
    assert sel.source == "walk"
    assert sel.git_commit is None and sel.git_dirty is None
    assert sel.files == sorted(SENT + [".ddpfabkeep"], key=os.fsencode)


def test_with_git_sends_dot_git(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a", ".git/HEAD": "ref", ".git/objects/x": "o"})
    assert ".git/HEAD" not in sync.select(root).files
    assert {".git/HEAD", ".git/objects/x"} <= set(sync.select(root, with_git=True).files)


def test_keep_patterns_from_file_and_argument(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a", "out/x": "x", "ckpt/y": "y", ".ddpfabkeep": "# c\nout/\n"})
    assert sync.keep_patterns(str(root), ["ckpt/"]) == ("out/", "ckpt/")
    assert sync.select(root, keep=["ckpt/"]).files == [".ddpfabkeep", "a.py"]



@pytest.mark.parametrize("runs", ["exp/runs", "exp runs*/[x]", "#r", "!r", "runs"])
def test_a_runs_dir_inside_the_project_is_never_sent_and_nothing_else_is_left_out(tmp_path, runs):
    root = make_tree(tmp_path / "p", {"a.py": "a", f"{runs}/rid/manifest.json": "{}", f"{runs}x/b.py": "b",
                                      "exp/c.py": "c"})
    keep = sync.runs_keep(root, root / runs)
    assert sync.select(root, keep=keep).files == sorted(["a.py", f"{runs}x/b.py", "exp/c.py"])
    assert sync.runs_keep(root, f"{root}/./{runs}/.") == keep  # however it is spelt


def test_a_runs_dir_outside_the_project_or_the_project_itself_changes_no_selection(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a"})
    assert [sync.runs_keep(root, d) for d in (tmp_path / "runs", root, tmp_path, tmp_path / "p2")] == [()] * 4


# -- the copy, run by a real rsync -----------------------------------------------------------------
def rsync_local(sel: sync.Selection, dest: Path, dry_run: bool = False) -> str:
    files = dest.parent / "files"
    sync.write_list(sel.files, files)
    argv = sync.rsync_argv(str(files), "ssh", sel.root, str(dest), dry_run=dry_run)
    argv.remove("-e")
    argv.remove("ssh")
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def tree_of(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = ("file", p.read_bytes(), stat.S_IMODE(st.st_mode))
    return out


@needs_rsync
def test_copy_sends_exactly_the_selection_and_deletes_nothing(tmp_path):
    root = make_tree(tmp_path / "src", {**TREE, "odd/[x]*?.txt": "w", "odd/back\\slash": "b",
                                        "odd/new\nline": "n", "odd/ trail ": "t", "odd/- dash": "d",
                                        "wild[1]/f.txt": "f", "ok/a.txt": "a", "ok/b/c.txt": "c"})
    node_own = {"stale.py": "the node's", "secret.env": "the node's", "pkg/data/ignored.bin": "the node's",
                "runs/r1/log": "run records", "checkpoints/c9.pt": "outputs", ".git/HEAD": "a clone"}
    dest = make_tree(tmp_path / "dst", node_own)
    sel = sync.select(root)
    out = rsync_local(sel, dest)
    got = tree_of(dest)
    want = {rel: v for rel, v in tree_of(root).items() if rel in set(sel.files)}
    assert {k: v for k, v in got.items() if k in want} == want
    assert {k: got[k][1].decode() for k in node_own} == node_own  # nothing of the node's touched
    assert set(got) == set(want) | set(node_own)
    assert {"odd/[x]*?.txt", "odd/back\\slash", "odd/new\nline", "odd/ trail ", "wild[1]/f.txt"} <= set(got)
    assert sorted(p for a, p in sync.itemized(out) if a == "copy") == sorted(
        p.replace("\n", "\\#012") for p in sel.files)
    remote = treehash.tree_digest(str(dest), sel.files)
    assert remote["tree_hash"] == sync.local_tree(sel)["tree_hash"]


@needs_rsync
def test_dry_run_itemises_copies_and_updates_and_changes_nothing(tmp_path):
    root = make_tree(tmp_path / "src", {"a.py": "a", "b.py": "b", "lib/c.py": "c"})
    dest = tmp_path / "dst"
    rsync_local(sync.select(root), dest)
    (root / "b.py").write_text("b, changed")
    (root / "lib" / "new.py").write_text("new")
    before = tree_of(dest)
    items = sync.itemized(rsync_local(sync.select(root), dest, dry_run=True))
    assert sorted(items) == [["copy", "lib/new.py"], ["update", "b.py"]]
    assert tree_of(dest) == before


def test_deletions_are_only_placed_files_gone_here(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a", "renamed_to.py": "r", "now_ignored.log": "i",
                                      ".gitignore": "*.log\n", ".ddpfabkeep": "ckpt/\n"})
    sel = sync.select(root)
    placed = ["a.py", "deleted.py", "renamed_from.py", "now_ignored.log", "ckpt/c.pt", "runs/x", "sub/gone.py"]
    assert sync.deletions(sel, placed) == ["deleted.py", "renamed_from.py", "sub/gone.py"]


# -- the node side, through the program the nodes run --------------------------------------------------
def node(req: dict) -> dict:
    """One operation of the node program, as a node runs it (``python -I``, code and request on
    stdin); its result, or ``{"error": ...}`` for an error reply."""
    reqs = nodeprog.numbered(req)
    proc = subprocess.run([sys.executable, "-I", *nodeprog.argv(sys.executable, "ddpfab-node")[1:]],
                          input=nodeprog.stdin_for(*reqs), capture_output=True,
                          env={**os.environ, "HOME": os.environ.get("HOME", "/root")})
    assert proc.returncode == 0, proc.stderr
    reply = nodeprog.match_replies("local", reqs, proc.stdout.splitlines(), proc.returncode, proc.stderr.decode())[0]
    return reply.result if reply.ok else {"error": reply.error, "code": reply.code}


def test_first_sync_creates_and_records_then_owns(tmp_path):
    wd = tmp_path / "new" / "wd"
    out = node({"op": "probe", "workdir": str(wd), "nonce": "nope", "files": ["a.py"]})
    assert out["state"] == "new" and not out["shared"] and wd.is_dir()
    assert treehash.read_record(str(wd))["files"] == ["a.py"]  # recorded before the copy: a kill keeps it ours
    (wd / "a.py").write_text("a")  # what rsync does between probe and commit
    out = node({"op": "commit", "workdir": str(wd), "delete": [], "files": ["a.py"]})
    assert out["deleted"] == 0 and out["tree_hash"] == treehash.tree_digest(str(wd), ["a.py"])["tree_hash"]
    (wd / "checkpoint.pt").write_text("the node's own output")
    assert node({"op": "hash", "workdir": str(wd)})["tree_hash"] == out["tree_hash"]  # the record, not a walk
    assert node({"op": "probe", "workdir": str(wd), "nonce": "nope"})["record"] == ["a.py"]


def test_dry_run_probe_creates_nothing(tmp_path):
    wd = tmp_path / "wd"
    assert node({"op": "probe", "workdir": str(wd), "nonce": "n", "create": False})["state"] == "missing"
    assert not wd.exists()


def test_a_foreign_directory_is_refused_unless_adopted_and_then_nothing_is_lost(tmp_path):
    wd = make_tree(tmp_path / "wd", {"data/train.bin": "dataset", "train.py": "their version"})
    before = tree_of(wd)
    out = node({"op": "probe", "workdir": str(wd), "nonce": "n"})
    assert "refusing to sync" in out["error"] and "--adopt" in out["error"] and "data" in out["error"]
    assert out["code"] == treehash.NOT_OURS  # what the controller acts on (run's --adopt hint), not the text
    assert tree_of(wd) == before and not (wd / ".ddpfab").exists()
    out = node({"op": "probe", "workdir": str(wd), "nonce": "n", "adopt": True, "files": ["train.py", "other.py"]})
    assert out["state"] == "adopted" and out["kept"] == ["train.py"]
    assert (Path(out["kept_dir"]) / "train.py").read_text() == "their version"
    assert not (wd / "train.py").exists() and (wd / "data/train.bin").read_text() == "dataset"


def test_commit_deletes_only_recorded_files_and_never_through_a_symlink(tmp_path):
    wd = tmp_path / "wd"
    outside = make_tree(tmp_path / "outside", {"sub/victim.py": "not in the workdir"})
    node({"op": "probe", "workdir": str(wd), "nonce": "n", "files": ["old/x.py", "keep.py", "sub/victim.py"]})
    make_tree(wd, {"old/x.py": "placed", "keep.py": "placed", "mine.txt": "the node's", "sub/victim.py": "placed"})
    import shutil

    shutil.rmtree(wd / "sub")
    (wd / "sub").symlink_to(outside / "sub")  # a node-side symlink where a placed dir was
    out = node({"op": "commit", "workdir": str(wd), "files": ["keep.py"],
                "delete": ["old/x.py", "mine.txt", "sub/victim.py", "../outside/sub/victim.py"]})
    assert out["deleted"] == 1
    assert not (wd / "old").exists()  # the emptied dir went with its last placed file
    assert (wd / "mine.txt").exists() and (outside / "sub/victim.py").exists()
    assert treehash.read_record(str(wd))["files"] == ["keep.py"]


def test_a_tampered_record_is_data_not_orders(tmp_path):
    wd = tmp_path / "wd"
    victim = make_tree(tmp_path / "v", {"victim": "x"})
    node({"op": "probe", "workdir": str(wd), "nonce": "n"})
    (wd / ".ddpfab" / "sync.json").write_text(json.dumps({"v": 1, "files": ["../v/victim"]}))
    out = node({"op": "commit", "workdir": str(wd), "files": [], "delete": ["../v/victim"]})
    assert "not a ddpfab 1 record" in out["error"] and (victim / "victim").exists()
    out = node({"op": "probe", "workdir": str(wd), "nonce": "n"})  # a record it cannot trust: not proven its own
    assert "--adopt" in out["error"] and out["code"] == treehash.NOT_OURS


def test_a_workdir_without_a_record_says_so_as_a_code(tmp_path):
    wd = make_tree(tmp_path / "wd", {"a.py": "a"})
    out = node({"op": "hash", "workdir": str(wd)})
    assert out["code"] == treehash.NO_RECORD  # sync's unchanged-tree check asks again with the paths on it
    assert node({"op": "hash", "workdir": str(wd), "paths": ["a.py"]})["tree_hash"] == digest(wd)


def test_the_nodes_refused_as_not_ours_are_data_on_the_sync_error():
    result = sync.SyncResult(src="/p", tree_hash="", files=1, bytes=1, selection="walk", git_commit=None,
                             git_dirty=None, fanout="star")
    result.nodes = {"node1": sync.NodeSync("node1", state="owned"),
                    "node10": sync.NodeSync("node10", state=treehash.NOT_OURS)}
    assert sync.SyncError(["host node10: ..."], result).not_ours == ["node10"]
    assert sync.SyncError(["host node1: refusing to sync: ..."]).not_ours == []
    result.nodes["node1"].ok, result.nodes["node10"].error = True, "host node10: probe: refusing to sync ..."
    [problem] = result.problems  # what sync --json reports
    assert (problem.node, problem.check, problem.fix, str(problem)) == (
        "node10", "workdir", "ddpfab sync --adopt", "host node10: probe: refusing to sync ...")


def test_shared_cannot_be_proven_is_refused(tmp_path):
    wd = make_tree(tmp_path / "wd", {"a.py": "a"})
    out = node({"op": "probe", "workdir": str(wd), "nonce": None, "nonce_error": "read-only file system"})
    assert "cannot tell whether" in out["error"] and "read-only" in out["error"] and out["code"] == ""
    out = node({"op": "probe", "workdir": str(tmp_path / "fresh"), "nonce": None, "nonce_error": "read-only"})
    assert out["state"] == "new"  # a directory that did not exist cannot be this one


# -- the hash ---------------------------------------------------------------------------------------
def digest(root: Path, keep=()) -> str:
    files, _ = treehash.walk(str(root), treehash.Skipper(str(root), keep))
    return treehash.tree_digest(str(root), files)["tree_hash"]


def test_hash_counts_names_contents_exec_bit_and_link_targets(tmp_path):
    root = make_tree(tmp_path / "t", {"a.py": "a", "d/b.sh": ("exec", "b"), "l": ("link", "a.py")})
    base = digest(root)
    assert digest(root) == base
    (root / "a.py").write_text("A")
    assert digest(root) != base
    (root / "a.py").write_text("a")
    assert digest(root) == base
    (root / "d/b.sh").chmod(0o644)
    assert digest(root) != base
    (root / "d/b.sh").chmod(0o755)
    (root / "l").unlink()
    (root / "l").symlink_to("d/b.sh")
    assert digest(root) != base
    (root / "l").unlink()
    (root / "l").symlink_to("a.py")
    (root / "a.py").rename(root / "a2.py")
    assert digest(root) != base


def test_hash_ignores_mtime_umask_bits_empty_dirs_and_skipped(tmp_path):
    root = make_tree(tmp_path / "t", {"a.py": "a", "d/b.sh": ("exec", "b")})
    base = digest(root)
    os.utime(root / "a.py", (1, 1))
    (root / "a.py").chmod(0o664)
    (root / "d/b.sh").chmod(0o775)
    (root / "empty").mkdir()
    make_tree(root, {"__pycache__/x.pyc": "c", "runs/r/x": "r", "venv/pyvenv.cfg": "", ".git/HEAD": "h",
                     "out/c.pt": "o"})
    assert digest(root, keep=("out/",)) == base


def test_hash_is_the_same_for_a_walk_and_a_list_and_diff_names_paths(tmp_path):
    root = make_tree(tmp_path / "t", {"b": "1", "a/c": "2", "a b/ü": "3"})
    by_list = treehash.tree_digest(str(root), ["a b/ü", "b", "a/c"], detail=True)
    assert by_list["tree_hash"] == digest(root)
    assert by_list["files"] == 3 and by_list["bytes"] == 3
    other = dict(by_list["entries"], b="x")
    other.pop("a/c")
    other["new"] = "y"
    assert treehash.diff_entries(by_list["entries"], other) == ["a/c (missing there)", "b (differs)",
                                                                 "new (only there)"]


def test_node_program_is_standalone_and_agrees(tmp_path):
    """What the nodes run: the node program (workdir.py, treehash.py, ...) through `python -c`,
    stdlib only, the request on stdin."""
    for module in nodeprog.SOURCES:
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     and not n.level}
        # torch: only what `facts` with `full` checks on a node that has it (ddpfab check --full)
        assert imported - {"torch"} <= set(sys.stdlib_module_names), module.__name__
    root = make_tree(tmp_path / "t", {"a.py": "a", "x/y.sh": ("exec", "y"), "runs/r": "r", "out/o": "o"})
    out = node({"op": "hash", "workdir": str(root), "paths": ["a.py", "x/y.sh"]})
    assert out["tree_hash"] == digest(root, keep=("out/",))


# -- fan-out plan -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64])
def test_tree_schedule_reaches_every_node_once_in_log_rounds(n):
    children = sync.tree_schedule(n)
    parents = [p for p, kids in children.items() for _ in kids]
    received = sorted(c for kids in children.values() for c in kids)
    assert received == list(range(1, n))  # everyone but the root, once
    assert len(parents) == n - 1
    # rounds: node 0 holds at round 0; a child served k-th by its parent holds at parent's round + k
    when = {0: 0}
    for p in sorted(children):
        for k, c in enumerate(children[p], start=1):
            when[c] = when[p] + k
    assert max(when.values()) == (n - 1).bit_length()


def test_tree_schedule_of_eight():
    assert sync.tree_schedule(8) == {0: [1, 2, 4], 1: [3, 5], 2: [6], 3: [7], 4: [], 5: [], 6: [], 7: []}


def test_rsync_argv_and_stats():
    argv = sync.rsync_argv("/f", "ssh -p 2", "/src/", "h:/dst", compress=True)
    assert argv[:len(sync.RSYNC_BASE) + 1] == ["rsync", *sync.RSYNC_BASE]
    assert "--compress" in argv and "--checksum" not in argv and "--files-from=/f" in argv
    assert not any(a.startswith("--delete") for a in argv)
    assert argv[-2:] == ["/src/", "h:/dst/"]
    stats = "Number of regular files transferred: 1,234\nTotal bytes sent: 5,678,901\n"
    assert sync._rsync_stats(stats) == {"files_transferred": 1234, "bytes_sent": 5678901}


def test_register_adds_the_subcommand():
    parser = argparse.ArgumentParser(prog="ddpfab")
    sub = parser.add_subparsers(dest="command", required=True)
    sync_cli.register(sub)
    args = parser.parse_args(["sync", "-i", "inv.yml", "--fanout", "tree", "--keep", "ckpt/", "--adopt", "--dry-run",
                              "proj"])
    assert args.func is sync_cli.cmd_sync
    assert (args.inventory, args.fanout, args.keep, args.path) == (["inv.yml"], "tree", ["ckpt/"], "proj")
    assert args.adopt and args.dry_run


def test_list_needs_no_inventory(tmp_path, capsys):
    root = make_tree(tmp_path / "p", {"a.py": "a", "b/c.py": "c", ".ddpfab/sync.json": "{}"})
    assert cli.main(["sync", "--list", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == ["a.py", "b/c.py"]  # never ddpfab's own state
    assert cli.main(["sync", str(root)]) == 2


def test_sync_leaves_out_the_runs_dir_run_uses(tmp_path, capsys, monkeypatch):
    """`run --runs-dir exp/runs` leaves its records out of its sync; `sync` must too, or the two
    place and release them in turn (and the next sync moves them to .ddpfab/kept/ on every node)."""
    root = make_tree(tmp_path / "p", {"a.py": "a", "exp/runs/r1/manifest.json": "{}", "runs2/r/x": "x"})
    monkeypatch.delenv("DDPFAB_RUNS_DIR", raising=False)
    assert cli.main(["sync", "--list", "--runs-dir", str(root / "exp/runs"), str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == ["a.py", "runs2/r/x"]
    monkeypatch.setenv("DDPFAB_RUNS_DIR", str(root / "runs2"))  # the default, as run's
    assert cli.main(["sync", "--list", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == ["a.py", "exp/runs/r1/manifest.json"]

def test_an_empty_selection_stops_before_any_host_is_contacted(tmp_path):
    from ddpfab.hosts.inventory import Inventory

    root = make_tree(tmp_path / "p", {".gitignore": "*\n"})
    cluster = Inventory("inv", "all", (Node(name="n1", host="192.0.2.1"),))
    with pytest.raises(sync.SyncError, match="no files to send"):
        sync.sync_cluster(cluster, root, HostKeyPolicy())
    with pytest.raises(ValueError):
        sync.sync_cluster(cluster, root, HostKeyPolicy(), fanout="ring")


def test_digest_cache_skips_unchanged_files_but_not_rewrites_with_old_stamps(tmp_path, monkeypatch):
    monkeypatch.setattr(treehash, "RACY_S", -1.0)  # cache even files written just now
    root = make_tree(tmp_path / "t", {"a.py": "aaaa", "b.py": "bbbb"})
    first = treehash.tree_digest(str(root), ["a.py", "b.py"], cache=True)["tree_hash"]
    where = Path(treehash.cache_path(str(root)))
    cached = json.loads(where.read_text())
    assert set(cached["files"]) == {"a.py", "b.py"}
    # a hit really skips the read: a planted digest with matching stamps is what gets used
    cached["files"]["b.py"][4] = "0" * 64
    where.write_text(json.dumps(cached))
    assert treehash.tree_digest(str(root), ["a.py", "b.py"], cache=True)["tree_hash"] != first
    assert treehash.tree_digest(str(root), ["a.py", "b.py"], cache=False)["tree_hash"] == first
    # same size, mtime put back: ctime moved, so the cache misses and the change shows
    where.unlink()
    assert treehash.tree_digest(str(root), ["a.py", "b.py"], cache=True)["tree_hash"] == first
    time.sleep(0.05)  # past the clock tick of the cached stamps (what RACY_S guards in real use)
    st = (root / "a.py").stat()
    (root / "a.py").write_text("AAAA")
    os.utime(root / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert json.loads(where.read_text())["files"]["a.py"][:2] == [st.st_size, st.st_mtime_ns]
    assert treehash.tree_digest(str(root), ["a.py", "b.py"], cache=True)["tree_hash"] != first


def _two_trees(tmp_path, here: bytes, there: bytes):
    """The detailed digests of a one-file tree here and on a 'node' whose file holds *there*."""
    a, b = tmp_path / "here", tmp_path / "there"
    tmp_path.mkdir(exist_ok=True)
    for d, data in ((a, here), (b, there)):
        d.mkdir()
        (d / "train.py").write_bytes(data)
    return (treehash.tree_digest(str(a), ["train.py"], detail=True),
            treehash.tree_digest(str(b), ["train.py"], detail=True))


def test_mismatch_advice_names_checksum_only_where_the_quick_check_could_have_skipped(tmp_path):
    ours, theirs = _two_trees(tmp_path, b"print(1)\n", b"print(22)\n")  # the size changed
    assert ours["sizes"] == {"train.py": 9} and theirs["sizes"] == {"train.py": 10}
    after_copy = sync.mismatch_advice(ours, theirs, verify_only=False, checksum=False)
    assert "checksum=True would not help" in after_copy and "run `ddpfab sync --checksum`" not in after_copy
    verify = sync.mismatch_advice(ours, theirs, verify_only=True, checksum=False)
    assert "(verify_only=True)" in verify and "`ddpfab sync`" in verify and "checksum" not in verify

    ours, theirs = _two_trees(tmp_path / "same", b"print(1)\n", b"print(2)\n")  # same size, other bytes
    after_copy = sync.mismatch_advice(ours, theirs, verify_only=False, checksum=False)
    assert after_copy.startswith("train.py: the same size") and "run `ddpfab sync --checksum`" in after_copy
    assert "`ddpfab sync --checksum`" in sync.mismatch_advice(ours, theirs, verify_only=True, checksum=False)
    # contents were compared already: --checksum is no advice
    assert "checksum" not in sync.mismatch_advice(ours, theirs, verify_only=False, checksum=True)


def test_a_sync_never_copies_from_a_system_dir_or_a_home(tmp_path, monkeypatch):
    """From / the selection walked the whole machine (a PermissionError traceback in /proc); from a
    home it would send its keys and dotfiles to every node. What lies under them is a project."""
    home = tmp_path / "someone"
    (home / "proj").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(workdir, "_homes", lambda: ["/home/alice", "/var/www", "/nonexistent"])
    for root, why in (("/", "it is a system directory"), ("/etc", "it is a system directory"),
                      (str(home), "it is a home directory"), ("/home/alice", "it is a home directory")):
        assert why in workdir.source_problem(root) and "cd into the project" in workdir.source_problem(root)
    with pytest.raises(sync.SyncError, match="refusing to sync from /: it is a system directory"):
        sync.select("/")
    with pytest.raises(sync.SyncError, match="it is a home directory"):
        sync.select(home)
    for project in ("/usr/src/app", "/usr/local/src/proj", "/var/www", "/srv/x", "/opt/x", "/home/alice/proj",
                    "/home/shared-datasets", str(home / "proj"), "/work"):
        assert workdir.source_problem(project) is None, project
    assert sync.select(home / "proj").files == []


def test_an_unreadable_directory_in_the_tree_is_named_not_a_traceback(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x")
    real = os.scandir

    def scandir(path):
        if str(path).endswith("secret"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    (tmp_path / "secret").mkdir()
    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(sync.SyncError, match=r"cannot read .*secret: Permission denied; make it readable"):
        sync.select(tmp_path)


def test_a_directory_the_project_turns_back_into_a_file_is_no_obstacle(tmp_path):
    """``item`` a file, then ``item/f``, then a file again: every node refused the third sync ("a
    directory that ddpfab did not place") though its record listed item/f. The placed files the
    project no longer has go first; a node's own files in that directory are moved aside whole."""
    wd = tmp_path / "wd"
    node({"op": "probe", "workdir": str(wd), "nonce": "n", "files": ["item/f", "other/g"]})
    for rel in ("item/f", "other/g"):
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_text(rel)
    node({"op": "commit", "workdir": str(wd), "delete": [], "files": ["item/f", "other/g"]})
    (wd / "other" / "ckpt.pt").write_text("the node's own")  # made by a job on the node
    out = node({"op": "probe", "workdir": str(wd), "nonce": "n", "files": ["item", "other"]})
    assert "error" not in out, out
    assert not (wd / "item").exists()  # only ddpfab's file was there: gone with its dir
    assert out["kept"] == ["other"] and (Path(out["kept_dir"]) / "other" / "ckpt.pt").read_text() == "the node's own"
    assert not (wd / "other").exists()
    assert treehash.read_record(str(wd))["files"] == sorted(["item", "item/f", "other", "other/g"])


def test_a_ctrl_c_while_the_nodes_are_probed_does_not_wait_for_the_local_hash(monkeypatch):
    """A Ctrl-C (or a node's failure) while sync probes the nodes reaches the caller at once, as
    what it is: it used to wait for this machine's hash of the tree to end, and a hash that then
    failed (a file gone mid-read) replaced the interrupt with a SyncError (exit 1, not 130)."""
    import signal

    from ddpfab.launch.interrupt import Interrupted

    def slow_failing_hash(*args):
        time.sleep(1.5)
        raise OSError("a file vanished while it was read")

    def interrupted_probe(create: bool) -> None:
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(sync, "local_tree", slow_failing_hash)
    job = object.__new__(sync._Sync)
    job.sel, job.checksum = None, False
    job.connect_and_probe = interrupted_probe
    started = time.monotonic()
    with pytest.raises(Interrupted):
        job.probe_while_hashing(create=True)
    assert time.monotonic() - started < 1


def test_what_plan_emit_wrote_into_the_project_is_never_sent(tmp_path):
    """``plan --emit job`` inside the project: its scripts hold the run's secrets, and the next
    run's sync copied them (and the emitted ssh_config) to every node's workdir (a new user's
    pass). The files its marker lists stay here; a file of the user's in that directory is sent."""
    (tmp_path / "train.py").write_text("")
    job = tmp_path / "job"
    job.mkdir()
    for name in ("rank0-node1.sh", "ssh_config", "README.txt"):
        (job / name).write_text("export HF_TOKEN=hunter2\n")
    (job / ".ddpfab-emit").write_text("rank0-node1.sh\nssh_config\nREADME.txt\n")
    (job / "notes.md").write_text("mine\n")
    files = sync.select(tmp_path).files
    assert sorted(files) == ["job/notes.md", "train.py"], files


def test_an_unreadable_emit_marker_is_no_list_and_no_traceback(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / ".ddpfab-emit").write_bytes(b"\xff\xfe not utf-8\n")
    (tmp_path / "job" / "notes.md").write_text("")
    assert sorted(sync.select(tmp_path).files) == ["job/notes.md", "train.py"]


def test_only_a_setup_line_s_failure_changes_a_sync_problem_s_kind():
    """A node's setup line is its environment's problem; any other stays sync's (a review found
    every kind passed on: unreachable, auth, timeout...)."""
    result = sync.SyncResult(src="/p", tree_hash="x", files=0, bytes=0, selection="walk", git_commit=None,
                             git_dirty=None, fanout="star")
    for name, kind in (("a", "setup"), ("b", "unreachable"), ("c", None)):
        rec = result.nodes[name] = sync.NodeSync(name)
        sync._Sync.fail(None, types.SimpleNamespace(rec=rec),  # type: ignore[arg-type]
                        Problem(name, kind, text=f"host {name}: no") if kind else f"host {name}: no")
    assert [(p.node, p.check) for p in result.problems] == [("a", "setup"), ("b", "sync"), ("c", "sync")]
