"""``ddpfab run`` and ``ddpfab plan``: make the plan, then start it (or print it, or emit it)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import replace

from ddpfab.cli import recover as recovery
from ddpfab.cli.common import add_cluster_args, add_env_args, load_cluster, nproc_type
from ddpfab.cli.errors import die, print_problems, refuse
from ddpfab.cli.perf import add_run_arguments as add_perf_arguments
from ddpfab.cli.perf import before_run
from ddpfab.hosts import inventory
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.launch import replicate
from ddpfab.launch.progress import Ticker
from ddpfab.planning import plan as planmod
from ddpfab.planning import scriptfile
from ddpfab.planning.plan import EXIT_GUARD_MODES, LOCAL_RANK_ARGS, Facts, PlanError, master_port
from ddpfab.problems import Problem


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Everything that shapes the plan: shared by `run` and `plan`."""
    add_cluster_args(p)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=nproc_type, metavar="N|gpu|cpu|auto",
                   help="processes per node (default: inventory, GPUs, or 1); as torchrun: gpu = the node's GPUs, "
                        "cpu = its CPUs, auto = its GPUs if any, else its CPUs (decided per node from the probe)")
    p.add_argument("--master-port", "--master_port", type=int,
                   help="MASTER_PORT (default: a port found free on the master)")
    add_env_args(p)
    p.add_argument("--secret-env", action="append", default=[], metavar="KEY",
                   help="mask KEY's value wherever the run is shown or recorded (repeatable; also the inventory's "
                        "ddpfab_secret_env list), besides the keys the built-in rule masks (see README, Secrets)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the preflight checks (firewall/data plane, hostnames, versions)")
    p.add_argument("--socket-ifname", metavar="IFACE|auto",
                   help="set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; auto = the interface each node "
                        "reaches its peers through")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="torchrun's in-node restarts (default 0)")
    p.add_argument("--exit-guard", choices=EXIT_GUARD_MODES, default="on",
                   help="the ranks' exit guard (README: 'A rank that aborts at exit'): on (default) = each rank "
                        "records that it finished and leaves without the interpreter teardown where gloo can abort "
                        "it; record = only record (a finished rank that aborts is reported as such, not as a "
                        "failure); off = nothing in the ranks' interpreter")
    p.add_argument("--run-id", help="the run id (default: time + random suffix)")
    p.add_argument("--rdzv", choices=("static", "c10d"), default="static",
                   help="static: node_rank fixed in inventory order (default); c10d: torchrun's c10d rendezvous "
                        "on the master (torchrun assigns node ranks)")
    p.add_argument("--launcher", choices=("torchrun", "legacy"), default="torchrun",
                   help="torchrun (default), or legacy: torch.distributed.launch, which passes --local-rank=N "
                        "to scripts written for it (--local_rank=N to a script that declares only that spelling)")
    p.add_argument("--local-rank-style", choices=("auto", "dash", "underscore"), default="auto",
                   help="how the script gets its local rank as an argument: --local-rank (dash) or --local_rank "
                        "(underscore); auto (default) reads the script here: the legacy launcher passes the "
                        "spelling it declares (else the dash), torchrun passes it only to a script that declares "
                        "one (torchrun itself sets only LOCAL_RANK)")
    p.add_argument("--init-method", choices=("env", "tcp", "file"), default="env",
                   help="for scripts that call init_process_group via ddpfab.dist: env:// (default), "
                        "tcp://MASTER:PORT, or file:// in the inventory's ddpfab_shared_dir (DDPFAB_INIT_METHOD)")
    p.add_argument("--debug", action="store_true",
                   help="NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET TORCH_DISTRIBUTED_DEBUG=DETAIL "
                        "TORCH_CPP_LOG_LEVEL=INFO (--env wins; TORCH_DISTRIBUTED_DEBUG=INFO on nodes without "
                        "ddpfab_gpus: DETAIL crashes DDP on gloo); per-rank logs: ddpfab logs --ranks RUN_ID")
    p.add_argument("--offline", action="store_true",
                   help="plan without contacting the hosts; port = --master-port or 29500 (run: with --dry-run)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (run: only with --dry-run)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (copies, rendezvous waits); they are off anyway when stderr is not a terminal")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module, run as `python -m SCRIPT` (torchrun's -m; `-- -m pkg.train` too)")
    p.add_argument("script", help="training script, relative to the nodes' workdir (with -m: a module)")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="arguments for the script, passed unchanged except the per-node placeholders "
                        "{{node_rank}} {{nnodes}} {{nproc}} {{world_size}} {{master_addr}} {{master_port}} "
                        "{{run_id}} {{node_name}} (quote them for the shell)")


