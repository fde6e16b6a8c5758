"""The data-plane probe of ``ddpfab check`` (and of ``run``'s preflight): can every member reach
every other on the ports gloo and NCCL use?

Each node's program (:mod:`ddpfab.node`) answers ``mesh_listen``: it listens on port 0 (the kernel
picks an ephemeral port, exactly as gloo and NCCL do) and, on the master, on the master port, and
reports its ports; then ``mesh_connect``: it connects to its targets with a bounded number of
connects in flight and reports; it keeps listening until every node is done (the session's stdin
EOF), so nothing it opened outlives the check.

Why it is shaped like this (measured on lab hosts, see docs/benchmarks.md):

- **A timeout is not yet a failure.** With every host on a loaded machine, a connect can take
  seconds to complete although nothing drops it. A timed-out connect is retried with a longer
  timeout (:data:`ATTEMPT_TIMEOUTS_S`) until the node's deadline; only a connect that times out on
  every attempt counts as dropped. A *refused* connect is an answer from the peer and fails at
  once; a *host unreachable* one is retried like a timeout, because on one L2 segment it only
  means that nobody answered the kernel's ARP requests for 3 s (a link that just came back, a
  loaded peer), and a rule's ICMP answer comes back at once on every attempt anyway.
- **Bounded work per node.** At most :data:`DEFAULT_CONCURRENCY` connects are in flight per node
  and the node accepts on one thread (a selector), whatever the cluster size; the deadline grows
  with the number of targets, so a large cluster gets the time its work needs.
- **Which pairs.** Up to :data:`EXHAUSTIVE_MAX_NODES` nodes every ordered pair is probed.
  Beyond, each node probes :data:`DEFAULT_DEGREE` peers at offsets ``{1} + random`` around the
  ring of nodes (a random circulant graph, fresh offsets each check): every node is then the
  target of exactly ``degree`` peers and the source of exactly ``degree`` probes, so the faults
  that concern a node as a whole are found with certainty, however large the cluster: a node whose
  firewall drops members (every probe to it fails), a node on the wrong subnet or with a dead
  route (every probe to and from it fails), a node whose OUTPUT rules drop members (every probe
  from it fails). A rule that drops only some pairs, or one direction between two groups, is
  caught when a sampled pair crosses it: a rule between one specific pair with probability
  ``degree/(N-1)`` per check (stated in the report as ``coverage``); ``check --exhaustive`` probes
  all pairs.
- **The master port is probed from every node**, always: it is O(N), and the TCPStore is the one
  port every rank must reach.
- **Bulk transfers, not only connects** (:func:`bulk_pairs`): a path-MTU black hole (jumbo frames
  on all ports but one) passes every connect and stalls the backends' first large tensor, so each
  node sends :data:`BULK_BYTES` to its ring neighbour and to the master and reads as many back:
  O(N) transfers, each node's port crossed both ways; the node all of whose transfers stall is
  named (:func:`classify_bulk`).
- **The advertised address**: gloo and NCCL bind and advertise what the node's hostname resolves
  to (without a ``*_SOCKET_IFNAME``); where that is not the data address, the node's probing peers
  also connect to it (:func:`classify_advertised`).

:func:`plan_targets` and :func:`classify` are pure (unit-tested without hosts); :func:`run_mesh`
is the effectful part.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hostlist import compact
from ddpfab.optionnames import option
from ddpfab.results import GroupResult

#: Per-attempt connect timeouts (seconds). The kernel answers a SYN itself, so CPU load alone
#: rarely delays a connect; the kernel resends a lost SYN after 1 s, so an attempt of 2 s already
#: covers one loss, and three attempts (8 s in all) cover a burst. A dropped connect costs 8 s.
ATTEMPT_TIMEOUTS_S = (2.0, 2.0, 4.0)
#: Connects in flight per node (a thread pool of this size on each node).
DEFAULT_CONCURRENCY = 16
#: Up to this many nodes every ordered pair is probed. Evidence (lab, one loaded 2-core machine):
#: on a healthy cluster all pairs cost little even at 128 nodes (the mesh step took 3.3 s at 64
#: nodes and 7.5 s at 128 exhaustive, against 5.7 s sampled at 128: most of it is starting python
#: on every node); what does not scale is the *faulty* case: a node whose connects all time out
#: works through its targets DEFAULT_CONCURRENCY at a time, each after every attempt (8 s), so a
#: check takes ceil((N-1)/16) x 8 s: 16 s at 32 nodes, 32 s at 64, 64 s at 128. Sampling keeps
#: that at 8 s (+ the master port) at any size, with certainty for node-wide faults.
EXHAUSTIVE_MAX_NODES = 32
#: Peers each node probes beyond EXHAUSTIVE_MAX_NODES (and sources that probe each node).
DEFAULT_DEGREE = 16
#: Seconds of slack on every node's deadline (python start, thread start) on top of the work.
DEADLINE_BASE_S = 10.0
#: Bytes of each bulk transfer: far more than one segment, so with any MTU the transfer needs
#: full-size segments; a path that drops them (a path-MTU black hole: jumbo frames on some ports
#: only) lets connects through and stalls this, as it stalls the backends' first large tensor.
BULK_BYTES = 256 * 1024
#: Seconds a bulk transfer may take. 256 KiB crosses a loaded lab bridge in milliseconds; a lost
#: full-size segment is never delivered, so a stalled transfer does not complete at any timeout.
BULK_TIMEOUT_S = 5.0

@dataclass
class MeshPlan:
    """Which node probes which peers.

    Args:
        nodes: the nodes taking part, in inventory order (those that answered the probe).
        offsets: node i probes nodes (i + d) mod N for each d; all of 1..N-1 when exhaustive.
        exhaustive: every ordered pair is probed.
        seed: the seed the sampled offsets came from (None when exhaustive), for the record.
    """

    nodes: list[str]
    offsets: list[int]
    exhaustive: bool
    seed: int | None = None

    def targets_of(self, name: str) -> list[str]:
        i = self.nodes.index(name)
        n = len(self.nodes)
        return [self.nodes[(i + d) % n] for d in self.offsets]

    @property
    def pairs(self) -> int:
        return len(self.nodes) * len(self.offsets)

    @property
    def coverage(self) -> float:
        """Fraction of all ordered pairs probed (1.0 when exhaustive)."""
        n = len(self.nodes)
        return 1.0 if n < 2 else self.pairs / (n * (n - 1))

    def to_dict(self) -> dict:
        return {"mode": "exhaustive" if self.exhaustive else "sampled", "nodes": len(self.nodes),
                "degree": len(self.offsets), "pairs_probed": self.pairs,
                "pairs_total": len(self.nodes) * (len(self.nodes) - 1), "coverage": round(self.coverage, 4),
                "seed": self.seed, "offsets": self.offsets}


def plan_targets(nodes: list[str], exhaustive: bool = False, degree: int = DEFAULT_DEGREE,
                 exhaustive_max: int = EXHAUSTIVE_MAX_NODES, seed: int | None = None) -> MeshPlan:
    """Choose the probed pairs: all of them up to *exhaustive_max* nodes (or when asked), else a
    random circulant graph of the given degree (offset 1 always, so neighbours in inventory order,
    often rack neighbours, are always probed).

    Args:
        nodes: node names in inventory order.
        exhaustive: probe every ordered pair whatever the size.
        degree: peers per node when sampling.
        exhaustive_max: the largest cluster probed exhaustively by default.
        seed: for the sampled offsets; None draws one (recorded in the plan).
    """
    n = len(nodes)
    if exhaustive or n <= exhaustive_max or degree >= n - 1:
        return MeshPlan(list(nodes), list(range(1, n)), exhaustive=True)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    offsets = [1] + sorted(rng.sample(range(2, n), degree - 1))
    return MeshPlan(list(nodes), offsets, exhaustive=False, seed=seed)


def deadline_for(targets: int, concurrency: int = DEFAULT_CONCURRENCY,
                 attempts: tuple[float, ...] = ATTEMPT_TIMEOUTS_S) -> float:
    """Seconds one node may take: every target timing out on every attempt, *concurrency* at a time."""
    if not targets:
        return DEADLINE_BASE_S
    return DEADLINE_BASE_S + math.ceil(targets / concurrency) * sum(attempts)


# -- classification (pure) ----------------------------------------------------------------
@dataclass
class MeshProblem:
    """One distinct data-plane problem and the nodes it concerns.

    Args:
        kind: isolated | no-inbound | no-outbound | pairs | master-port.
        nodes: the nodes to blame, in inventory order.
        summary: what was found, the same text for every node of the problem (so it groups).
        fix: the likely cause and what to do.
        pairs: the failed (source, target, result) triples behind it.
    """

    kind: str
    nodes: list[str]
    summary: str
    fix: str
    pairs: list[tuple[str, str, str]] = field(default_factory=list)


def _cause(results: list[str]) -> tuple[str, str]:
    """(what the failures were, their likely cause) from the connect results behind a problem."""
    kinds = sorted(set(results))
    seen = ", ".join(kinds)
    if all(r == "timed out" for r in results):
        return seen, "dropped (a firewall DROP rule)"
    if all(r == "refused" for r in results):
        return seen, "rejected (a firewall REJECT rule, or nothing listening)"
    if any("unreachable" in r.lower() or "no route" in r.lower() for r in results):
        return seen, ("not routed (a wrong address or subnet, a missing route, or a full neighbour table: "
                      "net.ipv4.neigh.default.gc_thresh3)")
    return seen, "refused or dropped"


FIREWALL_FIX = "allow TCP from the cluster members (ddpfab provision --tags firewall)"


#: (peer, connect result) pairs: the probes into a node, or out of it.
Entries = list[tuple[str, str]]


def classify(order: list[str], results: dict[str, list[dict]]) -> list[MeshProblem]:
    """Explain failed ephemeral-port probes by the fewest causes: nodes nobody reaches (their
    INPUT), nodes that reach nobody (their OUTPUT), nodes cut off both ways (address, subnet,
    route), and what remains as pair rules. A failure explained by a node-wide cause is not
    blamed on the other end too.

    Args:
        order: node names in inventory order.
        results: source -> its probe results (``target``, ``kind``, ``result``).
    """
    ins, outs = _ephemeral_probes(order, results)
    isolated, no_in, no_out = _node_faults(order, ins, outs)
    problems = _node_problems(
        "isolated", isolated, order, ins, outs,
        lambda n: f"cannot reach or be reached by any of {_peers(ins[n] + outs[n])} peers probed "
                  f"({_seen(ins[n] + outs[n])})",
        "likely a wrong address or subnet, or no route between them: check ddpfab_data_addr and "
        "`ip route` on these nodes")
    problems += _node_problems(
        "no-inbound", no_in, order, ins, outs, lambda n: f"unreachable from {_peers(ins[n])} peers ({_seen(ins[n])})",
        lambda pairs: f"likely their firewall: connects to them are {_cause([r for _, _, r in pairs])[1]}; "
                      + FIREWALL_FIX)
    problems += _node_problems(
        "no-outbound", no_out, order, ins, outs, lambda n: f"cannot reach {_peers(outs[n])} peers ({_seen(outs[n])})",
        "likely their OUTPUT firewall rules; allow TCP to the cluster members")
    pairs = _pairs_problem(order, outs, isolated | no_in | no_out)
    return problems if pairs is None else problems + [pairs]


def _ephemeral_probes(order: list[str], results: dict[str, list[dict]]) -> tuple[dict[str, Entries], dict[str, Entries]]:
    """(node -> the ephemeral-port probes into it, node -> those out of it), for the nodes of
    *order* only: :func:`classify` judges each node by both directions of its own probes."""
    ins: dict[str, Entries] = {n: [] for n in order}
    outs: dict[str, Entries] = {n: [] for n in order}
    for src, probes in results.items():
        for p in probes:
            if p.get("kind", "ephemeral") != "ephemeral" or p["target"] not in ins or src not in outs:
                continue
            ins[p["target"]].append((src, p["result"]))
            outs[src].append((p["target"], p["result"]))
    return ins, outs


def _all_fail(entries: Entries) -> bool:
    """Some probes, and none of them succeeded."""
    return bool(entries) and all(r != "ok" for _, r in entries)


def _node_faults(order: list[str], ins: dict[str, Entries], outs: dict[str, Entries]
                 ) -> tuple[set[str], set[str], set[str]]:
    """(isolated, no inbound, no outbound) nodes: the node-wide causes, each failure blamed on one
    end only, so a node is not reported for what its peer's fault explains."""
    no_in = {n for n in order if _all_fail(ins[n])}
    no_out = {n for n in order if _all_fail(outs[n])}
    isolated = no_in & no_out
    # a source whose every failed probe went to a node nobody reaches is not at fault itself
    no_out = {n for n in no_out - isolated if any(t not in no_in for t, r in outs[n] if r != "ok")}
    # a node reached by nobody only because its sources reach nobody is not at fault itself
    no_in = {n for n in no_in - isolated if any(s not in no_out | isolated for s, r in ins[n] if r != "ok")}
    return isolated, no_in, no_out


