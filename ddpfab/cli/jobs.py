"""``ddpfab ps``, ``stop``, ``attach``, ``logs``, ``doctor``: jobs on the cluster, by run id."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.cli.common import add_runs_dir_arg, add_selection_args, origin_named, run_id_type
from ddpfab.cli.config import MISSING_INVENTORY, ConfigError, given
from ddpfab.cli.errors import EXIT_CLOSED_STDOUT, EXIT_FAILED, die, note, refuse, warn
from ddpfab.hosts import inventory
from ddpfab.masking import setup_was_masked
from ddpfab.launch.runs import RunRecordError, read_record, record_plan
from ddpfab.planning.plan import Plan
from ddpfab.remote.ssherror import SSHError
from ddpfab.results import GroupResult


def _source(args, manifest: dict | None):
    """The inventory: -i as given, else the run's record's, else $DDPFAB_INVENTORY/ddpfab.yml's
    (:func:`ddpfab.cli.config.apply` filled those in); None when there is none."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.replay import recorded_inventory

    if given(args, "inventory"):
        return args.inventory
    return (recorded_inventory(manifest) if manifest else None) or args.inventory


def _cluster(args, manifest: dict | None):
    """The nodes: -i/--group as given, else the run's record's, else $DDPFAB_INVENTORY/ddpfab.yml's
    (:func:`ddpfab.cli.config.apply` filled those in)."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import attempt_cluster
    from ddpfab.launch.replay import ManifestError, recorded_selection

    recorded = (manifest or {}).get("plan", {})
    source = _source(args, manifest)
    if not source and manifest is None and getattr(args, "run_id", None):  # a run id typo, as often as not
        raise ConfigError(f"no local record of run {args.run_id} in {args.runs_dir}, and no inventory to ask "
                          f"the nodes for it: check the run id (`ddpfab ps -i INVENTORY` lists the nodes' runs), "
                          f"or give -i INVENTORY")
    if not source:
        raise ConfigError(MISSING_INVENTORY)
    group = args.group if given(args, "group") else recorded.get("group") or args.group or "all"
    extra = getattr(args, "extra_vars", None) or []
    if manifest:
        # the run's -e (how its nodes are reached: ansible_host, ansible_port...) with this command's
        # -e over it; a mapping among them is the project config's (config.apply puts it first),
        # which the record holds as the run had it, but for the values it masks (secrets)
        try:
            limit, variables, masked = recorded_selection(
                manifest, [e for e in extra if not isinstance(e, dict)],
                fallback=inventory.parse_extra_vars([e for e in extra if isinstance(e, dict)]))
        except ManifestError as exc:
            raise RunRecordError(str(exc)) from None
        chosen: tuple = (variables,) if variables else ()
    else:
        limit, chosen, masked = None, tuple(extra), []
    if given(args, "limit") or (manifest is None and getattr(args, "limit", None)):
        limit = args.limit
    if masked:
        warn(f"the run's extra vars {', '.join(masked)} are recorded masked (secrets): the nodes are reached "
             "without them (give them again with -e @FILE, a file of KEY: VALUE lines, which keeps them out of "
             "the command line)")
    if manifest and "attempt_nodes" in manifest:  # an attempt of a run with restarts: maybe on spares
        if given(args, "limit"):
            warn(f"run {manifest.get('run_id')} had restarts: its attempts' records name their nodes, "
                 "so --limit is not applied")
        return attempt_cluster(manifest, source, group, extra_vars=chosen)
    with origin_named(args) if manifest is None else contextlib.nullcontext():
        cluster = inventory.load(source, group, limit=limit, extra_vars=chosen)
    for line in cluster.warnings:
        warn(line)
    return cluster


def _latest(args, manifest: dict | None) -> dict | None:
    """For a run with restarts, its latest attempt's manifest (the one running, or that ran last)."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import current_manifest

    return current_manifest(args.runs_dir, manifest) if manifest else None


def _library(args, nodes: inventory.Inventory, manifest: dict | None = None):
    """The library's :class:`ddpfab.api.Cluster` of *nodes*, reached as -i, --ssh-config and
    --known-hosts say (or the run's record): what every command here calls or connects through."""
    from ddpfab.api import Cluster

    return Cluster(nodes, inventory=_source(args, manifest), ssh_config=args.ssh_config, known_hosts=args.known_hosts)


