"""Checkpoints without a shared filesystem: ``ddpfab run --replicate PATH``.

A script like pytorch/examples' ``multinode.py`` saves its snapshot from global rank 0 only and,
at start, every rank loads it if it exists. Without a shared filesystem only rank 0's node has it,
so the next run resumes there and starts over everywhere else, and the ranks disagree.
``--replicate PATH`` (and the inventory list ``ddpfab_replicate``) copies PATH, a file relative to
the workdir, from rank 0's node (node_rank 0) to every other node before the launch, and each
node checks the sha256 of what it received against the one rank 0's node computed: a copy that
does not match leaves the node's old file as it was and nothing starts.

What it touches: on the other nodes exactly PATH itself (replaced by a rename, never followed
through a symlink; its missing parent directories inside the workdir are made); nothing is
deleted. A node that holds the same bytes already gets nothing. A PATH that rank 0's node does not
have (the first run) is nothing to replicate: one line says so and the run goes on.

How the bytes travel: the controller relays them over the run's own SSH connections (rank 0's
node sends the file once; the controller writes each chunk to every other node as it arrives),
so it works wherever ``run`` works, bastions included, and needs no node-to-node SSH trust.
docs/replicate.md has the figures against node-to-node rsync on the lab.

The preflight's part (:func:`warnings`): a file named like a resume file (``*snapshot*.pt``,
``*checkpoint*``, ``*.ckpt`` at the workdir's top level) or a ``--replicate`` PATH that some nodes
hold and others do not, or that differs in size between them, is named with the nodes and
``--replicate PATH`` as the fix. A warning, not a refusal: the script may not resume from it.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hosts.inventory import Node
from ddpfab.node import treehash
from ddpfab.optionnames import option
from ddpfab.planning.plan import PlanError
from ddpfab.problems import Problem

#: How long a node may take to hash its files (a checkpoint of many GB) or to answer a copy.
TIMEOUT_S = 600
#: The relay's read size.
CHUNK = 1 << 20


def path_problem(path: str) -> str | None:
    """Why *path* cannot be replicated as written (no filesystem access), or None: it must be
    relative to the workdir, without ``..`` or control characters, not into ddpfab's ``.ddpfab/``.
    The node checks it again as it resolves it (a symlink out of the workdir is refused there)."""
    if not treehash.rel_ok(path) or any(ord(c) < 32 or ord(c) == 127 for c in path):
        return (f"{path!r} is refused: write a file's path relative to the workdir, without '..', '.', empty "
                "components, control characters or ddpfab's own .ddpfab/ (e.g. snapshot.pt or ckpt/last.pt)")
    return None


def wanted(cluster, given: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The paths to replicate: each node's ``ddpfab_replicate``, then ``--replicate``'s, once each,
    in that order. A PlanError names the first bad one and where it came from."""
    out: list[str] = []
    for source, paths in [*((f"host {n.name}: ddpfab_replicate", n.replicate) for n in cluster.nodes),
                          (option("replicate"), tuple(given or ()))]:
        for p in paths:
            why = path_problem(p)
            if why:
                raise PlanError(f"{source}: {why}")
            if p not in out:
                out.append(p)
    return tuple(out)


def stat_request(workdir: str, paths: tuple[str, ...], scan: bool) -> dict:
    """The node program's ``replica_stat``: each path's kind, size and sha256, and (with *scan*)
    the top-level files named like resume files."""
    return {"op": "replica_stat", "workdir": workdir, "paths": list(paths), "hash": bool(paths), "scan": scan}


def send(cluster, sessions: dict, cwd: str, paths: tuple[str, ...], scan: bool) -> dict[str, list[dict]]:
    """Every node's ``replica_stat`` request, sent without waiting (:func:`ask` takes the answers
    with *sent*): a preparation asks it ahead of its other requests, in the same round trip. A
    node whose session broke is left out (``ask`` asks it again, and names the break)."""
    sent = {}
    for n in cluster.nodes:
        if n.name in sessions:
            try:
                sent[n.name] = sessions[n.name].send(stat_request(n.workdir or cwd, paths, scan))
            except Exception:  # noqa: BLE001 - ask's exchange says what broke
                pass
    return sent


