"""``ddpfab check``: prove the cluster can train before anything starts.

Multi-node jobs mostly die in two ways: they hang at init (a firewall drops gloo/NCCL's
rank-to-rank connections on ephemeral ports, the master address is unroutable, a hostname resolves
to loopback) or they run on mismatched software. Both are cheap to detect beforehand, so ddpfab
checks all of it in one parallel pass and says, per host, what was expected, what was found and
how to fix it.

The pass has three parts: connect (host keys verified), the probe (``probe.PROBE_SNIPPET``, the
same one ``run`` uses, so checks and plans read the same facts), and the data plane: every node
listens on port 0 (the kernel picks an ephemeral port, exactly as gloo and NCCL do) and the master
on the master port, and every node connects to every other node's listeners, all pairs at once.
The evaluation (:func:`evaluate`) is pure: facts in, results out, unit-tested without hosts.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .cliargs import add_cluster_args

#: Seconds a node waits for a TCP connect to a peer before calling it dropped.
CONNECT_TIMEOUT_S = 2.0
#: Clock skew (seconds) between a node and the controller beyond which check fails.
DEFAULT_MAX_SKEW_S = 1.0
LOOPBACK_PREFIXES = ("127.", "::1")

MESH_SNIPPET = r"""
import json, socket, sys, threading, time
req = json.loads(sys.argv[1])
def serve(s):
    # let the client close first: the TIME_WAIT then stays on its ephemeral port, not on ours
    # (a TIME_WAIT on the master port would make it look busy to a bind without SO_REUSEADDR)
    def drain(c):
        try:
            c.settimeout(5)
            c.recv(1)
        except OSError:
            pass
        c.close()
    while True:
        try:
            c, _ = s.accept()
        except OSError:
            return
        threading.Thread(target=drain, args=(c,), daemon=True).start()