def _connect(args, nodes: inventory.Inventory, manifest: dict | None = None, warm: bool = True):
    """A connection to every node: over ``ddpfab hold``'s where it holds them (*warm*), else of its own."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner

    cluster = _library(args, nodes, manifest)
    with cluster.held_connections() if warm else contextlib.nullcontext():
        return runner.connect_all(nodes, cluster.policy, cluster.ssh_config)


def _connect_one(args, nodes: inventory.Inventory, node: inventory.Node, manifest: dict | None = None,
                 warm: bool = True):
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import ssh

    cluster = _library(args, nodes, manifest)
    with cluster.held_connections() if warm else contextlib.nullcontext():
        return ssh.connect(node, cluster.policy, cluster.ssh_config)


def _on_each_node(args, nodes: inventory.Inventory, fn, manifest: dict | None = None) -> GroupResult:
    """``fn(conn, node)`` on every node over connections of their own, or ``ddpfab hold``'s (a
    node that cannot be reached is one failure among the results)."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import ssh

    cluster = _library(args, nodes, manifest)
    with cluster.held_connections():
        return ssh.on_each(nodes.nodes, cluster.policy, cluster.ssh_config, fn)


def _common(p: argparse.ArgumentParser, inventory_required: bool) -> None:
    # the defaults of every inventory command ($DDPFAB_INVENTORY, ddpfab.yml: cli/config.py), after a run's record
    p.set_defaults(_cluster_args=True, _inventory_required=inventory_required)
    p.add_argument("-i", "--inventory", action="append",
                   help="inventory, repeatable: merged in order (default: the one recorded in the run's local "
                        "manifest, else $DDPFAB_INVENTORY, else `inventory:` in ./ddpfab.yml)" if not inventory_required
                   else "inventory, repeatable: merged in order (default: $DDPFAB_INVENTORY, else `inventory:` in "
                        "./ddpfab.yml)")
    p.add_argument("--group", help="inventory group (default: the recorded one, else $DDPFAB_GROUP, the config's, "
                                   "or all)")
    add_selection_args(p, recorded=not inventory_required)  # (ps, queue: no run, no record)
    add_runs_dir_arg(p, "where run records are")
    p.add_argument("--known-hosts")
    p.add_argument("--ssh-config")


def register(sub) -> None:
    ps = sub.add_parser("ps", help="list ddpfab jobs on the cluster's nodes")
    _common(ps, inventory_required=True)
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(func=cmd_ps)
    q = sub.add_parser("queue", help="GPU leases and waiting jobs on the nodes, every user's (ddpfab run --wait)")
    _common(q, inventory_required=True)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_queue)
    for name, text, func in (("stop", "end one job on every node", cmd_stop),
                             ("attach", "stream a (detached) job's output from every node until it ends", cmd_attach),
                             ("logs", "fetch a job's output from every node into runs/<id>/", cmd_logs)):
        p = sub.add_parser(name, help=text)
        p.add_argument("run_id", type=run_id_type)
        _common(p, inventory_required=False)
        if name == "attach":
            p.add_argument("-v", "--verbose", action="store_true",
                           help="every line of the job's output: torchrun's failure reports and the tracebacks of "
                                "ranks that lost their peer are folded otherwise (ddpfab logs RUN_ID has them)")
            p.add_argument("--no-color", action="store_true")
        if name == "logs":
            p.add_argument("--ranks", action="store_true",
                           help="also fetch torchrun's full per-rank logs (stdout/stderr of every local rank, "
                                "every restart) into runs/<id>/ranks/<node>/")
        p.set_defaults(func=func)
    d = sub.add_parser("doctor", help="where a running job's ranks are: each rank's state and Python stack "
                                      "(py-spy), grouped; a stopped, gone or odd rank named; a job that has "
                                      "ended: how")
    d.add_argument("run_id", type=run_id_type)
    _common(d, inventory_required=False)
    d.add_argument("--json", action="store_true", help="print the doctor's record (also saved in runs/<id>/)")
    d.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long each node has to answer before it is named as not answering (default 30)")
    d.set_defaults(func=cmd_doctor)
    g = sub.add_parser("debug", help="drive the pdb of a rank that waits in it (a run --pdb job, detached too)",
                       description="Attach this terminal to rank RANK's pdb: a rank of a `ddpfab run --pdb` job "
                                   "that stopped at breakpoint() or an uncaught exception, and that no other "
                                   "terminal drives.")
    g.add_argument("run_id", type=run_id_type)
    g.add_argument("--rank", type=int, required=True, help="the global rank to attach to")
    _common(g, inventory_required=False)
    g.set_defaults(func=cmd_debug)
    s = sub.add_parser("shell", help="an interactive shell on a node as ddpfab starts things there, or as a rank",
                       description="A shell on NODE in its workdir, after its setup lines, with its python first on "
                                   "PATH; with --run-id and --rank, on that rank's node with the rank's whole "
                                   "environment (the run's env, MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, "
                                   "WORLD_SIZE, ...), so `python train.py` there is that rank.")
    s.add_argument("node", nargs="?", metavar="NODE", help="the inventory host (with --rank: its node by default)")
    s.add_argument("--run-id", type=run_id_type, help="a run of runs/: the rank's environment comes from its record")
    s.add_argument("--rank", type=int, help="with --run-id: the global rank whose environment the shell has")
    s.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="set K in the shell (repeatable; a bare KEY takes this shell's value): a value the "
                        "run's record masks, or any other")
    _common(s, inventory_required=False)
    s.set_defaults(func=cmd_shell)


