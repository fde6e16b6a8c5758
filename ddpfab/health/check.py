"""``ddpfab check``: prove the cluster can train before anything starts.

Multi-node jobs mostly die in two ways: they hang at init (a firewall drops gloo/NCCL's
rank-to-rank connections on ephemeral ports, the master address is unroutable, a hostname resolves
to loopback) or they run on mismatched software. Both are cheap to detect beforehand, so ddpfab
checks all of it in one parallel pass and says, per host, what was expected, what was found and
how to fix it.

The pass has three parts: connect (host keys verified), the probe (the node program's ``facts``, the
same one ``run`` uses, so checks and plans read the same facts), and the data plane
(:mod:`ddpfab.health.mesh`: ephemeral-port listeners on every node and the master port, probed with
retries, bounded concurrency, all pairs up to a size and a sampled graph beyond). The evaluation
(:func:`evaluate`) is pure: facts in, results out, unit-tested without hosts. Printed failures
are grouped, one line per distinct problem (:func:`grouped_lines`); ``--json`` has every detail.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import mesh as meshmod
from ddpfab.health import packages
from ddpfab.node.ops import MAX_PACKAGES
from ddpfab.health import resourcecheck
from ddpfab.health.mesh import run_mesh  # noqa: F401 - runner's preflight calls check.run_mesh
from ddpfab.hostlist import compact
from ddpfab.optionnames import option
from ddpfab.hosts import nodeenv
from ddpfab.health import probe
from ddpfab.planning import gpu_leases
from ddpfab.planning.plan import PlanError, RunOptions, choose_master, nproc_for
from ddpfab.problems import NodeError, Problem
from ddpfab.remote import ssh

#: Clock skew (seconds) between a node and the controller beyond which check fails.
DEFAULT_MAX_SKEW_S = 1.0
LOOPBACK_PREFIXES = ("127.", "::1")

@dataclass
class CheckResult:
    """One cell of the report: a check on a node."""

    node: str
    check: str
    status: str  # pass | fail | warn | skip
    found: str = ""
    expected: str = ""
    fix: str = ""

    def line(self) -> str:
        text = f"host {self.node}: {self.check}: "
        if self.expected:
            text += f"expected {self.expected}, found {self.found}"
        else:
            text += self.found
        if self.fix:
            text += f"; fix: {self.fix}"
        return text

    def problem(self) -> Problem:
        return Problem(self.node, self.check, self.expected, self.found, self.fix, text=self.line())


@dataclass
class CheckOptions:
    master_port: int | None = None
    nproc_per_node: int | str | None = None
    max_skew_s: float = DEFAULT_MAX_SKEW_S
    full: bool = True  # import torch on every node (CUDA/NCCL/GPU facts); run's fast checks skip it
    exhaustive: bool = False  # probe every pair of nodes, whatever the cluster size
    floors: resourcecheck.Floors = field(default_factory=resourcecheck.Floors)  # --resource-floors
    # a GPU used without a lease fails here; run's preflight leaves it to the lease refusal (--wait aware)
    busy_gpus_fail: bool = True


@dataclass
class Report:
    nodes: list[str]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed): the nodes are ready."""
        return not self.failures

    @property
    def problems(self) -> list[Problem]:
        """Each failure as a problem (node, expected, found, fix)."""
        return [r.problem() for r in self.failures]

    def to_dict(self) -> dict:
        """The report as JSON data; ``problems``: every failure as a problem record."""
        return {"ok": self.ok, "seconds": round(self.seconds, 3), "nodes": self.nodes,
                "results": [asdict(r) for r in self.results],
                "problems": [p.to_dict() for p in self.problems], **self.extra}


# -- evaluation (pure) -------------------------------------------------------------------
def _differs(values: dict[str, Any]) -> bool:
    return len({json.dumps(v) for v in values.values()}) > 1


def _same_check(results: list[CheckResult], check: str, values: dict[str, Any], what: str, fix: str) -> None:
    """All nodes must agree on *values*. A difference fails the nodes that differ from a value more
    than half of them have (that majority passes: it is what the odd ones are told to match), and
    every node where no value has such a majority (then nobody here knows which is right). The
    text names only the node's own value and the majority's, so nodes with the same value group
    into one line."""
    if not values:
        return
    if _differs(values):
        majority = max(set(map(str, values.values())), key=lambda v: sum(str(x) == v for x in values.values()))
        clear = sum(str(x) == majority for x in values.values()) * 2 > len(values)
        for n, v in values.items():
            if clear and str(v) == majority:
                results.append(CheckResult(n, check, "pass", found=f"{v} (as most nodes)"))
                continue
            results.append(CheckResult(n, check, "fail", found=f"{what} {v}",
                                       expected=f"the same {what} on every node (most have {majority})", fix=fix))
    else:
        for n, v in values.items():
            results.append(CheckResult(n, check, "pass", found=str(v)))


