"""``ddpfab doctor``: a live job's ranks, their states and Python stacks, grouped; the odd ones named.

When one rank of a job stops, every other rank soon waits for it in a collective and the whole job
goes quiet: "no rank has printed" cannot say which one. The doctor asks every node's program
(:mod:`ddpfab.node.stacks`, over the one connection per node) for each rank's process state and
its stack (py-spy), groups the ranks by where they wait (the collective and the user's call site
around it) and names the odd ones out: a rank that is stopped (state T), stuck in the kernel
(D), gone, or waiting somewhere else than the others, and a node that does not answer. The verdict
comes first (one or two lines), the grouped stacks after it, the whole record as JSON in the run's
dir (``doctor-<time>.json``).

Records are data: every node's reply is checked field by field before anything reads it, and the
NCCL flight recorder's dumps are kept as bytes, never unpickled here.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hostlist import FOLD_ABOVE, compact, number_ranges
from ddpfab.planning.plan import Plan
from ddpfab.remote import ssh

#: Seconds a node has to answer (its py-spy dumps run in parallel, each at most
#: ddpfab.node.stacks.PY_SPY_TIMEOUT_S): past it the node is named as not answering.
NODE_TIMEOUT_S = 30.0
#: torch.distributed's collectives and point-to-point calls, by the name of their Python function.
COLLECTIVES = frozenset((
    "all_reduce", "all_reduce_coalesced", "broadcast", "barrier", "monitored_barrier", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list", "init_process_group", "new_group",
    "_all_gather_base", "_reduce_scatter_base",
    # DistributedDataParallel's construction: its checks and broadcast across the ranks (C++ below them)
    "_verify_param_shape_across_processes", "_sync_module_states", "_sync_params_and_buffers"))
#: The collective that makes the group: every rank calls it once, at its start, and a rank leaves
#: it once it has connected to every peer; so a rank still in it while others have left it cannot
#: connect to some peer. (Not ``new_group``: a rank may pass it alone, and one elsewhere after it
#: is the odd one out, as for any collective.)
JOINING = frozenset(("init_process_group",))
#: Waits on a collective started before (``async_op=True``, functional collectives): a collective
#: only in torch.distributed's or torch.futures' code (a ``wait`` of the user's, or threading's, is none).
TORCH_WAITS = frozenset(("wait", "wait_all", "wait_tensor"))
#: How a state letter reads in a verdict; the states that make a rank an odd one out by themselves.
ODD_STATES = {"T": "is stopped (SIGSTOP, state T)", "t": "is stopped by a debugger (state t)",
              "D": "is in uninterruptible sleep (state D: stuck in the kernel, e.g. I/O or a driver)",
              "Z": "is gone (exited, not yet reaped)", "X": "is gone"}
#: How many odd ranks a verdict names one by one before it counts the rest.
NAMED_AT_MOST = 4


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int | None

    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line}" if self.line is not None else Path(self.file).name


@dataclass
class Rank:
    """One rank as a node reported it (checked)."""

    node: str
    pid: int
    rank: int | None
    local_rank: int | None
    state: str
    cpu_ticks: int | None = None
    frames: tuple[Frame, ...] = ()  # the main thread's, innermost first
    stack_error: str | None = None
    stack_fix: str | None = None

    @property
    def label(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else f"local rank {self.local_rank}"
        return f"{self.node} {who} (pid {self.pid})"


class Place(Enum):
    """Where a rank is, as its stack says."""

    COLLECTIVE = "collective"  # waiting in a torch.distributed collective or point-to-point call
    OUTSIDE = "outside"  # in no collective: its own code (a sleep, a loop, I/O) or torch's outside one
    UNKNOWN = "unknown"  # no stack to tell


class Odd(str, Enum):
    """What makes a rank or a node an odd one out (the ``what`` of the verdict's odd ones: a str,
    as the record has it)."""

    NODE = "node"  # the node did not answer
    GONE = "gone"  # a rank of the plan is not running and did not finish
    ENDED = "ended"  # the node's job has ended as a whole
    RECORD = "record"  # the node's record of the job is missing or wrong
    STATE = "state"  # a rank stopped (T, t), stuck in the kernel (D) or gone (Z, X)
    SITE = "site"  # a rank elsewhere than the others (see its ``place``)


@dataclass(frozen=True)
class Site:
    """Where a rank waits: the collective (None: not in one) and the innermost frame of the user's
    code (outside torch) that led there."""

    collective: str | None
    where: str | None
    function: str | None
    state: str | None = None  # an odd state's group (its ranks shown where they stopped)

    def text(self) -> str:
        if self.state:
            return f"state {self.state}"
        if self.collective:
            return f"{self.collective} ({self.where})" if self.where else self.collective
        if self.where:
            return f"{self.function} ({self.where})" if self.function else self.where
        return "an unknown place (no stack)"


def place_of(site: Site) -> Place:
    if site.collective:
        return Place.COLLECTIVE
    return Place.OUTSIDE if site.where else Place.UNKNOWN


#: The share of one CPU a rank must use over the sample to count as busy (computing, importing).
BUSY_SHARE = 0.1
#: How long the node program samples each rank's CPU time (``stacks.node_stacks``' default).
SAMPLE_S = 1.0


def _ticks_per_sample(reply) -> float:
    """Clock ticks in one sample on the node that sent *reply* (its SC_CLK_TCK; 100 when unknown)."""
    ticks = reply.get("clock_ticks") if isinstance(reply, dict) else None
    return SAMPLE_S * (ticks if type(ticks) is int and 0 < ticks <= 10_000 else 100)


def _where_key(where: str) -> tuple:
    """file.py:LINE sorted by file, then line as a number."""
    file, _, line = where.rpartition(":")
    return (file, int(line)) if line.isdigit() else (where, 0)


@dataclass
class Verdict:
    lines: list[str]
    hung: bool
    odd: list[dict] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    ended: bool = False  # the job has ended on every node: nothing to diagnose, and nothing wrong with that


#: One node's end as its records say it: (how: exited, stopped, cancelled, or pruned: from the
#: run's record here, the node's gone; its exit code; what stopped it, in its supervisor's words,
#: or None).
End = tuple[str, int | None, str | None]


def end_text(end: End) -> str:
    """``exit code 3``, ``stopped (signal 15)``: one node's end, in words (a ``run --tmux`` launch's
    exit code is known to its controller only; a node whose record of it is gone, pruned, has its
    end from the controller's record)."""
    how, code, why = end
    if how in ("stopped", "cancelled"):
        return f"{how} ({why})" if why else how
    if how == "pruned":
        return (f"exit code {code}" if code is not None else "ended") + \
            " (from the run's record here)"
    return f"exit code {code}" if code is not None else "ended (its exit code is in the record of the machine that ran it)"