def _plan_of(args, manifest: dict) -> Plan:
    return record_plan(manifest, args.runs_dir, args.command)


def _guard(fn):
    def wrapper(args) -> int:
        # slow to import: see LAZY in ddpfab/cli/__init__.py
        from ddpfab.launch import runner

        try:
            return fn(args)
        except (inventory.InventoryError, ConfigError) as exc:
            return refuse(args, str(exc), "inventory")  # (ps --json: as JSON too)
        except RunRecordError as exc:
            return refuse(args, exc, "record")
        except runner.RunError as exc:
            return refuse(args, exc.problems, "ssh")
        except SSHError as exc:  # (shell's and debug's one node)
            return refuse(args, exc, "ssh", EXIT_FAILED)
    return wrapper


@_guard
def cmd_ps(args) -> int:
    from ddpfab.launch.jobs import grouped, node_state_text
    from ddpfab.launch.tmuxrun import attach_line, session_name

    cluster = _library(args, _cluster(args, None), None)
    jobs = cluster.ps(runs_dir=args.runs_dir)
    for problem in jobs.problems:  # one node's failure is data: the others are listed
        warn(problem)
    for line in jobs.warnings:
        warn(line)
    code = 0 if jobs.ok else EXIT_FAILED
    if args.json:
        print(json.dumps({"ok": jobs.ok, "runs": jobs.runs, "problems": [p.to_dict() for p in jobs.problems],
                          "gpus": {n: [asdict(g) for g in states] for n, states in jobs.gpus.items()}},
                         indent=2, ensure_ascii=False))
        return code
    print(f"{'RUN ID':<26} {'STATE':<8} {'AGE':>8}  NODES")
    for r in jobs.runs:
        states = {n: node_state_text(s) for n, s in r["nodes"].items()}
        nodes = " ".join(line.replace(": ", ":", 1) for line in grouped(states))
        lineage = (f"  (restart {r['restart']} of {r['attempt_of']})" if r.get("attempt_of") else
                   f"  ({r['attempts']} attempts, run {r['recovery_state']})" if r.get("attempts", 0) > 1 else
                   f"  (in tmux: {attach_line(session_name(r['run_id']), r.get('tmux_socket'))})"
                   if r.get("tmux") and r["state"] == "running"
                   else "")
        print(f"{r['run_id']:<26} {r['state']:<8} {r['age_s']:>7.0f}s  {nodes}{lineage}")
    for name, gpus in jobs.gpus.items():  # the node's GPUs, every user's leases (ddpfab.node.leases)
        for g in gpus:
            print(f"{name}: {g.describe()}")
    return code


