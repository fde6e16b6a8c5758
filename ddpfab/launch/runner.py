"""``ddpfab run`` end to end: connect, probe, plan, execute, record.

The order is the safety property: every node is connected (host keys verified) and probed, and
the whole plan is made, before any node starts anything. A problem anywhere means nothing starts
anywhere.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import check, packages, probe, resourcecheck
from ddpfab.health.mesh import listen_request
from ddpfab.hosts import inventory
from ddpfab.launch import replicate, tmuxrun
from ddpfab.launch.execute import STOP_GRACE_S, NodeOutcome, Printer, RunResult, agent_input, execute, remote_command
from ddpfab.launch.interrupt import Interrupted
from ddpfab.launch.replay import MANIFEST_KIND, SCHEMA_VERSION, manifest_fields, recorded_options
from ddpfab.launch.runs import RunDir, controller_info, mask_env, mask_plan
from ddpfab.optionnames import option
from ddpfab.planning import gpu_leases, scriptfile
from ddpfab.planning.plan import Facts, Plan, RunOptions, choose_master, make_plan, nproc_for, socket_ifname_for
from ddpfab.problems import DdpfabError, Problem
from ddpfab.remote import heldconn, ssh
from ddpfab.remote.target import resolve_all
from ddpfab.results import GroupResult

if TYPE_CHECKING:  # (slow to import: see ddpfab.remote.ssh.connect)
    from fabric import Connection


class RunError(DdpfabError):
    """The run could not start; ``problems`` has one :class:`~ddpfab.problems.Problem` per host
    or cause (a line of text given is a problem about no single node)."""

    check = "run"


@dataclass
class Prepared:
    cluster: inventory.Inventory
    plan: Plan
    conns: dict[str, Connection]
    facts: dict[str, probe.NodeFacts]
    policy: ssh.HostKeyPolicy | None = None  # for fresh connections (cleanup after a lost supervisor)
    ssh_config: str | None = None
    options: RunOptions | None = None  # what the plan was made from (recorded for replay)
    cwd: str | None = None
    preflight: dict | None = None  # the preflight check's full report (the run dir's check.json)
    replicas: dict[str, dict] | None = None  # per node, its replica_stat answer (ddpfab.launch.replicate)
    #: the nodes as the inventory gave them, before the probe decided their python: what replay
    #: loads again and compares (the inventory's fingerprint)
    loaded: inventory.Inventory | None = None
    #: node -> its preparation's session, which goes on as its supervisor (:func:`supervisors_to_be`)
    sessions: dict[str, nodeprog.Session] = field(default_factory=dict)

    def reconnect(self, name: str) -> Connection:
        """A fresh connection to node *name*, the same way as the first one."""
        return ssh.connect(self.cluster.node(name), self.policy or ssh.HostKeyPolicy(), self.ssh_config)

    def targets(self) -> dict:
        """How each node is reached (:mod:`ddpfab.remote.target`), for the ssh lines a plan prints."""
        return resolve_all(self.cluster.nodes, self.policy, self.ssh_config)

    def take_sessions(self) -> dict[str, nodeprog.Session]:
        """The preparation's sessions, handed to the run that makes them its supervisors: from
        here the run ends them, and :meth:`close` no longer does."""
        sessions, self.sessions = self.sessions, {}
        return sessions

    def close(self) -> None:
        nodeprog.close_all(self.take_sessions(), 0)  # (none once a run took them over)
        for conn in self.conns.values():
            conn.close()


def connect_all(cluster: inventory.Inventory, policy: ssh.HostKeyPolicy,
                ssh_config: str | None = None) -> dict[str, Connection]:
    """Open verified connections to every node in parallel; on any failure close them all and
    raise one error listing every host that failed."""
    results = ssh.parallel(cluster.nodes, lambda n: ssh.connect(n, policy, ssh_config),
                           release=lambda conn: conn.close())  # an interrupt: the caller has none of them
    conns, failed = results.succeeded, results.failed
    if failed:
        for c in conns.values():
            c.close()
        raise _unreachable(failed)
    return conns


def _unreachable(failed: dict[str, Exception]) -> RunError:
    """One error listing every host whose connection failed, and why."""
    return RunError([Problem(name, e.kind if isinstance(e, ssh.SSHError) else "ssh", found=str(e),
                             text=str(e) if isinstance(e, ssh.SSHError) else repr(e)) for name, e in failed.items()])


@dataclass
class Opened:
    """Every node's connection and node program session, each session started as soon as its own
    node's handshake ended (:func:`connect_and_start`).

    Args:
        conns: node -> its verified connection.
        sessions: node -> its program session, nothing asked on it yet.
        errors: node -> why its session did not open.
    """

    conns: dict[str, Connection]
    sessions: dict[str, nodeprog.Session]
    errors: dict[str, nodeprog.NodeProgramError]


def connect_and_start(cluster: inventory.Inventory, policy: ssh.HostKeyPolicy,
                      ssh_config: str | None = None, run_id: str | None = None) -> Opened:
    """:func:`connect_all`, then the node program on every node, with no wait between the two on
    any node: a node's python starts while the other nodes' handshakes go on (the controller's
    share of a handshake is CPU; the node's python start is the node's). A node that cannot be
    reached closes them all and raises RunError, as :func:`connect_all` does.

    With *run_id* (a run that will start attached), each program is started as that run's
    supervisor is (:func:`ddpfab.remote.nodeprogram.supervisor_words`), so that the preparation's
    session can go on as the supervisor (:func:`prepare` keeps it): one python start per node
    fewer before torchrun's. Not over a held connection: ``ddpfab hold`` has a program started
    ahead for the preparation (:mod:`ddpfab.remote.spares`), which no run id can name."""

    def open_one(node: inventory.Node) -> tuple[Connection, nodeprog.Session | nodeprog.NodeProgramError]:
        conn = ssh.connect(node, policy, ssh_config)
        words = ("ddpfab-node",)
        if run_id is not None and not isinstance(conn, heldconn.HeldConnection):
            words = nodeprog.supervisor_words(run_id)
        try:
            return conn, nodeprog.start(conn, node, words=words)
        except nodeprog.NodeProgramError as exc:  # the session's failure is the node's data, as in open_sessions
            return conn, exc

    # an interrupt hands back every connection opened (its node program ends with it)
    results = ssh.parallel(cluster.nodes, open_one, release=lambda opened: opened[0].close())
    conns = {name: conn for name, (conn, _) in results.succeeded.items()}
    sessions = {name: s for name, (_, s) in results.succeeded.items() if isinstance(s, nodeprog.Session)}
    if results.failed:
        nodeprog.close_all(sessions, 0)
        for c in conns.values():
            c.close()
        raise _unreachable(results.failed)
    return Opened(conns, sessions, {name: e for name, (_, e) in results.succeeded.items()
                                    if isinstance(e, nodeprog.NodeProgramError)})


@dataclass
class Probing:
    """One preparation's node program sessions (one python start per node before the supervisor's)
    and what was sent on them at once: per node ``facts`` and, with the preflight, ``mesh_listen``.

    Args:
        sessions: node -> its program session (open until :func:`prepare` ends).
        errors: node -> why its session did not open.
        master: the master node (the plan's choice, made before anything was asked).
        sent: node -> the requests on their way, in order: facts, then mesh_listen (preflight).
        sent_at: when they were sent (the facts' controller_sent, for the clock check).
    """

    sessions: dict[str, nodeprog.Session]
    errors: dict[str, nodeprog.NodeProgramError]
    master: inventory.Node
    sent: dict[str, list[dict]]
    sent_at: float

    def close(self, wait: float | None = None) -> None:
        nodeprog.close_all(self.sessions, wait)


def start_probe(cluster: inventory.Inventory, conns: dict[str, Connection], options: RunOptions, cwd: str,
                preflight: bool = True, new_run_dir: bool = True, opened: Opened | None = None) -> Probing:
    """Start the node program on every node (unless *opened* has it started already) and send
    what the preparation asks, without waiting: the facts, and with *preflight* the mesh listeners
    (on the master also on the master port, the one its facts find free unless the user gave
    one). Whatever is asked on the same sessions later (the code's hash) travels with it in the
    same round trip."""
    master = choose_master(cluster)
    if opened is not None:
        sessions, errors = dict(opened.sessions), dict(opened.errors)
    else:
        sessions, errors = nodeprog.open_sessions(cluster.nodes, conns)
    script = scriptfile.file_to_check(options.script, options.module, cwd)  # the file the nodes must have
    reqs = probe.requests(cluster, conns, master, cwd=cwd, script=script, master_port=options.master_port,
                          run_id=options.run_id, new_run_dir=new_run_dir)
    sent, sent_at = {}, time.time()
    for name, session in sessions.items():
        batch = [reqs[name]]
        if preflight:
            batch.append(listen_request(name, master.name, options.master_port or "found"))
        try:
            sent[name] = session.send(*batch)
        except Exception as exc:  # noqa: BLE001 - one node's failure is data
            errors[name] = nodeprog.NodeProgramError(name, f"the node program's session broke: {exc}")
    return Probing({n: s for n, s in sessions.items() if n in sent}, errors, master, sent, sent_at)


def prepare(cluster: inventory.Inventory, options: RunOptions, policy: ssh.HostKeyPolicy,
            ssh_config: str | None = None, cwd: str | None = None, preflight: bool = True,
            conns: dict[str, Connection] | None = None, probing: Probing | None = None,
            synced: bool = False, replicate_paths: tuple[str, ...] = (), will_sync: bool = False,
            new_run_dir: bool = True) -> Prepared:
    """Connect (unless *conns* are open already; then they are the Prepared's, to close), probe
    and (with *preflight*) run the fast checks, then plan. Raises RunError with one line per
    problem; nothing has been started on any node then.

    *probing*: what :func:`start_probe` sent already (the caller asked the code's hash on the same
    sessions meanwhile); *synced*: the code was copied since, so the workdir facts are asked
    again; *will_sync*: a dry run of a run that copies the code first, so a workdir or script not
    on a node yet is the copy's to place, not a refusal (the real run checks them after the copy,
    and the script was checked here). The sessions end here either way.

    *replicate_paths* (and, with *preflight*, the workdir's resume files) are looked at on every
    node over the same sessions, after the sync: the Prepared's ``replicas``. *new_run_dir*: the
    run's dir must not be on a node yet (False: the caller placed it, as ``check --perf`` does)."""
    cwd = cwd or os.getcwd()
    conns = conns if conns is not None else connect_all(cluster, policy, ssh_config)
    try:
        probing = probing or start_probe(cluster, conns, options, cwd, preflight, new_run_dir)
        try:
            master = probing.master
            answers, facts = _collect(cluster, conns, probing, options, cwd, synced, will_sync)
            loaded, cluster = cluster, probe.decide(cluster, facts)  # every later step runs the python the probe ran
            port, _ = probe.pick_port(conns, master, facts, [], options.master_port, cwd=cwd)
            # planned before the preflight: a plan refused (an interface a node lacks) is refused at once,
            # and the preflight probes the interfaces the plan names
            plan = make_plan(cluster, options, plan_facts(facts, port, cwd))
            report, scanned = None, None
            if preflight:
                if not replicate_paths:  # the resume files' scan (no hashing: quick) goes ahead of the mesh probe
                    scanned = replicate.send(cluster, probing.sessions, cwd, (), scan=True)
                listening = answers.map(lambda replies: replies[1])
                report = _preflight(cluster, conns, facts, {n: f.address for n, f in facts.items()}, master.name, port,
                                    options, probing.sessions, listening)
            replicas = (replicate.ask(cluster, probing.sessions, cwd, replicate_paths, scan=preflight, sent=scanned)
                        if replicate_paths or preflight else None)
        except BaseException:
            probing.close(wait=0)  # a problem or Ctrl-C: nothing to wait for
            raise
        kept = supervisors_to_be(cluster, probing.sessions, options.run_id, synced)
        nodeprog.close_all({n: s for n, s in probing.sessions.items() if n not in kept})
        held = [] if options.wait else gpu_leases.refusals(plan, {n: f.raw.get("leases") for n, f in facts.items()})
        if held:
            nodeprog.close_all(kept, 0)
            raise RunError(held)
    except BaseException:
        for c in conns.values():
            c.close()
        raise
    return Prepared(cluster, plan, conns, facts, policy, ssh_config, options, cwd, preflight=report, replicas=replicas,
                    loaded=loaded, sessions=kept)


def supervisors_to_be(cluster: inventory.Inventory, sessions: dict[str, nodeprog.Session], run_id: str,
                      synced: bool) -> dict[str, nodeprog.Session]:
    """The preparation's sessions that go on as the run's supervisors: those started as its
    supervisor (:func:`connect_and_start` with the run id) with nothing left to answer, except on a
    node whose setup lines ran before a sync changed its workdir (what they do may read it: the
    supervisor's own session runs them on the new tree), and on one whose python the probe found
    on PATH (*cluster* is the decided one: :func:`ddpfab.health.probe.decide`): a shim there
    (pyenv's, asdf's) sets the environment of the python it starts, where the supervisor's own
    session starts the python it found directly."""
    words = nodeprog.supervisor_words(run_id)
    return {name: s for name, s in sessions.items()
            if s.words == words and s.idle and not (synced and cluster.node(name).setup)
            and cluster.node(name).python_from != "default"}


def _collect(cluster: inventory.Inventory, conns: dict[str, Connection], probing: Probing, options: RunOptions,
             cwd: str, synced: bool, will_sync: bool) -> tuple[GroupResult[list[nodeprog.Reply]],
                                                               dict[str, probe.NodeFacts]]:
    """The answers to what *probing* sent (the workdir facts asked again when *synced*) and the
    nodes' facts read from them; a node whose program did not start, or any problem the facts
    show, is a RunError (with *will_sync*, a workdir or script not there yet is the copy's to
    place, not a problem)."""
    answers = nodeprog.exchange(probing.sessions, {}, timeout=60, sent=probing.sent)
    if synced:
        answers = _after_sync(cluster, conns, probing, answers, options, cwd)
    facts, problems = probe.collect(
        cluster, conns, probing.master, answers.map(lambda replies: replies[0]),
        cwd=cwd, script=scriptfile.file_to_check(options.script, options.module, cwd),
        master_port=options.master_port, sent_at=probing.sent_at)
    problems = [Problem(n.name, "node_program", found=e.found, text=str(e))
                for n in cluster.nodes if (e := probing.errors.get(n.name))] + problems
    if will_sync:
        problems = [p for p in problems if not (isinstance(p, Problem) and p.check in ("workdir", "script"))]
    if problems:
        raise RunError(problems)
    return answers, facts


def _after_sync(cluster, conns, probing: Probing, answers: GroupResult[list[nodeprog.Reply]], options: RunOptions,
                cwd: str) -> GroupResult[list[nodeprog.Reply]]:
    """The workdir facts again after a copy (the rest stands: a port found free is held by the
    mesh listener now, so it is not looked for again)."""
    reqs = probe.requests(cluster, conns, probing.master, cwd=cwd,
                          script=scriptfile.file_to_check(options.script, options.module, cwd), master_port=None)
    again = nodeprog.exchange(probing.sessions, {
        n: [{k: v for k, v in reqs[n].items() if k not in ("port", "find_port")}]
        for n, a in answers.succeeded.items() if a[0].ok}, timeout=60)
    answers.update(again.failed)
    for name, new in again.succeeded.items():
        if not new[0].ok:
            answers[name] = [new[0], *answers[name][1:]]
            continue
        old = answers[name][0]
        fresh = {k: new[0].result.get(k) for k in ("workdir_exists", "script_exists")}
        answers[name] = [nodeprog.Reply(old.id, old.op, True, result={**old.result, **fresh}), *answers[name][1:]]
    return answers


def plan_facts(facts: dict[str, probe.NodeFacts], port: int, cwd: str) -> Facts:
    """What the planner needs from the probe: addresses, homes, interfaces (the one towards the
    peers, and every one a node has), GPU and CPU counts (``--nproc-per-node gpu|cpu|auto``); and
    the port."""
    return Facts(addresses={n: f.address for n, f in facts.items()}, master_port=port, cwd=cwd,
                 homes={n: f.home for n, f in facts.items()}, ifnames={n: _ifname(f) for n, f in facts.items()},
                 gpus={n: probe.gpu_count(f.raw) for n, f in facts.items()},
                 cpus={n: c for n, f in facts.items() if (c := probe.cpu_count(f.raw)) is not None},
                 interfaces={n: f.interfaces for n, f in facts.items() if f.interfaces is not None})


def _ifname(facts: probe.NodeFacts) -> str | None:
    """The one interface a node uses to reach all its peers, if there is exactly one."""
    devs = {d for d in facts.raw.get("routes", {}).values() if d}
    return devs.pop() if len(devs) == 1 else None


def _preflight(cluster, conns, facts, addresses, master: str, port: int, options: RunOptions,
               sessions: dict | None = None, listening: GroupResult[nodeprog.Reply] | None = None) -> dict:
    """The fast part of ``ddpfab check`` (no torch import): a hang at init becomes an error here.
    Over the preparation's node program *sessions*, whose listeners are up (*listening*).
    Returns the full report (``check --json``'s form), which the run dir keeps as check.json."""
    started = time.monotonic()
    counted = plan_facts(facts, port, "")
    # where an interface is set, gloo/NCCL advertise its address, not the hostname's
    chosen = {n.name for n in cluster.nodes if socket_ifname_for(n, options, counted)[0]}
    mesh = check.run_mesh(cluster, conns, addresses, master, port, sessions=sessions, listening=listening,
                          advertised=check.advertised_addresses({n: f.raw for n, f in facts.items()}, chosen))
    nproc = {n.name: nproc_for(n, options, counted.gpus.get(n.name), counted.cpus.get(n.name)) for n in cluster.nodes}
    results = check.evaluate(cluster, master, {n: f.raw for n, f in facts.items()}, {}, mesh,
                             check.CheckOptions(master_port=port, nproc_per_node=options.nproc_per_node,
                                                full=False, floors=resourcecheck.parse_floors(options.resource_floors),
                                                busy_gpus_fail=False), nproc)
    failures: list[Problem | str] = list(check.grouped_problems(results))  # one per distinct problem, however many nodes
    failures += [Problem(n, "mesh", found=str(e), text=f"host {n}: data-plane probe failed: {e}")
                 for n, e in mesh.get("errors", {}).items()]
    if failures:
        raise RunError(failures + [f"preflight checks failed (details: ddpfab check -i {cluster.source}; "
                                   f"skip with {option('check', False)})"])
    return check.Report(nodes=[n.name for n in cluster.nodes], results=results,
                        seconds=time.monotonic() - started,
                        extra={"master": master, "master_port": port, "fast": True,
                               "mesh": check.mesh_detail(cluster, mesh)}).to_dict()


def _manifest_head(prepared: Prepared) -> dict:
    plan = prepared.plan
    return {
        "kind": MANIFEST_KIND,
        "schema_version": SCHEMA_VERSION,
        "run_id": plan.run_id,
        "state": "running",
        "started": time.time(),
        "plan": mask_plan(plan.to_dict()),
        "controller": controller_info(plan.secret_env),
        "nodes_facts": {n: {"hostname": f.hostname, "python": f.python, "address": f.address,
                            "executable": f.executable, "python_from": f.python_from,
                            **({"env_changes": {"set": mask_env(f.env_changes["set"], plan.secret_env),
                                                "unset": f.env_changes["unset"]}} if f.env_changes else {})}
                        for n, f in prepared.facts.items()},
        "logs": {n.name: f"{n.name}.log" for n in plan.nodes},
        "options": recorded_options(prepared.options, prepared.cwd, plan.secret_env) if prepared.options else None,
        **_replay_fields(prepared),
    }


def _replay_fields(prepared: Prepared) -> dict:
    """inventory_fingerprint, script_file, script_sha256: what `ddpfab replay` checks."""
    return manifest_fields(prepared.loaded or prepared.cluster, prepared.plan)


def _open_record(prepared: Prepared, runs_root: str | os.PathLike, extra: dict | None,
                 state: str | None = None) -> tuple[RunDir, dict]:
    """The run's dir (with the preflight's full report, check.json) and its manifest, written
    (*state* over the head's); a RunError, nothing started, when they cannot be written."""
    try:
        run_dir = RunDir(runs_root, prepared.plan.run_id)
        manifest = _manifest_head(prepared)
        if prepared.preflight is not None:
            manifest["check"] = run_dir.write_json("check.json", prepared.preflight).name
        manifest.update(extra or {})
        if state:
            manifest["state"] = state
        run_dir.write_manifest(manifest)
    except OSError as exc:  # (the dir was checked before the preparation: a change since, a full disk)
        raise RunError([f"cannot write the run's record {Path(runs_root) / prepared.plan.run_id}: "
                        f"{exc.strerror or exc}"]) from None  # (a RunError: nothing was started, as the CLI says)
    return run_dir, manifest


def run(prepared: Prepared, runs_root: str | os.PathLike, printer: Printer | None = None,
        extra: dict | None = None) -> tuple[RunResult, Path]:
    """Execute the prepared plan and record it; *extra* goes into the manifest as is (e.g. replay_of)."""
    plan = prepared.plan
    printer = printer or Printer(plan)
    run_dir, manifest = _open_record(prepared, runs_root, extra)
    printer.note(f"run {plan.run_id}: {plan.nnodes} nodes x {'/'.join(str(n.nproc) for n in plan.nodes)} "
                 f"procs, world size {plan.world_size}, master {plan.master} {plan.master_addr}:{plan.master_port}")
    try:
        result = execute(plan, prepared.conns, run_dir.path, printer, reconnect=prepared.reconnect,
                         sessions=prepared.take_sessions(),
                         node_hints=packages.failure_hints({n: f.raw for n, f in prepared.facts.items()},
                                                           {n.name: n.python for n in plan.nodes}))
    except KeyboardInterrupt as exc:  # a second signal leaves at once: the record still says how it ended
        code = exc.exit_code if isinstance(exc, Interrupted) else 130
        name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
        manifest.update({"state": "interrupted", "ended": time.time(), "exit_code": code, "interrupted": name,
                         "summary": f"interrupted ({name}): ddpfab left before the nodes reported; their jobs end "
                                    "as their connections close (`ddpfab ps` shows what is left)"})
        manifest["duration_s"] = round(manifest["ended"] - manifest["started"], 3)
        with contextlib.suppress(OSError):
            run_dir.write_manifest(manifest)
        raise
    manifest.update({
        "state": "succeeded" if result.exit_code == 0 else ("interrupted" if result.interrupted else "failed"),
        "ended": time.time(),
        "exit_code": result.exit_code,
        "first_failure": result.first_failure,
        "interrupted": result.interrupted,
        "summary": result.summary,
        "nodes": {n: o.to_dict() for n, o in result.outcomes.items()},
    })
    manifest["duration_s"] = round(manifest["ended"] - manifest["started"], 3)
    path = run_dir.write_manifest(manifest)
    line = f"{result.summary} (manifest: {path})"
    if result.exit_code == 0:
        printer.note(line)
    else:  # printed once, where errors go: stdout is the job's own output
        sys.stderr.write(f"ddpfab: {line}\n")
    return result, path


def run_tmux(prepared: Prepared, runs_root: str | os.PathLike, printer: Printer,
             extra: dict | None = None) -> tuple[RunResult, Path]:
    """``run --tmux``: the plan's launches in a tmux window per node (:mod:`ddpfab.launch.tmuxrun`),
    recorded as any run (before an attached terminal leaves the session)."""
    plan = prepared.plan
    run_dir, manifest = _open_record(prepared, runs_root, {**(extra or {}), "tmux": tmuxrun.session_name(plan.run_id),
                                                           "tmux_socket": tmuxrun.server_socket()})
    started = time.time()
    done: list[tuple[RunResult, Path]] = []

    def record(ended: tmuxrun.Ended) -> None:
        done.append(_record_tmux(plan, run_dir, manifest, ended, started, printer))

    tmuxrun.run(plan, prepared.conns, prepared.targets(), run_dir.path, printer, record)
    return done[0]


def _record_tmux(plan: Plan, run_dir: RunDir, manifest: dict, ended: tmuxrun.Ended, started: float,
                 printer: Printer) -> tuple[RunResult, Path]:
    """The manifest of a ``--tmux`` run, from how it ended; its closing line printed."""
    code, first = ended.exit_code, ended.first_failure
    outcomes = {n.name: NodeOutcome(n.name, n.node_rank, exit_code=ended.exit_codes.get(n.name), started=started,
                                    ended=time.time() if n.name in ended.exit_codes else 0.0,
                                    stopped_by_ddpfab=n.name != first and ended.exit_codes.get(n.name) not in (0, None))
                for n in plan.nodes}
    state = "succeeded" if code == 0 else ("interrupted" if ended.interrupted else "failed")
    manifest.update({"state": state, "ended": time.time(), "exit_code": code, "first_failure": first,
                     "interrupted": ended.interrupted, "summary": ended.summary,
                     "nodes": {n: o.to_dict() for n, o in outcomes.items()}})
    manifest["duration_s"] = round(manifest["ended"] - manifest["started"], 3)
    path = run_dir.write_manifest(manifest)
    (printer.note if code == 0 else lambda line: sys.stderr.write(f"ddpfab: {line}\n"))(
        f"{ended.summary} (manifest: {path})")
    return RunResult(code, outcomes, first, ended.interrupted, ended.summary), path


def record_emitted(prepared: Prepared, runs_root: str | os.PathLike, directory: str | os.PathLike,
                   selection: dict | None = None) -> Path:
    """The record of a job whose scripts ``plan --emit`` wrote (:mod:`ddpfab.launch.handrun`):
    detached, as nobody but ``attach`` watches it; RunError when it cannot be written.
    *selection*: ``--limit`` and ``-e`` as a run's record keeps them (the commands that follow
    the job reach the same nodes)."""
    run_dir, _ = _open_record(prepared, runs_root, {"emitted": os.fspath(directory), **(selection or {})},
                              state="detached")
    return run_dir.path / "manifest.json"


def start_detached(prepared: Prepared, runs_root: str | os.PathLike, printer: Printer,
                   extra: dict | None = None) -> int:
    """Start every node's supervisor in a session of its own and return: the job outlives ddpfab.

    If any node fails to start, the ones that did are stopped again: a detached job is started
    whole or not at all.
    """
    plan = prepared.plan
    run_dir, manifest = _open_record(prepared, runs_root, extra, state="detached")
    results = ssh.parallel(prepared.cluster.nodes, lambda n: ssh.run(
        prepared.conns[n.name], n.name, remote_command(plan, plan.node(n.name), detach=True), timeout=30,
        stdin=agent_input(plan, plan.node(n.name), detach=True)))
    failed = {**results.failed, **{n: r.stderr.strip() or f"exit {r.exit_code}"
                                   for n, r in results.succeeded.items() if r.exit_code != 0}}
    if failed:
        for name, why in failed.items():
            printer.note(f"{name}: could not start: {why}")

        def stop(n):
            return nodeprog.stop(prepared.conns[n.name], n, plan.node(n.name).remote_dir, STOP_GRACE_S, timeout=20)

        # only where it started: a node that refused may hold another run's job under this id
        ssh.parallel([n for n in prepared.cluster.nodes if n.name not in failed], stop)
        manifest["state"] = "failed to start"
        run_dir.write_manifest(manifest)
        return 1
    printer.note(f"run {plan.run_id} started detached on {plan.nnodes} nodes; follow it with "
                 f"`ddpfab attach {plan.run_id}`, end it with `ddpfab stop {plan.run_id}`")
    return 0
