"""Code sync: every node gets this project's files, checked by hash, and nothing else is touched.

``ddpfab sync --inventory INV [PATH]`` (PATH defaults to the current dir) copies the project to
every node's workdir (``ddpfab_workdir``, else the same absolute path as here) with rsync over
each node's one SSH connection, all nodes at once, then has each node hash the files it received (the same stdlib code
as here, :mod:`ddpfab.node.treehash`) and compares that with the local hash. A node whose copy differs
is an error naming the node and the paths that differ.

What is sent (the *selection*): in a git work tree, exactly ``git ls-files -co --exclude-standard``
(tracked plus untracked-but-not-ignored files; submodules and nested repos are listed by their own
git); elsewhere, a walk that applies ``.gitignore`` files like git does. Then, in both cases,
``.ddpfabignore`` files (gitignore syntax) remove more, and the skipped paths of
:mod:`ddpfab.node.treehash` (``runs/``, ``__pycache__``, ``.git`` unless ``--with-git``, ``.ddpfab/``,
virtualenvs, *keep* patterns) are never sent. Private keys and ``.ssh/`` directories
(:mod:`ddpfab.transfer.keys`) are left out too, and named in one line, unless ``--include-keys``
(or a ``.ddpfabignore`` negation names one). rsync receives that list as ``--files-from``.

Ownership, not a mirror: each node's workdir records what ddpfab placed (``.ddpfab/sync.json``).
A sync deletes on a node only recorded files that are gone here (deleted or renamed); a file that
is still here but no longer selected (it became ignored) is released, not deleted. Everything else
on a node is the user's: checkpoints, datasets, logs, ignored paths. A directory that exists, is
not empty and has no record is refused unless ``--adopt``; every workdir is checked here and on
the node as the node resolves it (:mod:`ddpfab.node.workdir`). ``--dry-run`` lists, per node, what would
be copied, updated and deleted; a real sync prints one line per node with those counts.

SSH: one connection per node (a run's own, when a run syncs) carries the probe, the lock's
session, rsync and the hash check: the node's :class:`ddpfab.remote.noderunner.NodeRunner`, which
reaches it as every command does (:mod:`ddpfab.remote.target`) and runs rsync's remote side on
a channel of it. With nothing changed, only the hash check runs (:func:`unchanged`). The helpers
(rsync and its relay, the fan-out's agent) and the temp dir are ended by a watcher
(:mod:`ddpfab.remote.reaper`) even when ddpfab is killed.

Fan-out (``--fanout tree``): the controller sends to one node only; nodes then forward along a
binomial tree (each round doubles the nodes that hold the code), so a slow uplink is crossed once.
Node-to-node rsync authenticates through a forwarded, dedicated ssh-agent that lives only for the
sync and holds the inventory key restricted (``ssh-add -h``) to the planned hops' destinations; the
forwarding node verifies the next node's host key against lines pushed from the controller's
known_hosts. When that is not possible ddpfab says why and uses the star. See docs/sync.md.
"""

from __future__ import annotations

import base64
import getpass
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.remote import waits
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.node import treehash, workdir
from ddpfab.optionnames import option
from ddpfab.planning import emit
from ddpfab.problems import DdpfabError, NodeError, Problem
from ddpfab.remote.reaper import Reaper
from ddpfab.remote.noderunner import Agent, Finished, NodeRunner, close_group, hop_rsh, open_group
from ddpfab.remote.noderunner import rsync_argv as runner_argv
from ddpfab.remote.ssherror import SSHError
from ddpfab.remote.target import HostKeyPolicy, TargetError, bracket, resolve_all
from ddpfab.results import GroupResult
from ddpfab.transfer import keys

#: rsync flags: links as links, permissions, times (the quick check needs them); no owners/groups
#: (files belong to the SSH user); no deletions (ddpfab deletes only what it placed, on the node);
#: the file list comes as --files-from; one itemised line per change (counted, or listed by
#: --dry-run).
RSYNC_BASE = ("-lpt", "--omit-dir-times", "--from0", "--stats", "--itemize-changes")
#: How long a sync waits for another sync of the same workdir to finish, by default (seconds).
LOCK_WAIT_S = 600.0
#: ``SyncError.code`` and ``NodeSync.state`` of a node whose workdir another sync holds: refused
#: (``--no-wait``, or the wait ran out) before anything was changed anywhere.
BUSY = "busy"


class SyncError(DdpfabError):
    """Sync failed on some nodes; ``problems`` has one problem per failing node (or cause),
    ``result`` what happened everywhere (the nodes that did sync are in it too), ``code`` the node
    program's code for a refusal on one node (``treehash.NOT_OURS``...), when it gave one."""

    check = "sync"

    def __init__(self, problems: Problem | str | Sequence[Problem | str], result: SyncResult | None = None,
                 code: str = ""):
        super().__init__(problems)
        self.result = result
        self.code = code

    @property
    def not_ours(self) -> list[str]:
        """The nodes whose workdir was refused as not ddpfab's (``--adopt`` takes it over)."""
        nodes = self.result.nodes.values() if self.result else ()
        return [r.name for r in nodes if r.state == treehash.NOT_OURS]

    @property
    def stale(self) -> list[str]:
        """The nodes that see this very directory (shared) with other contents: skipping the sync
        would run the old code there."""
        nodes = self.result.nodes.values() if self.result else ()
        return [r.name for r in nodes if r.source == "shared" and not r.ok]


# -- results -----------------------------------------------------------------------------------
@dataclass
class NodeSync:
    """What happened on one node.

    Args:
        name: the inventory name.
        workdir: the absolute workdir there.
        source: where the code came from: "controller", another node's name, or "shared" (the
            workdir is the controller's own directory, e.g. a shared filesystem: nothing copied).
        transfer_s: seconds the copy took (rsync, end to end).
        verify_s: seconds the hash check on the node took.
        state: whose the workdir was: new (created by this sync), owned (ddpfab's record was
            there), empty, adopted (``--adopt``), missing (a dry run into a dir not there yet),
            not-ours (it holds what ddpfab did not put there: refused, unless ``--adopt``).
        bytes_sent: bytes the sender put on the wire (rsync's "Total bytes sent").
        files_transferred: regular files rsync (re)wrote.
        copied: files and links that were not there; updated: ones rsync changed.
        deleted: files ddpfab had placed and this sync deleted (gone here).
        kept: paths that were there, not ddpfab's, and were moved aside for a project file.
        items: with --dry-run, ``[action, path]`` per change (copy, update, delete).
        tree_hash: the hash the node computed.
        ok: synced and verified.
        error: the problem, one line, when not ok.
        error_kind: ``setup`` when a setup line failed there (not sync's problem), else None.
    """

    name: str
    workdir: str = ""
    source: str = ""
    state: str = ""
    transfer_s: float | None = None
    verify_s: float | None = None
    bytes_sent: int | None = None
    files_transferred: int | None = None
    copied: int | None = None
    updated: int | None = None
    deleted: int | None = None
    kept: list[str] = field(default_factory=list)
    items: list[list[str]] = field(default_factory=list)
    tree_hash: str | None = None
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None