def listener(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", port))
    s.listen(128)
    threading.Thread(target=serve, args=(s,), daemon=True).start()
    return s
ports = {}
eph = listener(0)
ports["ephemeral"] = eph.getsockname()[1]
if req.get("master_port"):
    try:
        listener(req["master_port"])
        ports["master"] = req["master_port"]
    except OSError as exc:
        ports["master_error"] = str(exc)
print(json.dumps(ports), flush=True)
line = sys.stdin.readline()
if not line:
    sys.exit(0)
targets = json.loads(line)
results = [None] * len(targets)
def probe(i, t):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(req["timeout"])
    t0 = time.monotonic()
    try:
        s.connect((t["addr"], t["port"]))
        r = "ok"
    except socket.timeout:
        r = "timed out"
    except ConnectionRefusedError:
        r = "refused"
    except OSError as exc:
        r = exc.strerror or str(exc)
    finally:
        s.close()
    results[i] = dict(t, result=r, ms=round((time.monotonic() - t0) * 1000, 1))
threads = [threading.Thread(target=probe, args=(i, t)) for i, t in enumerate(targets)]
for th in threads:
    th.start()
for th in threads:
    th.join()
print(json.dumps(results), flush=True)
sys.stdin.read()  # keep listening until every node is done (EOF), then leave nothing behind
"""


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


@dataclass
class CheckOptions:
    master_port: int | None = None
    nproc_per_node: int | None = None
    max_skew_s: float = DEFAULT_MAX_SKEW_S
    full: bool = True  # import torch on every node (CUDA/NCCL/GPU facts); run's fast checks skip it


@dataclass
class Report:
    nodes: list[str]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    def to_dict(self) -> dict:
        return {"ok": not self.failures, "seconds": round(self.seconds, 3), "nodes": self.nodes,
                "results": [asdict(r) for r in self.results], **self.extra}


# -- evaluation (pure) -------------------------------------------------------------------
def _differs(values: dict[str, Any]) -> bool:
    return len({json.dumps(v) for v in values.values()}) > 1


def _same_check(results: list[CheckResult], check: str, values: dict[str, Any], what: str, fix: str) -> None:
    """All nodes must agree on *values*; a difference fails every node, each with the full list."""
    if not values:
        return
    if _differs(values):
        listing = ", ".join(f"{n}={v}" for n, v in values.items())
        majority = max(set(map(str, values.values())), key=lambda v: sum(str(x) == v for x in values.values()))
        for n, v in values.items():
            results.append(CheckResult(n, check, "fail", found=f"{what} {v} (nodes: {listing})",
                                       expected=f"the same {what} on every node ({majority})", fix=fix))
    else:
        for n, v in values.items():
            results.append(CheckResult(n, check, "pass", found=str(v)))


def evaluate(cluster, master: str, facts: dict[str, dict], unreachable: dict[str, str],
             mesh: dict | None, options: CheckOptions, nproc: dict[str, int]) -> list[CheckResult]:
    """Turn collected facts into per-node results. Pure: no I/O, unit-tested with made-up facts.

    Args:
        facts: node -> the probe's raw facts (only nodes that answered).
        unreachable: node -> why SSH failed (those nodes get only their ssh result).
        mesh: the data-plane results (see :func:`run_mesh`), None if not run.
        nproc: node -> processes the run would start there.
    """
    results: list[CheckResult] = []
    for node in cluster.nodes:
        if node.name in unreachable:
            results.append(CheckResult(node.name, "ssh", "fail", found=unreachable[node.name]))
        else:
            results.append(CheckResult(node.name, "ssh", "pass", found="connected, host key verified"))
    ok = [n for n in cluster.nodes if n.name in facts]
    fx = {n.name: facts[n.name] for n in ok}

    # software: present, then identical everywhere
    with_torch = {}
    for n in ok:
        f = fx[n.name]
        if not f.get("torch"):
            results.append(CheckResult(n.name, "torch", "fail", found=f"{n.python} cannot import torch",
                                       expected="torch in the node's python",
                                       fix="ddpfab provision (python role), or set ddpfab_python"))
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

    # GPUs vs processes
    for n in ok:
        f = fx[n.name]
        gpus = f.get("gpus") if f.get("gpus") is not None else f.get("nvidia_gpus", 0)
        want = nproc.get(n.name, 1)
        if n.gpus is not None and gpus != n.gpus and (options.full or f.get("nvidia_gpus") is not None):
            results.append(CheckResult(n.name, "gpus", "fail", found=f"{gpus} GPUs", expected=f"{n.gpus} (ddpfab_gpus)",
                                       fix="check the driver (nvidia-smi) or correct ddpfab_gpus"))
        elif gpus and want > gpus:
            results.append(CheckResult(n.name, "gpus", "fail", found=f"{gpus} GPUs for {want} processes",
                                       expected=f"at most {gpus} processes (one per GPU)",
                                       fix="lower ddpfab_nproc_per_node / --nproc-per-node"))
        elif not gpus:
            results.append(CheckResult(n.name, "gpus", "pass", found=f"no GPU: {want} CPU processes (gloo)"))
        else:
            results.append(CheckResult(n.name, "gpus", "pass", found=f"{gpus} GPUs, {want} processes"))

    # names and addresses
    for n in ok:
        f = fx[n.name]
        addr = f.get("hostname_addr")
        if addr is None:
            results.append(CheckResult(n.name, "hostname", "warn", found=f"hostname {f['hostname']!r} does not resolve",
                                       fix="add it to /etc/hosts, or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"))
        elif addr.startswith(LOOPBACK_PREFIXES) and len(cluster.nodes) > 1:
            results.append(CheckResult(
                n.name, "hostname", "fail", found=f"hostname {f['hostname']!r} resolves to {addr}",
                expected="an address the other nodes can reach (gloo advertises what the hostname resolves to)",
                fix=f"map {f['hostname']} to its cluster address in /etc/hosts, or pass "
                    f"--env GLOO_SOCKET_IFNAME=<iface> --env NCCL_SOCKET_IFNAME=<iface>"))
        else:
            results.append(CheckResult(n.name, "hostname", "pass", found=f"{f['hostname']} -> {addr}"))
        for name, ip in f.get("resolved", {}).items():
            if str(ip).startswith("error"):
                results.append(CheckResult(n.name, "names", "fail", found=f"{name} does not resolve here ({ip})",
                                           fix="use IP addresses in ddpfab_data_addr or fix DNS//etc/hosts"))

    # interfaces: which one each node uses towards its peers (suggested *_SOCKET_IFNAME)
    for n in ok:
        devs = {d for d in fx[n.name].get("routes", {}).values() if d}
        if len(devs) == 1:
            dev = devs.pop()
            results.append(CheckResult(n.name, "iface", "pass", found=f"{dev} (GLOO_SOCKET_IFNAME={dev} "
                                                                      f"NCCL_SOCKET_IFNAME={dev})"))
        elif len(devs) > 1:
            results.append(CheckResult(n.name, "iface", "warn", found=f"peers reached via {', '.join(sorted(devs))}",
                                       fix="pin one with --env NCCL_SOCKET_IFNAME=... GLOO_SOCKET_IFNAME=..."))

    # clock skew against the controller (midpoint of the probe's round trip)
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

    if mesh is not None:
        results += _evaluate_mesh(cluster, master, mesh, options)
    return results


def _evaluate_mesh(cluster, master: str, mesh: dict, options: CheckOptions) -> list[CheckResult]:
    results: list[CheckResult] = []
    ports = mesh.get("ports", {})
    m = ports.get(master, {})
    if options.master_port is not None or "master" in m or "master_error" in m:
        port = options.master_port or m.get("master")
        if "master_error" in m:
            results.append(CheckResult(master, "master-port", "fail", found=f"port {port} in use ({m['master_error']})",
                                       expected=f"port {port} free on the master",
                                       fix="pick another --master-port or leave it out to get a free one"))
    failed_in: dict[tuple[str, str], list[str]] = {}
    reached: dict[str, int] = {}
    for src, probes in mesh.get("results", {}).items():
        for p in probes:
            key = (p["target"], p["kind"])
            if p["result"] == "ok":
                reached[p["target"]] = reached.get(p["target"], 0) + 1
            else:
                failed_in.setdefault(key, []).append(f"{src} ({p['result']})")
    for node in cluster.nodes:
        name = node.name
        if name not in ports:
            continue
        eph = failed_in.get((name, "ephemeral"))
        if eph:
            results.append(CheckResult(
                name, "mesh", "fail",
                found=f"TCP to its ephemeral port {ports[name].get('ephemeral')} fails from {', '.join(eph)}",
                expected="every member reachable from every other on any port (gloo/NCCL connect rank to rank "
                         "on ephemeral ports; a dropped connect hangs init)",
                fix="allow TCP from the cluster members (ddpfab provision --tags firewall)"))
        else:
            results.append(CheckResult(name, "mesh", "pass", found=f"reachable from {reached.get(name, 0)} peers"))
        if name == master and "master" in ports[name]:
            mp = failed_in.get((name, "master"))
            if mp:
                results.append(CheckResult(name, "master-port", "fail",
                                           found=f"port {ports[name]['master']} unreachable from {', '.join(mp)}",
                                           expected="the master port reachable from every node",
                                           fix=f"open TCP {ports[name]['master']} to the cluster members"))
            else:
                results.append(CheckResult(name, "master-port", "pass",
                                           found=f"{ports[name]['master']} free and reachable"))
    return results


# -- collection (effectful) --------------------------------------------------------------
def run_mesh(cluster, conns: dict, addresses: dict[str, str], master: str, master_port: int | None,
             timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """All-pairs TCP reachability on ephemeral ports (and the master port), all at once.

    Each node runs MESH_SNIPPET: it opens its listeners and reports their ports, gets its targets,
    connects to all of them in parallel, reports, and keeps listening until every node is done
    (stdin EOF), so nothing it opened outlives the check.
    """
    nodes = [n for n in cluster.nodes if n.name in conns]
    chans: dict[str, Any] = {}
    readers: dict[str, Any] = {}
    ports: dict[str, dict] = {}
    results: dict[str, list] = {}
    errors: dict[str, str] = {}
    try:
        for n in nodes:
            req = {"master_port": master_port if n.name == master else None, "timeout": timeout}
            chan = conns[n.name].transport.open_session(timeout=30)
            chan.exec_command(f"{shlex.quote(n.python)} -c {shlex.quote(MESH_SNIPPET)} {shlex.quote(json.dumps(req))}")
            chans[n.name] = chan
            readers[n.name] = chan.makefile("rb")
        for n in nodes:
            line = readers[n.name].readline()
            if not line:
                errors[n.name] = chans[n.name].makefile_stderr("rb").read().decode(errors="replace")[-300:]
                continue
            ports[n.name] = json.loads(line)
        for n in nodes:
            if n.name not in ports:
                continue
            targets = []
            for peer in nodes:
                if peer.name == n.name or peer.name not in ports:
                    continue
                targets.append({"target": peer.name, "kind": "ephemeral", "addr": addresses[peer.name],
                                "port": ports[peer.name]["ephemeral"]})
                if peer.name == master and "master" in ports[peer.name]:
                    targets.append({"target": peer.name, "kind": "master", "addr": addresses[peer.name],
                                    "port": ports[peer.name]["master"]})
            chans[n.name].sendall((json.dumps(targets) + "\n").encode())

        def collect(name: str) -> None:
            line = readers[name].readline()
            results[name] = json.loads(line) if line else []

        threads = [threading.Thread(target=collect, args=(n,)) for n in ports]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout * 4 + 10)
    finally:
        for chan in chans.values():
            try:
                chan.shutdown_write()
            except Exception:  # noqa: BLE001
                pass
        for chan in chans.values():
            try:
                chan.recv_exit_status()
                chan.close()
            except Exception:  # noqa: BLE001
                pass
    return {"ports": ports, "results": results, "errors": errors}


def check_cluster(cluster, policy, options: CheckOptions, ssh_config: str | None = None) -> Report:
    """The whole pass: connect, probe, mesh, evaluate. Failures on one host never hide others."""
    import os

    from . import probe, ssh
    from .plan import choose_master, nproc_for, RunOptions

    started = time.monotonic()
    results = ssh.parallel(cluster.nodes, lambda n: ssh.connect(n, policy, ssh_config))
    conns = {k: v for k, v in results.items() if not isinstance(v, BaseException)}
    unreachable = {k: (str(v).split(": ", 1)[-1] if isinstance(v, ssh.SSHError) else repr(v))
                   for k, v in results.items() if isinstance(v, BaseException)}
    master = choose_master(cluster)
    try:
        facts, _problems = probe.gather(cluster, conns, master, cwd=os.getcwd(), script=None,
                                        master_port=options.master_port, full=options.full)
        raw = {n: f.raw for n, f in facts.items()}
        for name in conns:
            if name not in facts:
                unreachable.setdefault(name, "probe failed: " + "; ".join(p for p in _problems if name in p))
        addresses = {n.name: (facts[n.name].address if n.name in facts else n.data_addr) for n in cluster.nodes}
        port = options.master_port
        if port is None and master.name in facts:
            port = facts[master.name].free_port
        mesh = run_mesh(cluster, {k: v for k, v in conns.items() if k in facts}, addresses, master.name, port)
        for name, err in mesh.get("errors", {}).items():
            unreachable.setdefault(name, f"data-plane probe failed: {err}")
    finally:
        for c in conns.values():
            c.close()
    run_opts = RunOptions("check", nproc_per_node=options.nproc_per_node)
    nproc = {n.name: nproc_for(n, run_opts) for n in cluster.nodes}
    checks = evaluate(cluster, master.name, raw, unreachable, mesh, CheckOptions(
        master_port=port, nproc_per_node=options.nproc_per_node, max_skew_s=options.max_skew_s,
        full=options.full), nproc)
    return Report(nodes=[n.name for n in cluster.nodes], results=checks, seconds=time.monotonic() - started,
                  extra={"master": master.name, "master_port": port})


# -- presentation ------------------------------------------------------------------------
SYMBOL = {"pass": "ok", "fail": "FAIL", "warn": "warn", "skip": "-"}


def render(report: Report) -> str:
    checks: list[str] = []
    for r in report.results:
        if r.check not in checks:
            checks.append(r.check)
    cell: dict[tuple[str, str], str] = {}
    for r in report.results:
        prev = cell.get((r.node, r.check))
        if prev != "fail":
            cell[(r.node, r.check)] = r.status
    width = max(len(n) for n in report.nodes)
    lines = [f"{'node':<{width}}  " + "  ".join(f"{c:<{max(len(c), 4)}}" for c in checks)]
    for n in report.nodes:
        lines.append(f"{n:<{width}}  " + "  ".join(
            f"{SYMBOL.get(cell.get((n, c), 'skip'), '?'):<{max(len(c), 4)}}" for c in checks))
    fails = report.failures
    warns = [r for r in report.results if r.status == "warn"]
    if fails or warns:
        lines.append("")
    lines += [f"FAIL {r.line()}" for r in fails]
    lines += [f"warn {r.line()}" for r in warns]
    verdict = "all checks passed" if not fails else f"{len(fails)} check(s) failed"
    lines.append(f"\n{verdict} on {len(report.nodes)} nodes in {report.seconds:.1f} s")
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser("check", help="prove the cluster can train: ssh, versions, GPUs, names, firewall, clocks")
    add_cluster_args(p)
    p.add_argument("--master-port", type=int, help="check this port instead of picking a free one")
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--max-skew", type=float, default=DEFAULT_MAX_SKEW_S, help="clock skew bound in seconds")
    p.add_argument("--fast", action="store_true", help="skip importing torch on the nodes (no CUDA/NCCL facts)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    from . import inventory, ssh

    try:
        cluster = inventory.load(args.inventory, args.group)
    except inventory.InventoryError as exc:
        sys.stderr.write(f"ddpfab: error: {exc}\n")
        return 2
    policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
    report = check_cluster(cluster, policy, CheckOptions(
        master_port=args.master_port, nproc_per_node=args.nproc_per_node, max_skew_s=args.max_skew,
        full=not args.fast), args.ssh_config)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 1 if report.failures else 0