@_guard
def cmd_queue(args) -> int:
    """Running and waiting jobs across users, with their GPUs, owners and ages, from every node's
    lease dir; and the GPUs used without a lease."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.jobs import node_problem
    from ddpfab.planning import gpu_leases

    def ask(conn, n) -> dict:
        return nodeprog.call(conn, n, {"op": "leases"}, timeout=30)[0].value(n.name)

    cluster = _cluster(args, None)
    results = _on_each_node(args, cluster, ask)
    problems = [node_problem(name, exc) for name, exc in results.failed.items()]
    for p in problems:
        warn(p)
    answers = {n.name: results.succeeded[n.name] for n in cluster.nodes if n.name in results.succeeded}
    rows = gpu_leases.queue_rows(answers)
    busy = {name: [g for g in gpu_leases.parse(raw) or () if g.state == "busy"] for name, raw in answers.items()}
    code = EXIT_FAILED if problems else 0
    if args.json:
        print(json.dumps({"ok": not problems, "jobs": rows, "problems": [p.to_dict() for p in problems],
                          "busy": {n: [asdict(g) for g in gs] for n, gs in busy.items() if gs}}, indent=2,
                         ensure_ascii=False))
        return code
    print(f"{'RUN ID':<26} {'USER':<10} {'STATE':<8} {'AGE':>8}  NODES")
    for r in rows:
        nodes = " ".join(f"{n}:{','.join(v) if isinstance(v, list) else '(' + v + ')'}" for n, v in r["nodes"].items())
        age = f"{r['age_s']:>7.0f}s" if r["age_s"] is not None else f"{'?':>8}"
        print(f"{r['run_id']:<26} {r['user'] or '?':<10} {r['state']:<8} {age}  {nodes}")
    for name, gs in busy.items():
        for g in gs:
            print(f"{name}: {g.describe()}")
    return code


@_guard
def cmd_stop(args) -> int:
    from ddpfab.launch.jobs import grouped
    from ddpfab.launch.recover import stop_supervisor

    supervisor = stop_supervisor(args.runs_dir, args.run_id)  # a detached run with restarts: no more attempts
    if supervisor:
        print(f"controller: {supervisor}")
    manifest = _latest(args, read_record(args.runs_dir, args.run_id))  # then its latest attempt's nodes
    cluster = _library(args, _cluster(args, manifest), manifest)
    stopped = cluster.stop(args.run_id, runs_dir=args.runs_dir, record=manifest)
    if not stopped.found:
        return die(f"no run {args.run_id}: no local record in {args.runs_dir}, and no node of the inventory "
                   f"knows it (~/.ddpfab/runs/{args.run_id}); nothing was stopped; check the run id (`ddpfab ps` "
                   "lists the nodes' runs)")
    if stopped.tmux:
        print(f"controller: {stopped.tmux}")
    for line in grouped(stopped.said):
        print(line)
    return 0 if stopped.ok else EXIT_FAILED


@_guard
def cmd_attach(args) -> int:
    """Follow a job's output on every node until it ends, and end as run would have: the same
    closing line and exit code (ddpfab/cli/errors.py). A detached job's hang watch runs here
    (nobody else watches it): its plan's ``--hang-timeout`` and ``--on-hang``, as run's."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.health import hints
    from ddpfab.launch.execute import Printer, cancelled_waiting
    from ddpfab.launch.jobs import attach_end, attach_story, ended_outcomes, exit_races_of, follow_all

    manifest = read_record(args.runs_dir, args.run_id)
    if manifest is None:
        return die(f"no local record of run {args.run_id} in {args.runs_dir}; "
                   "attach from the machine (and --runs-dir) that started it")
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import next_attempt

    root, followed, races, hung, failed, outside = manifest, None, {}, None, None, {}
    while manifest is not None:  # a run with restarts: each attempt in turn, until the last has ended
        plan = _plan_of(args, manifest)
        cluster = _cluster(args, manifest)
        conns = _connect(args, cluster, warm=False)  # (it outlives `hold --stop`: the job goes on)
        printer = Printer(plan, verbose=args.verbose, color=False if args.no_color else None)
        hang = _hang_watch(args, manifest, plan, conns, printer)
        codes: dict[str, int] = {}
        readers: dict = {}
        try:
            codes = follow_all(plan, cluster, conns, printer, hang, readers)
            outcomes = ended_outcomes(plan, conns, codes, readers)
            races = exit_races_of(outcomes, plan.exit_guard)  # as run reports them: finished, then aborted at exit
            outside = {n: sig for n, o in outcomes.items() if (sig := o.stopped_from_outside) is not None}
            # as run tells it: the rank that failed on its own (of a job stopped from outside, only such a rank)
            failed = attach_story(plan, outcomes, own_only=bool(outside))
        except KeyboardInterrupt as exc:
            printer.note(f"detached from {args.run_id}; the job goes on (ddpfab stop {args.run_id} ends it)")
            return getattr(exc, "exit_code", 130)
        finally:
            for c in conns.values():
                c.close()
        if printer.closed:
            note(f"stdout was closed: detached from {args.run_id}; the job goes on (ddpfab stop {args.run_id} ends it)")
            return EXIT_CLOSED_STDOUT
        if hang is not None and hang.stop_now.is_set() and hang.verdict is not None:
            hung = hang.verdict.lines
            break
        followed = plan.run_id
        manifest = next_attempt(args.runs_dir, root, followed)
        if manifest is not None:
            printer.note(f"attempt {followed} ended; following {manifest['run_id']}")
    printer.folded_note()
    if failed and not hung and not races:
        for line in failed[1]:
            printer.note(line)
        for line in failed[2]:
            printer.note(f"hint: {line}")
    code, summary, warned = attach_end(codes, races, hung, failed[0] if failed else None, outside,
                                       cancelled_waiting(outcomes.values()))
    printer.note(f"run {args.run_id} ended: {summary}")
    if warned:
        printer.note(f"warning: {hints.exit_abort_hint()}")
    return code