@dataclass
class SyncResult:
    """The synced tree and what happened on each node; ``to_dict()`` goes into the run manifest.

    Args:
        src: the local directory that was sent.
        tree_hash: sha256 tree hash of the selection (see :mod:`ddpfab.node.treehash`).
        files: number of files and symlinks in the selection; bytes: their total size.
        selection: "git" (git ls-files) or "walk" (not a git work tree).
        git_commit: HEAD of the work tree, None outside git or before the first commit.
        git_dirty: uncommitted changes or untracked files (the tree is not exactly the commit).
        fanout: the fan-out used ("star" or "tree"; "tree" may have fallen back to "star").
        nodes: per node, in inventory order.
        notes: things the user should know (fallbacks, shared dirs).
        duration_s: wall time of the whole sync.
        dry_run: nothing was written; ``items`` per node say what would be.
        left_out: the private keys (and ``.ssh/`` files) the selection left out
            (:mod:`ddpfab.transfer.keys`); include_keys: they were sent on purpose (``--include-keys``).
    """

    src: str
    tree_hash: str
    files: int
    bytes: int
    selection: str
    git_commit: str | None
    git_dirty: bool | None
    fanout: str
    nodes: dict[str, NodeSync] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    dry_run: bool = False
    left_out: list[str] = field(default_factory=list)
    include_keys: bool = False

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out["nodes"] = {k: asdict(v) for k, v in self.nodes.items()}
        return out

    @property
    def problems(self) -> list[Problem]:
        """Every node that did not sync, as a problem (a workdir refused as not ddpfab's names
        ``--adopt`` as its fix)."""
        out = []
        for r in self.nodes.values():
            if r.ok:
                continue
            text = r.error or f"host {r.name}: not synced"
            if r.state == treehash.NOT_OURS:
                out.append(Problem(r.name, "workdir", expected="a workdir ddpfab placed, or an empty one",
                                   found="files ddpfab did not put there", fix="ddpfab sync --adopt", text=text))
            else:
                out.append(Problem(r.name, r.error_kind or "sync", found=text, text=text))
        return out


# -- what is sent ------------------------------------------------------------------------------
@dataclass
class Selection:
    """The files (and symlinks) to send, relative to ``root``, and where that list came from;
    ``left_out``: the private keys it holds back (:mod:`ddpfab.transfer.keys`), none with
    ``include_keys``."""

    root: str
    files: list[str]
    source: str
    keep: tuple[str, ...] = ()
    with_git: bool = False
    git_commit: str | None = None
    git_dirty: bool | None = None
    left_out: list[str] = field(default_factory=list)
    include_keys: bool = False

    def result(self, **fields) -> SyncResult:
        """A SyncResult of this selection (its counts, origin and what it left out), *fields* added."""
        return SyncResult(src=self.root, files=len(self.files), selection=self.source, git_commit=self.git_commit,
                          git_dirty=self.git_dirty, left_out=list(self.left_out), include_keys=self.include_keys,
                          **fields)


def keep_patterns(root: str, extra: tuple[str, ...] | list[str] = ()) -> tuple[str, ...]:
    """The keep patterns: lines of ROOT/.ddpfabkeep, then *extra* (``--keep``)."""
    lines = treehash.read_lines(os.path.join(root, treehash.KEEP_FILE))
    return tuple(ln for ln in lines if treehash.compile_line(ln)) + tuple(extra)


def runs_keep(src: str | os.PathLike, runs_dir: str | os.PathLike) -> tuple[str, ...]:
    """The keep pattern that leaves the controller's runs dir out of the project *src* when it is
    inside it (``--runs-dir exp/runs``): ``("/exp/runs/",)``, else ``()``. Sent, the records would
    reach every node, and each run, making its record, would change the tree (replay: "the code
    changed"). ``runs/`` at the top, the default, is skipped anyway (:mod:`ddpfab.node.treehash`)."""
    root = os.path.realpath(os.fspath(src))
    rel = os.path.relpath(os.path.realpath(os.path.expanduser(os.fspath(runs_dir))), root)
    if rel == "." or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return ()
    return ("/" + re.sub(r"([\\*?\[ !#])", r"\\\1", rel.replace(os.sep, "/")) + "/",)


def _git(root: str, *args: str) -> bytes | None:
    try:
        proc = subprocess.run(["git", "-C", root, *args], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _git_listing(root: str) -> list[str] | None:
    """``git ls-files -co --exclude-standard`` of *root*, or None when git does not apply (no git,
    not a work tree, or *root* itself ignored by an enclosing repo)."""
    inside = _git(root, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != b"true":
        return None
    if _git(root, "check-ignore", "-q", ".") is not None:  # exit 0: root is ignored
        return None
    out = _git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard")
    if out is None:
        return None
    seen, rels = set(), []
    for raw in out.split(b"\0"):
        if raw and raw not in seen:
            seen.add(raw)
            rels.append(os.fsdecode(raw).rstrip("/"))
    return rels


def _walked_files(root: str, skipper: treehash.Skipper) -> list[str]:
    """The files outside git: a walk that applies ``.gitignore`` and ``.ddpfabignore`` files as
    git does; an unreadable directory is a SyncError that says how to leave it out."""
    try:
        found, _ = treehash.walk(root, skipper, treehash.IgnoreFiles(root, [".gitignore", treehash.IGNORE_FILE]))
    except OSError as exc:  # an unreadable directory in the tree
        raise SyncError([f"cannot read {exc.filename}: {exc.strerror}; make it readable, or leave it out with "
                         f"a line in {treehash.IGNORE_FILE}"]) from None
    return found


def _git_state(root: str) -> tuple[str | None, bool | None]:
    """HEAD of the work tree at *root* (None before the first commit) and whether the tree differs
    from it (None when git cannot say): the result records which code was sent."""
    head = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    commit = head.decode().strip() if head else None
    status = _git(root, "status", "--porcelain", "-z", "--untracked-files=normal", "--", ".")
    return commit, (bool(status) if status is not None else None)


def _git_files(root: str, listed: list[str], skipper: treehash.Skipper, ddp_ignore: treehash.IgnoreFiles,
               with_git: bool) -> list[str]:
    """The files of git's *listed* paths that are sent: a submodule or nested repository expanded
    by its own listing, then the skipped and ``.ddpfabignore``d ones left out; ``.git`` added
    with *with_git*."""
    files: list[str] = []
    queue = list(listed)
    while queue:
        rel = queue.pop()
        try:
            st = os.lstat(os.path.join(root, rel))
        except OSError:  # tracked but deleted here
            continue
        if stat.S_ISDIR(st.st_mode):  # a submodule or a nested repository: its own listing
            if skipper.dir_reason(rel):
                continue
            sub = os.path.join(root, rel)
            inner = _git_listing(sub)
            if inner is None:
                inner, _ = treehash.walk(sub, treehash.Skipper(sub, (), with_git),
                                         treehash.IgnoreFiles(sub, [".gitignore"]))
            queue.extend(rel + "/" + r for r in inner)
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            continue
        if skipper.file_reason(rel) or ddp_ignore.ignored(rel):
            continue
        files.append(rel)
    if with_git and os.path.isdir(os.path.join(root, ".git")):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, ".git")):
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return files


def select(src: str | os.PathLike, keep: tuple[str, ...] | list[str] = (), with_git: bool = False,
           include_keys: bool = False) -> Selection:
    """The selection of *src*: what a sync sends (see the module doc). Private keys are left out
    (``left_out``) unless *include_keys*, or a ``.ddpfabignore`` negation names one."""
    root = os.path.abspath(os.fspath(src))
    if not os.path.isdir(root):
        raise SyncError([f"{root}: not a directory"])
    why = workdir.source_problem(root)
    if why:
        raise SyncError([why])
    patterns = keep_patterns(root, keep)
    skipper = treehash.Skipper(root, patterns, with_git)
    ddp_ignore = treehash.IgnoreFiles(root, [treehash.IGNORE_FILE])
    listed = _git_listing(root)
    commit: str | None = None
    dirty: bool | None = None
    if listed is None:
        files, source = _walked_files(root, skipper), "walk"
    else:
        source = "git"
        commit, dirty = _git_state(root)
        files = _git_files(root, listed, skipper, ddp_ignore, with_git)
    files = _without_emitted(root, files)
    left_out: list[str] = []
    if not include_keys:  # one rule for both listings, after every other one
        files, left_out = keys.split(root, files, ddp_ignore.negated)
    files.sort(key=os.fsencode)
    left_out.sort(key=os.fsencode)
    return Selection(root=root, files=files, source=source, keep=patterns, with_git=with_git,
                     left_out=left_out, include_keys=include_keys,
                     git_commit=commit, git_dirty=dirty)


def _without_emitted(root: str, files: list[str]) -> list[str]:
    """*files* less what ``plan --emit`` wrote into a directory of the tree (its marker lists
    them): its scripts hold the run's secrets, and are never sent to the nodes."""
    dirs = {os.path.dirname(f) for f in files if os.path.basename(f) == emit.MARKER}
    drop = {os.path.join(d, name) for d in dirs for name in [*(emit.own_files(Path(root, d)) or []), emit.MARKER]}
    return [f for f in files if f not in drop] if drop else files


