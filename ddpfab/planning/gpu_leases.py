"""GPU leases seen from the controller: what each node says about its GPUs (free, leased by a
run, busy without a lease), read back as validated data, the refusal of a run whose GPUs are
taken, before anything starts (the dry run refuses it the same way), and ``ddpfab queue``'s rows.
Pure: the nodes' answers in, states and problems out.

The leases themselves are taken and held on each node by the job's supervisor
(:mod:`ddpfab.node.leases`; :mod:`ddpfab.launch.gate` starts a ``--wait`` job when every node
holds them); this module only reads and judges what the nodes report, so a plan checked here
can still lose a race to a job started at the same instant: that job's supervisor then refuses
it on its node, naming the holder, and the run stops everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ddpfab.remote.nodeprogram import printable
from ddpfab.optionnames import option
from ddpfab.planning.plan import Plan
from ddpfab.problems import Problem

#: A GPU's states as a node reports them.
STATES = ("free", "leased", "busy")


@dataclass(frozen=True)
class GpuState:
    """One GPU of a node, as its node program reported it.

    Args:
        gpu: its index (nvidia-smi's).
        state: free, leased (by ``run_id`` of ``user``, supervisor ``pid``, ``since`` epoch s) or
            busy (``procs``: (pid, name) of processes that use it without a lease).
    """

    gpu: str
    state: str
    run_id: str = ""
    user: str = ""
    pid: int = 0
    since: float = 0.0
    procs: tuple[tuple[int, str], ...] = ()
    uuid: str = ""

    def describe(self, now: float | None = None) -> str:
        """``GPU 1 leased by run R (user U, pid P, for 12 s)`` or ``GPU 2 busy without a lease: ...``."""
        if self.state == "leased" and not (self.run_id or self.user or self.pid):
            return (f"GPU {self.gpu} leased by a process that left no record of itself (as root, "
                    "`ss -xap | grep ddpfab-lease-` names it)")
        if self.state == "leased":
            age = f", for {(now or time.time()) - self.since:.0f} s" if self.since else ""
            return (f"GPU {self.gpu} leased by run {self.run_id or '?'} (user {self.user or '?'}, "
                    f"pid {self.pid or '?'}{age})")
        if self.state == "busy":
            return f"GPU {self.gpu} busy without a lease: " + ", ".join(f"pid {p} ({n})" for p, n in self.procs)
        return f"GPU {self.gpu} free"


def _text(value: object, limit: int = 200) -> str:
    return printable(value)[:limit] if isinstance(value, str) else ""


def parse(raw: object) -> list[GpuState] | None:
    """A node's ``leases`` answer (``{"gpus": [...]}``) as GpuStates; None when it is not one
    (an error, or no answer): records are data, each field taken only with its type."""
    if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), list):
        return None
    out = []
    for g in raw["gpus"]:
        if not isinstance(g, dict) or not isinstance(g.get("gpu"), str) or g.get("state") not in STATES:
            continue
        h: dict = g["holder"] if isinstance(g.get("holder"), dict) else {}
        pid, since = h.get("pid"), h.get("since")
        procs = tuple((p["pid"], _text(p.get("name"), 80)) for p in g.get("procs") or ()
                      if isinstance(p, dict) and isinstance(p.get("pid"), int) and not isinstance(p.get("pid"), bool))
        out.append(GpuState(_text(g["gpu"], 20), g["state"], _text(h.get("run_id"), 80), _text(h.get("user"), 64),
                            pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
                            float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else 0.0,
                            procs, _text(g.get("uuid"), 80)))
    return out


def error(raw: object) -> str | None:
    """The node's reason it could not tell its leases, if it said one."""
    return _text(raw.get("error"), 300) or None if isinstance(raw, dict) else None


def refusals(plan: Plan, leases: dict[str, object]) -> list[Problem]:
    """One Problem per node of *plan* that cannot grant the GPUs its supervisor will ask for now:
    too few free (or a pinned one taken), naming what holds them. *leases*: node -> its raw
    ``leases`` answer (the probe's facts carry it)."""
    problems = []
    for node in plan.nodes:
        if not node.gpus:
            continue
        raw = leases.get(node.name)
        states = parse(raw)
        if states is None:
            why = error(raw) or "no answer about its GPU leases"
            problems.append(Problem(node.name, "gpu_leases", expected=f"{node.gpus} GPUs to lease", found=why,
                                    fix="check the lease dir and nvidia-smi there",
                                    text=f"host {node.name}: cannot lease GPUs: {why}"))
            continue
        by_gpu = {**{s.uuid: s for s in states if s.uuid}, **{s.gpu: s for s in states}}
        wanted = [by_gpu[g] for g in node.gpu_pin if g in by_gpu] if node.gpu_pin else states
        free = [s for s in wanted if s.state == "free"]
        need = len(node.gpu_pin) if node.gpu_pin else node.gpus
        if len(free) >= need:
            continue
        taken = [s for s in wanted if s.state != "free"]
        held = "; ".join(s.describe() for s in taken)
        what = f"GPU{'s' if need > 1 else ''} {','.join(node.gpu_pin)} (pinned)" if node.gpu_pin else \
            f"{need} GPU{'s' if need > 1 else ''}"
        wait, fewer = f"wait for them with {option('wait', True)}", f"ask for fewer with {option('gpus_per_node')}"
        problems.append(Problem(
            node.name, "gpus_held", expected=f"{what} free", found=held,
            fix=f"{wait} (ddpfab queue shows who waits), or {fewer}",
            text=f"host {node.name}: {what} wanted, {len(free)} free: {held}; {wait}, or {fewer}"))
    return problems


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def queue_rows(answers: dict[str, dict], now: float | None = None) -> list[dict]:
    """``ddpfab queue``: the jobs on the nodes (every user's), from each node's ``leases`` answer:
    running ones (holding leases) and waiting ones (a ticket in a node's queue), each with its user,
    age, and per node its GPUs or its place in that node's queue; running first, then waiting, in
    arrival order. Everything read is validated (strings printable, numbers numbers)."""
    now = now or time.time()
    rows: dict[str, dict] = {}
    for node, raw in answers.items():
        for g in parse(raw) or ():
            if g.state != "leased":
                continue
            row = rows.setdefault(g.run_id or "?", {"run_id": g.run_id or "?", "user": g.user, "state": "running",
                                                    "since": g.since, "nodes": {}})
            row["nodes"].setdefault(node, []).append(g.gpu)
        tickets: list = raw["queue"] if isinstance(raw, dict) and isinstance(raw.get("queue"), list) else []
        for place, t in enumerate(t for t in tickets if isinstance(t, dict)):
            run_id = _text(t.get("run_id"), 80) or "?"
            since = t.get("since") if isinstance(t.get("since"), float) else 0.0
            row = rows.setdefault(run_id, {"run_id": run_id, "user": _text(t.get("user"), 64), "state": "waiting",
                                           "since": since, "nodes": {}, "key": _text(t.get("key"), 120)})
            row["state"] = "waiting"  # it holds leases on some nodes, waits on this one
            row.setdefault("key", _text(t.get("key"), 120))
            row["nodes"][node] = f"place {place + 1}, wants {_int(t.get('count'))}" + (
                f" (pinned {','.join(_text(p, 40) for p in t.get('pin') or ())})" if t.get("pin") else "")
    out = sorted(rows.values(), key=lambda r: (r["state"] != "running", r.get("key") or "", r["since"]))
    for r in out:
        r["age_s"] = round(now - r["since"], 1) if r["since"] else None
        r.pop("key", None)
    return out