def register(sub) -> None:
    run = sub.add_parser("run", help="launch torchrun on every node of the inventory",
                         description="Launch SCRIPT with torchrun on every node; ARGS pass through unchanged.")
    _add_run_args(run)
    run.add_argument("--no-sync", action="store_true",
                     help="do not sync the current directory to the nodes' workdirs first")
    run.add_argument("--fanout", choices=("star", "tree"), default="star",
                     help="sync: star = controller to every node; tree = nodes forward to each other")
    run.add_argument("--compress", action="store_true", help="sync: rsync --compress (slow uplinks)")
    run.add_argument("--replicate", action="append", default=[], metavar="PATH",
                     help="copy PATH (a file, relative to the workdir: a checkpoint saved by rank 0 only) from rank "
                          "0's node to every other node before the launch, verified by hash on each; repeatable; "
                          "adds to the inventory's ddpfab_replicate. Nothing to copy (a first run): said, and on")
    run.add_argument("--detach", action="store_true",
                     help="start the job and return; it runs on without ddpfab (see attach, logs, ps, stop)")
    run.add_argument("--runs-dir", default=os.environ.get("DDPFAB_RUNS_DIR", "runs"),
                     help="where run records go (default: ./runs, or $DDPFAB_RUNS_DIR)")
    run.add_argument("--dry-run", action="store_true",
                     help="print the plan and each node's exact command; start nothing")
    run.add_argument("--no-color", action="store_true", help="no colours in the output")
    recovery.add_arguments(run)
    add_perf_arguments(run)  # --perf-check
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser("plan", help="print (or --emit as shell scripts) exactly what `run` would start",
                          description="Make the plan `ddpfab run` would make (contacting the hosts for a free "
                                      "port, unless --offline) and print it; --emit DIR writes one shell script "
                                      "per node that reproduces the run by hand over plain SSH.")
    _add_run_args(plan)
    plan.add_argument("--emit", metavar="DIR",
                      help="write DIR/node<rank>_<host>.sh per node (the exact env and launcher command) and "
                           "DIR/README.txt (which to run where, with the ssh command line); private files, "
                           "and a non-empty DIR that ddpfab did not write is refused")
    plan.add_argument("--force", action="store_true",
                      help="--emit into a non-empty directory anyway (only ddpfab's own files are written)")
    plan.set_defaults(func=cmd_plan)


def cmd_run(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import recover, runner
    from ddpfab.launch.execute import Printer
    from ddpfab.remote import ssh
    from ddpfab.remote.target import TargetError

    try:
        cluster = load_cluster(args)
        ropts = recovery.recovery_options(args, cluster)
        cluster, spares = recover.split_spares(cluster, ropts.spares_group)  # spares never start in the set
        recovery.check_sizes(ropts, len(cluster.nodes), len(spares))
        options = _run_options(args)
        args.replicate_paths = replicate.wanted(cluster, args.replicate)
        if not args.dry_run and os.path.lexists(os.path.join(args.runs_dir, options.run_id)):
            raise planmod.PlanError(f"--run-id {options.run_id}: {os.path.join(args.runs_dir, options.run_id)} "
                                    "exists already: a run id names one run; pick another (or leave --run-id out)")
        if not args.no_sync:  # the dry run too: the real run refuses it before starting
            _check_script_here(options.script, options.module)
        if args.dry_run and args.offline:
            targets = _targets(cluster, args)
            plan = planmod.make_plan(cluster, options, _offline_facts(cluster, args.master_port, targets))
            for path in args.replicate_paths:
                sys.stderr.write(f"ddpfab: replicate (offline, not looked at on the hosts): {path} from "
                                 f"{plan.nodes[0].name} (rank 0's node) to the other nodes, where it differs\n")
            return _print_dry_run(plan, args.json, offline=True, targets=targets)
        if recovery.wanted(args) and args.detach and not recover.is_supervisor():
            return recover.start_detached(args.argv[1:], options.run_id, args.runs_dir)
        policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
        perf = _perf_check(cluster, policy, args, _env(args))

        def prepare(cl, opts):
            return _prepare(cl, opts, policy, args)

        if recovery.wanted(args) and not args.dry_run:
            return recover.Recovery(cluster, spares, options, ropts, policy, args.ssh_config, args.runs_dir,
                                    prepare, runner.run, color=False if args.no_color else None).run()
        prepared, extra = prepare(cluster, options)
        if spares:  # the nodes are the group without its spares: replay, stop and logs must know
            extra.update(spares_group=ropts.spares_group, attempt_nodes=[n.name for n in cluster.nodes])
        if perf:
            extra["perf"] = perf
    except (inventory.InventoryError, planmod.PlanError, TargetError) as exc:
        return refuse(args, str(exc), "run")
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "run")
        return die(exc.problems + ["nothing was started"])
    if args.dry_run:
        prepared.close()
        return _print_dry_run(prepared.plan, args.json, offline=False, targets=_targets(cluster, args))
    printer = Printer(prepared.plan, color=False if args.no_color else None)
    try:
        if args.detach:
            return runner.start_detached(prepared, args.runs_dir, printer, extra=extra)
        result, _ = runner.run(prepared, args.runs_dir, printer, extra=extra)
    finally:
        prepared.close()
        _say_where_rank0_is(prepared.plan, args)
    # the summary was printed once already, with the manifest's path
    return result.exit_code