def write_list(files: list[str], path: str | os.PathLike) -> None:
    """Write *files* NUL-separated, for ``rsync --from0 --files-from=PATH`` (names may hold
    newlines)."""
    with open(path, "wb") as fh:
        fh.write(b"".join(os.fsencode(r) + b"\0" for r in files))


def deletions(sel: Selection, placed: list[str]) -> list[str]:
    """Which of the files ddpfab *placed* on a node to delete there: those gone from this tree
    (deleted or renamed). A placed file that is still here but no longer selected (it became
    ignored) is left alone, and so is anything the keep patterns, ``runs/``, ``.git`` or a
    virtualenv cover: the node may have made it its own."""
    selected, out = set(sel.files), []
    skipper = treehash.Skipper(sel.root, sel.keep, sel.with_git)
    for rel in placed:
        if rel in selected or os.path.lexists(os.path.join(sel.root, rel)):
            continue
        if skipper.file_reason(rel) in treehash.PROTECTED:
            continue
        out.append(rel)
    return out


def check_workdir(node: Node, default: str) -> str:
    """The node's workdir as written (``ddpfab_workdir``, else *default*), checked as text here
    (the node checks it again as it resolves it); a SyncError names the host."""
    raw = node.workdir if node.workdir is not None else default
    why = workdir.lexical_problem(raw)
    if why:
        raise SyncError(Problem(node.name, "workdir", found=why,
                                text=f"host {node.name}: refusing to sync: {why}; nothing was changed there"))
    return raw


def local_tree(sel: Selection, detail: bool = False, cache: bool = True) -> dict:
    """The tree hash of the selection here (content digests cached, see ``treehash``)."""
    return treehash.tree_digest(sel.root, sel.files, detail=detail, cache=cache)


# -- the node program, over the node's runner ---------------------------------------------------
def _session(runner: NodeRunner) -> nodeprog.Session:
    """The node program kept open on *runner*'s connection (it holds the workdir's lock: the node's
    kernel releases it when the session ends in any way, a SIGKILLed ddpfab included)."""
    try:
        return runner.session(fallback="python3")
    except NodeError as exc:
        raise SyncError(exc.problems) from None


def ask_node(runner: NodeRunner, session: nodeprog.Session | None, *requests: dict, timeout: float = 600) -> list[dict]:
    """The results of *requests* in *session* (None: a session of its own, closed after it), run
    with the node's ``ddpfab_python`` when that exists there, else ``python3`` (sync may come
    first); a SyncError naming the node for the first that failed (its ``code`` kept)."""
    try:
        replies = (runner.ask(session, *requests, timeout=timeout) if session is not None else
                   runner.call(*requests, timeout=timeout, fallback="python3"))
    except NodeError as exc:
        raise SyncError(exc.problems) from None
    for r in replies:
        if not r.ok:
            raise SyncError(Problem(runner.name, r.op or "node_program", found=r.error,
                                    text=f"host {runner.name}: {r.op}: {r.error}"), code=r.code)
    return [r.result for r in replies]


def holder_text(holder: object) -> str:
    """Who holds a workdir's lock, from what the node read back (checked again here: data)."""
    h = holder if isinstance(holder, dict) else {}

    def get(key: str, kind: type) -> object:
        v = h.get(key)
        return v if isinstance(v, kind) and not isinstance(v, bool) else None

    user, host, src = get("user", str), get("host", str), get("src", str)
    pid, since = get("pid", int), get("since", (int, float))
    if not (user or host or pid):
        return "another sync (it did not say whose)"
    who = nodeprog.printable(f"{user or '?'}@{host or '?'}")
    when = time.strftime("%H:%M:%S UTC", time.gmtime(since)) if since else "?"
    where = f", from {nodeprog.printable(src)}" if src else ""
    return f"a sync by {who} (pid {pid or '?'}, since {when}{where})"


_STATS = re.compile(r"^(Total bytes sent|Number of regular files transferred):\s*([\d,]+)", re.MULTILINE)


def _rsync_stats(text: str) -> dict[str, int]:
    keys = {"Total bytes sent": "bytes_sent", "Number of regular files transferred": "files_transferred"}
    return {keys[m.group(1)]: int(m.group(2).replace(",", "")) for m in _STATS.finditer(text)}


def rsync_argv(files_from: str, rsh_e: str, src: str, dest: str, *, compress: bool = False,
               checksum: bool = False, dry_run: bool = False) -> list[str]:
    """The rsync command line of one copy (controller to node, or node to node)."""
    return runner_argv(RSYNC_BASE, files_from, rsh_e, src, dest, compress=compress, checksum=checksum,
                       dry_run=dry_run)


def itemized(text: str) -> list[list[str]]:
    """``[action, path]`` for each file or link rsync's ``--itemize-changes`` lines report:
    "copy" (not there before) or "update" (content or attributes changed). Directories are left
    out (they follow from the files)."""
    out = []
    for line in text.splitlines():
        code, _, name = line.partition(" ")
        if len(code) != 11 or code[0] not in "<>ch." or code[1] not in "fLDS" or not name:
            continue
        if code[1] == "L":
            name = name.split(" -> ", 1)[0]
        out.append(["copy" if code[2:] == "+++++++++" else "update", name])
    return out


def same_size_differences(ours: dict, theirs: dict) -> list[str]:
    """The files whose contents differ here and there at the same size (each side's
    ``tree_digest(detail=True)``): those rsync's quick check (size and mtime) may have skipped."""
    mine, there = ours.get("entries", {}), theirs.get("entries", {})
    return sorted((rel for rel in set(mine) & set(there)
                   if mine[rel] != there[rel] and ours["sizes"].get(rel) == theirs["sizes"].get(rel)),
                  key=os.fsencode)


def mismatch_advice(ours: dict | None, theirs: dict | None, *, verify_only: bool, checksum: bool) -> str:
    """What to do about a node whose tree hash is not this tree's, from what differs (each side's
    ``tree_digest(detail=True)``; None when that could not be read). ``--checksum`` only where it
    helps: for a file whose size is the same on both sides (rsync's quick check, size and mtime,
    may skip it; a size change it never skips), and not when the copy compared contents already."""
    if ours is None or theirs is None:
        return ("A file there differs from here (`ddpfab sync --checksum` compares contents, not size and mtime), "
                "or the tree changed during the sync: sync again")
    same_size = same_size_differences(ours, theirs)
    shown = ", ".join(same_size[:3]) + (", ..." if len(same_size) > 3 else "")
    if verify_only:
        if same_size:
            return (f"Nothing was copied ({option('verify_only', True)}); {shown} has the same size here and there: run "
                    "`ddpfab sync --checksum` (rsync's quick check may skip a file whose size and mtime match)")
        return f"Nothing was copied ({option('verify_only', True)}): run `ddpfab sync` to copy this tree there"
    if same_size and not checksum:
        return (f"{shown}: the same size here and there but other contents, so a file there was changed without "
                "changing its size and mtime (rsync's quick check skips those), or it changed during the sync: "
                "run `ddpfab sync --checksum`")
    return ("The tree changed during the sync (here, or in the node's workdir meanwhile): sync again"
            + ("" if checksum else f" (rsync copies a file whose size changed: {option('checksum', True)} would not help)"))