#: The facts' key for what a node's login shell printed before the node program's first reply.
SHELL_OUTPUT = "shell_output"


def evaluate(cluster, master: str, facts: dict[str, dict], unreachable: dict[str, str],
             mesh: dict | None, options: CheckOptions, nproc: dict[str, int],
             setup_failed: dict[str, str] | None = None) -> list[CheckResult]:
    """Turn collected facts into per-node results. Pure: no I/O, unit-tested with made-up facts.

    Args:
        facts: node -> the probe's raw facts (only nodes that answered).
        unreachable: node -> why SSH failed (those nodes get only their ssh result).
        mesh: the data-plane results (see :func:`run_mesh`), None if not run.
        nproc: node -> processes the run would start there.
        setup_failed: node -> which of its setup lines failed (SSH worked; nothing else ran there).
    """
    results: list[CheckResult] = []
    for node in cluster.nodes:
        if node.name in unreachable:
            results.append(CheckResult(node.name, "ssh", "fail", found=unreachable[node.name]))
        else:
            results.append(CheckResult(node.name, "ssh", "pass", found="connected, host key verified"))
        if node.name in (setup_failed or {}):
            results.append(CheckResult(node.name, "environment", "fail", found=(setup_failed or {})[node.name],
                                       expected="every setup line succeeds"))
    ok = [n for n in cluster.nodes if n.name in facts]
    fx = {n.name: facts[n.name] for n in ok}
    results += _software(ok, fx, options)
    results += _gpus(ok, fx, options, nproc)
    for n in ok:  # the node's resources and left-overs of earlier jobs (ddpfab.health.resourcecheck)
        results += [CheckResult(f.node, f.check, f.status, f.found, f.expected, f.fix) for f in resourcecheck.evaluate(
            n.name, fx[n.name], nproc.get(n.name, 1), options.floors,
            master_port=options.master_port if n.name == master else None, busy_gpus_fail=options.busy_gpus_fail)]
    results += _names(ok, fx, len(cluster.nodes))
    results += _ifaces(ok, fx)
    results += _clocks(ok, fx, options)
    if mesh is not None:
        results += _evaluate_mesh(cluster, master, mesh, options, fx)
    return results


def _software(ok: list, fx: dict[str, dict], options: CheckOptions) -> list[CheckResult]:
    """The shell, the interpreter and the setup's env, torch and its launcher: present, then the
    same everywhere (torch, python, CUDA, NCCL, the NVIDIA driver)."""
    results: list[CheckResult] = []
    with_torch = {}
    for n in ok:
        f = fx[n.name]
        if f.get(SHELL_OUTPUT):
            results.append(CheckResult(n.name, "shell", "fail", found=f"its shell prints {f[SHELL_OUTPUT].strip()[:120]!r} "
                                       "before a command's own output", expected="nothing (a command without a terminal)",
                                       fix="print it only in interactive shells: guard that line in ~/.bashrc (or "
                                           "/etc/bash.bashrc) with `[ -t 1 ] &&`; rsync, so sync and fetch, fails on "
                                           "such a node ('protocol version mismatch')"))
        results.append(CheckResult(n.name, "interpreter", "pass", found=nodeenv.describe(nodeenv.decided(n, f))))
        changes = nodeenv.env_changes(f)
        if changes and (changes["set"] or changes["unset"]):
            results.append(CheckResult(n.name, "environment", "pass", found="setup sets " + (
                ", ".join(sorted(changes["set"])) or "nothing") + (
                "; unsets " + ", ".join(changes["unset"]) if changes["unset"] else "")))
        if not f.get("torch"):
            results.append(CheckResult(n.name, "torch", "fail",
                                       found=f"{nodeenv.decided(n, f).python} cannot import torch",
                                       expected="torch in the node's python", fix=nodeenv.torch_fix(nodeenv.decided(n, f))))
        elif f.get("torch_import_error"):
            results.append(CheckResult(n.name, "torch", "fail", found=f"import torch failed: {f['torch_import_error']}",
                                       fix="reinstall torch on this node (ddpfab provision)"))
        else:
            with_torch[n.name] = f.get("torch_version")
    _same_check(results, "torch", with_torch, "torch", "install one pinned torch everywhere (ddpfab provision)")
    _same_check(results, "python", {n.name: fx[n.name]["python"] for n in ok}, "python",
                "use the same python version on every node (ddpfab provision)")
    for n in ok:
        if n.name in with_torch:
            found = fx[n.name].get("launcher")
            results.append(CheckResult(n.name, "launcher", "pass" if found else "fail",
                                       found="torch.distributed.run present" if found else
                                       "torch.distributed.run missing", fix="" if found else "reinstall torch"))
    if options.full:
        _same_check(results, "cuda", {n: fx[n].get("cuda") for n in with_torch}, "CUDA",
                    "install the same torch build (CUDA variant) everywhere")
        gpu_nodes = {n: fx[n].get("nccl") for n in with_torch if fx[n].get("cuda_available")}
        _same_check(results, "nccl", gpu_nodes, "NCCL", "install the same torch build everywhere")
    drivers = {n.name: fx[n.name]["driver"] for n in ok if fx[n.name].get("driver")}
    _same_check(results, "driver", drivers, "NVIDIA driver", "install one driver version (ddpfab provision, gpu role)")
    return results + _packages(ok, fx)