def ended_line(ends: dict[str, End]) -> str:
    """The doctor's verdict on a job that has ended on every node: how, nodes with the same end
    named together (``the job has ended on every node: node1, node2 stopped (signal 15)``)."""
    by_text: dict[str, list[str]] = {}
    for node, end in ends.items():
        by_text.setdefault(end_text(end), []).append(node)
    return "the job has ended on every node: " + "; ".join(f"{compact(nodes)} {text}"
                                                           for text, nodes in by_text.items())


def ends_of(replies: dict[str, dict | str], recorded: dict[str, int | None] | None = None) -> dict[str, End] | None:
    """Every node's end when the job has ended on each (its exit code recorded, no rank left); else
    None (a node that did not answer, or one whose job runs, leaves it to the analysis).
    *recorded*: node -> its exit code in the run's record here, when that says the run ended: a
    node with no record of the job left (pruned) has ended as it says."""
    ends: dict[str, End] = {}
    for node, reply in replies.items():
        if recorded is not None and node in recorded and isinstance(reply, dict) and reply.get("job") is None \
                and not ranks_of(node, reply):
            ends[node] = ("pruned", recorded[node], None)
            continue
        if not isinstance(reply, dict) or _int(reply.get("exit_code")) is None or ranks_of(node, reply):
            return None
        how = reply.get("how") if reply.get("how") in ("exited", "stopped", "cancelled") else "exited"
        why = reply.get("stopped")
        ends[node] = (how, reply["exit_code"], str(why)[:200] if isinstance(why, str) and why else None)
    return ends or None