def _rsync_problem(name: str, rc: int, stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    text = " | ".join(lines[-3:]) or "no message"
    return f"host {name}: rsync failed (exit {rc}): {text}"


# -- fan-out -----------------------------------------------------------------------------------
def tree_schedule(n: int) -> dict[int, list[int]]:
    """Who forwards to whom in a binomial tree over nodes 0..n-1 (0 gets the code from the
    controller): in round r every node that holds the code sends it to one that does not, so all n
    nodes hold it after ceil(log2 n) rounds. Children are listed in the order they are served."""
    children: dict[int, list[int]] = {j: [] for j in range(n)}
    r = 1
    while r < n:
        for j in range(r):
            if j + r < n:
                children[j].append(j + r)
        r *= 2
    return children


def _known_keys(known_hosts: str, lookup: str) -> list[str]:
    """``keytype key`` of every (non-revoked, non-CA) key known_hosts has for *lookup*."""
    try:
        proc = subprocess.run(["ssh-keygen", "-F", lookup, "-f", known_hosts], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    keys = []
    for line in proc.stdout.splitlines():
        words = line.split()
        if not words or words[0].startswith("#") or words[0].startswith("@"):
            continue
        if len(words) >= 3:
            keys.append(f"{words[1]} {words[2]}")
    return keys


def _host_entry(host: str, port: str | int | None) -> str:
    return host if str(port or 22) == "22" else f"[{host}]:{port}"


def _probe_file(root: str) -> tuple[str | None, str | None]:
    """A new empty file in *root* under a random name, and None; or None and why it could not be
    made. A node that finds that name in its workdir sees this very directory (a shared filesystem):
    nothing is copied there."""
    nonce = f"{treehash.PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        fd = os.open(os.path.join(root, nonce), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except OSError as exc:
        return None, f"could not write a probe file into {root}: {exc.strerror}"
    return nonce, None


# -- the sync ----------------------------------------------------------------------------------
@dataclass
class _SyncTarget:
    node: Node
    runner: NodeRunner | None
    rec: NodeSync
    real: str = ""
    placed: list[str] | None = None
    shared: bool = False
    resent: tuple[str, ...] = ()  # files sent again by content after the quick check skipped them
    ready: bool = False
    session: nodeprog.Session | None = None
    locked: bool = False
    holder: dict | None = None


class _Sync:
    def __init__(self, cluster: Inventory, sel: Selection, conns: dict, down: dict[str, Exception],
                 compress: bool, checksum: bool, progress: Callable[[str], object], adopt: bool = False,
                 lock_wait: float = LOCK_WAIT_S, no_wait: str | None = None):
        """*conns*: each node's open connection (the run's, or sync_cluster's own); *down*: why
        the others have none; *no_wait*: how the caller asks not to wait (None: it cannot)."""
        self.cluster, self.sel, self.down = cluster, sel, down
        self.lock_wait, self.no_wait, self.refused = lock_wait, no_wait, False
        self.compress, self.checksum, self.progress, self.adopt = compress, checksum, progress, adopt
        self.ctl_dir = tempfile.mkdtemp(prefix="ddpfab-sync-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.reaper = Reaper(self.ctl_dir)
        self.list_file = os.path.join(self.ctl_dir, "files")
        write_list(sel.files, self.list_file)
        self.targets = {n.name: _SyncTarget(n, NodeRunner(n, conns[n.name], sock_dir=self.ctl_dir, reaper=self.reaper)
                                        if n.name in conns else None, NodeSync(n.name))
                        for n in cluster.nodes}
        self.notes: list[str] = []
        self.local: dict | None = None
        self.agent: Agent | None = None
        self.stages: dict[str, str] = {}
        self.holds: list[nodeprog.Session] = []
        self.fanout_used = "star"
        self.lock = threading.Lock()
        self.cancelled = False
        self.dry_run = False
        self.verify_only = False

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
        self.progress(text)

    def fail(self, t: _SyncTarget, problem: Problem | str) -> None:
        t.rec.ok, t.rec.error = False, str(problem)  # reported once, at the end (SyncError, by node)
        # (a setup line's failure is the node's environment, not sync's; every other stays sync's)
        t.rec.error_kind = "setup" if isinstance(problem, Problem) and problem.check == "setup" else None

    def request(self, t: _SyncTarget, op: str, **fields) -> dict:
        return {"op": op, "workdir": t.rec.workdir, **fields}

    # -- phase 1: connect and probe --------------------------------------------------------
    def connect_and_probe(self, create: bool) -> None:
        """Probe every node and, for a real sync (*create*), hold every workdir's lock and prepare
        it; a probe file here meanwhile lets a node tell whether its workdir is this very one."""
        nonce, nonce_error = _probe_file(self.sel.root)
        try:
            with waits.pool(min(32, len(self.targets))) as pool:
                waits.mapped(pool, lambda t: self.probe(t, create, nonce, nonce_error), self.targets.values())
                if create:
                    self.lock_all()
                    mine = [t for t in self.targets.values() if t.ready and not t.shared]
                    waits.mapped(pool, lambda t: self.prepare(t, nonce, nonce_error), mine)
        finally:
            if nonce:
                try:
                    os.unlink(os.path.join(self.sel.root, nonce))
                except OSError:
                    pass
        shared = [t.node.name for t in self.targets.values() if t.shared]
        if shared:
            self.note(f"{', '.join(shared)}: the workdir is this very directory (shared filesystem): nothing to "
                      "copy, verifying only")

    def probe(self, t: _SyncTarget, create: bool, nonce: str | None, nonce_error: str | None) -> None:
        """First look, changing nothing: the workdir checked as the node resolves it, whose it
        is, whether it is this very directory; for a real sync in the session that then holds
        the lock, with a first try (no wait) at the lock."""
        try:
            raw = check_workdir(t.node, self.sel.root)
            if t.runner is None:
                return self.fail(t, str(self.down[t.node.name]))
            req = {"op": "probe", "workdir": raw, "nonce": nonce, "nonce_error": nonce_error,
                   "create": False, "adopt": self.adopt, "files": []}
            if create:
                t.session = _session(t.runner)
            out = ask_node(t.runner, t.session, req, timeout=120)[0]
        except SyncError as exc:
            if exc.code == treehash.NOT_OURS:
                t.rec.state = exc.code
            return self.fail(t, exc.problems[0])
        t.rec.workdir, t.real = out["workdir"], out["real"]
        if out.get("shared"):
            t.shared, t.ready, t.rec.source = True, True, "shared"
            return None
        t.rec.state = out.get("state", "")
        if out["state"] == "missing" and not create and not self.dry_run:
            return self.fail(t, f"host {t.node.name}: workdir {out['workdir']} does not exist; run ddpfab sync")
        if create and not out.get("rsync"):
            return self.fail(t, f"host {t.node.name}: rsync is not installed there (apt-get install rsync, "
                                "or ddpfab provision)")
        t.placed, t.ready = out.get("record", []), True
        if create:
            self.try_lock(t, 0)
        return None

    def prepare(self, t: _SyncTarget, nonce: str | None, nonce_error: str | None) -> None:
        """Under the lock: read the record and record the files about to be placed (the union
        of old and new until the commit), moving aside what is in the way."""
        try:
            out = ask_node(t.runner, t.session, {"op": "probe", "workdir": t.rec.workdir, "nonce": nonce,
                                  "nonce_error": nonce_error, "create": True, "adopt": self.adopt,
                                  "files": self.sel.files, "locked": True}, timeout=120)[0]
        except SyncError as exc:
            t.ready = False
            if exc.code == treehash.NOT_OURS:
                t.rec.state = exc.code
            return self.fail(t, exc.problems[0])
        t.rec.state, t.placed = out.get("state", ""), out.get("record", [])
        if out.get("kept"):
            t.rec.kept = out["kept"]
            shown = ", ".join(out["kept"][:5]) + (", ..." if len(out["kept"]) > 5 else "")
            self.note(f"{t.node.name}: {len(out['kept'])} files there that ddpfab had not placed are in the way "
                      f"of project files; moved to {out['kept_dir']}: {shown}")
        return None

    # -- one writer per workdir ----------------------------------------------------------------
    def try_lock(self, t: _SyncTarget, wait_s: float) -> None:
        """Ask *t*'s session for its workdir's lock, waiting up to *wait_s* s on the node."""
        holder = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.time(), "src": self.sel.root}
        try:
            out = ask_node(t.runner, t.session, {"op": "lock", "holder": holder, "wait_s": wait_s}, timeout=wait_s + 120)[0]
        except SyncError as exc:
            t.ready = False
            return self.fail(t, exc.problems[0])
        t.locked, t.holder = out.get("locked") is True, out.get("holder")
        return None

    def lock_all(self) -> None:
        """Hold every node's workdir lock, or none and refuse (nothing changed anywhere). A sync
        that must wait releases what it holds and waits for one busy node at a time, so two syncs
        over overlapping nodes never wait for each other; the wait is bounded (``lock_wait``)."""
        deadline = time.monotonic() + self.lock_wait
        said: set[str] = set()
        while True:
            wanted = [t for t in self.targets.values() if t.ready and not t.shared]
            busy = [t for t in wanted if not t.locked]
            if not busy:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                why = ((self.no_wait or "not waiting") if self.lock_wait <= 0 else
                       f"waited {self.lock_wait:g} s; retry when it has finished, or end it")
                for t in wanted:
                    self.fail(t, f"host {t.node.name}: refusing to sync: {t.rec.workdir} is being changed by "
                                 f"{holder_text(t.holder)} ({why}); nothing was changed there" if not t.locked else
                                 f"host {t.node.name}: not synced: another node's workdir is being synced "
                                 "(see there); nothing was changed here")
                    t.rec.state, t.ready = BUSY, False
                self.refused = True
                return
            with waits.pool(min(32, len(wanted))) as pool:
                waits.mapped(pool, self.unlock, [t for t in wanted if t.locked])
            t = busy[0]
            whose = f"{t.node.name}: {t.rec.workdir} is being changed by {holder_text(t.holder)}"
            if whose not in said:  # one line per holder met, not one per retry
                said.add(whose)
                instead = f"; {self.no_wait} refuses instead" if self.no_wait else ""
                self.progress(f"{whose}; waiting for it (up to {left:.0f} s{instead})")
            self.try_lock(t, left)
            if t.locked:
                with waits.pool(min(32, len(wanted))) as pool:
                    waits.mapped(pool, lambda u: self.try_lock(u, 0), [u for u in wanted if not u.locked and u is not t])

    def unlock(self, t: _SyncTarget) -> None:
        try:
            ask_node(t.runner, t.session, {"op": "unlock"}, timeout=60)
        except SyncError as exc:
            t.ready = False
            self.fail(t, exc.problems[0])
        t.locked = False

    # -- copies ---------------------------------------------------------------------------
    def copy_from_controller(self, t: _SyncTarget, dry_run: bool = False) -> bool:
        argv = rsync_argv(self.list_file, t.runner.rsh(), self.sel.root, t.runner.remote(t.real),
                          compress=self.compress, checksum=self.checksum, dry_run=dry_run)
        return self._run_copy(t, lambda: t.runner.rsync(argv), "controller")

    def copy_from_node(self, src: _SyncTarget, t: _SyncTarget, hop: dict) -> bool:
        inner = rsync_argv(f"{hop['stage']}/files", hop_rsh(hop["stage"], hop["port"], hop["user"]), src.real,
                           f"{bracket(hop['addr'])}:{t.real}", compress=self.compress, checksum=self.checksum)
        return self._run_copy(t, lambda: src.runner.run_forwarding(shlex.join(inner), self.agent.sock), src.node.name)

    def _run_copy(self, t: _SyncTarget, copy: Callable[[], Finished], source: str) -> bool:
        """*copy* (rsync here, or on a forwarding node) to its end; its counts into *t*'s record."""
        if self.cancelled:
            t.rec.error = f"host {t.node.name}: sync interrupted"
            return False
        start = time.monotonic()
        done = copy()
        elapsed = time.monotonic() - start
        out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        if self.cancelled:
            t.rec.error = f"host {t.node.name}: sync interrupted"
            return False
        if done.code not in (0, 24):  # 24: files vanished meanwhile; the hash check decides
            problem = _rsync_problem(t.node.name, done.code, err)
            if source != "controller":
                problem = f"{problem} (copying from {source})"
            t.rec.error = problem
            return False
        t.rec.source, t.rec.transfer_s, t.rec.error = source, round(elapsed, 3), None
        for key, value in _rsync_stats(out).items():
            setattr(t.rec, key, value)
        items = itemized(out)
        t.rec.copied = sum(1 for a, _ in items if a == "copy")
        t.rec.updated = len(items) - t.rec.copied
        if self.dry_run:
            t.rec.items = items
        return True

    def abort(self) -> None:
        """Ctrl-C or an error in ddpfab itself: end the copies now (the threads then finish)."""
        self.cancelled = True
        for t in self.targets.values():
            if t.runner is not None:
                t.runner.cancel()

    # -- verification ------------------------------------------------------------------------
    def summary(self, t: _SyncTarget) -> str:
        counts = f"{t.rec.copied or 0} copied, {t.rec.updated or 0} updated, {t.rec.deleted or 0} deleted"
        src = f"from {t.rec.source}"
        sent = f", sent {megabytes(t.rec.bytes_sent)}" if t.rec.bytes_sent is not None else ""
        took = f" in {t.rec.transfer_s:.2f} s" if t.rec.transfer_s is not None else ""
        return (f"{t.node.name}: {t.rec.workdir}: {counts} ({src}{took}{sent}; verified in {t.rec.verify_s:.2f} s)")

    def commit(self, t: _SyncTarget) -> None:
        """After a copy: delete what ddpfab placed and is gone here, record what is placed now,
        and check the node's hash of it (one node call)."""
        if self.cancelled:
            return self.fail(t, f"host {t.node.name}: sync interrupted")
        gone = deletions(self.sel, t.placed or [])
        start = time.monotonic()
        try:
            out = ask_node(t.runner, t.session, self.request(t, "commit", delete=gone, files=self.sel.files,
                                              cache=not self.checksum, locked=True))[0]
        except SyncError as exc:
            return self.fail(t, exc.problems[0])
        t.rec.deleted = out["deleted"]
        self.check_hash(t, out, start)
        return None

    def verify(self, t: _SyncTarget) -> None:
        req = self.request(t, "hash", cache=not self.checksum)
        if t.shared:
            req["paths"] = self.sel.files
        start = time.monotonic()
        try:
            out = ask_node(t.runner, None, req)[0]
        except SyncError as exc:
            return self.fail(t, exc.problems[0])
        self.check_hash(t, out, start)
        return None

    def check_hash(self, t: _SyncTarget, out: dict, start: float) -> None:
        t.rec.verify_s = round(time.monotonic() - start, 3)
        t.rec.tree_hash = out["tree_hash"]
        if out["tree_hash"] == self.local["tree_hash"]:
            t.rec.ok = True
            if t.shared or t.rec.copied is None:
                self.progress(f"{t.node.name}: {t.rec.workdir} ok ({'shared' if t.shared else 'unchanged'}; verified "
                              f"in {t.rec.verify_s:.2f} s)")
            else:
                self.progress(self.summary(t))
            return None
        req = self.request(t, "hash", detail=True, paths=self.sel.files)
        try:
            theirs = ask_node(t.runner, None, req)[0]
            ours = local_tree(self.sel, detail=True, cache=False)
            diffs = treehash.diff_entries(ours["entries"], theirs["entries"])
        except (SyncError, OSError, KeyError):
            ours = theirs = None
            diffs = []
        if t.shared:
            return self.fail(t, (
                f"host {t.node.name}: {t.rec.workdir} is this very directory (a shared filesystem), but the node "
                "reads other contents" + (f" ({', '.join(diffs)})" if diffs else "") + ": its view lags this "
                f"machine's. Nothing is copied to a shared directory, and {option('sync', False)} would run the old "
                "code there: run again in a moment (NFS revalidates its cache within seconds). On a `ddpfab lab` host, "
                "a dir given to `lab up --share` keeps a file replaced by rename (`sed -i`, an editor's save) stale: "
                "bring the lab up from the project's directory, which its hosts see live"))
        skipped = same_size_differences(ours, theirs) if ours is not None and theirs is not None else []
        if (skipped and t.rec.copied is not None and not t.resent
                and not (t.shared or self.checksum or self.verify_only or self.dry_run)):
            return self.resend(t, skipped)
        return self.fail(t, (
            f"host {t.node.name}: tree hash mismatch in {t.rec.workdir}: the node has {out['tree_hash'][:12]} "
            f"({out['files']} files), this tree is {self.local['tree_hash'][:12]} ({self.local['files']} files)"
            + (f"; differs: {', '.join(diffs)}" if diffs else "")
            + ". " + mismatch_advice(ours, theirs, verify_only=self.verify_only,
                                     checksum=self.checksum or bool(t.resent))))

    def resend(self, t: _SyncTarget, files: list[str]) -> None:
        """rsync's quick check skipped *files* (the same size and mtime there, other contents: a
        file changed in place there, or two checkouts made in the same second): send exactly those
        again, compared by content, then commit and check the node's tree once more."""
        t.resent = tuple(files)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        self.progress(f"{t.node.name}: {shown}: the same size and mtime there but other contents; "
                      "sending again, compared by content")
        fd, path = tempfile.mkstemp(prefix="resend-", dir=self.ctl_dir)
        os.close(fd)
        write_list(files, path)
        argv = rsync_argv(path, t.runner.rsh(), self.sel.root, t.runner.remote(t.real), compress=self.compress,
                          checksum=True)
        before = (t.rec.copied or 0, t.rec.updated or 0)
        if not self._run_copy(t, lambda: t.runner.rsync(argv), "controller"):
            return self.fail(t, t.rec.error)
        t.rec.copied, t.rec.updated = before[0] + (t.rec.copied or 0), before[1] + (t.rec.updated or 0)
        return self.commit(t)

    # -- phase 2: star ------------------------------------------------------------------------
    def star(self, targets: list[_SyncTarget]) -> None:
        def one(t: _SyncTarget) -> None:
            if not self.copy_from_controller(t, dry_run=self.dry_run):
                return self.fail(t, t.rec.error)
            if self.dry_run:
                t.rec.items += [["delete", rel] for rel in deletions(self.sel, t.placed or [])]
                t.rec.deleted = sum(1 for a, _ in t.rec.items if a == "delete")
                t.rec.ok = True
                return None
            return self.commit(t)

        if targets:
            pool = ThreadPoolExecutor(max_workers=min(32, len(targets)))
            try:
                waits.mapped(pool, one, targets)
            except BaseException:  # Ctrl-C: end the copies first, or shutdown() waits for them
                self.abort()
                raise
            finally:
                pool.shutdown(wait=True)

    # -- phase 2: tree ------------------------------------------------------------------------
    def tree_setup(self, order: list[_SyncTarget]) -> tuple[dict, str | None]:
        """The hops of the binomial tree over *order*, or why the tree cannot be used."""
        if len(order) < 2:
            return {}, "tree fan-out needs at least 2 nodes to copy to"
        keys: list[str] = []
        children = tree_schedule(len(order))
        labels, constraints, hops = [], [], {}
        try:  # (over held connections, read now: an ssh_config broken since the holder started)
            reaches = {t.node.name: t.runner.target for t in order}
        except SSHError as exc:
            return {}, str(exc)
        for t in order:
            reach = reaches[t.node.name]
            if reach.jump is not None or reach.proxy_command:
                via = reach.jump.name if reach.jump else "a ProxyCommand"
                return {}, f"host {t.node.name} is reached through {via}; node-to-node copies would go around it"
        for i, t in enumerate(order):
            reach = reaches[t.node.name]
            found = [k for k in reach.identity_files if os.path.isfile(k)]
            if not found:
                return {}, (f"no private key file for host {t.node.name} (ansible_ssh_private_key_file or an ssh_config "
                            "IdentityFile): the forwarded agent needs the key in a file")
            keys += [k for k in found if k not in keys]
            lookup = _host_entry(reach.host, reach.port)
            host_keys = [k for f in reach.known_hosts for k in _known_keys(os.path.expanduser(f), lookup)]
            if not host_keys:
                return {}, (f"host {t.node.name}: no key for {lookup} in {', '.join(reach.known_hosts)} to hand to the "
                            "forwarding node")
            labels += [f"ddpfab-n{i} {k}" for k in host_keys]
            hops[t.node.name] = {"user": reach.user or getpass.getuser(), "port": str(reach.port),
                                 "addr": t.node.data_addr or t.node.host, "keys": host_keys}
        # Each hop's key use is bound to its destination (user@host key). The first hop is
        # paramiko's, which does not tell the agent which host it forwards to (no session-bind), so
        # the agent sees a forwarding node's use as its own: the key is restricted to the planned
        # hop destinations, each with its user, rather than to the (forwarder > child) pairs.
        for kids in children.values():
            constraints += [f"{hops[order[c].node.name]['user']}@ddpfab-n{c}" for c in kids]
        labels_file = os.path.join(self.ctl_dir, "agent_known_hosts")
        Path(labels_file).write_text("\n".join(labels) + "\n")
        problem = self.agent.add(keys, labels_file, list(dict.fromkeys(constraints)))
        if problem:
            return {}, problem
        list_b64 = base64.b64encode(Path(self.list_file).read_bytes()).decode()
        forwarders = [j for j, kids in children.items() if kids]
        with waits.pool(min(32, len(forwarders))) as pool:
            problems = [p for p in waits.mapped(pool, lambda j: self.stage_files(order, children, hops, list_b64, j), forwarders)
                        if p]
        if problems:
            return {}, problems[0]
        return {"children": children, "hops": hops}, None

    def stage_files(self, order: list[_SyncTarget], children: dict[int, list[int]], hops: dict, list_b64: str,
                    j: int) -> str | None:
        """The file list and the known_hosts lines of its next hops, onto forwarding node j (in a
        session held to the end of the sync: the node removes its staged files when it ends); why
        not, or None."""
        lines = [f"{_host_entry(hops[order[c].node.name]['addr'], hops[order[c].node.name]['port'])} {k}"
                 for c in children[j] for k in hops[order[c].node.name]["keys"]]
        req = {**self.request(order[j], "stage"), "hold": True, "files": {
            "files": list_b64, "known_hosts": base64.b64encode(("\n".join(lines) + "\n").encode()).decode()}}
        try:
            hold = _session(order[j].runner)  # the node removes its staged files when it ends
            with self.lock:
                self.holds.append(hold)
            out = ask_node(order[j].runner, hold, req, timeout=120)[0]
        except SyncError as exc:
            return f"cannot stage the forwarding files: {exc.problems[0]}"
        with self.lock:
            self.stages[order[j].node.name] = out["dir"]
        return None

    def tree(self, order: list[_SyncTarget]) -> None:
        if not order:
            return
        got = [threading.Event() for _ in order]
        have = [False] * len(order)

        def first_copy() -> None:  # over the slow uplink: starts at once, the hop setup overlaps it
            have[0] = self.copy_from_controller(order[0])
            if not have[0]:
                self.fail(order[0], order[0].rec.error)

        first = threading.Thread(target=first_copy)
        first.start()
        plan, why = self.tree_setup(order)
        if why:
            self.note(f"{option('fanout', 'tree')} not possible ({why}); using the star (every node from this machine)")
            self.fanout_used = "star"
            rest = threading.Thread(target=self.star, args=(order[1:],))
            rest.start()
            waits.join(first)
            if have[0]:
                self.commit(order[0])
            waits.join(rest)
            return
        self.fanout_used = "tree"
        children, hops = plan["children"], plan["hops"]

        def deliver(j: int) -> None:
            verifier = None
            try:
                if j == 0:
                    first.join()
                    got[0].set()
                got[j].wait()
                if have[j]:
                    verifier = threading.Thread(target=self.commit, args=(order[j],))
                    verifier.start()
                for c in children[j]:
                    have[c] = self.forward(order[j], order[c], have[j], hops[order[c].node.name])
                    got[c].set()
            finally:
                for c in children[j]:
                    got[c].set()  # never leave a subtree waiting, whatever happened here
                if verifier:
                    verifier.join()

        threads = [threading.Thread(target=deliver, args=(j,)) for j in range(len(order))]
        for th in threads:
            th.start()
        for th in threads:
            waits.join(th)
        return

    def forward(self, src: _SyncTarget, t: _SyncTarget, src_has: bool, hop: dict) -> bool:
        """Copy to *t* from the forwarding node *src* when that has a copy (*src_has*), else, or
        when that copy fails, from this machine: a failed hop costs the uplink, not the node.
        Whether *t* has the copy now."""
        ok = False
        if src_has:
            ok = self.copy_from_node(src, t, dict(hop, stage=self.stages[src.node.name]))
            if not ok:
                self.note(f"{t.node.name}: copy from {src.node.name} failed ({t.rec.error}); "
                          "copying from this machine instead")
        else:
            self.note(f"{t.node.name}: {src.node.name} has no copy to forward; "
                      "copying from this machine")
        if not ok:
            ok = self.copy_from_controller(t)
            if not ok:
                self.fail(t, t.rec.error)
        return ok

    # -- the steps _sync runs, in order ------------------------------------------------------
    def start_agent(self) -> None:
        """The forwarding agent of ``--fanout tree``, or a note and the star when it cannot start."""
        # the agent first: the masters to the nodes must know it to forward it later
        self.agent = Agent(self.ctl_dir, self.reaper)
        why = self.agent.start()
        if why:
            self.agent = None
            self.note(f"{option('fanout', 'tree')} not possible ({why}); using the star (every node from this machine)")

    def probe_while_hashing(self, create: bool) -> None:
        """:meth:`connect_and_probe`, with the local tree hashed meanwhile (into ``local``): the
        nodes answer while this machine reads its files."""
        hasher = ThreadPoolExecutor(max_workers=1)
        local = hasher.submit(local_tree, self.sel, False, not self.checksum)
        try:
            self.connect_and_probe(create=create)
        except BaseException:  # a Ctrl-C or a node's failure goes on as it is, not waiting for the hash
            hasher.shutdown(wait=False, cancel_futures=True)
            raise
        try:
            self.local = waits.result(local)
        except OSError as exc:
            raise SyncError([f"cannot hash {self.sel.root}: {exc}"]) from None
        finally:
            hasher.shutdown(wait=False)

    def copy_and_verify(self, fanout: str, to_copy: list[_SyncTarget], only_verify: list[_SyncTarget]) -> None:
        """Copy to *to_copy* (the tree when its agent started, else the star) while the nodes of
        *only_verify* check their hash."""
        pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(only_verify))))
        try:
            checks = [pool.submit(self.verify, t) for t in only_verify]
            if fanout == "tree" and self.agent is not None:
                self.tree(to_copy)
            else:
                self.star(to_copy)
            for c in checks:
                waits.result(c)
        except BaseException:  # Ctrl-C (or a bug): end the copies before waiting for their threads
            self.abort()
            raise
        finally:
            pool.shutdown(wait=True)

    def cleanup(self) -> None:
        if self.cancelled:
            self.abort()
        for hold in self.holds:  # the node removes its staged files when the session ends
            hold.close()
        if self.agent:
            self.agent.close()
        for t in self.targets.values():
            if t.session:  # its end releases the node's lock
                t.session.close()
            if t.runner is not None:  # its rsync relay; the connection is sync_cluster's or the run's
                t.runner.close()
        shutil.rmtree(self.ctl_dir, ignore_errors=True)
        self.reaper.close()


def megabytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _checked_selection(cluster: Inventory, src: str | os.PathLike, keep: tuple[str, ...] | list[str],
                       with_git: bool, include_keys: bool, verify_only: bool) -> Selection:
    """The selection to send, with all that needs no node checked first (rsync here, files to
    send, every node's workdir as written): a SyncError before any host is contacted."""
    if not verify_only and shutil.which("rsync") is None:
        raise SyncError(["rsync not found on this machine: apt-get install rsync"])
    sel = select(src, keep, with_git, include_keys)
    if not sel.files and not verify_only:
        raise SyncError([f"{sel.root}: no files to send (everything is ignored or the directory is empty)"])
    problems = []
    for n in cluster.nodes:
        try:
            check_workdir(n, sel.root)
        except SyncError as exc:
            problems += exc.problems
    if problems:
        raise SyncError(problems)
    return sel


def _open_connections(cluster: Inventory, policy: HostKeyPolicy, ssh_config: str | None) -> GroupResult:
    """One connection per node, for this sync alone (the caller closes them)."""
    try:  # before anything is started: a route that cannot be honoured starts nothing
        resolve_all(cluster.nodes, policy, ssh_config)
    except TargetError as exc:
        raise SyncError(exc.problems) from None
    return open_group(cluster.nodes, policy, ssh_config)


