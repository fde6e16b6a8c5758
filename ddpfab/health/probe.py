"""One parallel pass over the nodes that gathers the facts the plan needs, before anything starts.

Each node's program (:mod:`ddpfab.node`, with its own ``ddpfab_python``) answers a ``facts``
request: its hostname, python, whether torch is importable, whether the workdir and script exist,
and on the master a free port (or whether the user's port is free). Connecting is also where host keys are
verified, so an unknown key, an unreachable host or a busy port stops the run before any node
has started anything.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import resourcecheck
from ddpfab.hosts import nodeenv
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.planning import scriptfile
from ddpfab.optionnames import option
from ddpfab.planning.plan import DEFAULT_PORT_RANGE, REMOTE_RUNS_DIR, Interface, is_port, master_port
from ddpfab.problems import NodeError, Problem
from ddpfab.remote import ssh
from ddpfab.remote.address import resolve
from ddpfab.results import GroupResult

if TYPE_CHECKING:  # (slow to import: see ddpfab.remote.ssh.connect)
    from fabric import Connection


@dataclass
class NodeFacts:
    name: str
    hostname: str = ""
    python: str = ""
    home: str = ""
    torch: bool = False
    address: str = ""
    free_port: int | None = None
    port_free: bool | None = None
    workdir_exists: bool = True
    script_exists: bool | None = None
    #: the node's own dir for the run id asked about, when it exists there already (the id was used)
    run_dir_used: str | None = None
    raw: dict = field(default_factory=dict)
    #: the node's python as decided (:func:`ddpfab.hosts.nodeenv.decided`) and where it came from
    executable: str = ""
    python_from: str = ""
    #: what the node's setup lines changed in its environment (``{"set": ..., "unset": ...}``)
    env_changes: dict | None = None
    #: its network interfaces by name (:func:`interfaces_of`); None where the node could not list them
    interfaces: dict[str, Interface] | None = None


def decide(cluster: Inventory, facts: dict[str, NodeFacts]) -> Inventory:
    """*cluster* with each probed node's python decided from its facts (the one decision every
    later step uses: the plan, the preflight, the launch)."""
    return replace(cluster, nodes=tuple(nodeenv.decided(n, facts[n.name].raw) if n.name in facts else n
                                        for n in cluster.nodes))


def gpu_count(raw: dict) -> int:
    """A node's GPUs from its facts: torch's count when asked (``check --full``), else the lines
    nvidia-smi lists, else none (no nvidia-smi)."""
    gpus = raw.get("gpus") if raw.get("gpus") is not None else raw.get("nvidia_gpus")
    return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0 else 0


def cpu_count(raw: dict) -> int | None:
    """A node's CPUs from its facts (``os.cpu_count()`` there, as torchrun's ``cpu`` counts), or None."""
    cpus = raw.get("cpus")
    return cpus if isinstance(cpus, int) and not isinstance(cpus, bool) and cpus >= 1 else None


#: The longest interface name Linux allows (IFNAMSIZ - 1).
IFNAME_MAX = 15


def interfaces_of(value: object) -> dict[str, Interface] | None:
    """A ``facts`` reply's ``interfaces`` (:func:`ddpfab.node.ops.interfaces`) as data; None when
    the node could not list them. Raises ValueError, saying what is wrong, on anything else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"interfaces {nodeprog.printable(repr(value))[:60]} (expected an object, or null)")
    out: dict[str, Interface] = {}
    for name, item in value.items():
        shown = nodeprog.printable(repr(name))[:40]
        if not isinstance(name, str) or not 0 < len(name) <= IFNAME_MAX or not name.isprintable():
            raise ValueError(f"interface name {shown} (expected 1-{IFNAME_MAX} printable characters)")
        if not isinstance(item, dict):
            raise ValueError(f"interface {shown}: {nodeprog.printable(repr(item))[:60]} (expected an object)")
        up, state, addrs = item.get("up"), item.get("state"), item.get("addrs")
        if up is not None and not isinstance(up, bool):
            raise ValueError(f"interface {shown}: up {nodeprog.printable(repr(up))[:40]} (expected true, false or null)")
        if state is not None and not (isinstance(state, str) and len(state) <= 40 and state.isprintable()):
            raise ValueError(f"interface {shown}: state {nodeprog.printable(repr(state))[:40]} (expected a word, or null)")
        if not isinstance(addrs, list):
            raise ValueError(f"interface {shown}: addrs {nodeprog.printable(repr(addrs))[:40]} (expected a list)")
        for a in addrs:
            try:
                ipaddress.ip_address(a)
            except (TypeError, ValueError):
                raise ValueError(f"interface {shown}: address {nodeprog.printable(repr(a))[:60]} "
                                 "(expected an IP address)") from None
        out[name] = Interface(up=up, state=state, addrs=tuple(addrs))
    return out