def _packages(ok: list, fx: dict[str, dict]) -> list[CheckResult]:
    """Each node's installed packages against most nodes' (:mod:`ddpfab.health.packages`): a
    warning, as a package no job imports fails nothing; nodes that differ the same way (the same
    python) share one line and one fix."""
    listed = {n.name: got for n in ok if (got := packages.listed(fx[n.name])) is not None}
    odd = packages.compare(dict(listed))
    groups: dict[tuple[str, str], list[str]] = {}
    for n in ok:
        if n.name in odd:
            groups.setdefault((odd[n.name].text(), nodeenv.decided(n, fx[n.name]).python), []).append(n.name)
    fixes = {name: packages.fix(names, python, odd[name]) for (_, python), names in groups.items() for name in names}
    results = []
    for n in ok:
        if n.name in odd:
            results.append(CheckResult(n.name, "packages", "warn", found=odd[n.name].text(),
                                       expected="the packages most nodes have, in their versions", fix=fixes[n.name]))
        elif n.name in listed:
            results.append(CheckResult(n.name, "packages", "pass", found=f"{len(listed[n.name])} packages"
                                       + (", as most nodes" if len(listed) > 1 else "")))
        elif fx[n.name].get("packages_capped") is True:
            results.append(CheckResult(n.name, "packages", "warn", found=f"its python lists at least "
                                       f"{MAX_PACKAGES} packages: not compared with the other nodes'",
                                       expected="a training environment (a venv: tens to a few hundred packages)",
                                       fix="point ddpfab_python at the venv the job runs in, or `ddpfab provision`"))
    return results


def _gpus(ok: list, fx: dict[str, dict], options: CheckOptions, nproc: dict[str, int]) -> list[CheckResult]:
    """Each node's GPUs against its processes and ddpfab_gpus; its GPU leases, shown."""
    results: list[CheckResult] = []
    for n in ok:
        f = fx[n.name]
        gpus = probe.gpu_count(f)
        want = nproc.get(n.name, 1)
        if n.gpus is not None and gpus != n.gpus and (options.full or f.get("nvidia_gpus") is not None):
            results.append(CheckResult(n.name, "gpus", "fail", found=f"{gpus} GPUs", expected=f"{n.gpus} (ddpfab_gpus)",
                                       fix="check the driver (nvidia-smi) or correct ddpfab_gpus"))
        elif gpus and want > gpus:
            results.append(CheckResult(n.name, "gpus", "fail", found=f"{gpus} GPUs for {want} processes",
                                       expected=f"at most {gpus} processes (one per GPU)",
                                       fix=f"lower ddpfab_nproc_per_node / {option('nproc_per_node')}"))
        elif not gpus:
            results.append(CheckResult(n.name, "gpus", "pass", found=f"no GPU: {want} CPU processes (gloo)"))
        else:
            results.append(CheckResult(n.name, "gpus", "pass", found=f"{gpus} GPUs, {want} processes"))
        states = gpu_leases.parse(f.get("leases"))
        if states:  # every user's leases there, and GPUs used without one (shown, never judged here)
            taken = [s.describe() for s in states if s.state != "free"]
            free = sum(s.state == "free" for s in states)
            results.append(CheckResult(n.name, "gpu_leases", "pass",
                                       found=f"{free} of {len(states)} GPUs free" + (f"; {'; '.join(taken)}" if taken else "")))
    return results