def _is_torch(path: str) -> bool:
    parts = Path(path).parts
    return "torch" in parts and ("site-packages" in parts or "dist-packages" in parts or "lib" in parts) \
        or "/torch/" in path


def _is_dist_wait(path: str) -> bool:
    parts = Path(path).parts
    return "torch" in parts and ("distributed" in parts or "futures" in parts)


def site_of(frames: Iterable[Frame]) -> Site:
    """The collective a rank waits in and the user's call site: walking out from the innermost
    frame, the outermost collective name inside torch's code before the first frame that is not
    torch's (``all_reduce`` wrapped by c10d's logger is still ``all_reduce``)."""
    frames = tuple(frames)
    waits, stopped = in_pdb(frames)
    if waits:  # in ddpfab's debugger hook (a socket's accept): where the user's code stopped is the place
        return Site(None, stopped.where() if stopped else "post-mortem", f"pdb at {stopped.name}" if stopped else "pdb")
    collective, entry = None, None
    for fr in frames:
        if _is_torch(fr.file):
            if fr.name in COLLECTIVES or fr.name in TORCH_WAITS and _is_dist_wait(fr.file):
                collective = fr.name
            entry = fr.name  # the outermost torch frame so far: what the user's code called
            continue
        if fr.name in COLLECTIVES and collective is None:  # a user's own function of that name
            collective = fr.name
        return Site(collective, fr.where(), entry or fr.name)
    return Site(collective, None, entry)


def _main_frames(threads: list, pid: int) -> tuple[Frame, ...]:
    """The main thread's frames (its tid is the pid), else the first thread's."""
    chosen = next((t for t in threads if t.get("tid") == pid), threads[0] if threads else None)
    if not chosen:
        return ()
    return tuple(Frame(str(f.get("name")), str(f.get("file")), f.get("line") if type(f.get("line")) is int else None)
                 for f in chosen.get("frames") or () if isinstance(f, dict))


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def ranks_of(node: str, reply: dict) -> list[Rank]:
    """A node's ``stacks`` reply as Ranks, each field checked (a malformed rank is left out)."""
    out = []
    for r in reply.get("ranks") or () if isinstance(reply.get("ranks"), list) else ():
        if not isinstance(r, dict) or _int(r.get("pid")) is None or not isinstance(r.get("state"), str):
            continue
        stack = r.get("stack") if isinstance(r.get("stack"), dict) else {}
        threads = [t for t in stack.get("threads") or () if isinstance(t, dict)] \
            if isinstance(stack.get("threads"), list) else []
        out.append(Rank(node, r["pid"], _int(r.get("rank")), _int(r.get("local_rank")), r["state"][:1],
                        _int(r.get("cpu_ticks")), _main_frames(threads, r["pid"]),
                        str(stack["error"])[:300] if "error" in stack else None,
                        str(stack.get("fix"))[:300] if stack.get("fix") else None))
    return sorted(out, key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.local_rank or 0))


def _ranks_text(ranks: list[Rank]) -> str:
    nums = [r.rank for r in ranks]
    if all(n is not None for n in nums):
        return f"rank{'s' if len(nums) > 1 else ''} {', '.join(str(n) for n in nums)}"
    return ", ".join(r.label for r in ranks)


def _odd(what: Odd, node: str, text: str, **more: Any) -> dict:
    return {"node": node, "what": what, **more, "text": text}