def facts_request(node: Node, *, workdir: str, script: str | None, port: int | None = None,
                  find_port: bool = False, peers: dict[str, str] | None = None,
                  resolve_names: list[str] | None = None, full: bool = False, reserve_for: str | None = None,
                  run_id: str | None = None) -> dict:
    """The node program's ``facts`` request (see :func:`ddpfab.node.ops.op_facts`); with
    *reserve_for* (a run id) the port found is reserved for that run where the node leases; with
    *run_id*, whether the node has that run's dir already (a run id names one run on every node)."""
    req: dict = {"op": "facts", "workdir": workdir, "script": script, "peers": peers or {},
                 "resolve": resolve_names or [], "full": full, "leases": True,
                 "resources": True,  # the node's resources a job needs (ddpfab.health.resourcecheck)
                 "interfaces": True,  # what --socket-ifname IFACE is checked against
                 "packages": True}  # what the nodes' pythons have installed, compared across nodes
    if run_id:
        req["run_dir"] = f"~/{REMOTE_RUNS_DIR}/{run_id}"
    if port:
        req["port"] = port
    if find_port:
        lo, hi = DEFAULT_PORT_RANGE
        # start at a random place so two jobs probing at once rarely pick the same port
        req["find_port"] = [lo, hi, random.randint(lo, hi)]
        if reserve_for:
            req["reserve_for"] = reserve_for
    return req


def to_facts(node: Node, data: dict, sent: float, received: float) -> NodeFacts:
    """A ``facts`` reply as NodeFacts; a reply without the facts every node reports, or with a
    port that is none, is an error."""
    free_port, port_free = data.get("free_port"), data.get("port_free")
    bad = [f"{key} {nodeprog.printable(repr(value))[:60]} (expected {want})" for key, value, ok, want in (
        ("free_port", free_port, free_port is None or is_port(free_port), "an integer 1-65535, or null"),
        ("port_free", port_free, port_free is None or isinstance(port_free, bool), "true, false or null")) if not ok]
    try:
        ifaces = interfaces_of(data.get("interfaces"))
    except ValueError as exc:
        bad.append(str(exc))
    if bad:
        raise nodeprog.NodeProgramError(node.name, f"its facts give {'; '.join(bad)}; ddpfab's node program never "
                                                   "answers so: check what runs as ddpfab_python there")
    chosen = nodeenv.decided(node, data)
    try:
        return NodeFacts(name=node.name, hostname=nodeprog.printable(data["hostname"]),
                         executable=nodeprog.printable(chosen.python),
                         python_from=chosen.python_from or nodeenv.ON_NODE_FROM,
                         env_changes=nodeenv.env_changes(data),
                         python=nodeprog.printable(data["python"]), home=str(data["home"]), torch=bool(data["torch"]),
                         free_port=free_port, port_free=port_free, workdir_exists=bool(data["workdir_exists"]),
                         script_exists=data.get("script_exists"), interfaces=ifaces,
                         run_dir_used=(nodeprog.printable(data["run_dir_used"])
                                       if isinstance(data.get("run_dir_used"), str) else None),
                         raw={**data, "controller_sent": sent, "controller_received": received})
    except KeyError as exc:
        raise nodeprog.NodeProgramError(node.name, f"its facts lack {exc}") from None


def probe_node(conn: Connection, node: Node, **request) -> NodeFacts:
    """One node's facts in one exchange of its own (``facts_request``'s keyword arguments)."""
    sent = time.time()
    reply = nodeprog.call(conn, node, facts_request(node, **request), timeout=60)[0]
    return to_facts(node, reply.value(node.name), sent, time.time())


