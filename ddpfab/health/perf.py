"""``ddpfab check --perf``, the analysis: which node or link is slower than the rest. Pure.

The node side (:mod:`ddpfab.health.perfnode`) measures; the collection (:mod:`ddpfab.launch.perfcheck`) runs it
with torchrun; this module only turns numbers into a verdict, so every rule is unit-tested
without hosts: the pair schedule, the validation of what nodes sent back, the comparison with the
cluster's median, and the history of past checks.

Comparing with the median, not with a nominal figure, is what makes one rule work for a laptop lab
and a GPU cluster alike: synchronous training runs at the pace of its slowest member, so what
matters is a member that is much slower than its peers. The thresholds (below) are wider than the
spread measured on healthy labs under load (``docs/perf-check.md``) and narrower than the faults
the check is for.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpfab.health.resourcecheck import size
from ddpfab.problems import DdpfabError, Problem

#: The thresholds below come from healthy lab checks on a loaded shared machine (15 checks, 3 and
#: 8 nodes, load average 13-56) against the drills; the table is in docs/perf-check.md.
#: A device's matmul throughput below this fraction of the median device is "slow compute".
#: Lowest healthy ratio seen 0.60 (3 nodes, a neighbour's burst over all three windows); a 3 %
#: CPU quota gave 0.30-0.31, a 1 % one 0.07. On quiet hardware 0.5 or more would do.
COMPUTE_MIN_RATIO = 0.4
#: Host memory bandwidth below this fraction of the median node is "slow memory" (healthy: >= 0.71).
MEMORY_MIN_RATIO = 0.4
#: A link whose bandwidth is below this fraction of the median link is slow. Loaded-lab links
#: swing more than compute (TCP through one shared kernel): lowest healthy ratio seen 0.32;
#: tc's 30 Mbit/s gave 0.009-0.04; a NIC at 10G among 100G ones would be 0.1.
LINK_MIN_RATIO = 0.2
#: A link whose latency is above this multiple of the median link's is slow. Latency is what a
#: loaded host disturbs most (scheduling delays of milliseconds): highest healthy ratio seen 7.4.
LATENCY_MAX_RATIO = 20.0
#: Up to this many nodes every pair is measured; above it, the ring plus sampled rounds.
ALL_PAIRS_MAX = 16
#: Link rounds above ALL_PAIRS_MAX nodes: the ring (2 or 3 rounds) plus sampled pairs, so every
#: node meets at least 5 distinct peers (enough to tell a bad node from one bad link).
MAX_ROUNDS = 8
MARKER = "DDPFAB_PERF "
SCHEMA = 1


@dataclass(frozen=True)
class PerfOptions:
    """What ``check --perf`` measures and how long it may take.

    Args:
        window_s: one compute/memory timing window (longer than a CFS period, 100 ms, so a CPU
            quota shows as the share it grants).
        samples: timing windows per node; the best is kept (load spikes lower one, not all).
        mem_bytes: buffer size for the host memory bandwidth copy.
        min_bytes, max_bytes, max_bytes_gpu: link message sizes, growing x4 from min to max.
        passes: how many times the whole link schedule runs; each link keeps its best pass.
        step_s: a pair stops growing its message once a transfer (both ends) takes this long.
        step_reps: transfers per size (the fastest counts).
        latency_reps: ping-pongs per link for the latency.
        allreduce_sizes, allreduce_sizes_gpu: all_reduce message sizes (bytes) on CPU / GPU nodes.
        allreduce_max_reps: the most repetitions per all_reduce size.
        allreduce_cap_s: a size that would take longer over the slowest link measured is skipped.
        budget_s: link rounds not started after this many seconds (from the job's start) are
            skipped and reported as such.
        timeout_s: the process group's timeout (a dead peer fails the check instead of hanging).
        all_pairs_max, max_rounds: the pair schedule (see :func:`schedule`).
        nproc_per_node: processes per node (default: as a job would: inventory, GPUs, or 1).
    """

    window_s: float = 0.3
    samples: int = 3
    mem_bytes: int = 64 << 20
    min_bytes: int = 64 << 10
    max_bytes: int = 64 << 20
    max_bytes_gpu: int = 1 << 30
    passes: int = 2
    step_s: float = 0.1
    step_reps: int = 2
    latency_reps: int = 10
    allreduce_sizes: tuple[int, ...] = (4 << 10, 1 << 20, 16 << 20)
    allreduce_sizes_gpu: tuple[int, ...] = (4 << 10, 16 << 20, 256 << 20)
    allreduce_max_reps: int = 20
    allreduce_cap_s: float = 2.0
    budget_s: float = 60.0
    timeout_s: float = 120.0
    all_pairs_max: int = ALL_PAIRS_MAX
    max_rounds: int = MAX_ROUNDS
    nproc_per_node: int | None = None

    def node_config(self, nodes: int) -> dict[str, Any]:
        """The JSON the node script gets: every size and the pair rounds, decided here."""
        cfg = asdict(self)
        for key in ("all_pairs_max", "max_rounds", "nproc_per_node"):
            cfg.pop(key)
        cfg["rounds"] = [[list(p) for p in r] for r in schedule(nodes, self.all_pairs_max, self.max_rounds)]
        if cfg["max_bytes"] > cfg["max_bytes_gpu"]:
            cfg["max_bytes_gpu"] = cfg["max_bytes"]
        return cfg


# -- the pair schedule ----------------------------------------------------------------------
def _circle_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Round-robin tournament (circle method): n-1 rounds (n even) or n (odd, one idle node per
    round), each a matching; together every pair exactly once."""
    players: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = players[i], players[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The ring i -- i+1 (mod n) split into matchings: 2 rounds when n is even, 3 when odd."""
    rounds: list[list[tuple[int, int]]] = []
    for i in range(n):
        edge = (min(i, (i + 1) % n), max(i, (i + 1) % n))
        for r in rounds:
            if all(edge[0] not in p and edge[1] not in p for p in r):
                r.append(edge)
                break
        else:
            rounds.append([edge])
    return [sorted(r) for r in rounds]


def schedule(n: int, all_pairs_max: int = ALL_PAIRS_MAX, max_rounds: int = MAX_ROUNDS) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint node pairs (node ranks) to measure links in.

    Up to *all_pairs_max* nodes: every pair (n-1 or n rounds). Above it: the ring first (the
    neighbours of a ring all_reduce), then rounds of the round-robin tournament without the pairs
    already covered, up to *max_rounds* rounds in all: every node then meets at least
    ``max_rounds - 3`` distinct peers besides its two ring neighbours, so a node that is slow with
    all of them is told apart from one bad link. Rounds are matchings: no node is in two
    transfers at once.

    Args:
        n: the number of nodes.
        all_pairs_max: the largest cluster measured pair by pair.
        max_rounds: the round budget above *all_pairs_max* (at least 3, the ring's worst case).
    """
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    if n <= all_pairs_max:
        return _circle_rounds(n)
    rounds = _ring_rounds(n)
    seen = {p for r in rounds for p in r}
    for r in _circle_rounds(n):
        if len(rounds) >= max(max_rounds, len(rounds)):
            break
        fresh = [p for p in r if p not in seen]
        if len(fresh) >= n // 4:  # a round that only adds a few pairs is not worth its time
            rounds.append(fresh)
            seen.update(fresh)
    return rounds


# -- what nodes send back ----------------------------------------------------------------------
class PerfDataError(DdpfabError, ValueError):
    """A node's report is malformed; the message names the node and the field."""

    check = "perf_report"

    def __init__(self, node: str, message: str):
        super().__init__([Problem(node, self.check, text=message)])


def _num(node: str, where: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise PerfDataError(node, f"host {node}: perf report field {where}: expected a number >= {minimum:g}, "
                            f"found {value!r}")
    return float(value)


def validate_report(node: str, data: Any) -> dict:
    """Check one node's ``DDPFAB_PERF`` record (data, never code) and return the fields used."""
    if not isinstance(data, dict):
        raise PerfDataError(node, f"host {node}: perf report: expected a JSON object, found {type(data).__name__}")
    out: dict[str, Any] = {"node_rank": int(_num(node, "node_rank", data.get("node_rank"))),
                           "device": str(data.get("device", "?"))[:80], "backend": str(data.get("backend", "?"))[:16]}
    comp = data.get("compute")
    if not isinstance(comp, dict) or not isinstance(comp.get("per_device"), list) or not comp["per_device"]:
        raise PerfDataError(node, f"host {node}: perf report field compute.per_device: expected a non-empty list")
    out["compute"] = [_num(node, "compute.per_device", v) for v in comp["per_device"]]
    mem = data.get("memory")
    out["memory"] = _num(node, "memory.gbs", mem.get("gbs") if isinstance(mem, dict) else None)
    links = data.get("links", [])
    if not isinstance(links, list):
        raise PerfDataError(node, f"host {node}: perf report field links: expected a list")
    out["links"] = [{"peer": int(_num(node, "links.peer", ln.get("peer") if isinstance(ln, dict) else None)),
                     "gbs": _num(node, "links.gbs", ln.get("gbs")), "lat_us": _num(node, "links.lat_us", ln.get("lat_us"))}
                    for ln in links]
    out["all_reduce"] = [{"bytes": int(_num(node, "all_reduce.bytes", a.get("bytes") if isinstance(a, dict) else None)),
                          "s": _num(node, "all_reduce.s", a.get("s")),
                          "busbw_gbs": (None if a.get("busbw_gbs") is None else _num(node, "all_reduce.busbw_gbs",
                                                                                       a.get("busbw_gbs")))}
                         for a in data.get("all_reduce", [])]
    skipped = data.get("all_reduce_skipped", [])
    if not isinstance(skipped, list):
        raise PerfDataError(node, f"host {node}: perf report field all_reduce_skipped: expected a list")
    out["all_reduce_skipped"] = [int(_num(node, "all_reduce_skipped", v)) for v in skipped]
    out["rounds_skipped"] = int(_num(node, "rounds_skipped", data.get("rounds_skipped", 0)))
    out["seconds"] = _num(node, "seconds", data.get("seconds", 0))
    return out


# -- the verdict ----------------------------------------------------------------------------------
@dataclass
class Finding:
    """One straggler: a node (``subject`` = its name) or a link (``"a--b"``)."""

    subject: str
    kind: str  # compute | memory | link | latency | pair
    ratio: float
    value: float
    median: float
    unit: str
    text: str


@dataclass
class PerfResult:
    nodes: list[str]
    node_figures: dict[str, dict] = field(default_factory=dict)
    links: dict[str, dict] = field(default_factory=dict)  # "a--b" -> gbs, lat_us, ratios
    all_reduce: list[dict] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def stragglers(self) -> list[str]:
        """Subjects named in the verdict, in order, once each."""
        return list(dict.fromkeys(f.subject for f in self.findings))

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "nodes": self.nodes, "node_figures": self.node_figures, "links": self.links,
                "all_reduce": self.all_reduce, "medians": self.medians,
                "findings": [asdict(f) for f in self.findings], "stragglers": self.stragglers,
                "notes": self.notes, "thresholds": self.thresholds, "ok": not self.findings}


def link_key(a: str, b: str) -> str:
    return f"{a}--{b}"


def _ratio(value: float, median: float) -> float:
    return value / median if median > 0 else 1.0


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.3f}x"


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _median_of_medians(per_node: dict[str, list[tuple[str, dict]]], key: str) -> float:
    mids = [statistics.median(v[key] for _, v in links) for links in per_node.values() if links]
    return statistics.median(mids) if mids else 0.0


def analyze(reports: dict[str, dict], order: list[str], *, compute_min: float = COMPUTE_MIN_RATIO,
            memory_min: float = MEMORY_MIN_RATIO, link_min: float = LINK_MIN_RATIO,
            latency_max: float = LATENCY_MAX_RATIO) -> PerfResult:
    """The verdict from every node's validated report.

    Args:
        reports: node name -> :func:`validate_report` output (every node of the job).
        order: node names in node-rank order (``order[node_rank]`` is that node).
        compute_min, memory_min, link_min: a node (device, link) below this fraction of the
            cluster's median is named.
        latency_max: a link whose latency is above this multiple of the median is named.
    """
    a = _Analysis(reports, order, compute_min, memory_min, link_min, latency_max)
    if len(order) < 2:
        a.res.notes.append("a single node: nothing to compare it with")
        return a.res
    a.node_findings()
    a.link_findings()
    a.starved_links()
    a.pair_findings()
    return a.res


class _Analysis:
    """:func:`analyze`'s steps over the medians and link figures it computes first."""

    def __init__(self, reports: dict[str, dict], order: list[str], compute_min: float, memory_min: float,
                 link_min: float, latency_max: float):
        self.order, self.compute_min, self.memory_min = order, compute_min, memory_min
        self.res = res = PerfResult(nodes=list(order), thresholds={
            "compute_min": compute_min, "memory_min": memory_min, "link_min": link_min, "latency_max": latency_max})
        self.med_dev = statistics.median(g for n in order for g in reports[n]["compute"])
        self.med_mem = statistics.median(reports[n]["memory"] for n in order)
        self.link_vals = _link_values(reports, order)
        self.per_node_links: dict[str, list[tuple[str, dict]]] = {n: [] for n in order}
        for (a, b), v in self.link_vals.items():
            self.per_node_links[a].append((b, v))
            self.per_node_links[b].append((a, v))
        # the reference link: the median over nodes of each node's median link. A plain median over
        # links fails when one node holds most of them (3 nodes: 2 of the 3 links touch a bad node)
        self.med_link = _median_of_medians(self.per_node_links, "gbs")
        self.med_lat = _median_of_medians(self.per_node_links, "lat_us")
        res.medians = {"compute_gflops": self.med_dev, "memory_gbs": self.med_mem, "link_gbs": self.med_link,
                       "latency_us": self.med_lat}
        self.slow_links: dict[tuple[str, str], list[str]] = {}
        for (a, b), v in self.link_vals.items():
            v["ratio"] = round(_ratio(v["gbs"], self.med_link), 4)
            v["lat_ratio"] = round(_ratio(v["lat_us"], self.med_lat), 4)
            why = ["bandwidth"] * (v["ratio"] < link_min) + ["latency"] * (v["lat_ratio"] > latency_max)
            if why:
                self.slow_links[(a, b)] = why
            res.links[link_key(a, b)] = v
        for n in order:
            res.node_figures[n] = self.figures(reports[n], self.per_node_links[n])
        self.slow_cpu: set[str] = set()
        self.bad_nodes: set[str] = set()
        self.starved: set[str] = set()

    def figures(self, r: dict, mine: list[tuple[str, dict]]) -> dict:
        """One node's figures and their ratios to the medians."""
        fig = {"compute_gflops": min(r["compute"]), "per_device": r["compute"], "memory_gbs": r["memory"],
               "device": r["device"], "backend": r["backend"],
               "link_gbs": statistics.median(v["gbs"] for _, v in mine) if mine else None,
               "latency_us": statistics.median(v["lat_us"] for _, v in mine) if mine else None,
               "peers": len(mine)}
        fig["compute_ratio"] = round(_ratio(fig["compute_gflops"], self.med_dev), 4)
        fig["memory_ratio"] = round(_ratio(fig["memory_gbs"], self.med_mem), 4)
        fig["link_ratio"] = round(_ratio(fig["link_gbs"], self.med_link), 4) if mine else None
        return fig

    def node_findings(self) -> None:
        """Nodes first: slow compute (a device), slow host memory."""
        med_dev, med_mem = self.med_dev, self.med_mem
        for n in self.order:
            fig = self.res.node_figures[n]
            slow_devs = [i for i, g in enumerate(fig["per_device"]) if _ratio(g, med_dev) < self.compute_min]
            if slow_devs:
                self.slow_cpu.add(n)
                gpu = fig["device"] != "cpu"
                which = ("" if not gpu else f" (GPU {', '.join(map(str, slow_devs))} of {len(fig['per_device'])})")
                worst = min(fig["per_device"][i] for i in slow_devs)
                fix = ("check its GPU clocks, power and thermal throttling (nvidia-smi -q -d CLOCK,PERFORMANCE) "
                       "and other processes on it" if gpu else
                       "its CPU is throttled or busy: check CPU quotas/cgroups, frequency scaling, thermal state "
                       "and other processes on it")
                self.res.findings.append(Finding(
                    n, "compute", round(_ratio(worst, med_dev), 4), worst, med_dev, "GFLOP/s",
                    f"{n}: slow compute{which}: matmul {_x(_ratio(worst, med_dev))} of median "
                    f"({_fmt(worst)} vs {_fmt(med_dev)} GFLOP/s); {fix}"))
            if fig["memory_ratio"] < self.memory_min:
                fix = ("its CPU is slow too: a throttled or busy CPU copies memory slowly as well" if n in self.slow_cpu
                       else "check its memory configuration (DIMMs, NUMA) and what else is running there")
                self.res.findings.append(Finding(
                    n, "memory", fig["memory_ratio"], fig["memory_gbs"], med_mem, "GB/s",
                    f"{n}: slow host memory: copy bandwidth {_x(fig['memory_ratio'])} of median "
                    f"({_fmt(fig['memory_gbs'])} vs {_fmt(med_mem)} GB/s); {fix}"))

    def pair(self, x: str, y: str) -> tuple[str, str]:
        return (x, y) if self.order.index(x) < self.order.index(y) else (y, x)

    def link_findings(self) -> None:
        """A node whose links are slow with most of its peers is the culprit (the rest are pairs)."""
        for n in self.order:
            mine = self.per_node_links[n]
            slow = [p for p, _ in mine if self.pair(n, p) in self.slow_links]
            if len(mine) < 2 or len(slow) * 2 <= len(mine):
                continue
            self.bad_nodes.add(n)
            kinds = {w for p in slow for w in self.slow_links[self.pair(n, p)]}
            kind, key, med, unit = (("link", "gbs", self.med_link, "GB/s") if "bandwidth" in kinds else
                                    ("latency", "lat_us", self.med_lat, "us"))
            value = statistics.median(v[key] for p, v in mine if p in slow)
            ratio = _ratio(value, med)
            every = "every peer" if len(slow) == len(mine) else f"{len(slow)} of its {len(mine)} peers"
            starved = (" (its CPU is slow too, and gloo moves data on the CPU: the starved CPU may be the cause)"
                       if n in self.slow_cpu else "; check its NIC (link speed, errors), cable and MTU")
            what = (f"link bandwidth {_x(ratio)} of median" if kind == "link" else f"link latency {ratio:.1f}x the median")
            self.res.findings.append(Finding(
                n, kind, round(ratio, 4), value, med, unit,
                f"{n}: {what} ({_fmt(value)} vs {_fmt(med)} {unit}); its link to {every} is slow ({_names(slow)}){starved}"))

    def starved_links(self) -> None:
        """A CPU node whose compute is slow slows its links too (gloo moves data on the CPU): a slow
        link at it is told with its compute finding, not as a fault of the path."""
        self.starved = {n for n in self.slow_cpu if self.res.node_figures[n]["device"] == "cpu"}
        for f in [f for f in self.res.findings if f.kind == "compute" and f.subject in self.starved - self.bad_nodes]:
            peers = [b if a == f.subject else a for (a, b) in self.slow_links if f.subject in (a, b)]
            if peers:
                f.text += (f"; its link{'s' if len(peers) > 1 else ''} to {_names(peers)} "
                           f"{'are' if len(peers) > 1 else 'is'} slow too (gloo moves data on the CPU)")

    def pair_findings(self) -> None:
        """The slow links no bad node or starved CPU explains: the path between two nodes."""
        for (a, b), slow_in in self.slow_links.items():
            if a in self.bad_nodes or b in self.bad_nodes or a in self.starved or b in self.starved:
                continue
            v = self.link_vals[(a, b)]
            bandwidth = "bandwidth" in slow_in
            what = (f"bandwidth {_x(v['ratio'])} of median ({_fmt(v['gbs'])} vs {_fmt(self.med_link)} GB/s)"
                    if bandwidth else
                    f"latency {v['lat_ratio']:.1f}x the median ({_fmt(v['lat_us'])} vs {_fmt(self.med_lat)} us)")
            enough = len(self.per_node_links[a]) >= 2 and len(self.per_node_links[b]) >= 2
            where = ("both nodes are fine with their other peers: check the path between them (cables, switch "
                     "ports, routes)" if enough else "too few pairs measured to tell which end is at fault")
            self.res.findings.append(Finding(
                link_key(a, b), "pair", v["ratio"] if bandwidth else v["lat_ratio"],
                v["gbs"] if bandwidth else v["lat_us"], self.med_link if bandwidth else self.med_lat,
                "GB/s" if bandwidth else "us", f"link {a}--{b}: {what}; {where}"))


def _link_values(reports: dict[str, dict], order: list[str]) -> dict[tuple[str, str], dict]:
    """Each link's figures: each end measured the same transfers; the slower end's figure counts."""
    ends: dict[tuple[str, str], list[dict]] = {}
    for n in order:
        for ln in reports[n]["links"]:
            peer = order[ln["peer"]] if 0 <= ln["peer"] < len(order) else None
            if peer is None or peer == n:
                continue
            a, b = sorted((n, peer), key=order.index)
            ends.setdefault((a, b), []).append(ln)
    return {k: {"gbs": min(x["gbs"] for x in v), "lat_us": max(x["lat_us"] for x in v)} for k, v in ends.items()}


def add_all_reduce(res: PerfResult, reports: dict[str, dict], order: list[str]) -> None:
    """The whole set's all_reduce (every rank agreed on the slowest time, so any node's figure is
    the cluster's; node rank 0's is used), and how it compares with the median link."""
    first = reports[order[0]]["all_reduce"] if order else []
    res.all_reduce = [dict(a) for a in first]
    skipped = reports[order[0]]["all_reduce_skipped"] if order else []
    if skipped:
        res.notes.append(f"all_reduce at {', '.join(size(s) for s in skipped)} skipped: over the slowest link "
                         "measured it would take longer than the time cap")
    largest = max(first, key=lambda a: a["bytes"], default=None)
    if largest and largest["busbw_gbs"] and res.medians.get("link_gbs"):
        ratio = largest["busbw_gbs"] / res.medians["link_gbs"]
        res.notes.append(f"all_reduce bus bandwidth at {size(largest['bytes'])}: {_fmt(largest['busbw_gbs'])} GB/s, "
                         f"{_x(ratio)} of the median link (a ring all_reduce moves at the pace of its slowest link)")


# -- terminal ----------------------------------------------------------------------------------------
def render(res: PerfResult, report_path: str | None = None, seconds: float | None = None) -> str:
    """The table, the slow links, the all_reduce figures and the verdict, for a terminal."""
    w = max([4] + [len(n) for n in res.nodes])
    head = (f"{'node':<{w}}  {'compute GFLOP/s':>15} {'x med':>6}  {'memory GB/s':>11} {'x med':>6}  "
            f"{'link GB/s':>9} {'x med':>6}  {'latency us':>10}")
    lines = [head]
    for n in res.nodes:
        f = res.node_figures[n]
        link = "-" if f["link_gbs"] is None else _fmt(f["link_gbs"])
        lr = "-" if f["link_ratio"] is None else f"{f['link_ratio']:.2f}"
        lat = "-" if f["latency_us"] is None else _fmt(f["latency_us"])
        mark = "  <" if n in res.stragglers else ""
        lines.append(f"{n:<{w}}  {_fmt(f['compute_gflops']):>15} {f['compute_ratio']:>6.2f}  "
                     f"{_fmt(f['memory_gbs']):>11} {f['memory_ratio']:>6.2f}  {link:>9} {lr:>6}  {lat:>10}{mark}")
    m = res.medians
    lines.append(f"{'median':<{w}}  {_fmt(m.get('compute_gflops', 0)):>15} {'':>6}  {_fmt(m.get('memory_gbs', 0)):>11} "
                 f"{'':>6}  {_fmt(m.get('link_gbs', 0)):>9} {'':>6}  {_fmt(m.get('latency_us', 0)):>10}")
    if res.links:
        lines.append(f"\nlinks measured: {len(res.links)} pairs; slowest: " + ", ".join(
            f"{k} {_fmt(v['gbs'])} GB/s ({v['ratio']:.2f}x)"
            for k, v in sorted(res.links.items(), key=lambda kv: kv[1]["ratio"])[:3]))
    if res.all_reduce:
        lines.append("all_reduce (bus bandwidth): " + ", ".join(
            f"{size(a['bytes'])} {_fmt(a['busbw_gbs']) if a['busbw_gbs'] is not None else '-'} GB/s"
            for a in res.all_reduce))
    for note in res.notes:
        lines.append(f"note: {note}")
    lines.append("")
    if res.findings:
        lines += [f"STRAGGLER {f.text}" for f in res.findings]
        verdict = f"{len(res.stragglers)} straggler(s) among {len(res.nodes)} nodes: {', '.join(res.stragglers)}"
    else:
        verdict = f"no straggler among {len(res.nodes)} nodes"
    if seconds is not None:
        verdict += f" ({seconds:.1f} s)"
    lines.append(verdict)
    if report_path:
        lines.append(f"report: {report_path}")
    return "\n".join(lines)


# -- history ------------------------------------------------------------------------------------------
def history(records: list[dict], nodes: list[str] | None = None) -> dict[str, list[dict]]:
    """Per node, its figures in every past check, oldest first.

    Args:
        records: ``perf.json`` contents (``{"time": ..., "run_id": ..., "result": PerfResult dict}``),
            in any order; malformed ones must have been dropped by the caller.
        nodes: only these nodes (default: every node seen).
    """
    out: dict[str, list[dict]] = {}
    for rec in sorted(records, key=lambda r: r["time"]):
        result = rec["result"]
        for n, f in result["node_figures"].items():
            if nodes and n not in nodes:
                continue
            out.setdefault(n, []).append({
                "time": rec["time"], "run_id": rec["run_id"], "compute_gflops": f["compute_gflops"],
                "compute_ratio": f["compute_ratio"], "memory_gbs": f["memory_gbs"], "link_gbs": f["link_gbs"],
                "link_ratio": f["link_ratio"], "straggler": n in result.get("stragglers", [])})
    return out


def render_history(hist: dict[str, list[dict]], time_fmt=None) -> str:
    """One block per node: each check's compute and link figures (and ratio to that check's median),
    then the trend: the latest against the node's own first record."""
    if not hist:
        return "no perf checks recorded yet (run ddpfab check --perf)"
    lines = []
    for n in sorted(hist):
        rows = hist[n]
        lines.append(f"{n}: {len(rows)} check(s)")
        for r in rows:
            when = time_fmt(r["time"]) if time_fmt else f"{r['time']:.0f}"
            link = "-" if r["link_gbs"] is None else f"{_fmt(r['link_gbs'])} GB/s ({r['link_ratio']:.2f}x)"
            lines.append(f"  {when}  compute {_fmt(r['compute_gflops'])} GFLOP/s ({r['compute_ratio']:.2f}x)  "
                         f"link {link}{'  STRAGGLER' if r['straggler'] else ''}")
        if len(rows) >= 2:
            trend = []
            for key, label in (("compute_gflops", "compute"), ("link_gbs", "link")):
                first, last = rows[0][key], rows[-1][key]
                if first and last is not None:
                    trend.append(f"{label} {_x(last / first)} of its first")
            lines.append("  trend: " + ", ".join(trend))
    return "\n".join(lines)