def _hang_watch(args, manifest: dict, plan: Plan, conns: dict, printer):
    """The hang watch of a job started detached (``run --detach``: its record's state), which no
    controller watches; None for a job its own controller watches (a run attached elsewhere, an
    attempt of a run with restarts) or without ``--hang-timeout``."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.hangwatch import HangWatch

    if manifest.get("state") != "detached" or plan.hang_timeout <= 0:
        return None
    return HangWatch(plan, conns, Path(args.runs_dir) / plan.run_id, printer.note)


@_guard
def cmd_doctor(args) -> int:
    """Every rank's state and stack, grouped; the verdict on top; the record in runs/<id>/."""

    if not args.timeout > 0:
        return die(f"--timeout {args.timeout:g}: expected a number of seconds > 0")
    manifest = _latest(args, read_record(args.runs_dir, args.run_id))
    if manifest is None:
        return _doctor_without_record(args)
    cluster = _library(args, _cluster(args, manifest), manifest)
    found = cluster.doctor(args.run_id, runs_dir=args.runs_dir, timeout=args.timeout, record=manifest)
    if args.json:
        print(found.record.read_text() if found.record else json.dumps({"verdict": found.lines}))
    else:
        for line in found.lines:
            print(line)
        print(f"record: {found.record}")
    return 0 if found.ok else EXIT_FAILED