def _already_there(cluster: Inventory, conns: dict, sel: Selection,
                   progress: Callable[[str], object]) -> SyncResult | None:
    """The hash-only check before a full sync: the result, each node's line said, when every node
    has this tree already; else None (the full sync follows)."""
    same = _unchanged(cluster, conns, sel, shared=False)
    if same is not None:
        for rec in same.nodes.values():
            progress(f"{rec.name}: {rec.workdir} ok (unchanged; verified in {rec.verify_s:.2f} s)")
    return same


def sync_cluster(cluster: Inventory, src: str | os.PathLike, policy: HostKeyPolicy, *, fanout: str = "star",
                 compress: bool = False, ssh_config: str | None = None, checksum: bool = False,
                 keep: tuple[str, ...] | list[str] = (), with_git: bool = False, verify_only: bool = False,
                 adopt: bool = False, dry_run: bool = False, lock_wait: float = LOCK_WAIT_S,
                 progress: Callable[[str], object] | None = None, conns: dict | None = None,
                 fast: bool = True, include_keys: bool = False, no_wait: str | None = None) -> SyncResult:
    """Place the selection of *src* in every node's workdir, delete there only what ddpfab placed
    and is gone here, and prove the result by hash.

    Args:
        cluster: the nodes (``inventory.load``).
        src: the local project directory.
        policy: the host-key policy (the runner's).
        fanout: "star" (the controller sends to every node) or "tree" (to one node; nodes forward).
        compress: rsync --compress (off by default: code on a LAN is not worth the CPU).
        ssh_config: an ssh_config file for every ssh (else the node's ``-F``, else ~/.ssh/config).
        checksum: compare files by content, not size and mtime (repairs files changed in place).
        keep: extra keep patterns (gitignore syntax) on top of ``.ddpfabkeep``.
        with_git: send ``.git`` too.
        verify_only: copy nothing; only compare each node's tree hash with the local one.
        adopt: take over a workdir that is not empty and has no ddpfab record (nothing there is
            deleted; files the project overwrites are moved aside first).
        dry_run: change nothing anywhere; each node's ``items`` say what a sync would copy,
            update and delete (always the star: there is nothing to forward).
        lock_wait: how long to wait (seconds) for another sync that is changing a node's workdir
            (one line says whose it is); 0: refuse at once. Refused: a SyncError with code
            ``BUSY``, nothing changed on any node.
        progress: called with one line per event (node done, fallback...).
        conns: each node's open connection (a run's): everything goes over it, nothing else is
            opened; else one is opened per node for this sync and closed after it.
        fast: first the hash-only check (:func:`unchanged`): when every node already has this
            tree, nothing more is started (not for a dry run, ``verify_only`` or ``checksum``).
        include_keys: send private keys and ``.ssh/`` files too (:mod:`ddpfab.transfer.keys`); by
            default they are left out (the result's ``left_out`` names them).
        no_wait: how the caller asks for a refusal instead of a wait (``--no-wait``), for the
            messages; None when it has no such option (a run's own sync).

    Returns the SyncResult; raises SyncError (with the result) when any node failed.
    """
    if fanout not in ("star", "tree"):
        raise ValueError(f"fanout must be 'star' or 'tree', not {fanout!r}")
    started = time.monotonic()
    progress = progress or (lambda _line: None)
    sel = _checked_selection(cluster, src, keep, with_git, include_keys, verify_only)
    opened: GroupResult = GroupResult()
    if conns is None:
        opened = _open_connections(cluster, policy, ssh_config)
        conns = {name: r.conn for name, r in opened.succeeded.items()}
    down = {n.name: opened.get(n.name, SyncError(Problem(n.name, "ssh", text=f"host {n.name}: no connection")))
            for n in cluster.nodes if n.name not in conns}
    try:
        if fast and not (down or dry_run or verify_only or checksum):
            same = _already_there(cluster, conns, sel, progress)
            if same is not None:
                return same
        return _sync(cluster, sel, conns, down, started, fanout=fanout, compress=compress, checksum=checksum,
                     verify_only=verify_only, adopt=adopt, dry_run=dry_run, lock_wait=lock_wait, progress=progress,
                     no_wait=no_wait)
    finally:
        close_group(opened)


