"""``ddpfab fetch``: bring results back (a checkpoint, a log dir) from a node to this machine.

    ddpfab fetch -i INV [--node NODE | --node-rank N] REMOTE_PATH [LOCAL_DIR]

REMOTE_PATH is relative to the node's workdir (the same one sync and run use), or absolute inside
the workdir or the node's run dirs (``~/.ddpfab/runs``); the node checks that, as it resolves the
path (symlinks followed), before anything is copied. The copy is rsync over the one SSH
connection that asked the node (:class:`ddpfab.remote.noderunner.NodeRunner`: the host-key policy and
route of every command), with rsync's progress line for anything over :data:`PROGRESS_BYTES`.
The result lands in LOCAL_DIR (default: .) under the remote path's last name; an existing file
or dir there is never overwritten unless ``--overwrite``.

``--node-rank N`` (``--rank N``) is the node rank of a static rendezvous (``ddpfab run``'s default): rank 0 is the
master, then the other nodes in inventory order (:func:`ddpfab.planning.plan.node_order`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import resourcecheck
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.optionnames import option
from ddpfab.planning.plan import REMOTE_RUNS_DIR, node_order
from ddpfab.problems import DdpfabError, NodeError, Problem
from ddpfab.remote.noderunner import NodeRunner, rsync_argv
from ddpfab.remote.target import HostKeyPolicy
from ddpfab.transfer.sync import SyncError, ask_node, check_workdir

#: Above this size rsync shows its one-line progress (on stderr).
PROGRESS_BYTES = 16 * 2**20
#: Where rsync keeps an unfinished file (``--partial-dir``, beside it), so a fetch again resumes it.
PARTIAL_DIR = ".ddpfab-partial"


class FetchError(DdpfabError):
    """Nothing was fetched; the problem says why and what to do. *code*: the exit code, 2 when the
    request is refused before any host is contacted (bad input), 1 once the node has been asked (the
    path refused or missing there, a destination that exists, the copy failed)."""

    check = "fetch"

    def __init__(self, problems: Problem | str | Sequence[Problem | str], code: int = 2):
        super().__init__(problems)
        self.code = code


def check_local_dir(local_dir: str | os.PathLike) -> None:
    """LOCAL_DIR must be a directory, or not exist yet (it is made): a file there is refused before
    any host is contacted."""
    path = os.path.abspath(os.fspath(local_dir))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FetchError(f"LOCAL_DIR {path} exists and is not a directory; the copy goes into a directory "
                         "(it is made if missing): give a directory, e.g. the file's parent, or another path")
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise FetchError(f"LOCAL_DIR {path}: {parent} is not a directory, so {path} cannot be made; "
                         "give another LOCAL_DIR")
    here = path if os.path.isdir(path) else parent
    if not os.access(here, os.W_OK | os.X_OK):  # this machine's fault, not the node's or rsync's: said so
        try:
            who = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:  # a uid without a passwd entry (a container's)
            who = f"uid {os.geteuid()}"
        raise FetchError(f"LOCAL_DIR {path}: {here} is not writable here (by {who}); give another LOCAL_DIR")


#: rsync's exit codes when a write failed on the receiving side, this machine ("error in file
#: I/O", "partial transfer due to error"); a lost link or an interrupt ends it with others.
LOCAL_WRITE_EXITS = (11, 23)
ROOM_FIX = "free space here, or give a LOCAL_DIR on another disk"


@dataclass(frozen=True)
class Room:
    """Free space of a filesystem of this machine, as this user may take it (root: the blocks and
    inodes reserved for root too)."""

    bytes: int
    inodes: int | None  # None: the filesystem keeps no inode count
    block: int

    def lacks(self, needed: int, files: int) -> str | None:
        """What is short for *needed* bytes in *files* files, or None."""
        if self.bytes < needed:
            return f"{resourcecheck.size(self.bytes)} free, {resourcecheck.size(needed)} needed"
        if self.inodes is not None and self.inodes < files:
            return f"{self.inodes} inodes free, {files} needed"
        return None


def room(local_dir: str) -> Room | None:
    """The free space where *local_dir* is, or None when the filesystem does not tell (statvfs
    fails, or reports no blocks at all, as some FUSE and network filesystems do)."""
    try:
        st = os.statvfs(local_dir)
    except OSError:
        return None
    if not st.f_blocks:
        return None
    root = os.geteuid() == 0
    return Room((st.f_bfree if root else st.f_bavail) * st.f_frsize,
                ((st.f_ffree if root else st.f_favail) if st.f_files else None), st.f_frsize or 4096)


def _tree_bytes(path: str) -> int:
    """Bytes in the files under *path* (a file: its size), links not followed; 0 if it is gone."""
    if not os.path.isdir(path) or os.path.islink(path):
        try:
            return os.lstat(path).st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def made_by_fetch(local_dir: str, dest: str, kind: str, created: bool) -> list[str]:
    """What this fetch's rsync left after failing, all of it ddpfab's: the destination when this
    fetch created it (nothing was there before), else the unfinished files rsync keeps in
    PARTIAL_DIRs (beside a file: ``LOCAL_DIR/PARTIAL_DIR/NAME``; in a directory, any depth). A
    PARTIAL_DIR that is a symlink is not followed (it is not rsync's)."""
    made = []
    top = os.path.join(local_dir, PARTIAL_DIR)
    if kind == "file" and os.path.isdir(top) and not os.path.islink(top):
        partial = os.path.join(top, os.path.basename(dest))
        if os.path.lexists(partial):
            made.append(partial)
    if created and os.path.lexists(dest):
        made.append(dest)
    elif kind == "dir" and os.path.isdir(dest) and not os.path.islink(dest):
        for dirpath, dirnames, _ in os.walk(dest):
            if PARTIAL_DIR in dirnames:
                dirnames.remove(PARTIAL_DIR)
                if not os.path.islink(os.path.join(dirpath, PARTIAL_DIR)):
                    made.append(os.path.join(dirpath, PARTIAL_DIR))
    return made


def _remove(paths: list[str]) -> None:
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _mkdir(path: str) -> bool:
    try:
        os.mkdir(path)
    except OSError:
        return False
    return True


def pick_node(cluster: Inventory, node: str | None, rank: int | None) -> Node:
    """The node named *node*, or the one with node rank *rank* (default: rank 0, the master)."""
    if node is not None:
        try:
            return cluster.node(node)
        except KeyError:
            raise FetchError(f"no host {node!r} in the inventory (hosts: {', '.join(n.name for n in cluster.nodes)})") \
                from None
    order = node_order(cluster)
    r = 0 if rank is None else rank
    if not 0 <= r < len(order):
        raise FetchError(f"{option('rank', r)}: the inventory has node ranks 0..{len(order) - 1}")
    return order[r]


@dataclass(frozen=True)
class Located:
    """What the node said it has at the path asked for (its ``locate`` answer, validated)."""

    path: str
    bytes: int
    files: int  # at least 1: it only sizes the disk check here
    kind: str  # "file" or "dir"


def located(name: str, found: dict) -> Located:
    """A ``locate`` reply, validated (records are data): the path's last name becomes the local
    destination's, so it must be a name (not ``..``, ``.`` or empty) of an absolute path without
    control characters, and the size an integer. The file count only sizes a check: anything but
    a count is taken as one file; anything but ``dir`` is a file."""
    path, size = found.get("path"), found.get("bytes")
    name_ok = isinstance(path, str) and path.startswith("/") and \
        os.path.basename(path.rstrip("/")) not in ("", ".", "..", PARTIAL_DIR) and \
        not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in path)
    if not name_ok or not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool):
        raise FetchError(Problem(name, "locate", text=(
            f"host {name}: locate: the node answered path {nodeprog.printable(repr(path))[:200]}, bytes "
            f"{nodeprog.printable(repr(size))[:40]}; expected an absolute path ending in a name, and a "
            "byte count; ddpfab's node program never answers so: check what runs as ddpfab_python there")), 1)
    files = found.get("files")
    files = files if isinstance(files, int) and not isinstance(files, bool) else 1
    return Located(path, size, max(files, 1), "dir" if found.get("kind") == "dir" else "file")