def _names(ok: list, fx: dict[str, dict], nnodes: int) -> list[CheckResult]:
    """Each node's hostname (what gloo advertises) and the names it must resolve."""
    results: list[CheckResult] = []
    for n in ok:
        f = fx[n.name]
        addr = f.get("hostname_addr")
        if addr is None:
            results.append(CheckResult(n.name, "hostname", "warn", found=f"hostname {f['hostname']!r} does not resolve",
                                       fix="add it to /etc/hosts, or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"))
        elif addr.startswith(LOOPBACK_PREFIXES) and nnodes > 1:
            results.append(CheckResult(
                n.name, "hostname", "fail", found=f"hostname {f['hostname']!r} resolves to {addr}",
                expected="an address the other nodes can reach (gloo advertises what the hostname resolves to)",
                fix=f"map {f['hostname']} to its cluster address in /etc/hosts, or set "
                    f"GLOO_SOCKET_IFNAME=<iface> and NCCL_SOCKET_IFNAME=<iface> with {option('env')}"))
        else:
            results.append(CheckResult(n.name, "hostname", "pass", found=f"{f['hostname']} -> {addr}"))
        for name, ip in f.get("resolved", {}).items():
            if str(ip).startswith("error"):
                results.append(CheckResult(n.name, "names", "fail", found=f"{name} does not resolve here ({ip})",
                                           fix="use IP addresses in ddpfab_data_addr or fix DNS//etc/hosts"))
    return results


def _ifaces(ok: list, fx: dict[str, dict]) -> list[CheckResult]:
    """Which interface each node uses towards its peers (the suggested *_SOCKET_IFNAME)."""
    results: list[CheckResult] = []
    for n in ok:
        devs = {d for d in fx[n.name].get("routes", {}).values() if d}
        if len(devs) == 1:
            dev = devs.pop()
            results.append(CheckResult(n.name, "iface", "pass", found=f"{dev} (GLOO_SOCKET_IFNAME={dev} "
                                                                      f"NCCL_SOCKET_IFNAME={dev})"))
        elif len(devs) > 1:
            results.append(CheckResult(n.name, "iface", "warn", found=f"peers reached via {', '.join(sorted(devs))}",
                                       fix=f"pin one: NCCL_SOCKET_IFNAME=... GLOO_SOCKET_IFNAME=... with {option('env')}"))
    return results


def _clocks(ok: list, fx: dict[str, dict], options: CheckOptions) -> list[CheckResult]:
    """Each node's clock skew against the controller (the midpoint of the probe's round trip)."""
    results: list[CheckResult] = []
    for n in ok:
        f = fx[n.name]
        if "time" in f and "controller_sent" in f:
            mid = (f["controller_sent"] + f["controller_received"]) / 2
            skew = f["time"] - mid
            rtt = f["controller_received"] - f["controller_sent"]
            bound = options.max_skew_s + rtt / 2
            status = "pass" if abs(skew) <= bound else "fail"
            results.append(CheckResult(n.name, "clock", status, found=f"{skew:+.2f} s vs the controller",
                                       expected=f"within ±{options.max_skew_s:g} s" if status == "fail" else "",
                                       fix="run time sync (ddpfab provision --tags timesync)" if status == "fail" else ""))
    return results


def iface_mtu(f: dict) -> int | None:
    """The MTU of the interface a node's probe found towards most of its peers, when known."""
    devs = [d for d in (f.get("routes") or {}).values() if d]
    mtus = f.get("mtus") or {}
    if not devs:
        return None
    dev = max(set(devs), key=devs.count)
    mtu = mtus.get(dev)
    return mtu if isinstance(mtu, int) else None


def advertised_addresses(facts: dict[str, dict], skip: set[str] | frozenset = frozenset()) -> dict[str, str]:
    """Node -> the address gloo/NCCL would advertise without a *_SOCKET_IFNAME (its hostname's),
    from the probe's facts; nodes in *skip* (an interface will be set there) left out."""
    return {n: f["hostname_addr"] for n, f in facts.items()
            if n not in skip and isinstance(f.get("hostname_addr"), str)}