def _peers(entries: Entries) -> int:
    """How many distinct peers the probes concern."""
    return len({p for p, _ in entries})


def _seen(entries: Entries) -> str:
    """The failed results among the probes, in words (for a problem's summary)."""
    return _cause([r for _, r in entries if r != "ok"])[0]


def _node_problems(kind: str, members: set[str], order: list[str], ins: dict[str, Entries],
                   outs: dict[str, Entries], text: Callable[[str], str],
                   fix: str | Callable[[list[tuple[str, str, str]]], str]) -> list[MeshProblem]:
    """The problems of one node-wide cause: *members* grouped by their summary (*text* of each),
    with the failed pairs that concern them and the *fix* (or what it says of those pairs)."""
    # one problem per distinct text, so "unreachable from 61 peers" groups and "from 59" does not
    by_text: dict[str, list[str]] = {}
    for n in order:
        if n in members:
            by_text.setdefault(text(n), []).append(n)
    problems = []
    for summary, nodes in by_text.items():
        pairs = [(s, n, r) for n in nodes for s, r in ins[n] if r != "ok"]
        pairs += [(n, t, r) for n in nodes for t, r in outs[n] if r != "ok"]
        problems.append(MeshProblem(kind, nodes, summary, fix(pairs) if callable(fix) else fix, pairs))
    return problems


