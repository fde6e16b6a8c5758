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
from pathlib import Path
from typing import Any

from ddpfab import node as nodeprog
from ddpfab.health.mesh import compact
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
    "batch_isend_irecv", "send_object_list", "recv_object_list", "init_process_group", "new_group"))
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


#: One node's end as its records say it: (how: exited, stopped or cancelled; its exit code; what
#: stopped it, in its supervisor's words, or None).
End = tuple[str, int, str | None]


def end_text(end: End) -> str:
    """``exit code 3``, ``stopped (signal 15)``: one node's end, in words."""
    how, code, why = end
    if how in ("stopped", "cancelled"):
        return f"{how} ({why})" if why else how
    return f"exit code {code}"


def ended_line(ends: dict[str, End]) -> str:
    """The doctor's verdict on a job that has ended on every node: how, nodes with the same end
    named together (``the job has ended on every node: node1, node2 stopped (signal 15)``)."""
    by_text: dict[str, list[str]] = {}
    for node, end in ends.items():
        by_text.setdefault(end_text(end), []).append(node)
    return "the job has ended on every node: " + "; ".join(f"{compact(nodes)} {text}"
                                                           for text, nodes in by_text.items())


def ends_of(replies: dict[str, dict | str]) -> dict[str, End] | None:
    """Every node's end when the job has ended on each (its exit code recorded, no rank left); else
    None (a node that did not answer, or one whose job runs, leaves it to the analysis)."""
    ends: dict[str, End] = {}
    for node, reply in replies.items():
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


def site_of(frames: Iterable[Frame]) -> Site:
    """The collective a rank waits in and the user's call site: walking out from the innermost
    frame, the outermost collective name inside torch's code before the first frame that is not
    torch's (``all_reduce`` wrapped by c10d's logger is still ``all_reduce``)."""
    collective, entry = None, None
    for fr in frames:
        if _is_torch(fr.file):
            if fr.name in COLLECTIVES:
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