def _sync(cluster: Inventory, sel: Selection, conns: dict, down: dict[str, Exception], started: float, *,
          fanout: str, compress: bool, checksum: bool, verify_only: bool, adopt: bool, dry_run: bool,
          lock_wait: float, progress: Callable[[str], object], no_wait: str | None) -> SyncResult:
    """:func:`sync_cluster` once every node's connection is open (or known to be down)."""
    job = _Sync(cluster, sel, conns, down, compress, checksum, progress, adopt, lock_wait, no_wait)
    job.dry_run, job.verify_only = dry_run, verify_only
    result = sel.result(tree_hash="", bytes=0, fanout=fanout, dry_run=dry_run)
    try:
        if fanout == "tree" and not (verify_only or dry_run):
            job.start_agent()
        job.probe_while_hashing(create=not (verify_only or dry_run))
        result.tree_hash, result.bytes = job.local["tree_hash"], job.local["bytes"]
        if job.refused:
            result.nodes = {n.name: job.targets[n.name].rec for n in cluster.nodes}
            raise SyncError(result.problems, result, code=BUSY)
        ready = [t for t in job.targets.values() if t.ready]
        only_verify = [] if dry_run else ready if verify_only else [t for t in ready if t.shared]
        to_copy = [] if verify_only else [t for t in ready if not t.shared]
        for t in ready if dry_run else []:
            t.rec.ok = t.shared
        job.copy_and_verify(fanout, to_copy, only_verify)
        result.fanout = job.fanout_used
    except BaseException:
        job.abort()
        raise
    finally:
        job.cleanup()
    result.nodes = {n.name: job.targets[n.name].rec for n in cluster.nodes}
    result.notes = job.notes
    result.duration_s = round(time.monotonic() - started, 3)
    problems = result.problems
    if problems:
        raise SyncError(problems, result)
    return result