def _pairs_problem(order: list[str], outs: dict[str, Entries], blamed: set[str]) -> MeshProblem | None:
    """The failed connects no node-wide cause explains (between two nodes not *blamed*), as one
    problem: a rule that drops some members or one direction; None when there are none."""
    rest = [(s, t, r) for s in order for t, r in outs[s] if r != "ok" and s not in blamed and t not in blamed]
    if not rest:
        return None
    targets = [n for n in order if any(t == n for _, t, _ in rest)]
    shown = ", ".join(f"{s}->{t} ({r})" for s, t, r in rest[:6])
    more = f" and {len(rest) - 6} more" if len(rest) > 6 else ""
    return MeshProblem(
        "pairs", targets, f"{len(rest)} connections fail between nodes that reach others: {shown}{more}",
        "likely a firewall rule that drops some members or one direction; " + FIREWALL_FIX, rest)


def bulk_pairs(nodes: list[str], master: str) -> list[tuple[str, str]]:
    """The bulk transfers (source, target): each node to its ring neighbour (so every node sends
    one and receives one: both directions of its port) and each node to the master (the pair
    every backend uses first). O(N) transfers, N - 1 of them into the master."""
    n = len(nodes)
    pairs: list[tuple[str, str]] = []
    for i, name in enumerate(nodes):
        if n > 1:
            pairs.append((name, nodes[(i + 1) % n]))
        if name != master and master in nodes and (n < 2 or nodes[(i + 1) % n] != master):
            pairs.append((name, master))
    return pairs


