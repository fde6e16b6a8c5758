"""Command line: parse, call, print. No decisions live here."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .cliargs import add_cluster_args, add_env_args

EXIT_USAGE = 2  # bad input or a failed preflight: nothing was started


def _die(lines: list[str] | str, code: int = EXIT_USAGE) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        sys.stderr.write(f"ddpfab: error: {line}\n")
    return code


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Everything that shapes the plan: shared by `run` and `plan`."""
    add_cluster_args(p)
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: inventory, GPUs, or 1)")
    p.add_argument("--master-port", type=int, help="MASTER_PORT (default: a port found free on the master)")
    add_env_args(p)
    p.add_argument("--no-check", action="store_true",
                   help="skip the preflight checks (firewall/data plane, hostnames, versions)")
    p.add_argument("--socket-ifname", metavar="IFACE|auto",
                   help="set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; auto = the interface each node "
                        "reaches its peers through")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun's in-node restarts (default 0)")
    p.add_argument("--run-id", help="the run id (default: time + random suffix)")
    p.add_argument("--rdzv", choices=("static", "c10d"), default="static",
                   help="static: node_rank fixed in inventory order (default); c10d: torchrun's c10d rendezvous "
                        "on the master (torchrun assigns node ranks)")
    p.add_argument("--launcher", choices=("torchrun", "legacy"), default="torchrun",
                   help="torchrun (default), or legacy: torch.distributed.launch, which passes --local-rank=N "
                        "to scripts written for it")
    p.add_argument("--init-method", choices=("env", "tcp", "file"), default="env",
                   help="for scripts that call init_process_group via ddpfab.dist: env:// (default), "
                        "tcp://MASTER:PORT, or file:// in the inventory's ddpfab_shared_dir (DDPFAB_INIT_METHOD)")
    p.add_argument("--debug", action="store_true",
                   help="NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET TORCH_DISTRIBUTED_DEBUG=DETAIL "
                        "TORCH_CPP_LOG_LEVEL=INFO (--env wins; TORCH_DISTRIBUTED_DEBUG=INFO on nodes without "
                        "ddpfab_gpus: DETAIL crashes DDP on gloo); per-rank logs: ddpfab logs --ranks RUN_ID")
    p.add_argument("--offline", action="store_true",
                   help="plan without contacting the hosts; port = --master-port or 29500 (run: with --dry-run)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (run: with --dry-run)")
    p.add_argument("script", help="training script, relative to the nodes' workdir")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpfab", description=(
        "Start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH."))
    parser.add_argument("--version", action="version", version=f"ddpfab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch torchrun on every node of the inventory",
                         description="Launch SCRIPT with torchrun on every node; ARGS pass through unchanged.")
    _add_run_args(run)
    run.add_argument("--no-sync", action="store_true",
                     help="do not sync the current directory to the nodes' workdirs first")
    run.add_argument("--fanout", choices=("star", "tree"), default="star",
                     help="sync: star = controller to every node; tree = nodes forward to each other")
    run.add_argument("--compress", action="store_true", help="sync: rsync --compress (slow uplinks)")
    run.add_argument("--detach", action="store_true",
                     help="start the job and return; it runs on without ddpfab (see attach, logs, ps, stop)")
    run.add_argument("--runs-dir", default=os.environ.get("DDPFAB_RUNS_DIR", "runs"),
                     help="where run records go (default: ./runs, or $DDPFAB_RUNS_DIR)")
    run.add_argument("--dry-run", action="store_true",
                     help="print the plan and each node's exact command; start nothing")
    run.add_argument("--no-color", action="store_true", help="no colours in the output")
    from .recover import add_arguments as add_recovery_arguments

    add_recovery_arguments(run)
    from .perfcli import add_run_arguments

    add_run_arguments(run)  # --perf-check

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

    lab = sub.add_parser("lab", help="a local multi-host lab in network namespaces (root)")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True)
    up = lab_sub.add_parser("up", help="bring up N hosts node1..nodeN with sshd")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--dir", required=True, help="where the lab keeps its state, keys and inventory")
    up.add_argument("--subnet", default="10.213.0.0/24")
    up.add_argument("--python", help="the nodes' python (default: this python)")
    up.add_argument("--share", action="append", default=[], metavar="DIR",
                    help="a dir under /tmp that hosts must see (each host has its own /tmp); the lab dir, "
                         "the python's venv and the current dir are always shared (repeatable)")
    for name, text in (("down", "remove everything the lab made"), ("status", "show the lab's hosts")):
        p = lab_sub.add_parser(name, help=text)
        p.add_argument("--dir", required=True)

    prov = sub.add_parser("provision", help="run playbooks/provision.yml against the inventory")
    from .provision import add_arguments as add_provision_arguments

    add_provision_arguments(prov)
    run.set_defaults(func=cmd_run)
    plan.set_defaults(func=cmd_plan)
    lab.set_defaults(func=cmd_lab)
    prov.set_defaults(func=cmd_provision)
    for module in PLUGIN_MODULES:
        # each module adds its own subcommand(s): `register(subparsers)` sets `func` on them
        __import__(f"ddpfab.{module}", fromlist=["register"]).register(sub)
    return parser