def _advertised_info(cluster, fx: dict[str, dict]) -> dict[str, dict]:
    return {n.name: {"addr": fx[n.name].get("hostname_addr"), "iface": fx[n.name].get("hostname_iface"),
                     "hostname": fx[n.name].get("hostname"), "data_addr": n.data_addr or n.host}
            for n in cluster.nodes if n.name in fx}


def _evaluate_mesh(cluster, master: str, mesh: dict, options: CheckOptions,
                   fx: dict[str, dict] | None = None) -> list[CheckResult]:
    """Mesh and master-port results per node, from :func:`mesh.classify`'s problems: each blamed
    node carries its problem's text (the same for all nodes of a problem, so they print as one line);
    then the bulk transfers (path MTU) and the advertised addresses."""
    fx = fx or {}
    results: list[CheckResult] = []
    ports = mesh.get("ports", {})
    m = ports.get(master, {})
    port = options.master_port or m.get("master")
    if "master_error" in m:
        results.append(CheckResult(master, "master-port", "fail", found=f"port {port} in use ({m['master_error']})",
                                   expected=f"port {port} free on the master",
                                   fix=f"pick another {option('master_port')} or leave it out to get a free one"))
    order = [n.name for n in cluster.nodes if n.name in ports]
    probes = mesh.get("results", {})
    blamed: dict[str, meshmod.MeshProblem] = {}
    for problem in meshmod.classify(order, probes):
        for name in problem.nodes:
            blamed.setdefault(name, problem)
    reached = {name: 0 for name in order}
    for src_probes in probes.values():
        for p in src_probes:
            if p["result"] == "ok" and p.get("kind", "ephemeral") == "ephemeral" and p["target"] in reached:
                reached[p["target"]] += 1
    for name in order:
        problem = blamed.get(name)
        if problem:
            results.append(CheckResult(name, "mesh", "fail", found=problem.summary, fix=problem.fix))
        else:
            results.append(CheckResult(name, "mesh", "pass", found=f"reachable from {reached[name]} peers"))
    if "master" in m:
        problem = meshmod.master_port_problem(master, m["master"], order, probes)
        if problem:
            results.append(CheckResult(master, "master-port", "fail", found=problem.summary, fix=problem.fix))
        else:
            results.append(CheckResult(master, "master-port", "pass", found=f"{m['master']} free and reachable"))
    results += _evaluate_bulk(order, probes, fx)
    for problem in meshmod.classify_advertised(order, probes, _advertised_info(cluster, fx)):
        for name in problem.nodes:
            results.append(CheckResult(name, "advertised", "fail", found=problem.summary,
                                       expected="an address every peer reaches", fix=problem.fix))
    return results


def _evaluate_bulk(order: list[str], probes: dict[str, list[dict]], fx: dict[str, dict]) -> list[CheckResult]:
    """A ``bulk`` result per node that took part in a bulk transfer: failed for the nodes
    :func:`mesh.classify_bulk` blames."""
    involved = {n: 0 for n in order}
    for src, ps in probes.items():
        for p in ps:
            if p.get("kind") == "bulk" and p.get("result") == "ok":
                for n in (src, p.get("target")):
                    if n in involved:
                        involved[n] += 1
    blamed: dict[str, meshmod.MeshProblem] = {}
    for problem in meshmod.classify_bulk(order, probes, {n: iface_mtu(f) for n, f in fx.items()}):
        for name in problem.nodes:
            blamed.setdefault(name, problem)
    results = []
    for name in order:
        problem = blamed.get(name)
        if problem:
            results.append(CheckResult(name, "bulk", "fail", found=problem.summary,
                                       expected="full-size segments delivered both ways", fix=problem.fix))
        elif involved[name]:
            results.append(CheckResult(name, "bulk", "pass",
                                       found=f"{involved[name]} transfer(s) of {meshmod.BULK_BYTES // 1024} KiB"))
    return results


def mesh_detail(cluster, mesh: dict) -> dict:
    """What the report's JSON keeps of the data plane: the plan (mode, coverage, deadline, retries),
    every distinct problem with the pairs behind it, and every failed probe."""
    order = [n.name for n in cluster.nodes if n.name in mesh.get("ports", {})]
    problems = meshmod.classify(order, mesh.get("results", {}))
    problems += meshmod.classify_bulk(order, mesh.get("results", {}))
    return {**mesh.get("plan", {}), "problems": [asdict(p) for p in problems],
            "failed_probes": [dict(p, source=src) for src, probes in mesh.get("results", {}).items()
                              for p in probes if p["result"] != "ok"],
            "errors": mesh.get("errors", {})}