PATH_MTU_FIX = ("set the same MTU on every node and switch port (ip link set IFACE mtu N), "
                "or lower this node's MTU to what the path carries")


def classify_bulk(order: list[str], results: dict[str, list[dict]], mtus: dict[str, int | None] | None = None
                  ) -> list[MeshProblem]:
    """Explain stalled bulk transfers (connected, then the data never arrived): a node all of whose
    transfers stalled, in and out, is the one whose path drops full-size frames; stalls left
    unexplained are reported as pairs.

    Args:
        order: node names in inventory order.
        results: source -> its probe results; the ``bulk`` ones are read.
        mtus: node -> the MTU of its interface towards its peers (for the message), when known.
    """
    mtus = mtus or {}
    mine: dict[str, list[tuple[str, str, str]]] = {n: [] for n in order}
    for src, probes in results.items():
        for p in probes:
            if p.get("kind") != "bulk" or p.get("target") not in mine or src not in mine:
                continue
            if p["result"] != "ok" and p["result"] not in ("stalled", "short"):
                continue  # the connect itself failed: the connect probes explain that
            mine[src].append((src, p["target"], p["result"]))
            mine[p["target"]].append((src, p["target"], p["result"]))
    blamed = [n for n in order if mine[n] and all(r != "ok" for _, _, r in mine[n])]
    problems = []
    for n in blamed:
        mtu = mtus.get(n)
        stalled = mine[n]
        problems.append(MeshProblem(
            "path-mtu", [n],
            f"path MTU: small packets pass, full-size ones are lost: {len(stalled)} transfer(s) of "
            f"{BULK_BYTES // 1024} KiB to and from it stalled after connecting "
            f"(interface MTU {mtu if mtu else 'unknown'} on {n}, the path drops its full-size frames)",
            PATH_MTU_FIX, stalled))
    rest = [t for n in order for t in mine[n] if t[2] != "ok" and t[0] == n
            and t[0] not in blamed and t[1] not in blamed]
    if rest:
        targets = [n for n in order if any(n in (s, t) for s, t, _ in rest)]
        shown = ", ".join(f"{s}->{t}" for s, t, _ in rest[:6])
        problems.append(MeshProblem(
            "bulk-pairs", targets, f"path MTU: {len(rest)} bulk transfer(s) stalled after connecting: {shown}",
            PATH_MTU_FIX, rest))
    return problems