#: Modules that register subcommands of their own (small, so the parser stays cheap to build).
PLUGIN_MODULES: list[str] = ["jobs", "export", "check", "sync", "fetch", "execute", "replay"]


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command; SIGINT/SIGTERM at any stage end it with one line (130/143)."""
    from .interrupt import run_interruptible

    return run_interruptible(lambda: unguarded_main(argv))


def unguarded_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


def cmd_run(args: argparse.Namespace) -> int:
    from . import inventory, recover, runner, ssh
    from . import plan as planmod
    from .launch import Printer
    from .runs import mask_plan, new_run_id

    try:
        cluster = inventory.load(args.inventory, args.group)
        ropts = recover.recovery_options(args, cluster)
        cluster, spares = recover.split_spares(cluster, ropts.spares_group)  # spares never start in the set
        options = _run_options(args, planmod, new_run_id)
        if not args.dry_run and os.path.lexists(os.path.join(args.runs_dir, options.run_id)):
            raise planmod.PlanError(f"--run-id {options.run_id}: {os.path.join(args.runs_dir, options.run_id)} "
                                    "exists already: a run id names one run; pick another (or leave --run-id out)")
        if args.dry_run and args.offline:
            plan = planmod.make_plan(cluster, options, _offline_facts(cluster, args.master_port))
            return _print_dry_run(plan, args.json, mask_plan, offline=True)
        if recover.wanted(args) and args.detach and not recover.is_supervisor():
            return recover.start_detached(args.argv[1:], options.run_id, args.runs_dir)
        policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
        perf = _perf_check(cluster, policy, args, _env(args, planmod))

        def prepare(cl, opts):
            return _prepare(cl, opts, policy, args)

        if recover.wanted(args) and not args.dry_run:
            return recover.Recovery(cluster, spares, options, ropts, policy, args.ssh_config, args.runs_dir,
                                    prepare, runner.run, color=False if args.no_color else None).run()
        prepared, extra = prepare(cluster, options)
        if spares:  # the nodes are the group without its spares: replay, stop and logs must know
            extra.update(spares_group=ropts.spares_group, attempt_nodes=[n.name for n in cluster.nodes])
        if perf:
            extra["perf"] = perf
    except (inventory.InventoryError, planmod.PlanError) as exc:
        return _die(str(exc))
    except runner.RunError as exc:
        return _die(exc.problems + ["nothing was started"])
    if args.dry_run:
        prepared.close()
        return _print_dry_run(prepared.plan, args.json, mask_plan, offline=False)
    printer = Printer(prepared.plan, color=False if args.no_color else None)
    try:
        if args.detach:
            return runner.start_detached(prepared, args.runs_dir, printer, extra=extra)
        result, _ = runner.run(prepared, args.runs_dir, printer, extra=extra)
    finally:
        prepared.close()
        _say_where_rank0_is(prepared.plan, args)
    if result.exit_code != 0:
        sys.stderr.write(f"ddpfab: {result.summary}\n")
    return result.exit_code


def _prepare(cluster, options, policy, args: argparse.Namespace):
    """One attempt's start: connect, sync the code (unless --no-sync or --dry-run), probe,
    preflight, plan. Returns (Prepared, manifest extra); raises RunError with nothing started."""
    from . import runner

    conns = runner.connect_all(cluster, policy, args.ssh_config)
    try:
        code = None if args.dry_run or args.no_sync else _sync_code(cluster, policy, args, conns)
    except BaseException:
        for c in conns.values():
            c.close()
        raise
    prepared = runner.prepare(cluster, options, policy, args.ssh_config, preflight=not args.no_check, conns=conns)
    return prepared, ({"code": code} if code else {})


def _say_where_rank0_is(plan, args: argparse.Namespace) -> None:
    """Where results are: rank 0's workdir, and the command that brings a file back."""
    node = plan.nodes[0]
    inv = f" -i {args.inventory}" if args.inventory else ""
    sys.stderr.write(f"ddpfab: rank 0's workdir: {node.name}:{node.workdir} (copy results here with: ddpfab fetch"
                     f"{inv} --rank 0 PATH)\n")