# -- collection (effectful) --------------------------------------------------------------
def check_cluster(cluster, policy, options: CheckOptions, ssh_config: str | None = None) -> Report:
    """The whole pass: connect, probe, mesh, evaluate. Failures on one host never hide others."""
    started = time.monotonic()
    results = ssh.parallel(cluster.nodes, lambda n: ssh.connect(n, policy, ssh_config))
    phases = {"connect": time.monotonic() - started}
    conns = results.succeeded
    unreachable = {k: (v.found if isinstance(v, NodeError) else repr(v)) for k, v in results.failed.items()}
    master = choose_master(cluster)
    sessions, failed = nodeprog.open_sessions(cluster.nodes, conns)  # one node program per node, for all
    try:
        facts, _problems = probe.gather(cluster, {k: v for k, v in conns.items() if k in sessions}, master,
                                        cwd=os.getcwd(), script=None, master_port=options.master_port,
                                        full=options.full, sessions=sessions)
        setup_failed: dict[str, str] = {}  # a setup line failed: the node is reachable, its environment is not
        for name, exc in failed.items():
            if exc.kind == "setup":
                setup_failed[name] = exc.found
            else:
                unreachable.setdefault(name, exc.found)
        raw = {n: f.raw for n, f in facts.items()}
        for name, session in sessions.items():  # what its login shell printed before the program spoke
            if session.stray and name in raw:
                raw[name] = {**raw[name], SHELL_OUTPUT: nodeprog.printable(session.stray.decode(errors="replace"))}
        phases["probe"] = time.monotonic() - started - sum(phases.values())
        for name in conns:
            mine = [p for p in _problems if p.about(name)]
            if name not in facts and name not in setup_failed:
                if mine and all(p.check == "setup" for p in mine):
                    setup_failed[name] = "; ".join(p.found or p.text for p in mine)
                else:
                    unreachable.setdefault(name, "probe failed: " + "; ".join(map(str, mine)))
        addresses = {n.name: (facts[n.name].address if n.name in facts else n.data_addr) for n in cluster.nodes}
        port, _ = probe.pick_port(conns, master, facts, [], options.master_port, cwd=os.getcwd())
        mesh = run_mesh(cluster, {k: v for k, v in conns.items() if k in facts}, addresses, master.name, port,
                        exhaustive=options.exhaustive, sessions=sessions, advertised=advertised_addresses(raw))
        for name, err in mesh.get("errors", {}).items():
            unreachable.setdefault(name, f"data-plane probe failed: {err}")
        phases["mesh"] = time.monotonic() - started - sum(phases.values())
    finally:
        nodeprog.close_all(sessions, wait_for={master.name})  # only the master's listener holds a port a run may want
        for c in conns.values():
            c.close()
    cluster = probe.decide(cluster, facts)  # the python each node's probe ran: the one a run uses
    nproc, refused = _nprocs(cluster, RunOptions("check", nproc_per_node=options.nproc_per_node), raw)
    checks = refused + evaluate(cluster, master.name, raw, unreachable, mesh, CheckOptions(
        master_port=port, nproc_per_node=options.nproc_per_node, max_skew_s=options.max_skew_s,
        full=options.full, floors=options.floors), nproc, setup_failed)
    return Report(nodes=[n.name for n in cluster.nodes], results=checks, seconds=time.monotonic() - started,
                  extra={"master": master.name, "master_port": port, "mesh": mesh_detail(cluster, mesh),
                         "phases_s": {k: round(v, 3) for k, v in phases.items()}})


def _nprocs(cluster, options: RunOptions, raw: dict[str, dict]) -> tuple[dict[str, int], list[CheckResult]]:
    """Processes per node that answered, as a run would decide them (``gpu|cpu|auto`` from its
    facts); a node where the asked count cannot be (``gpu`` without GPUs) is a failed check."""
    nproc, refused = {}, []
    for n in cluster.nodes:
        if n.name not in raw:
            continue
        try:
            nproc[n.name] = nproc_for(n, options, probe.gpu_count(raw[n.name]), probe.cpu_count(raw[n.name]))
        except PlanError as exc:
            refused.append(CheckResult(n.name, "gpus", "fail", found=str(exc), expected="a count it can run",
                                       fix=f"give {option('nproc_per_node')} a number, cpu or auto"))
    return nproc, refused