def ask(cluster, sessions: dict, cwd: str, paths: tuple[str, ...], scan: bool,
        sent: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    """Every node's ``replica_stat`` answer over its open node program session (those :func:`send`
    *sent* already are waited for, not asked again); a node that could not answer is a
    RunError-worthy problem, returned under its name as ``{"error": ...}``."""
    sent = sent or {}
    reqs = {n.name: [stat_request(n.workdir or cwd, paths, scan)] for n in cluster.nodes
            if n.name in sessions and n.name not in sent}
    answers = nodeprog.exchange(sessions, reqs, timeout=TIMEOUT_S, sent=sent)
    out: dict[str, dict] = {}
    for name, replies in answers.succeeded.items():
        r = replies[0]
        out[name] = _valid(r.result) if r.ok else {"error": r.error}
    for name, exc in answers.failed.items():
        out[name] = {"error": str(exc)}
    return out


def _valid(result: dict) -> dict:
    """A ``replica_stat`` result as data of the expected shape (a node's answer is never trusted
    further): files and scan map names to dicts with a str kind, int bytes, str sha256."""
    def entry(e) -> dict:
        if not isinstance(e, dict) or not isinstance(e.get("kind"), str):
            return {"kind": "error", "error": "not an answer of ddpfab's node program"}
        out = {"kind": e["kind"]}
        if isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool):
            out["bytes"] = e["bytes"]
        if isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64:
            out["sha256"] = e["sha256"]
        if isinstance(e.get("error"), str):
            out["error"] = nodeprog.printable(e["error"])
        return out

    files, scan = result.get("files"), result.get("scan")
    return {"files": {str(k): entry(v) for k, v in files.items()} if isinstance(files, dict) else {},
            "scan": {str(k): entry(v) for k, v in scan.items()} if isinstance(scan, dict) else {}}


@dataclass
class Copy:
    """One PATH to copy.

    Args:
        path: relative to the workdir.
        source: rank 0's node, which has it.
        sha256: its hash there; bytes: its size.
        to: the nodes that get it (theirs is missing or differs).
        had_it: the nodes that hold the same bytes already (nothing sent).
        seconds: the copy's wall time, all nodes together (after it ran).
    """

    path: str
    source: str
    sha256: str
    bytes: int
    to: list[str] = field(default_factory=list)
    had_it: list[str] = field(default_factory=list)
    seconds: float | None = None