def _prepare(cluster, options, policy, args: argparse.Namespace):
    """One attempt's start: connect, sync the code (unless --no-sync or --dry-run), probe,
    preflight, plan. Returns (Prepared, manifest extra); raises RunError with nothing started."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner

    conns = runner.connect_all(cluster, policy, args.ssh_config)
    probing = None
    try:  # one node program per node for the whole preparation: facts, hash, mesh in one session
        probing = runner.start_probe(cluster, conns, options, os.getcwd(), preflight=not args.no_check)
        code = None if args.dry_run or args.no_sync else _sync_code(cluster, policy, args, conns,
                                                                    progress=_progress(args), sessions=probing.sessions)
    except BaseException:
        if probing:
            probing.close(wait=0)
        for c in conns.values():
            c.close()
        raise
    copied = bool(code) and any(n.get("source") != "unchanged" for n in code.get("nodes", {}).values())
    paths = getattr(args, "replicate_paths", ())
    prepared = runner.prepare(cluster, options, policy, args.ssh_config, preflight=not args.no_check, conns=conns,
                              probing=probing, synced=copied, replicate_paths=paths,
                              will_sync=args.dry_run and not args.no_sync)
    extra = {"code": code} if code else {}
    try:
        replicated = _replicate(prepared, paths, args)
    except BaseException:
        prepared.close()
        raise
    if replicated:
        extra["replicate"] = replicated
    return prepared, extra


def _replicate(prepared, paths: tuple[str, ...], args: argparse.Namespace) -> dict | None:
    """``--replicate``: copy each path from rank 0's node to the others (the dry run says what it
    would copy), after the preflight's warning about resume files that differ between nodes.
    The manifest's ``replicate`` entry, or None when there was nothing to say; RunError when a
    copy is refused or fails (nothing has started)."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner

    if prepared.replicas is None:
        return None
    order = [n.name for n in sorted(prepared.plan.nodes, key=lambda n: n.node_rank)]
    warned = replicate.warnings(order, paths, prepared.replicas)
    for w in warned:
        sys.stderr.write(f"ddpfab: warning: {w}\n")
    # without paths the look was for the warning alone: a node that could not answer it stops nothing
    decision = replicate.decide(order, paths, prepared.replicas) if paths else replicate.Decision()
    if decision.problems:
        raise runner.RunError([*decision.problems, "replicate: nothing was copied"])
    for path in decision.missing:
        sys.stderr.write(f"ddpfab: replicate: {path} is not in the workdir of {order[0]} (rank 0's node): nothing to "
                         "replicate (a first run?)\n")
    workdirs = {n.name: n.workdir for n in prepared.plan.nodes}
    nodes = {n.name: n for n in prepared.cluster.nodes}
    for copy in decision.copies:
        if copy.to and not args.dry_run:
            problems = replicate.relay(copy, prepared.conns, nodes, workdirs)
            if problems:
                raise runner.RunError([*problems, f"replicate {copy.path}: nothing was started (the nodes that did not "
                                                  "get it keep their old file)"])
        sys.stderr.write(f"ddpfab: replicate: {replicate.describe(copy, dry_run=args.dry_run)}\n")
    if not (paths or warned):
        return None
    return replicate.record(decision, warned)


def _say_where_rank0_is(plan, args: argparse.Namespace) -> None:
    """Where results are: rank 0's workdir, and the command that brings a file back. The command
    names the node, not ``--rank 0``: fetch's ranks count the hosts its own --limit leaves, and a
    run's rank 0 is often not the inventory's first host (``-l``, spares)."""
    node = plan.nodes[0]
    inv = "".join(f" -i {shlex.quote(s)}" for s in args.inventory or ())
    sys.stderr.write(f"ddpfab: rank 0's workdir: {node.name}:{node.workdir} (copy results here with: ddpfab fetch"
                     f"{inv} --node {shlex.quote(node.name)} PATH)\n")