def _doctor_without_record(args) -> int:
    """``doctor RUN_ID`` with no local record of the run: the inventory's nodes (given, or the
    configured one) are asked for theirs. A job that has ended there is said so, how each node's
    ended (0: nothing to diagnose); one still there needs the record that started it (2); a run
    no node knows is no run (2); nodes that could not be asked leave it open (1)."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.health import doctor
    from ddpfab.hostlist import compact
    from ddpfab.launch.jobs import node_problem, ps_record

    none_here = f"no local record of run {args.run_id} in {args.runs_dir}"
    try:
        cluster = _cluster(args, None)
    except ConfigError:
        return die(f"{none_here}; run the doctor from the machine (and --runs-dir) that started it, or name the "
                   "nodes it ran on with -i INVENTORY")

    def ask(conn, n) -> list[dict]:
        res = nodeprog.call(conn, n, {"op": "ps", "root": "~/.ddpfab/runs", "run_id": args.run_id},
                            timeout=20)[0].value(n.name)
        return [ps_record(r) for r in res["runs"]]

    results = _on_each_node(args, cluster, ask)
    for name, exc in results.failed.items():
        warn(node_problem(name, exc))
    found = {name: recs[0] for name, recs in results.succeeded.items() if recs}
    if not found and results.failed:
        return die(f"{none_here}, and no node that answered has one; the others could not be asked (above)",
                   EXIT_FAILED)
    if not found:
        return die(f"no run {args.run_id}: {none_here}, and no node of the inventory has one "
                   f"(~/.ddpfab/runs/{args.run_id}); check the run id (`ddpfab ps` lists the nodes' runs)")
    live = [n for n, r in found.items() if r["state"] in ("running", "dead")]
    if live:
        return die(f"{none_here}; its job is still on {compact(live)}: run the doctor from the machine (and "
                   "--runs-dir) that started it, which has its plan")
    ends = {n: (r["state"], r["exit_code"], r.get("stopped")) for n, r in found.items()}
    line = doctor.ended_line(ends)
    if args.json:
        print(json.dumps({"kind": "ddpfab-doctor", "run_id": args.run_id, "verdict": [line], "hung": False,
                          "ended": True, "odd": [], "groups": [], "nodes": {n: dict(found[n]) for n in ends}},
                         indent=1, ensure_ascii=False))
    else:
        print(line)
        print(f"(from the nodes' records: {none_here})")
    return 0


@_guard
def cmd_logs(args) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import attempt_manifests
    from ddpfab.launch.runner import RunError

    root = read_record(args.runs_dir, args.run_id)
    bad = 0
    for manifest in attempt_manifests(args.runs_dir, root) if root else [None]:
        run_id = manifest["run_id"] if manifest else args.run_id
        if run_id != args.run_id:
            print(f"attempt {run_id}:")
        try:
            bad |= _logs_of(args, manifest, run_id)
        except RunError as exc:  # e.g. a node lost in that attempt: the other attempts' logs still come
            if root is None or len((root.get("recovery") or {}).get("attempts") or []) < 2:
                raise
            bad = 1
            die([f"attempt {run_id}: {line}" for line in exc.problems])
    return bad


def _logs_of(args, manifest: dict | None, run_id: str) -> int:
    """Fetch one attempt's output from each of its nodes into runs/<attempt id>/."""
    from ddpfab.launch.jobs import grouped, logs_report

    cluster = _library(args, _cluster(args, manifest), manifest)
    logs = cluster.logs(run_id, runs_dir=args.runs_dir, ranks=bool(getattr(args, "ranks", False)),
                        record=manifest)
    if manifest is None and not logs.files and logs.problems and all(p.check == "logs.no-run" for p in logs.problems):
        # as stop says it: a run id no record here and no node knows is no run (a typo), not N failures
        return die(f"no run {run_id}: no local record in {args.runs_dir}, and no node of the inventory has its run "
                   f"dir (~/.ddpfab/runs/{run_id}); check the run id (`ddpfab ps` lists the nodes' runs)")
    die([f"host {line}" for line in grouped({p.node or "?": p.found or p.text for p in logs.problems})])
    fetched = {n: (path, logs.lines[n], f"{logs.rank_files[n]} per-rank log files in {logs.directory / 'ranks' / n}"
                   if n in logs.rank_files else "") for n, path in logs.files.items()}
    for line in logs_report(run_id, logs.directory, fetched, len(cluster.names)):
        print(line)
    return 0 if logs.ok else 1