def _perf_check(cluster, policy, args: argparse.Namespace, env) -> dict | None:
    """``run --perf-check``: the slow-node check first (its own job and record); the manifest's
    ``perf`` entry, or RunError on a straggler (see :func:`ddpfab.perfrun.before_run`)."""
    if not (args.perf_check or args.perf_check_warn) or args.dry_run:
        return None
    from .perfcli import before_run

    return before_run(cluster, policy, args, env)


def _sync_code(cluster, policy, args: argparse.Namespace, conns: dict) -> dict:
    """Sync the current directory to every node and verify it by hash (before the probe, which
    checks that the script is there); the result goes into the manifest as ``code``. When every
    node has the tree already (checked over the run's own connections) nothing is started for it."""
    from . import runner
    from . import sync as syncmod

    same = syncmod.unchanged(cluster, conns, os.getcwd())
    if same is not None:
        return same.to_dict()
    try:
        result = syncmod.sync_cluster(cluster, os.getcwd(), policy, fanout=args.fanout, compress=args.compress,
                                      ssh_config=args.ssh_config,
                                      progress=lambda line: sys.stderr.write(f"ddpfab: sync: {line}\n"))
    except syncmod.SyncError as exc:
        adopt = any("--adopt" in p for p in exc.problems)
        raise runner.RunError([f"sync: {p}" for p in exc.problems]
                              + ["(to take such a directory over: `ddpfab sync --adopt`)"] * adopt
                              + ["(skip syncing with --no-sync)"]) from None
    return result.to_dict()


def _run_options(args: argparse.Namespace, planmod, new_run_id):
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise planmod.PlanError(f"--master-port {args.master_port} is not a TCP port (1-65535)")
    return planmod.RunOptions(
        script=args.script, args=tuple(args.args), nproc_per_node=args.nproc_per_node,
        master_port=args.master_port, env=_env(args, planmod), max_restarts=args.max_restarts,
        run_id=planmod.check_run_id(args.run_id or new_run_id()), socket_ifname=args.socket_ifname, rdzv=args.rdzv,
        launcher=args.launcher, init_method=args.init_method, debug=args.debug)