def _perf_check(cluster, policy, args: argparse.Namespace, env) -> dict | None:
    """``run --perf-check``: the slow-node check first (its own job and record); the manifest's
    ``perf`` entry, or RunError on a straggler (see :func:`ddpfab.health.perfrun.before_run`)."""
    if not (args.perf_check or args.perf_check_warn) or args.dry_run:
        return None

    return before_run(cluster, policy, args, env)


def _progress(args: argparse.Namespace) -> bool:
    """Progress lines (copies, rendezvous waits): only on a terminal, never with -q."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def _check_script_here(script: str, module: bool = False) -> None:
    """A relative script (or a module of this directory) is synced from here: name a typo before
    anything starts (did you mean), in the real run and the dry run alike."""
    try:
        scriptfile.check_here(script, module, os.getcwd())
    except scriptfile.ScriptError as exc:
        folder = os.path.dirname(script) or "."
        try:
            names = [os.path.join(os.path.dirname(script), n) for n in os.listdir(folder) if n.endswith(".py")]
        except OSError:
            names = []
        hint = "" if module else did_you_mean(script, names)
        raise PlanError(f"{exc}{hint} (it is synced from here; with --no-sync it must be in the nodes' "
                        "workdir)") from None


def _sync_code(cluster, policy, args: argparse.Namespace, conns: dict, progress: bool = True,
               sessions: dict | None = None) -> dict:
    """Sync the current directory to every node and verify it by hash (before the probe, which
    checks that the script is there); the result goes into the manifest as ``code``. When every
    node has the tree already (checked in the run's node program *sessions*) nothing is started
    for it."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner
    from ddpfab.transfer import sync as syncmod

    same = syncmod.unchanged(cluster, conns, os.getcwd(), sessions=sessions)
    if same is not None:
        return same.to_dict()
    done: list[str] = []

    def say(line: str) -> None:
        done.append(line)
        if progress:
            sys.stderr.write(f"ddpfab: sync: {line}\n")

    def copying(elapsed: float) -> str:
        return f"sync: copying to {len(cluster.nodes)} nodes, {elapsed:.0f} s ({len(done)} reported)"

    try:
        with Ticker(copying, enabled=progress):
            result = syncmod.sync_cluster(cluster, os.getcwd(), policy, fanout=args.fanout, compress=args.compress,
                                          ssh_config=args.ssh_config, progress=say)
    except syncmod.SyncError as exc:
        # per node as problems (a restart leaves out the node they name) when sync got that far
        problems = exc.result.problems() if exc.result else exc.problems
        raise runner.RunError([replace(p, text=f"sync: {p}") if isinstance(p, Problem) else f"sync: {p}"
                               for p in problems]
                              + ["(to take such a directory over: `ddpfab sync --adopt`)"] * bool(exc.not_ours)
                              + ["(skip syncing with --no-sync)"]) from None
    return result.to_dict()


def _run_options(args: argparse.Namespace) -> planmod.RunOptions:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.runs import new_run_id

    planmod.master_port(args.master_port, offline=True)  # the port's one rule (raises PlanError)
    script, script_args, module = _script_and_mode(args)
    local_rank_arg, to_script = _local_rank_arg(args, script, module)
    return planmod.RunOptions(
        script=script, args=script_args, nproc_per_node=args.nproc_per_node,
        master_port=args.master_port, env=_env(args), max_restarts=args.max_restarts,
        run_id=planmod.check_run_id(args.run_id or new_run_id()), socket_ifname=args.socket_ifname, rdzv=args.rdzv,
        launcher=args.launcher, init_method=args.init_method, debug=args.debug,
        local_rank_arg=local_rank_arg, module=module, secret_env=tuple(args.secret_env),
        script_local_rank=to_script, exit_guard=args.exit_guard)


def _script_and_mode(args: argparse.Namespace) -> tuple[str, tuple[str, ...], bool]:
    """(script or module, its arguments, module mode): ``-m MODULE`` as ddpfab's option or as the
    first words after ``--`` (torchrun's habit), the same thing."""
    script, rest = args.script, tuple(args.args)
    if not args.module and script in ("-m", "--module"):
        if not rest:
            raise planmod.PlanError(f"{script} needs a module name after it (e.g. -- -m pkg.train)")
        return rest[0], rest[1:], True
    return script, rest, bool(args.module)


def _local_rank_arg(args: argparse.Namespace, script: str, module: bool) -> tuple[str, bool]:
    """The local-rank argument's spelling, and whether torchrun passes it to the script.

    Legacy launcher: the spelling asked for, or the one the script here declares (only
    ``--local_rank``: that; everything else the dashed form); it always passes one. torchrun sets
    only LOCAL_RANK, so a script that declares the argument (and may never read LOCAL_RANK: the
    argument's default on every rank) is given it too, in its spelling; a style asked for is
    passed as asked."""
    style = getattr(args, "local_rank_style", "auto")
    if style != "auto":
        return LOCAL_RANK_ARGS[style == "underscore"], True
    declared = scriptfile.declared_local_rank(scriptfile.local_file(script, module, os.getcwd()))
    return declared or LOCAL_RANK_ARGS[0], declared is not None


def cmd_plan(args: argparse.Namespace) -> int:
    """`ddpfab plan`: the plan `run` would make, printed, or emitted as one shell script per node."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner
    from ddpfab.planning import emit
    from ddpfab.remote import ssh
    from ddpfab.remote.target import TargetError

    try:
        cluster = load_cluster(args)
        targets = _targets(cluster, args)
        options = _run_options(args)
        if args.offline:
            plan = planmod.make_plan(cluster, options, _offline_facts(cluster, args.master_port, targets))
        else:
            policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
            prepared = runner.prepare(cluster, options, policy, args.ssh_config, preflight=not args.no_check)
            prepared.close()
            plan = prepared.plan
    except (inventory.InventoryError, planmod.PlanError, TargetError) as exc:
        return refuse(args, str(exc), "plan")
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "plan")
        return die(exc.problems + ["nothing was planned"])
    if not args.emit:
        return _print_dry_run(plan, args.json, offline=args.offline, targets=targets)
    try:
        written = emit.write(plan, args.emit, targets, force=args.force)
    except (emit.EmitError, OSError) as exc:
        return die(str(exc))
    for path in written:
        sys.stderr.write(f"ddpfab: wrote {path}\n")
    print((written[-1]).read_text(), end="")
    return 0


def _env(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """Forwarded allowlist, then env files, then --env: later wins."""
    merged: dict[str, str] = {}
    if not args.no_forward_env:
        merged.update(planmod.forwarded_env(dict(os.environ)))
    for path in args.env_file:
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as exc:
            raise planmod.PlanError(f"env file {path}: {exc.strerror}") from None
        merged.update(planmod.parse_env(planmod.read_env_file(text, path)))
    merged.update(planmod.parse_env(args.env, dict(os.environ)))
    return tuple(merged.items())


def _offline_facts(cluster, port, targets: dict):
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.planning.probe import offline_addresses

    addresses, unresolved = offline_addresses(cluster, targets)
    return Facts(addresses=addresses, master_port=master_port(port, offline=True), cwd=os.getcwd(),
                 unresolved=unresolved)


def _targets(cluster, args: argparse.Namespace) -> dict:
    """How each node is reached (:mod:`ddpfab.remote.target`), for the ssh lines a plan prints."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote.target import HostKeyPolicy, resolve_all

    return resolve_all(cluster.nodes, HostKeyPolicy(args.known_hosts, args.accept_new_host_keys), args.ssh_config)


def _print_dry_run(plan, as_json: bool, offline: bool, targets: dict | None = None) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.hosts import nodeenv
    from ddpfab.launch.runs import mask_plan
    from ddpfab.planning import render
    from ddpfab.planning.emit import ssh_target
    from ddpfab.remote.target import ssh_line

    if as_json:
        print(json.dumps(mask_plan(plan.to_dict()), indent=2, ensure_ascii=False))
        return 0
    masked = mask_plan(plan.to_dict())
    shown = render.masked(plan)  # what is printed is rendered from the masked plan
    print(f"# ddpfab plan {plan.run_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
          f"master {plan.master} {plan.master_addr}:{plan.master_port}")
    if offline:
        print("# offline: the master port was not checked on the host")
    if plan.unresolved:
        print(f"# {plan.unresolved_note()}")
    print("# Paste each command into an SSH session on its node (any order; they wait for each other).")
    if plan.exit_guard != "off":  # the supervisor installs it: a pasted command runs without it
        print(f"# exit guard: {plan.exit_guard} (ddpfab's node supervisor puts it on the ranks' PYTHONPATH; "
              "a command pasted by hand runs without it)")
    by_name = {n.name: n for n in plan.nodes}
    for node in masked["nodes"]:
        print(f"\n# python on {node['name']}: {nodeenv.describe(by_name[node['name']])}")
        print(f"# {node['name']} (node_rank {node['node_rank']}, {node['nproc']} procs): "
              f"{ssh_line(ssh_target(by_name[node['name']], targets))}")
        print(render.shell_line(shown, shown.node(node["name"])))
    return 0