@_guard
def cmd_debug(args) -> int:
    """This terminal to one waiting rank's pdb, over a channel of a connection to its node."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.debugger import relay, stdin_usable

    manifest = _latest(args, read_record(args.runs_dir, args.run_id))
    if manifest is None:
        return die(f"no local record of run {args.run_id} in {args.runs_dir}; debug from the machine (and "
                   "--runs-dir) that started it")
    plan = _plan_of(args, manifest)
    if not plan.pdb:
        return die(f"run {plan.run_id} was started without --pdb: its ranks have no debugger to attach to")
    try:
        node, _ = plan.node_of_rank(args.rank)
    except ValueError as exc:
        return die(str(exc))
    if plan.pdb != "all" and str(args.rank) not in plan.pdb.split(","):
        return die(f"rank {args.rank} of run {plan.run_id} is not one of its --pdb ranks ({plan.pdb}): it has no "
                   "debugger to attach to")
    if not stdin_usable():
        return die("debug needs an input to drive pdb from (stdin is /dev/null or closed); run it from a terminal")
    cluster = _cluster(args, manifest)
    hosts = {n.name: n for n in cluster.nodes}
    if node.name not in hosts:
        return die(f"host {node.name} (rank {args.rank}'s node) is not in the inventory given")
    conn = _connect_one(args, cluster, hosts[node.name], manifest)
    attached: list[bool] = []

    def on_attach() -> None:
        attached.append(True)
        note(f"pdb: attached to rank {args.rank} on {node.name}; `c` continues, `q` quits (the rank then fails), "
             "Ctrl-C detaches (the rank waits on)")

    try:
        quit_sent = relay(conn.transport, node, args.rank, on_attach=on_attach)
    except ConnectionError as exc:
        return die(str(exc), EXIT_FAILED)
    except KeyboardInterrupt as exc:  # a detach, as attach's: the rank waits in pdb for the next terminal
        if attached:
            note(f"pdb: detached from rank {args.rank} on {node.name}; it waits in pdb where it was "
                 f"(`ddpfab debug {plan.run_id} --rank {args.rank}` attaches again)")
        else:
            note(f"pdb: interrupted before attaching to rank {args.rank} on {node.name}; nothing changed there")
        return getattr(exc, "exit_code", 130)
    finally:
        conn.close()
    if quit_sent:  # what a script piping its commands meets at their end
        note(f"pdb: the input ended, so ddpfab sent pdb's quit (`q`, as Ctrl-D at a terminal): rank {args.rank} on "
             f"{node.name} takes it at its next pdb prompt, if it is still in pdb then, and fails, and the job "
             f"with it (`ddpfab attach {plan.run_id}` shows how it ends); a last `c` lets it go on")
    else:
        note(f"pdb: rank {args.rank} on {node.name} left the debugger")
    return 0


def _rank_shell(plan: Plan, node_plan, rank: int, given: dict[str, str], host) -> tuple[dict, object, str, str]:
    """A rank's shell (``shell --run-id --rank``): its environment, where it runs (the run's node
    plan), its workdir and its prompt; what the record masked is said."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import shell

    env, masked = shell.rank_env(plan, rank, given)
    where = node_plan
    if any(setup_was_masked(line) for line in node_plan.setup):  # the record's secret lines read KEY=***:
        where = replace(node_plan, setup=host.setup)  # the inventory's own lines run, not those
    why = shell.masked_note(masked)
    if why:
        warn(why)
    return env, where, node_plan.workdir, f"[ddpfab {node_plan.name} rank {rank}] \\w $ "


@_guard
def cmd_shell(args) -> int:
    """An interactive shell on a node (ddpfab.launch.shell), as a rank of a recorded run with --rank."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import shell
    from ddpfab.planning.plan import PlanError, parse_env, remote_workdir

    if (args.rank is None) != (args.run_id is None):
        return die("--rank and --run-id go together: the rank's environment is that of a recorded run")
    try:
        given = dict(parse_env(args.env, dict(os.environ)))
    except PlanError as exc:
        return die(str(exc))
    plan = manifest = None
    if args.run_id is not None:
        manifest = _latest(args, read_record(args.runs_dir, args.run_id))
        if manifest is None:
            return die(f"no local record of run {args.run_id} in {args.runs_dir}")
        plan = _plan_of(args, manifest)
        try:
            node_plan, local = plan.node_of_rank(args.rank)
        except ValueError as exc:
            return die(str(exc))
        if args.node and args.node != node_plan.name:
            return die(f"rank {args.rank} of run {plan.run_id} ran on {node_plan.name}, not {args.node}")
        name = node_plan.name
    elif not args.node:
        return die("which node? give NODE (or --run-id and --rank)")
    elif not args.inventory:
        return refuse(args, MISSING_INVENTORY, "inventory")
    else:
        name = args.node
    cluster = _cluster(args, manifest)
    hosts = {n.name: n for n in cluster.nodes}
    if name not in hosts:
        return die(f"host {name} is not in the inventory")
    if plan is not None:
        env, where, workdir, prompt = _rank_shell(plan, node_plan, args.rank, given, hosts[name])
    else:
        env, where = given, hosts[name]
        try:  # the workdir as run and sync take it (``~``, ``~/x``: the SSH home's), or refused as they refuse it
            workdir = remote_workdir(hosts[name].workdir or os.getcwd(), None)
        except PlanError as exc:
            return die(str(exc))
        prompt = f"[ddpfab {name}] \\w $ "
    try:  # before connecting: an input refused costs no connection
        script = shell.piped_script()
    except ValueError as exc:
        return die(str(exc))
    # its own connection: the terminal needs one (a held channel cannot carry it), and the start file
    # written first must be on the connection the shell then runs on
    conn = _connect_one(args, cluster, hosts[name], manifest, warm=False)
    try:
        return shell.run_shell(conn, where, workdir, env, prompt, script)
    except ConnectionError as exc:
        return die(str(exc), EXIT_FAILED)
    finally:
        conn.close()