def classify_advertised(order: list[str], results: dict[str, list[dict]], advertised: dict[str, dict]
                        ) -> list[MeshProblem]:
    """Nodes whose advertised address (what gloo/NCCL bind and tell their peers: the hostname's
    address) some peer cannot reach, although the same peer reaches its data address.

    Args:
        order: node names in inventory order.
        results: source -> its probe results; the ``advertised`` ones are read.
        advertised: node -> ``addr`` (the address), ``iface`` (its interface there, when known),
            ``hostname``, ``data_addr`` (the address peers do reach).
    """
    failed: dict[str, list[tuple[str, str, str]]] = {n: [] for n in order}
    probed: dict[str, int] = {n: 0 for n in order}
    for src, probes in results.items():
        for p in probes:
            t = p.get("target")
            if p.get("kind") != "advertised" or t not in failed:
                continue
            probed[t] += 1
            if p["result"] != "ok":
                failed[t].append((src, t, p["result"]))
    problems = []
    for n in order:
        if not failed[n]:
            continue
        a = advertised.get(n, {})
        seen = ", ".join(sorted({r for _, _, r in failed[n]}))
        problems.append(MeshProblem(
            "advertised", [n],
            f"hostname {a.get('hostname')!r} resolves to {a.get('addr')} (interface "
            f"{a.get('iface') or 'unknown'}), which {len(failed[n])} of {probed[n]} peers cannot reach ({seen}); "
            f"gloo/NCCL advertise that address",
            f"let ddpfab name the interface towards the peers (a run's default, {option('socket_ifname', 'auto')}; "
            f"not none), or map {a.get('hostname')} to {a.get('data_addr')} in this node's /etc/hosts", failed[n]))
    return problems