def requests(cluster: Inventory, conns: dict[str, Connection], master: Node, *, cwd: str, script: str | None,
             master_port: int | None, full: bool = False, run_id: str | None = None,
             new_run_dir: bool = True) -> dict[str, dict]:
    """Every node's ``facts`` request: the master's asks for the port (reserved for *run_id*,
    when given, where the master leases), each names its peers; with *new_run_dir* each also asks
    whether *run_id*'s dir is there already (a run id names one run; ``check --perf`` places its
    job in its own run dir first)."""
    addresses = {}
    for n in cluster.nodes:
        try:
            addresses[n.name] = resolve(n, conns.get(n.name))
        except ssh.SSHError:
            addresses[n.name] = n.data_addr
    names = sorted({n.data_addr for n in cluster.nodes if n.data_addr != addresses[n.name]})
    return {node.name: facts_request(
        node, workdir=node.workdir or cwd, script=script or None,  # absolute paths too: the node joins and checks it
        port=master_port if node.name == master.name else None,
        find_port=node.name == master.name and master_port is None,
        peers={k: v for k, v in addresses.items() if k != node.name}, resolve_names=names, full=full,
        reserve_for=run_id, run_id=run_id if new_run_dir else None)
        for node in cluster.nodes if node.name in conns}


def gather(cluster: Inventory, conns: dict[str, Connection], master: Node, *, cwd: str, script: str | None,
           master_port: int | None, full: bool = False,
           sessions: dict[str, nodeprog.Session] | None = None,
           run_id: str | None = None) -> tuple[dict[str, NodeFacts], list[Problem]]:
    """Probe every node at once; return the facts and a list of problems (empty = ready). In the
    nodes' open program *sessions* when given (left open for what comes next), else in a session
    of its own per node; with *run_id*, a node that has that run's dir is a problem. (``ddpfab
    run`` sends its facts requests with the rest of its preparation instead: :func:`requests`,
    :func:`collect`.)"""
    own = sessions is None
    errors: dict[str, nodeprog.NodeProgramError] = {}
    if own:
        sessions, errors = nodeprog.open_sessions(cluster.nodes, conns)
    try:
        sent_at = time.time()
        todo = {n: [r] for n, r in requests(cluster, conns, master, cwd=cwd, script=script,
                                            master_port=master_port, full=full, run_id=run_id).items()
                if n in sessions}
        answers = nodeprog.exchange(sessions, todo, timeout=120 if full else 60)
    finally:
        if own:
            nodeprog.close_all(sessions)
    answers.update(errors)
    return collect(cluster, conns, master, answers.map(lambda replies: replies[0]),
                   cwd=cwd, script=script, master_port=master_port, sent_at=sent_at)


def missing_script_fix(script: str, workdir: str, node: str, cwd: str | None = None) -> str:
    """What to do about *script* missing in *workdir* on *node*: sync the code, unless the script
    is outside the workdir (``../train.py``), which is outside what a sync copies too, or is not
    in *cwd* (here, where a sync copies from) either: a typo, which a sync would not mend."""
    tilde = script.startswith("~")
    if cwd is not None and not tilde and not posixpath.isabs(script) and not os.path.exists(os.path.join(cwd, script)):
        return f"it is not here ({cwd}) either{scriptfile.suggestion(script, cwd)}: check its name"
    if tilde != workdir.startswith("~") and (tilde or posixpath.isabs(script)):
        return "sync the code first"  # one is under a home the node expands: not comparable here
    base = posixpath.normpath(workdir)
    path = posixpath.normpath(script if tilde else posixpath.join(workdir, script))
    if path == base or path.startswith(base.rstrip("/") + "/"):
        return "sync the code first"
    return (f"it is outside {workdir}, the project a sync copies: move it into the project, or put it at that "
            f"path on {node}")