def unchanged(cluster: Inventory, conns: dict, src: str | os.PathLike, *, keep: tuple[str, ...] | list[str] = (),
              with_git: bool = False, sessions: dict | None = None, include_keys: bool = False) -> SyncResult | None:
    """The no-copy fast path of a sync (``ddpfab sync``, and before ``run``): when every node's
    workdir already hashes to this tree (the usual case while iterating: nothing changed since
    the last sync), the result that proves it, else None (then :func:`sync_cluster` does the
    real work).

    It asks the node program's ``hash`` over ddpfab's open SSH connections (*conns*), in the node
    program *sessions* ``run`` keeps open for its whole preparation when given (no python started
    for it then), else in one of its own per node: the same proof as the verification after a
    copy (the hash of the files ddpfab placed, by its record there), without the probes and rsync
    a full sync starts. The hash is taken holding the workdir's lock (tried without waiting, in
    the same exchange): while another sync is changing a workdir its hash proves nothing, so a
    busy workdir is not "unchanged" but a reason for the full sync, which waits for that sync and
    says whose it is. A workdir without a record (a shared filesystem) is asked once more for the
    hash of exactly this tree's paths. Any problem (no python, no workdir, a mismatch) is not an
    error here, only a reason to do the full sync, which reports it properly. *include_keys*: the
    selection keeps private keys (:mod:`ddpfab.transfer.keys`), as the sync's own.
    """
    sel = select(src, keep, with_git, include_keys)
    return _unchanged(cluster, conns, sel, sessions)


def _unchanged(cluster: Inventory, conns: dict, sel: Selection, sessions: dict | None = None,
               shared: bool = True) -> SyncResult | None:
    """:func:`unchanged` of the selection *sel*; without *shared*, a workdir without a record (a
    shared filesystem, or a directory ddpfab cannot prove is not this one) is not taken as
    unchanged: ``ddpfab sync`` reports and refuses those as its full probe does."""
    started = time.monotonic()
    if not sel.files:
        return None
    nodes = [n for n in cluster.nodes if not workdir.lexical_problem(n.workdir if n.workdir is not None else sel.root)]
    if len(nodes) < len(cluster.nodes):
        return None
    reqs, asked = _locked_hash_requests(nodes, sel)
    t0 = time.monotonic()
    own = sessions is None
    errors = {}
    if own:  # the questions travel with the program (and, where nothing more can follow, its end);
        # they are the workdir's alone: its part of the program is enough
        sessions, errors = nodeprog.open_sessions(nodes, conns, first=asked, last=not shared,
                                                  part=nodeprog.WORKDIR_PART)
    try:
        # asked first, the local tree hashed while the nodes hash theirs (a cold hash of a few
        # hundred files is tens of ms: off the path of every run that syncs)
        sent = {k: s.first for k, s in sessions.items()} if own else {}
        for name, batch in () if own else asked.items():
            try:
                sent[name] = sessions[name].send(*batch)
            except Exception as exc:  # noqa: BLE001 - a broken session is a reason for the full sync
                errors[name] = exc
        local = local_tree(sel)
        # (where a node's session did not open, the others' answers are still waited for: each
        # holds its workdir's lock until it has answered, and the full sync that follows takes it)
        answers = nodeprog.exchange(sessions, {}, timeout=120, sent=sent)
        if errors or answers.failed or any(not (ans[0].ok and ans[0].result.get("locked") is True)
                                           for ans in answers.succeeded.values()):
            return None  # a node's workdir is being changed (or did not answer): the full sync sees to it
        hashed = {name: ans[1] for name, ans in answers.succeeded.items()}
        again = {name: [{**reqs[name], "paths": sel.files}] for name, ans in hashed.items()
                 if shared and not ans.ok and ans.code == treehash.NO_RECORD}
        if again:
            hashed.update((name, ans[0]) for name, ans in nodeprog.exchange(sessions, again, timeout=120).items()
                          if not isinstance(ans, Exception))
    finally:
        if own:
            nodeprog.close_all(sessions)
    seconds = round(time.monotonic() - t0, 3)
    if len(hashed) < len(nodes) or any(not ans.ok or ans.result.get("tree_hash") != local["tree_hash"]
                                       for ans in hashed.values()):
        return None
    return _unchanged_result(cluster, sel, local, seconds, started)


def _locked_hash_requests(nodes: list[Node], sel: Selection) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Per node, its ``hash`` request, and the exchange that asks it holding the workdir's lock
    (tried without waiting, released after): a hash taken while another sync changes the workdir
    would prove nothing."""
    holder = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
              "src": sel.root, "check": "unchanged"}
    reqs = {n.name: {"op": "hash", "workdir": n.workdir if n.workdir is not None else sel.root, "cache": True}
            for n in nodes}
    asked = {k: [{"op": "lock", "workdir": v["workdir"], "holder": holder, "wait_s": 0}, v, {"op": "unlock"}]
             for k, v in reqs.items()}
    return reqs, asked


def _unchanged_result(cluster: Inventory, sel: Selection, local: dict, seconds: float,
                      started: float) -> SyncResult:
    """The result of a sync that found every node's workdir already hashing to *local*'s tree:
    each node verified in *seconds*, nothing copied."""
    result = sel.result(tree_hash=local["tree_hash"], bytes=local["bytes"], fanout="none")
    for n in cluster.nodes:
        result.nodes[n.name] = NodeSync(n.name, workdir=workdir.resolve(n.workdir, None) if n.workdir else sel.root,
                                        source="unchanged", verify_s=seconds, tree_hash=local["tree_hash"], ok=True,
                                        copied=0, updated=0, deleted=0)  # counts as data: nothing changed
    result.notes = ["every node already had this tree (verified by hash): nothing copied"]
    result.duration_s = round(time.monotonic() - started, 3)
    return result