def master_port_problem(master: str, port: int | None, order: list[str],
                        results: dict[str, list[dict]]) -> MeshProblem | None:
    """The master port must be reachable from every other node (all of them are always probed)."""
    failed = [(src, master, p["result"]) for src in order for p in results.get(src, [])
              if p.get("kind") == "master" and p["result"] != "ok"]
    if not failed:
        return None
    probed = sum(1 for src in order for p in results.get(src, []) if p.get("kind") == "master")
    seen, cause = _cause([r for _, _, r in failed])
    names = compact([s for s, _, _ in failed])
    return MeshProblem("master-port", [master], f"port {port} unreachable from {len(failed)} of {probed} nodes "
                       f"({seen}): {names}", f"connects are {cause}; open TCP {port} to the cluster members", failed)


# -- presentation helper --------------------------------------------------------------------
# -- collection (effectful) -------------------------------------------------------------------
def listen_request(name: str, master: str, master_port: int | str | None) -> dict:
    """A node's ``mesh_listen`` request; ``"found"`` as *master_port*: the port the same session's
    ``facts`` found free on the master."""
    return {"op": "mesh_listen", "master_port": master_port if name == master else None}


def run_mesh(cluster, conns: dict, addresses: dict[str, str], master: str, master_port: int | None,
             exhaustive: bool = False, concurrency: int = DEFAULT_CONCURRENCY,
             attempts: tuple[float, ...] = ATTEMPT_TIMEOUTS_S, degree: int = DEFAULT_DEGREE,
             sessions: dict | None = None, listening: GroupResult[nodeprog.Reply] | None = None,
             advertised: dict[str, str] | None = None) -> dict:
    """Probe the data plane (see the module docstring); returns ``ports`` (node -> its listener
    ports), ``results`` (source -> its probes), ``errors`` (node -> why its probe did not run)
    and ``plan`` (which pairs, the coverage, the deadline).

    Besides the connects: a bulk transfer of :data:`BULK_BYTES` on each of :func:`bulk_pairs`
    (a path-MTU black hole), and, for a node whose *advertised* address (node -> the address
    gloo/NCCL would bind) is not its data address, a connect to that address from each of the
    node's probing peers.

    Over the nodes' open program *sessions* when given (*listening*: their ``mesh_listen``
    replies, when that was asked already), else in sessions of its own."""
    started = time.monotonic()
    nodes = [n for n in cluster.nodes if n.name in conns]
    errors: dict[str, str] = {}
    own = sessions is None
    if own:
        sessions, failed = nodeprog.open_sessions(nodes, conns)
        errors = {n: str(e) for n, e in failed.items()}
    try:
        ports = _listen(sessions, nodes, master, master_port, listening, errors)
        plan = plan_targets([n.name for n in nodes if n.name in ports], exhaustive=exhaustive, degree=degree)
        work, deadline = _connect_work(plan, addresses, ports, master, advertised, concurrency, attempts)
        # the nodes stop on their own deadline; the margin covers the transfer
        answers = nodeprog.exchange(sessions, work, timeout=deadline + 15)
        results = _probe_results(answers, errors)
    finally:
        if own:
            nodeprog.close_all(sessions)
    retried = sum(1 for probes in results.values() for p in probes if p.get("attempts", 1) > 1)
    return {"ports": ports, "results": results, "errors": errors,
            "plan": {**plan.to_dict(), "concurrency": concurrency, "attempt_timeouts_s": list(attempts),
                     "deadline_s": round(deadline, 1), "retried": retried,
                     "seconds": round(time.monotonic() - started, 3)}}