def _node_odds(node: str, reply: dict, got: list[Rank], nproc: int) -> list[dict]:
    """What a node that answered says is wrong: its missing ranks (gone, unless they finished),
    its job ended as a whole, or its record's error."""
    odd = []
    done = {d.get("local_rank"): d for d in reply.get("ended") or () if isinstance(d, dict)} \
        if isinstance(reply.get("ended"), list) else {}
    seen = {r.local_rank for r in got}
    for local in range(nproc):
        if local in seen:
            continue
        rec = done.get(local)
        if rec and _int(rec.get("code")) == 0:
            continue  # it finished its work
        if not got and reply.get("exit_code") is not None and not rec:
            continue  # the node's job ended as a whole: said once below
        code = f" (its exit code {rec.get('code')})" if rec and _int(rec.get("code")) is not None else ""
        rank = f"rank {rec['rank']}" if rec and _int(rec.get("rank")) is not None else f"local rank {local}"
        odd.append(_odd(Odd.GONE, node, f"{node} {rank} is gone{code}", local_rank=local))
    if not got and _int(reply.get("exit_code")) is not None:
        odd.append(_odd(Odd.ENDED, node, f"{node}'s job has ended (exit code {reply['exit_code']})"))
    elif reply.get("error"):
        odd.append(_odd(Odd.RECORD, node, f"{node}: {str(reply['error'])[:200]}"))
    return odd


def _read_replies(replies: dict[str, dict | str], expected: dict[str, int]
                  ) -> tuple[list[Rank], list[dict], list[str]]:
    """Every node's ranks, what the nodes say is wrong (a silent node, missing ranks), and the
    nodes whose torchrun has not started its ranks yet."""
    odd: list[dict] = []
    ranks: list[Rank] = []
    starting: list[str] = []
    for node, reply in replies.items():
        if isinstance(reply, str):
            odd.append(_odd(Odd.NODE, node, f"{node} did not answer: {reply}"))
            continue
        got = ranks_of(node, reply)
        ranks.extend(got)
        job = reply.get("job")
        if not got and isinstance(job, dict) and job.get("alive") is True and reply.get("exit_code") is None \
                and not reply.get("ended"):
            starting.append(node)  # in rendezvous or still importing: no rank is missing yet
            continue
        odd.extend(_node_odds(node, reply, got, expected.get(node, len(got))))
    return ranks, odd, starting


def _state_odds(ranks: list[Rank]) -> list[dict]:
    return [_odd(Odd.STATE, r.node, f"{r.label} {ODD_STATES[r.state]}", rank=r.rank, pid=r.pid, state=r.state)
            for r in ranks if r.state in ODD_STATES]


def _by_site(ranks: list[Rank]) -> dict[Site, list[Rank]]:
    by_site: dict[Site, list[Rank]] = {}
    for r in ranks:
        by_site.setdefault(site_of(r.frames) if r.frames else Site(None, None, None), []).append(r)
    return by_site


def _merged(sites: dict[Site, list[Rank]]) -> dict[Site, list[Rank]]:
    """Several call sites of one collective as one place (their ranks wait for the same cause: a
    ring all_reduce lets some ranks through to the next call site of it); else *sites* as they are."""
    names = {s.collective for s in sites}
    if len(sites) < 2 or len(names) != 1 or None in names:
        return sites
    merged = Site(next(iter(names)), ", ".join(sorted({s.where for s in sites if s.where}, key=_where_key)), None)
    return {merged: [r for rs in sites.values() for r in rs]}


def _is_library(path: str) -> bool:
    """A frame of installed code (site-packages, the standard library, a frozen module): not the user's."""
    parts = Path(path).parts
    return (_is_torch(path) or "site-packages" in parts or "dist-packages" in parts or path.startswith("<")
            or any(p.startswith("python") and p[6:7].isdigit() for p in parts[:-1]) and "lib" in parts)


def user_frame(frames: tuple[Frame, ...]) -> tuple[Frame | None, Frame | None]:
    """(the innermost frame of the user's own code, the call it is in: the frame just inside it,
    in a library), else the innermost frame that is not torch's, as :func:`site_of` takes it."""
    for i, fr in enumerate(frames):
        if not _is_library(fr.file):
            return fr, frames[i - 1] if i else None
    return next(((fr, None) for fr in frames if not _is_torch(fr.file)), (None, None))


#: The file a rank of ``run --pdb`` waits in pdb from (:mod:`ddpfab.node.rankpdb`, as the node's
#: supervisor writes it beside the ranks' sitecustomize).
PDB_FILE = "ddpfab_rankpdb.py"