def analyse(replies: dict[str, dict | str], expected: dict[str, int]) -> Verdict:
    """The verdict from every node's reply (a dict) or its failure (a str: why it did not answer);
    *expected*: node -> its number of processes (the plan's). A job that has ended on every node
    is said so, how each ended, and nothing else: it is not a hang, nor a rank gone."""
    ends = ends_of(replies)
    if ends is not None:
        return Verdict([ended_line(ends)], False, ended=True)
    odd: list[dict] = []
    ranks: list[Rank] = []
    starting: list[str] = []  # nodes whose torchrun has not started its ranks yet
    for node, reply in replies.items():
        if isinstance(reply, str):
            odd.append({"node": node, "what": "node", "text": f"{node} did not answer: {reply}"})
            continue
        got = ranks_of(node, reply)
        ranks.extend(got)
        job = reply.get("job")
        if not got and isinstance(job, dict) and job.get("alive") is True and reply.get("exit_code") is None \
                and not reply.get("ended"):
            starting.append(node)  # in rendezvous or still importing: no rank is missing yet
            continue
        done = {d.get("local_rank"): d for d in reply.get("ended") or () if isinstance(d, dict)} \
            if isinstance(reply.get("ended"), list) else {}
        seen = {r.local_rank for r in got}
        for local in range(expected.get(node, len(got))):
            if local in seen:
                continue
            rec = done.get(local)
            if rec and _int(rec.get("code")) == 0:
                continue  # it finished its work
            if not got and reply.get("exit_code") is not None and not rec:
                continue  # the node's job ended as a whole: said once below
            code = f" (its exit code {rec.get('code')})" if rec and _int(rec.get("code")) is not None else ""
            rank = f"rank {rec['rank']}" if rec and _int(rec.get("rank")) is not None else f"local rank {local}"
            odd.append({"node": node, "what": "gone", "local_rank": local,
                        "text": f"{node} {rank} is gone{code}"})
        if not got and _int(reply.get("exit_code")) is not None:
            odd.append({"node": node, "what": "ended", "text": f"{node}'s job has ended (exit code {reply['exit_code']})"})
        elif reply.get("error"):
            odd.append({"node": node, "what": "record", "text": f"{node}: {str(reply['error'])[:200]}"})
    for r in ranks:
        if r.state in ODD_STATES:
            odd.append({"node": r.node, "what": "state", "rank": r.rank, "pid": r.pid, "state": r.state,
                        "text": f"{r.label} {ODD_STATES[r.state]}"})
    waiting = [r for r in ranks if r.state not in ODD_STATES]
    by_site: dict[Site, list[Rank]] = {}
    for r in waiting:
        by_site.setdefault(site_of(r.frames) if r.frames else Site(None, None, None), []).append(r)
    # the odd states' stacks are shown too (where a stopped rank stopped), each in a group of its own
    shown = {**by_site}
    for r in ranks:
        if r.state in ODD_STATES:
            shown.setdefault(Site(None, None, None, r.state), []).append(r)
    known = {s: rs for s, rs in by_site.items() if s.where or s.collective}
    # a stopped, stuck or gone rank (or a silent node) is the cause: the others wait wherever its
    # stop caught them (a ring all_reduce lets some ranks through to the next call site of the same
    # collective), so their places are not odd ones out; they are named as waiting, every place
    caused = any(o["what"] != "site" for o in odd)
    if caused and len(known) > 1 and len({s.collective for s in known}) == 1 and None not in {s.collective for s in known}:
        merged = Site(next(iter(known)).collective, ", ".join(sorted({s.where for s in known if s.where}, key=_where_key)),
                      None)
        known = {merged: [r for rs in known.values() for r in rs]}
    main = max(known, key=lambda s: (len(known[s]), -min(r.rank or 0 for r in known[s]))) if known else None
    if caused and main is not None and len(known) > 1:
        main = None  # every place is listed, none is called odd
    elif main is not None and len(known) > 1 and len(known[main]) > max(len(v) for s, v in known.items() if s != main):
        for site, rs in known.items():
            if site != main:
                odd.append({"node": rs[0].node, "what": "site", "ranks": [r.rank for r in rs],
                            "text": f"{', '.join(r.label for r in rs)} {'is' if len(rs) == 1 else 'are'} in "
                                    f"{site.text()}, not in {main.collective or 'the place'} like the others"})
    elif main is not None and len(known) > 1:  # no majority: every place is named
        main = None
    groups = [{"site": s.text(), "collective": s.collective, "where": s.where,
               "ranks": [{"node": r.node, "rank": r.rank, "pid": r.pid, "state": r.state} for r in rs],
               "frames": [f.__dict__ for f in rs[0].frames]}
              for s, rs in sorted(shown.items(), key=lambda kv: -len(kv[1]))]
    no_stack = [r for r in ranks if r.stack_error]
    # progress: a rank that runs (R) or used CPU in the sample is busy (importing, computing), not
    # hung, even where it is elsewhere than the others; a stopped, stuck or gone rank is a hang. A rank
    # blocked in a collective still uses a tick or two a second (gloo's and the interpreter's threads:
    # 0-2 of 100 seen on the lab), so "used CPU" means at least BUSY_SHARE of one CPU over the sample
    busy = [r for r in waiting
            if r.state == "R" or (r.cpu_ticks or 0) >= BUSY_SHARE * _ticks_per_sample(replies.get(r.node))]
    hard = [o for o in odd if o["what"] != "site"]
    lines = []
    if odd:
        named = "; ".join(o["text"] for o in odd[:NAMED_AT_MOST])
        more = f"; and {len(odd) - NAMED_AT_MOST} more" if len(odd) > NAMED_AT_MOST else ""
        lines.append(named + more)
    others = known.get(main, []) if main is not None else []
    if main is not None:
        plural = "s" if len(others) != 1 else ""
        if odd:
            lines.append(f"the other {len(others)} rank{plural} wait{'' if plural else 's'} in {main.text()}")
        else:
            using = " and use CPU (busy, not hung?)" if busy else ""
            lines.append(f"no rank stands out: all {len(others)} rank{plural} are in {main.text()}{using}")
    elif known:
        lines.append("the ranks are in " + "; ".join(f"{s.text()}: {_ranks_text(rs)}" for s, rs in known.items()))
    if no_stack:
        first = no_stack[0]
        nodes = compact(sorted({r.node for r in no_stack}))
        lines.append(f"no stack from {nodes}: {first.stack_error}; fix: {first.stack_fix}")
    if starting:
        lines.append(f"not started yet on {compact(starting)} (torchrun has not started the ranks there: "
                     "rendezvous, or still importing)")
    if not lines:
        lines.append("no rank of the job was found on any node" if not ranks else "no verdict")
    if busy and not hard and odd:
        lines.append(f"not a hang: {', '.join(r.label for r in busy[:NAMED_AT_MOST])} "
                     f"{'is' if len(busy) == 1 else 'are'} using CPU (busy: still importing, or computing)")
    hung = bool(hard) or (bool(waiting) and not busy)
    return Verdict(lines, hung, odd, groups)


def render(verdict: Verdict, frames_shown: int = 8) -> list[str]:
    """The verdict on top, then each group of ranks with its stack (innermost frames first)."""
    out = list(verdict.lines)
    for g in verdict.groups:
        nodes: dict[str, list[str]] = {}
        for r in g["ranks"]:
            nodes.setdefault(r["node"], []).append(str(r["rank"]) if r["rank"] is not None else f"pid {r['pid']}")
        who = "; ".join(f"{n} rank{'s' if len(v) > 1 else ''} {', '.join(v)}" for n, v in nodes.items())
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
             timeout: float = NODE_TIMEOUT_S) -> tuple[Verdict, Path | None]:
    """Collect, analyse, save (``doctor-<time>.json`` and the flight-recorder dumps under
    ``nccl-trace/<node>/`` in *run_dir*); the verdict and the record's path."""
    t0 = time.time()
    replies = collect(plan, call, timeout)
    verdict = analyse(replies, {n.name: n.nproc for n in plan.nodes})
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