def cmd_plan(args: argparse.Namespace) -> int:
    """`ddpfab plan`: the plan `run` would make, printed, or emitted as one shell script per node."""
    from . import emit, inventory, runner, ssh
    from . import plan as planmod
    from .runs import mask_plan, new_run_id

    try:
        cluster = inventory.load(args.inventory, args.group)
        options = _run_options(args, planmod, new_run_id)
        if args.offline:
            plan = planmod.make_plan(cluster, options, _offline_facts(cluster, args.master_port))
        else:
            policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
            prepared = runner.prepare(cluster, options, policy, args.ssh_config, preflight=not args.no_check)
            prepared.close()
            plan = prepared.plan
    except (inventory.InventoryError, planmod.PlanError) as exc:
        return _die(str(exc))
    except runner.RunError as exc:
        return _die(exc.problems + ["nothing was planned"])
    if not args.emit:
        return _print_dry_run(plan, args.json, mask_plan, offline=args.offline)
    try:
        written = emit.write(plan, args.emit, cluster, force=args.force)
    except (emit.EmitError, OSError) as exc:
        return _die(str(exc))
    for path in written:
        sys.stderr.write(f"ddpfab: wrote {path}\n")
    print((written[-1]).read_text(), end="")
    return 0


def _env(args: argparse.Namespace, planmod) -> tuple[tuple[str, str], ...]:
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


def _offline_facts(cluster, port):
    from .plan import Facts

    addresses = {}
    for n in cluster.nodes:
        try:
            from .probe import resolve

            addresses[n.name] = resolve(n)
        except Exception:  # noqa: BLE001 - offline: keep what the inventory says
            addresses[n.name] = n.data_addr
    return Facts(addresses=addresses, master_port=port or 29500, cwd=os.getcwd())


def _print_dry_run(plan, as_json: bool, mask_plan, offline: bool) -> int:
    import json
    import shlex

    if as_json:
        print(json.dumps(mask_plan(plan.to_dict()), indent=2, ensure_ascii=False))
        return 0
    masked = mask_plan(plan.to_dict())
    print(f"# ddpfab plan {plan.run_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
          f"master {plan.master} {plan.master_addr}:{plan.master_port}")
    if offline:
        print("# offline: the master port was not checked on the host")
    print("# Paste each command into an SSH session on its node (any order; they wait for each other).")
    for node in masked["nodes"]:
        target = (f"{node['ssh_user']}@" if node["ssh_user"] else "") + node["ssh_host"]
        port = f" -p {node['ssh_port']}" if node["ssh_port"] else ""
        print(f"\n# {node['name']} (node_rank {node['node_rank']}, {node['nproc']} procs): "
              f"ssh{port} {shlex.quote(target)}")
        print(node["command"])
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from . import lab

    try:
        if args.lab_command == "up":
            the_lab, already = lab.up(args.dir, hosts=args.hosts, subnet=args.subnet, python=args.python,
                                         share=args.share)
            state = "already up" if already else "up"
            first, last = the_lab.hosts[0], the_lab.hosts[-1]
            # every host of a small lab; a large one as a range (one short line at 128 hosts)
            names = (", ".join(f"{h.name}={h.address}" for h in the_lab.hosts) if len(the_lab.hosts) <= 8 else
                     f"{len(the_lab.hosts)} hosts {first.name}..{last.name} = {first.address}..{last.address}")
            print(f"lab {state}: {names}")
            print(f"inventory: {the_lab.inventory}")
            print(f"ssh:       ssh -F {the_lab.ssh_config} {the_lab.hosts[0].name}")
            return 0
        if args.lab_command == "down":
            lab.check_prerequisites()
            print("lab down" if lab.down(args.dir) else f"no lab in {os.path.abspath(args.dir)}")
            return 0
        print(lab.status(args.dir))
        return 0
    except lab.LabError as exc:
        return _die(str(exc), 1)


def cmd_provision(args: argparse.Namespace) -> int:
    from . import provision

    try:
        return provision.run_playbook(args.inventory, playbook=args.playbook, tags=args.tags or None,
                                      check=args.check, limit=args.limit,
                                      extra_args=[a for ev in args.extra_vars for a in ("-e", ev)])
    except provision.ProvisionError as exc:
        return _die(str(exc), 1)