def collect(cluster: Inventory, conns: dict[str, Connection], master: Node,
            answers: GroupResult[nodeprog.Reply], *, cwd: str, script: str | None,
            master_port: int | None, sent_at: float) -> tuple[dict[str, NodeFacts], list[Problem]]:
    """The nodes' ``facts`` replies (or why a node gave none) as facts and problems."""
    received = time.time()
    failed: dict[str, Exception] = answers.failed
    got: dict[str, NodeFacts] = {}
    for name, reply in answers.succeeded.items():
        node = cluster.node(name)
        try:
            got[name] = to_facts(node, reply.value(name), sent_at, received)
            got[name].address = resolve(node, conns[name])
        except (ssh.SSHError, nodeprog.NodeProgramError) as exc:
            failed[name] = exc
    facts: dict[str, NodeFacts] = {}
    problems: list[Problem] = []
    # a script no node has and that is not here either is a name to check; one that some node has is
    # the others' to get (a sync, or a copy by hand)
    here = cwd if os.path.isdir(cwd) and not any(f.script_exists for f in got.values()) else None
    for node in cluster.nodes:
        if node.name in failed:
            exc, why = failed[node.name], str(failed[node.name])
            # a setup line that failed keeps its kind (the node's environment, not its probe)
            kind = "setup" if isinstance(exc, NodeError) and exc.kind == "setup" else "probe"
            problems.append(Problem(node.name, kind, found=exc.found if isinstance(exc, NodeError) else why, text=why))
            continue
        if node.name not in got:
            continue
        res = facts[node.name] = got[node.name]
        workdir = node.workdir or cwd
        if res.run_dir_used:
            problems.append(Problem(node.name, "run_id", expected=f"no {res.run_dir_used} there", found="exists",
                                    fix=f"pick another {option('run_id')} (or leave it out)",
                                    text=f"host {node.name}: {res.run_dir_used} exists there: this run id was used "
                                         f"on this node already; pick another {option('run_id')} (or leave it out)"))
        if not res.workdir_exists:
            problems.append(Problem(node.name, "workdir", expected=f"{workdir} exists", found="missing",
                                    fix="create it, sync the code, or set ddpfab_workdir",
                                    text=f"host {node.name}: workdir {workdir} does not exist there; create it, "
                                         "sync the code, or set ddpfab_workdir"))
        elif script and res.script_exists is False:
            fix = missing_script_fix(script, workdir, node.name, here)
            problems.append(Problem(node.name, "script", expected=f"{script} in {workdir}", found="missing",
                                    fix=fix, text=f"host {node.name}: script {script} not found in {workdir}; {fix}"))
        if not res.torch:
            chosen = nodeenv.decided(node, res.raw)
            fix = nodeenv.torch_fix(chosen)
            problems.append(Problem(node.name, "torch", expected=f"{chosen.python} imports torch",
                                    found=f"it cannot (python {res.python}, {nodeenv.describe(chosen)})", fix=fix,
                                    text=f"host {node.name}: {chosen.python} cannot import torch (python "
                                         f"{res.python}, from {chosen.python_from or 'inventory'}); {fix}"))
        if node.name == master.name:
            problems += _master_port_problems(node, res, master_port)
    return facts, problems


def _master_port_problems(master: Node, res: NodeFacts, master_port: int | None) -> list[Problem]:
    """The master's port as asked (in use there: by whom, and how to end it) or as looked for
    (none free in the range)."""
    if master_port is not None and res.port_free is False:
        held, stop = resourcecheck.port_holders(res.raw)  # who holds it, and how to end it
        return [Problem(master.name, "master_port", expected=f"port {master_port} free", found="in use" + held,
                        fix=f"{stop}pick another port or leave {option('master_port')} out",
                        text=f"host {master.name}: {option('master_port', master_port)} is already in use there"
                             f"{held}; {stop}pick another port or leave {option('master_port')} out to get a free one")]
    if master_port is None and res.free_port is None:
        lo, hi = DEFAULT_PORT_RANGE
        return [Problem(master.name, "master_port", expected=f"a free port in {lo}-{hi}", found="none",
                        fix=f"pass {option('master_port')}",
                        text=f"host {master.name}: no free port in {lo}-{hi}; pass {option('master_port')}")]
    return []


def pick_port(conns: dict[str, Connection], master: Node, facts: dict[str, NodeFacts], problems: list[Problem],
              asked: int | None, *, cwd: str, replace_taken: bool = False) -> tuple[int | None, list[Problem]]:
    """Probe, then pick the master port: what the probe found on the master (*facts*, whose
    requests asked for *asked*, or for a free port) made into the port, for run, check and replay
    alike (:func:`ddpfab.planning.plan.master_port` is the rule). With *replace_taken* (replay
    without ``--same-port``) a taken *asked* port is not a problem: the master is asked once
    more, for a free one. Returns the port (None: none free; a problem says so) and the problems."""
    mine = facts.get(master.name)
    found = mine.free_port if mine else None
    asked_free = mine.port_free if mine else None
    if replace_taken and asked_free is False:
        problems = [p for p in problems if not p.about(master.name, "master_port")]
        try:
            found = probe_node(conns[master.name], master, workdir=master.workdir or cwd, script=None,
                               find_port=True).free_port
        except (nodeprog.NodeProgramError, ssh.SSHError) as exc:  # a bad answer is a problem, not a traceback
            problems.append(Problem(master.name, "master_port", found=str(exc), text=str(exc)))
        else:
            if found is None:
                problems.append(Problem(master.name, "master_port", expected="a free port", found="none",
                                        text=f"host {master.name}: no free port for the replay"))
    return master_port(asked, found=found, asked_free=asked_free, replace_taken=replace_taken), problems