@dataclass
class Decision:
    """What replicating means on these nodes: copies to make, paths rank 0's node lacks, and the
    problems that stop the run (the dry run refuses them too)."""

    copies: list[Copy] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def _size(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def decide(order: list[str], paths: tuple[str, ...], stats: dict[str, dict]) -> Decision:
    """Per path of *paths*, from every node's ``replica_stat`` (*stats*; *order*: the nodes, rank
    0's first): copy from ``order[0]`` to each node whose file is missing or has another hash.
    Refused: a node that could not answer, a path it refused, a directory, symlink or special
    file on rank 0's node (replicate copies one regular file), a directory in the way elsewhere."""
    out = Decision()
    source = order[0]
    for name in order:
        if "error" in stats.get(name, {"error": "no answer"}):
            why = stats.get(name, {}).get("error", "no answer")
            out.problems.append(Problem(name, "replicate", found=why,
                                        text=f"host {name}: replicate: cannot read the workdir's files: {why}"))
    if out.problems:
        return out
    for path in paths:
        src = stats[source]["files"].get(path, {"kind": "missing"})
        if src["kind"] == "missing":
            out.missing.append(path)
            continue
        if src["kind"] != "file" or "sha256" not in src or "bytes" not in src:
            found = src.get("error") or f"a {src['kind']}"
            out.problems.append(Problem(
                source, "replicate", expected=f"{path}: a regular file", found=found,
                fix=f"name a file (each file of a directory with its own {option('replicate')})",
                text=f"host {source} (rank 0's node): replicate {path}: {found}, not a regular file; name a file "
                     f"(each file of a directory with its own {option('replicate')})"))
            continue
        copy = Copy(path, source, src["sha256"], src["bytes"])
        for name in order[1:]:
            there = stats[name]["files"].get(path, {"kind": "missing"})
            if there["kind"] == "error" or there["kind"] == "dir":
                found = there.get("error") or "a directory"
                out.problems.append(Problem(
                    name, "replicate", expected=f"{path}: a file or nothing", found=found,
                    fix="move it away there", text=f"host {name}: replicate {path}: {found} is in the way there "
                                                   "(replicate replaces only a file); move it away"))
            elif there.get("sha256") == copy.sha256:
                copy.had_it.append(name)
            else:
                copy.to.append(name)
        out.copies.append(copy)
    return out


def warnings(order: list[str], paths: tuple[str, ...], stats: dict[str, dict]) -> list[Problem]:
    """Resume files that some nodes hold and others do not, or that differ in size between them
    (the preflight's check; *paths* being replicated are left out: the copy fixes them, except one
    that rank 0's node lacks and another node has). Each names the nodes and the fix."""
    out = []
    names: list[str] = []
    for name in order:
        for n in [*stats.get(name, {}).get("scan", {}), *stats.get(name, {}).get("files", {})]:
            if n not in names:
                names.append(n)
    for n in names:
        held = {name: (stats[name].get("scan", {}).get(n) or stats[name].get("files", {}).get(n) or {})
                for name in order if "error" not in stats.get(name, {"error": 1})}
        have = [name for name, e in held.items() if e.get("kind") == "file"]
        lack = [name for name, e in held.items() if e.get("kind") != "file"]
        if not have:
            continue
        if n in paths and order[0] in have:
            continue  # it is copied before the launch
        sizes = {held[name].get("bytes") for name in have}
        word = shlex.quote(n)  # the fix is a command line to type
        if lack:
            src_lacks = order[0] in lack
            found = f"{n} is in the workdir of {', '.join(have)} but not of {', '.join(lack)}"
            fix = (f"delete it on {', '.join(have)}, or put it on {order[0]} (rank 0's node) and run with "
                   f"{option('replicate')} {word}" if src_lacks
                   else f"run with {option('replicate')} {word} (copies it from {order[0]}, rank 0's node)")
        elif len(sizes) > 1:
            shown = ", ".join(f"{name}: {_size(held[name].get('bytes'))}" for name in have)
            found = f"{n} differs between nodes ({shown})"
            fix = f"run with {option('replicate')} {word} (copies {order[0]}'s, rank 0's node)"
        else:
            continue
        text = (f"{found}: a script that resumes from it would resume on some ranks and start over on others "
                f"(the ranks disagree and the job fails or hangs); {fix}")
        out.append(Problem(lack[0] if lack else have[-1], "resume_file", expected=f"{n} the same on every node",
                           found=found, fix=fix, text=text))
    return out


def describe(copy: Copy, dry_run: bool = False) -> str:
    """One line for a copy: what, from where, to where."""
    had = f" ({', '.join(copy.had_it)} had it already)" if copy.had_it else ""
    what = f"{copy.path} ({_size(copy.bytes)}, sha256 {copy.sha256[:12]})"
    if not copy.to:
        return f"{what}: every node has it already{'' if dry_run else ', nothing copied'}"
    if dry_run:
        return f"would copy {what} from {copy.source} to {', '.join(copy.to)}{had}"
    took = f" in {copy.seconds:.2f} s" if copy.seconds is not None else ""
    return f"copied {what} from {copy.source} to {', '.join(copy.to)}{took}, verified by hash on each{had}"


def _read_line(chan, limit: int = 1 << 16) -> bytes:
    """A reply line of the node program on *chan*, at most *limit* bytes (a ``replica_send``'s
    starts its output: read byte by byte, what follows is the file)."""
    line = b""
    while not line.endswith(b"\n"):
        b = chan.recv(1)
        if not b or len(line) > limit:
            break
        line += b
    return line


def relay(copy: Copy, conns: dict, nodes: dict, workdirs: dict[str, str]) -> list[Problem]:
    """Copy *copy* from its source to its ``to`` nodes through this machine: rank 0's node sends
    the file once over its connection (*conns*, the run's), each chunk goes on to every node as it
    comes, and each node checks the sha256 before it renames the file into place. The problems,
    one per node that did not get it (none: every node has it, verified)."""
    started = time.monotonic()
    src = nodes[copy.source]
    chans: dict[str, Any] = {}  # paramiko channels
    problems: list[Problem] = []

    def fail(name: str, why: str) -> None:
        problems.append(Problem(name, "replicate", found=why, text=f"host {name}: replicate {copy.path}: {why}"))

    src_chan = conns[src.name].transport.open_session(timeout=30)
    try:
        src_chan.settimeout(TIMEOUT_S)
        src_chan.exec_command(nodeprog.command(src.python, "ddpfab-node"))
        send = {"id": 1, "op": "replica_send", "workdir": workdirs[src.name], "path": copy.path}
        src_chan.sendall(nodeprog.setup_head(src.python) + nodeprog.stdin_for(send))
        src_chan.shutdown_write()
        refused = _send_refused(nodeprog.parse_reply(_read_line(src_chan)), copy)
        if refused is not None:
            fail(src.name, refused)
            return problems
        for name in copy.to:
            try:
                chans[name] = _start_receive(conns[name], nodes[name], workdirs[name], copy)
            except Exception as exc:  # noqa: BLE001 - one node's failure is data
                fail(name, f"could not start the copy there: {exc}")
        _fan_out(src_chan, chans, copy.bytes, fail)
        for name, chan in chans.items():
            problems += _receipt(name, chan, copy)
    except Exception as exc:  # noqa: BLE001 - a broken source link is this copy's failure, not a traceback
        fail(src.name, f"reading it from rank 0's node failed: {type(exc).__name__}: {exc}")
    finally:
        src_chan.close()
        for chan in chans.values():
            chan.close()
    copy.seconds = round(time.monotonic() - started, 3)
    return problems


def _send_refused(head: nodeprog.Reply | None, copy: Copy) -> str | None:
    """Why the source's first reply line *head* means no copy (it is not the node program's
    answer, the node refused, or the file's size is not the one hashed), or None: the file's
    bytes follow. A file that changed since it was hashed would fail every node's check."""
    if head is None or head.id != 1 or head.op != "replica_send":
        return "rank 0's node did not answer as ddpfab's node program does"
    if not head.ok:
        return head.error
    if head.result.get("bytes") != copy.bytes:
        return (f"it changed since it was hashed ({_size(copy.bytes)} then, "
                f"{_size(head.result.get('bytes'))} now); is a job still writing it?")
    return None


def _start_receive(conn, node: Node, workdir: str, copy: Copy) -> Any:
    """A channel to *node*'s node program, told to receive *copy* into *workdir*: it reads the
    bytes from its stdin and checks their sha256 before the rename (the paramiko channel; an
    exception when it cannot be started)."""
    chan = conn.transport.open_session(timeout=30)
    chan.settimeout(TIMEOUT_S)
    chan.exec_command(nodeprog.command(node.python, "ddpfab-node"))
    receive = {"id": 1, "op": "replica_receive", "workdir": workdir, "path": copy.path,
               "bytes": copy.bytes, "sha256": copy.sha256}
    chan.sendall(nodeprog.setup_head(node.python) + nodeprog.stdin_for(receive))
    return chan


def _fan_out(src_chan, chans: dict[str, Any], size: int, fail: Callable[[str, str], None]) -> None:
    """The file's *size* bytes from *src_chan* to every channel of *chans*, each chunk as it
    comes (the file is read once, never held whole). A node whose channel breaks is failed and
    left out of *chans*; the others go on."""
    left = size
    while left > 0 and chans:
        data = src_chan.recv(min(CHUNK, left))
        if not data:
            break  # the receivers' size check names it
        left -= len(data)
        for name, chan in list(chans.items()):
            try:
                chan.sendall(data)
            except Exception as exc:  # noqa: BLE001
                fail(name, f"the copy broke off: {exc}")
                chan.close()
                del chans[name]


def _receipt(name: str, chan, copy: Copy) -> list[Problem]:
    """The receiving node's answer: its reply (the sha256 it found) once its stdin ends."""
    try:
        chan.shutdown_write()
        data = _read_line(chan)  # its one reply line (bounded: a node that writes on is no node program)
        code = chan.recv_exit_status()
    except Exception as exc:  # noqa: BLE001
        return [Problem(name, "replicate", found=str(exc), text=f"host {name}: replicate {copy.path}: no answer: {exc}")]
    reply = nodeprog.match_replies(name, [{"id": 1, "op": "replica_receive"}], data.splitlines(), code)[0]
    if reply.ok and reply.result.get("sha256") == copy.sha256:
        return []
    why = reply.error if not reply.ok else f"it reports sha256 {str(reply.result.get('sha256'))[:12]}"
    return [Problem(name, "replicate", expected=f"sha256 {copy.sha256[:12]}", found=why,
                    text=f"host {name}: replicate {copy.path}: {why}")]


def record(decision: Decision, warned: list[Problem], method: str = "relay") -> dict:
    """The manifest's ``replicate`` entry: each copy (path, hash, from, to), what rank 0's node
    lacked, and the preflight's warnings."""
    return {"method": method, "copies": [asdict(c) for c in decision.copies], "missing": decision.missing,
            "warnings": [str(w) for w in warned]}