# -- presentation ------------------------------------------------------------------------
SYMBOL = {"pass": "ok", "fail": "FAIL", "warn": "warn", "skip": "-"}


#: Up to this many nodes the table has a row per node; beyond, consecutive identical rows fold.
TABLE_ROWS_MAX = 16


def grouped_problems(results: list[CheckResult], status: str = "fail") -> list[Problem]:
    """One problem per distinct problem: results with the same check and text on several nodes
    become one (node None) whose text names the nodes (``mesh: 3 nodes unreachable from 61 peers
    (timed out): node7, node9, node12; likely their firewall...``); a problem on one node keeps its
    node and its ``host`` line."""
    groups: dict[tuple, list[CheckResult]] = {}
    for r in results:
        if r.status == status:
            groups.setdefault((r.check, r.found, r.expected, r.fix), []).append(r)
    out = []
    for (check, found, expected, fix), members in groups.items():
        if len(members) == 1:
            out.append(members[0].problem())
            continue
        names = compact([r.node for r in members])
        if expected:
            text = f"{check}: {len(members)} nodes: expected {expected}, found {found}: {names}"
        else:
            text = f"{check}: {len(members)} nodes {found}: {names}"
        out.append(Problem(None, check, expected, found, fix,
                           text=text + (f"; {fix}" if fix and not expected else f"; fix: {fix}" if fix else "")))
    return out


def grouped_lines(results: list[CheckResult], status: str = "fail") -> list[str]:
    """:func:`grouped_problems` as the lines a person reads."""
    return [str(p) for p in grouped_problems(results, status)]


def render(report: Report) -> str:
    """The check table (nodes in inventory order; beyond TABLE_ROWS_MAX nodes, runs of identical
    rows folded into one) and the grouped failures and warnings."""
    checks: list[str] = []
    for r in report.results:
        if r.check not in checks:
            checks.append(r.check)
    cell: dict[tuple[str, str], str] = {}
    for r in report.results:
        prev = cell.get((r.node, r.check))
        if prev != "fail":
            cell[(r.node, r.check)] = r.status
    rows: list[tuple[list[str], tuple[str, ...]]] = []
    for n in report.nodes:
        row = tuple(SYMBOL.get(cell.get((n, c), "skip"), "?") for c in checks)
        if len(report.nodes) > TABLE_ROWS_MAX and rows and rows[-1][1] == row:
            rows[-1][0].append(n)
        else:
            rows.append(([n], row))
    labels = [compact(names, limit=1) if len(names) > 1 else names[0] for names, _ in rows]
    width = max(len(label) for label in labels + ["node"])
    lines = [f"{'node':<{width}}  " + "  ".join(f"{c:<{max(len(c), 4)}}" for c in checks)]
    for label, (_, row) in zip(labels, rows, strict=True):
        lines.append(f"{label:<{width}}  " + "  ".join(f"{s:<{max(len(c), 4)}}" for s, c in zip(row, checks, strict=True)))
    # what runs there, in words (the table only says ok): nodes with the same python grouped
    for check, label in (("interpreter", "python"), ("environment", "setup")):
        same: dict[str, list[str]] = {}
        for r in report.results:
            if r.check == check and r.status == "pass":  # (a failure is said below, with the others)
                same.setdefault(r.found, []).append(r.node)
        lines += [f"{label} {compact(names, limit=4)}: {found}" for found, names in same.items()]
    fails = report.failures
    fail_lines = grouped_lines(report.results, "fail")
    warn_lines = grouped_lines(report.results, "warn")
    if fail_lines or warn_lines:
        lines.append("")
    lines += [f"FAIL {line}" for line in fail_lines]
    lines += [f"warn {line}" for line in warn_lines]
    verdict = "all checks passed" if not fails else f"{len(fails)} check(s) failed"
    mesh = report.extra.get("mesh") or {}
    probed = (f"; data plane: {mesh['pairs_probed']} of {mesh['pairs_total']} pairs probed ({mesh['mode']}"
              + (f", {mesh['retried']} retried" if mesh.get("retried") else "") + ")") if "pairs_total" in mesh else ""
    lines.append(f"\n{verdict} on {len(report.nodes)} nodes in {report.seconds:.1f} s{probed}")
    return "\n".join(lines)