def fetch(node: Node, remote_path: str, local_dir: str | os.PathLike, policy: HostKeyPolicy, *,
          ssh_config: str | None = None, overwrite: bool = False, default_workdir: str | None = None,
          progress: bool | None = None) -> dict:
    """Copy *remote_path* from *node* into *local_dir*; the node's answer about it plus ``local``.

    Args:
        node: the inventory node.
        remote_path: relative to its workdir, or absolute inside the workdir or its run dirs.
        local_dir: where the copy goes (created if missing).
        policy: the host-key policy (the same as sync and run).
        ssh_config: an ssh_config file (else the node's ``-F``, else ~/.ssh/config).
        overwrite: replace what is already at the destination.
        default_workdir: the workdir when the inventory sets none (the controller's cwd, as run).
        progress: rsync's progress line on stderr (default: for transfers over PROGRESS_BYTES).
    """
    if not remote_path.strip() or remote_path.strip() in (".", "./"):
        raise FetchError(f"fetch {remote_path!r}: name what to copy (a file or directory in the workdir); "
                         "the whole workdir is not fetched by an empty name", 2)
    if not shutil.which("rsync"):
        raise FetchError("rsync not found on this machine: apt-get install rsync")
    try:
        raw = check_workdir(node, default_workdir or os.getcwd())
    except SyncError as exc:
        raise FetchError(exc.problems[0]) from None
    try:
        runner = NodeRunner.open(node, policy, ssh_config)
    except NodeError as exc:  # an ssh option that cannot be honoured is bad input: nothing was contacted
        raise FetchError(exc.problems, 2 if exc.kind == "ssh-option" else 1) from None
    try:
        return _fetch(runner, raw, remote_path, local_dir, overwrite, progress)
    finally:
        runner.close()