def in_pdb(frames: tuple[Frame, ...]) -> tuple[bool, Frame | None]:
    """(whether the rank waits in ``run --pdb``'s debugger, the frame of the user's code it stopped
    in: None post-mortem, whose hook runs after the user's frames have ended)."""
    hooked = [i for i, fr in enumerate(frames) if Path(fr.file).name == PDB_FILE]
    if not hooked:
        return False, None
    outer = frames[hooked[-1] + 1:]
    return True, next((fr for fr in outer if not _is_library(fr.file) and Path(fr.file).name != "bdb.py"), None)


def users_frames(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """*frames* as a stack is shown: those of ddpfab's debugger hook (and pdb's own) left out of a
    rank that waits in ``run --pdb``'s debugger, so the innermost shown is the user's."""
    hooked = [i for i, fr in enumerate(frames) if Path(fr.file).name == PDB_FILE]
    if not hooked:
        return frames
    return tuple(fr for fr in frames[hooked[-1] + 1:] if Path(fr.file).name not in ("bdb.py", "pdb.py"))


def _outside_odds(outside: dict[Site, list[Rank]], run_id: str | None = None) -> list[dict]:
    """The ranks in no collective while others wait in one: the ones those wait for, each named
    with its node, global and local rank and where it is (its innermost frame of the user's code
    and the library call it is in): ``node2 rank 1 (local rank 0, pid 52) is outside any
    collective, in next_batch (train.py:12) calling get (queue.py:171)``; a rank of ``run --pdb``
    that waits in the debugger, as such (with how to attach to it)."""
    odd = []
    for site, rs in outside.items():
        waits, stopped = in_pdb(rs[0].frames)
        if waits:
            at = f"at {stopped.name} ({stopped.where()})" if stopped else "(post-mortem)"
            for r in rs:
                who = f"{r.node} rank {r.rank}" if r.rank is not None else r.node
                odd.append(_odd(Odd.SITE, r.node, f"{who} (local rank {r.local_rank}, pid {r.pid}) waits in pdb {at}: "
                                f"`ddpfab debug {run_id or 'RUN_ID'} --rank {r.rank}` attaches to it", ranks=[r.rank],
                                rank=r.rank, local_rank=r.local_rank, pid=r.pid, place=Place.OUTSIDE.value, pdb=True))
            continue
        user, call = user_frame(rs[0].frames)
        where = f"{user.name} ({user.where()})" if user else site.text()
        if call is not None:
            where += f" calling {call.name} ({call.where()})"
        frame = {"file": user.file, "line": user.line, "function": user.name} if user else None
        for r in rs:
            who = f"{r.node} rank {r.rank}" if r.rank is not None else r.node
            odd.append(_odd(Odd.SITE, r.node, f"{who} (local rank {r.local_rank}, pid {r.pid}) is outside any "
                            f"collective, in {where}", ranks=[r.rank], rank=r.rank, local_rank=r.local_rank,
                            pid=r.pid, place=Place.OUTSIDE.value, frame=frame))
    return odd


def _joining_odds(joining: dict[Site, list[Rank]]) -> list[dict]:
    """The ranks still in ``init_process_group`` after others have left it:
    they wait to connect to a peer that the ones past it could reach; what is between their nodes
    (a firewall, the wrong interface) is the likely cause, not the ranks that moved on."""
    return [_odd(Odd.SITE, rs[0].node, f"{', '.join(r.label for r in rs)} {'is' if len(rs) == 1 else 'are'} still "
                 f"in {site.text()}, which the others have left: {'it' if len(rs) == 1 else 'they'} cannot connect to "
                 "some peer (a firewall or the wrong interface between nodes? `ddpfab check` tests every pair)",
                 ranks=[r.rank for r in rs], place=Place.COLLECTIVE.value)
            for site, rs in joining.items()]


def _majority(known: dict[Site, list[Rank]]) -> tuple[Site | None, list[dict]]:
    """The place most ranks are (ties: the lowest rank's), the ranks elsewhere named as odd ones
    out; no place when no place has more ranks than every other."""
    if not known:
        return None, []
    main = max(known, key=lambda s: (len(known[s]), -min(r.rank or 0 for r in known[s])))
    if len(known) == 1:
        return main, []
    if len(known[main]) <= max(len(v) for s, v in known.items() if s != main):
        return None, []  # no majority: every place is named
    odd = [_odd(Odd.SITE, rs[0].node, f"{', '.join(r.label for r in rs)} {'is' if len(rs) == 1 else 'are'} in "
                f"{site.text()}, not in {main.collective or 'the place'} like the others",
                ranks=[r.rank for r in rs], place=place_of(site).value)
           for site, rs in known.items() if site != main]
    return main, odd


def _places(known: dict[Site, list[Rank]], caused: bool, run_id: str | None = None
            ) -> tuple[Site | None, dict[Site, list[Rank]], list[dict]]:
    """(the place the ranks that are no odd ones out wait, the places to list when there is no such
    place, the ranks named as odd ones out for where they are).

    Ranks outside any collective while others wait in one are the ones those wait for, however
    many ranks (two: one waits, one is elsewhere). Behind a stopped, stuck or gone rank (or a
    silent node: *caused*) the others wait wherever its stop caught them, and no place is odd.
    Else the ranks not where the majority is are the odd ones (another collective, another
    call site)."""
    if caused:
        known = _merged(known)
        main = next(iter(known)) if len(known) == 1 else None
        return main, known, []
    inside = {s: rs for s, rs in known.items() if place_of(s) is Place.COLLECTIVE}
    outside = {s: rs for s, rs in known.items() if place_of(s) is Place.OUTSIDE}
    joining = {s: rs for s, rs in inside.items() if s.collective in JOINING}
    if joining and len(joining) < len(inside) and not outside:
        past = _merged({s: rs for s, rs in inside.items() if s not in joining})
        main, _ = _majority(past)
        return main, past, _joining_odds(joining)
    if inside and outside:
        inside = _merged(inside)
        main, odd = _majority(inside)
        return main, inside, _outside_odds(outside, run_id) + odd
    main, odd = _majority(known)
    return main, known, odd


def _where_lines(main: Site | None, places: dict[Site, list[Rank]], odd: list[dict], busy: list[Rank]) -> list[str]:
    """The verdict's lines on where the ranks are: the odd ones first, then where the others wait."""
    lines = []
    if odd:
        named = "; ".join(o["text"] for o in odd[:NAMED_AT_MOST])
        more = f"; and {len(odd) - NAMED_AT_MOST} more" if len(odd) > NAMED_AT_MOST else ""
        lines.append(named + more)
    if main is not None:
        others = places[main]
        if odd:
            waited = [o for o in odd if o.get("place") == Place.OUTSIDE.value]
            whom = "" if not waited else " for it" if len(waited) == 1 else " for them"
            group = "the other rank waits" if len(others) == 1 else f"the other {len(others)} ranks wait"
            lines.append(f"{group}{whom} in {main.text()}")
        else:
            plural = "s" if len(others) != 1 else ""
            using = " and use CPU (busy, not hung?)" if busy else ""
            lines.append(f"no rank stands out: all {len(others)} rank{plural} are in {main.text()}{using}")
    elif places:
        lines.append("the ranks are in " + "; ".join(f"{s.text()}: {_ranks_text(rs)}" for s, rs in places.items()))
    return lines


def _groups(ranks: list[Rank], by_site: dict[Site, list[Rank]]) -> list[dict]:
    """The stacks to show, a group per place; the odd states' too (where a stopped rank stopped),
    each in a group of its own."""
    shown = {**by_site}
    for r in ranks:
        if r.state in ODD_STATES:
            shown.setdefault(Site(None, None, None, r.state), []).append(r)
    return [{"site": s.text(), "collective": s.collective, "where": s.where,
             "ranks": [{"node": r.node, "rank": r.rank, "pid": r.pid, "state": r.state} for r in rs],
             "frames": [f.__dict__ for f in users_frames(rs[0].frames)]}
            for s, rs in sorted(shown.items(), key=lambda kv: -len(kv[1]))]


def _busy(waiting: list[Rank], replies: dict[str, dict | str]) -> list[Rank]:
    """The ranks making progress: one that runs (R) or used CPU in the sample is busy (importing,
    computing), not hung, even where it is elsewhere than the others. A rank blocked in a
    collective still uses a tick or two a second (gloo's and the interpreter's threads: 0-2 of 100
    seen on the lab), so "used CPU" means at least BUSY_SHARE of one CPU over the sample."""
    return [r for r in waiting
            if r.state == "R" or (r.cpu_ticks or 0) >= BUSY_SHARE * _ticks_per_sample(replies.get(r.node))]


def _closing_lines(ranks: list[Rank], starting: list[str], busy: list[Rank], odd: list[dict], hard: list[dict]
                   ) -> list[str]:
    """The verdict's lines after where the ranks are: ranks without a stack, nodes not started yet,
    and "not a hang" when the odd ones out use CPU."""
    lines = []
    no_stack = [r for r in ranks if r.stack_error]
    if no_stack:
        first = no_stack[0]
        nodes = compact(sorted({r.node for r in no_stack}))
        lines.append(f"no stack from {nodes}: {first.stack_error}; fix: {first.stack_fix}")
    if starting:
        lines.append(f"not started yet on {compact(starting)} (torchrun has not started the ranks there: "
                     "rendezvous, or still importing)")
    if busy and not hard and odd:
        lines.append(f"not a hang: {', '.join(r.label for r in busy[:NAMED_AT_MOST])} "
                     f"{'is' if len(busy) == 1 else 'are'} using CPU (busy: still importing, or computing)")
    return lines


def analyze(replies: dict[str, dict | str], expected: dict[str, int],
            recorded: dict[str, int | None] | None = None, run_id: str | None = None) -> Verdict:
    """The verdict from every node's reply (a dict) or its failure (a str: why it did not answer);
    *expected*: node -> its number of processes (the plan's); *recorded*: as :func:`ends_of`'s. A
    job that has ended on every node is said so, how each ended, and nothing else: it is not a
    hang, nor a rank gone. A rank waiting in ``run --pdb``'s debugger is no hang either: the
    others wait for it, and the verdict says how to attach to it (*run_id*)."""
    ends = ends_of(replies, recorded)
    if ends is not None:
        return Verdict([ended_line(ends)], False, ended=True)
    ranks, odd, starting = _read_replies(replies, expected)
    odd += _state_odds(ranks)
    waiting = [r for r in ranks if r.state not in ODD_STATES]
    by_site = _by_site(waiting)
    known = {s: rs for s, rs in by_site.items() if s.where or s.collective}
    hard = list(odd)  # a stopped, stuck or gone rank, a silent node: the cause, wherever the others are
    main, places, site_odd = _places(known, caused=bool(hard), run_id=run_id)
    odd += site_odd
    busy = _busy(waiting, replies)
    lines = _where_lines(main, places, odd, busy) + _closing_lines(ranks, starting, busy, odd, hard)
    if not lines:
        lines.append("no rank of the job was found on any node" if not ranks else "no verdict")
    debugged = any(in_pdb(r.frames)[0] for r in waiting)
    hung = bool(hard) or (bool(waiting) and not busy and not debugged)
    return Verdict(lines, hung, odd, _groups(ranks, by_site))


def _rank_ranges(ranks: list[dict]) -> str:
    """``0-4, 6-23`` of the ranks' global ranks (a process without one: ``pid N``)."""
    numbers = [str(r["rank"]) for r in ranks if r["rank"] is not None]
    return ", ".join(([number_ranges(numbers, ", ")] if numbers else [])
                     + [f"pid {r['pid']}" for r in ranks if r["rank"] is None])


def render(verdict: Verdict, frames_shown: int = 8) -> list[str]:
    """The verdict on top, then each group of ranks with its stack (innermost frames first)."""
    out = list(verdict.lines)
    for g in verdict.groups:
        nodes: dict[str, list[str]] = {}
        for r in g["ranks"]:
            nodes.setdefault(r["node"], []).append(str(r["rank"]) if r["rank"] is not None else f"pid {r['pid']}")
        who = "; ".join(f"{n} rank{'s' if len(v) > 1 else ''} {', '.join(v)}" for n, v in nodes.items()) \
            if len(nodes) <= FOLD_ABOVE else f"{compact(list(nodes))}: ranks {_rank_ranges(g['ranks'])}"
        out.append(f"-- {len(g['ranks'])} rank{'s' if len(g['ranks']) > 1 else ''} in {g['site']}: {who}")
        for f in g["frames"][:frames_shown]:
            out.append(f"     {f['name']} ({f['file']}:{f['line']})")
        if len(g["frames"]) > frames_shown:
            out.append(f"     ... {len(g['frames']) - frames_shown} outer frames")
    return out


def collect(plan: Plan, call: Callable[[Any, dict, float], dict], timeout: float = NODE_TIMEOUT_S
            ) -> dict[str, dict | str]:
    """Every node's ``stacks`` reply, in parallel: ``call(node_plan, request, timeout)`` returns the
    reply's value; a node that fails or does not answer in *timeout* is its reason, as a str."""
    results = ssh.parallel(list(plan.nodes), lambda n: call(n, {"op": "stacks", "dir": n.remote_dir}, timeout),
                           window=len(plan.nodes))
    out: dict[str, dict | str] = {}
    for n in plan.nodes:
        got = results[n.name]
        if isinstance(got, Exception):
            out[n.name] = (getattr(got, "found", None) or str(got) or type(got).__name__)[:300]
        elif not isinstance(got, dict):
            out[n.name] = f"malformed reply ({type(got).__name__})"
        else:
            out[n.name] = got
    return out


def over(conns: dict) -> Callable[[Any, dict, float], dict]:
    """:func:`collect`'s call over open connections (node name -> Connection)."""
    def call(node, request: dict, timeout: float) -> dict:
        return nodeprog.call(conns[node.name], node, request, timeout=timeout)[0].value(node.name)
    return call


def dumps_of(replies: dict[str, dict | str]) -> list[dict]:
    """The flight-recorder dumps the nodes sent (node, name, size), their bytes decoded from base64
    and nothing else: a dump is a pickle, never loaded here."""
    out = []
    for node, reply in replies.items():
        for d in (reply.get("dumps") or ()) if isinstance(reply, dict) and isinstance(reply.get("dumps"), list) else ():
            if isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("b64"), str) \
                    and "/" not in d["name"] and d["name"] not in (".", ".."):
                out.append({"node": node, "name": d["name"], "data": base64.b64decode(d["b64"], validate=True)})
    return out