def _listen(sessions: dict[str, nodeprog.Session], nodes: list, master: str, master_port: int | None,
            listening: GroupResult[nodeprog.Reply] | None, errors: dict[str, str]) -> dict[str, dict]:
    """node -> its listener ports, from *listening* (the ``mesh_listen`` replies) or, when that was
    not asked yet, from asking it now; adds to *errors* why a node has none (it probes nothing and
    is probed by nobody)."""
    if listening is None:
        listening = nodeprog.exchange(
            sessions, {n.name: [listen_request(n.name, master, master_port)] for n in nodes if n.name in sessions},
            timeout=60).map(lambda replies: replies[0])
    errors.update({n: str(e) for n, e in listening.failed.items()})
    ports: dict[str, dict] = {}
    for name, reply in listening.succeeded.items():
        try:
            ports[name] = _ports(name, reply.value(name))
        except (nodeprog.NodeProgramError, ValueError) as exc:
            errors[name] = str(exc)
    return ports


def _connect_work(plan: MeshPlan, addresses: dict[str, str], ports: dict[str, dict], master: str,
                  advertised: dict[str, str] | None, concurrency: int, attempts: tuple[float, ...]
                  ) -> tuple[dict[str, list[dict]], float]:
    """(node -> its ``mesh_connect`` request, the latest node deadline): what each node of *plan*
    probes, and how long the exchange must wait for the slowest of them."""
    master_ports = ports.get(master, {}).get("master")
    bulk = bulk_pairs(plan.nodes, master)
    other = {t: a for t, a in (advertised or {}).items()
             if a and t in ports and a != addresses.get(t) and not a.startswith(("127.", "::1"))}
    work = {}
    deadline = 0.0
    for name in plan.nodes:
        targets = _node_targets(name, plan, addresses, ports, bulk, other)
        if master_ports and name != master:
            targets.append({"target": master, "kind": "master", "addr": addresses[master],
                            "port": master_ports})
        node_deadline = deadline_for(len(targets), concurrency, attempts) + BULK_TIMEOUT_S
        deadline = max(deadline, node_deadline)
        work[name] = [{"op": "mesh_connect", "targets": targets, "attempts": list(attempts),
                       "concurrency": concurrency, "deadline": node_deadline}]
    return work, deadline


def _node_targets(name: str, plan: MeshPlan, addresses: dict[str, str], ports: dict[str, dict],
                  bulk: list[tuple[str, str]], other: dict[str, str]) -> list[dict]:
    """What node *name* probes on its peers' ephemeral ports: its bulk transfers, its planned
    connects, and its targets' advertised addresses where those differ (*other*)."""
    # bulk first: they start while the connects queue behind them
    targets = [{"target": t, "kind": "bulk", "addr": addresses[t], "port": ports[t]["ephemeral"],
                "bytes": BULK_BYTES, "timeout": BULK_TIMEOUT_S} for s, t in bulk if s == name]
    targets += [{"target": t, "kind": "ephemeral", "addr": addresses[t], "port": ports[t]["ephemeral"]}
                for t in plan.targets_of(name)]
    targets += [{"target": t, "kind": "advertised", "addr": other[t], "port": ports[t]["ephemeral"]}
                for t in plan.targets_of(name) if t in other]
    return targets


def _probe_results(answers: GroupResult[list[nodeprog.Reply]], errors: dict[str, str]) -> dict[str, list]:
    """source -> its probe results, from the nodes' ``mesh_connect`` replies, validated (they are
    data); adds to *errors* why a node has none."""
    errors.update({n: str(e) for n, e in answers.failed.items()})
    results: dict[str, list] = {}
    for name, replies in answers.succeeded.items():
        try:
            probes = replies[0].value(name)["probes"]
            if not isinstance(probes, list) or not all(isinstance(p, dict) and "result" in p for p in probes):
                raise ValueError(f"host {name}: mesh_connect: malformed probe results")
            results[name] = probes
        except (nodeprog.NodeProgramError, ValueError, KeyError, TypeError) as exc:
            errors[name] = str(exc)
    return results


def _ports(name: str, got: dict) -> dict:
    """A ``mesh_listen`` result, validated: an ephemeral port, maybe the master port or its error."""
    ok = isinstance(got.get("ephemeral"), int) and isinstance(got.get("master", 0), int)
    if not ok:
        raise ValueError(f"host {name}: mesh_listen: malformed ports {got!r:.200}")
    return got