def _locate(runner: NodeRunner, raw: str, remote_path: str) -> dict:
    """The node's ``locate`` answer for *remote_path* (where it is, what and how big); the node
    refusing it (not there, or not a path it may give) is a FetchError with exit code 1."""
    req = {"op": "locate", "workdir": raw, "path": remote_path, "runs_dir": "~/" + REMOTE_RUNS_DIR}
    try:
        return ask_node(runner, None, req, timeout=120)[0]
    except SyncError as exc:  # the node's answer: the path is not there, or not one it may give
        raise FetchError(exc.problems[0], 1) from None


def _destination(local_dir: str | os.PathLike, path: str, overwrite: bool) -> tuple[str, str]:
    """LOCAL_DIR made absolute (and made, if missing) and the destination in it, the remote
    path's last name; one that exists already is refused unless *overwrite*."""
    check_local_dir(local_dir)
    local_dir = os.path.abspath(os.fspath(local_dir))
    dest = os.path.join(local_dir, os.path.basename(path.rstrip("/")))
    if os.path.lexists(dest) and not overwrite:
        raise FetchError(f"{dest} exists already; pass {option('overwrite', True)} to replace it, or give another LOCAL_DIR", 1)
    try:
        os.makedirs(local_dir, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"LOCAL_DIR {local_dir} cannot be made: {exc.strerror}; give another LOCAL_DIR") from None
    return local_dir, dest


def _copy_error(node: Node, what: Located, code: int, stderr: bytes, local_dir: str, dest: str, existed: bool,
                need: int) -> FetchError:
    """Why the copy of *what* failed (rsync exit *code*): this machine's disk, when the copy could
    not fit even with what it made given back (that is removed then: a full disk hurts every
    program here), else rsync's own words."""
    text = " | ".join(stderr.decode(errors="replace").strip().splitlines()[-3:])
    made = made_by_fetch(local_dir, dest, what.kind, created=not existed)
    after = room(local_dir)
    if after and code in LOCAL_WRITE_EXITS and \
            Room(after.bytes + sum(map(_tree_bytes, made)), after.inodes, after.block).lacks(need, what.files):
        _remove(made)  # a full disk hurts every program here: give the space back
        now = room(local_dir)
        return FetchError(Problem(None, "local-disk", text=(
            f"LOCAL_DIR {local_dir}: this machine's disk there filled up during the copy of {what.path} from "
            f"{node.name} (rsync exit {code}: {text or 'no message'})"
            + (f"; what it had copied ({', '.join(made)}) was removed" if made else "")
            + (f"; it has {now.lacks(need, what.files) or 'room now'}" if now else "") + f": {ROOM_FIX}")), 1)
    return FetchError(Problem(node.name, "rsync", text=f"host {node.name}: rsync failed (exit {code}): "
                                                      f"{text or 'no message'}"), 1)


def _fetch(runner: NodeRunner, raw: str, remote_path: str, local_dir: str | os.PathLike, overwrite: bool,
           progress: bool | None) -> dict:
    """:func:`fetch` over *runner*: ask the node, then rsync over the same connection."""
    node = runner.node
    found = _locate(runner, raw, remote_path)
    what = located(node.name, found)
    path, size, files, kind = what.path, what.bytes, what.files, what.kind
    local_dir, dest = _destination(local_dir, path, overwrite)
    existed = os.path.lexists(dest)
    before = room(local_dir)
    need = size + files * before.block if before else size  # each file's last block is whole
    # (a directory replaced may need less: only its changed files are copied; a file needs its whole
    # size, as rsync writes the new copy beside the old one)
    short = before.lacks(need, files) if before and not (existed and kind == "dir") else None
    if short:
        raise FetchError(Problem(None, "local-disk", text=(
            f"LOCAL_DIR {local_dir}: this machine's disk there has {short} for {path} from {node.name} "
            f"({'a file' if kind == 'file' else f'{files} files'}): {ROOM_FIX}; nothing was copied")), 1)
    show = progress if progress is not None else size >= PROGRESS_BYTES
    # --overwrite replaces: a directory there ends as the node's, not merged with what was here before
    replace_dir = overwrite and kind == "dir" and os.path.isdir(dest) and not os.path.islink(dest)
    flags = ["-rlpt", f"--partial-dir={PARTIAL_DIR}", *(["--delete"] if replace_dir else []),
             *(["--info=progress2"] if show else [])]
    argv = rsync_argv(flags, None, runner.rsh(), runner.remote(path), local_dir + "/", trailing=False)
    # a file's partial dir made first: rsync keeps an unfinished file in it, and where making it would
    # take a block a full disk has not got (ext4, xfs), rsync deletes the file instead, and with it
    # the trace of what filled the disk
    top = os.path.join(local_dir, PARTIAL_DIR)
    made_top = kind == "file" and not os.path.lexists(top) and _mkdir(top)
    try:
        # rsync's progress goes to its stdout; ours is for results, so it is relayed to stderr
        copy = runner.rsync(argv, stdout=sys.stderr if show else subprocess.DEVNULL)
        if copy.code != 0:
            raise _copy_error(node, what, copy.code, copy.stderr, local_dir, dest, existed, need)
    finally:
        if made_top:
            with contextlib.suppress(OSError):
                os.rmdir(top)  # only while empty: a kept unfinished file stays for the next fetch
    return {**found, "node": node.name, "local": dest}