def diagnose(plan: Plan, call: Callable[[Any, dict, float], dict], run_dir: Path | None,
             timeout: float = NODE_TIMEOUT_S, recorded: dict[str, int | None] | None = None
             ) -> tuple[Verdict, Path | None]:
    """Collect, analyze, save (``doctor-<time>.json`` and the flight-recorder dumps under
    ``nccl-trace/<node>/`` in *run_dir*); the verdict and the record's path. *recorded*: node ->
    its exit code, from the run's record here when that says the run ended (:func:`ends_of`)."""
    t0 = time.time()
    replies = collect(plan, call, timeout)
    verdict = analyze(replies, {n.name: n.nproc for n in plan.nodes}, recorded, plan.run_id)
    path = None
    if run_dir is not None:
        record = {"kind": "ddpfab-doctor", "run_id": plan.run_id, "time": t0, "took_s": round(time.time() - t0, 3),
                  "verdict": verdict.lines, "hung": verdict.hung, "ended": verdict.ended, "odd": verdict.odd,
                  "groups": verdict.groups,
                  "nodes": {n: ({k: v for k, v in r.items() if k != "dumps"} if isinstance(r, dict) else {"error": r})
                            for n, r in replies.items()},
                  "nccl_trace": []}
        for d in dumps_of(replies):
            where = Path(run_dir) / "nccl-trace" / d["node"]
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            (where / d["name"]).write_bytes(d["data"])
            record["nccl_trace"].append({"node": d["node"], "file": f"nccl-trace/{d['node']}/{d['name']}",
                                         "size": len(d["data"])})
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(t0))
        path = Path(run_dir) / f"doctor-{stamp}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
    return verdict, path
