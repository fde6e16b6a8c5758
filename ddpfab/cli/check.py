"""``ddpfab check``: prove the cluster can train (and ``--perf``, the slow-node check)."""

from __future__ import annotations

import json

from ddpfab.cli.common import add_cluster_args, add_floors_arg, api_cluster, nproc_type
from ddpfab.cli.errors import refuse
from ddpfab.cli.perf import add_check_arguments, cmd_check_perf
from ddpfab.health import mesh as meshmod
from ddpfab.health.resourcecheck import parse_floors
from ddpfab.hosts import inventory
from ddpfab.planning.plan import PlanError, master_port, nproc_per_node


def register(sub) -> None:
    p = sub.add_parser("check", help="prove the cluster can train: ssh, versions, GPUs, names, firewall, clocks")
    add_cluster_args(p)
    p.add_argument("--master-port", "--master_port", type=int, help="check this port instead of picking a free one")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=nproc_type, metavar="N|gpu|cpu|auto")
    p.add_argument("--max-skew", type=float, help="clock skew bound in seconds")
    p.add_argument("--fast", action="store_true", help="skip importing torch on the nodes (no CUDA/NCCL facts)")
    p.add_argument("--exhaustive", action="store_true",
                   help=f"probe every pair of nodes (default: all pairs up to {meshmod.EXHAUSTIVE_MAX_NODES} nodes, "
                        f"then {meshmod.DEFAULT_DEGREE} sampled peers per node)")
    add_floors_arg(p)
    p.add_argument("--json", action="store_true")
    add_check_arguments(p)  # --perf, --history: the slow-node benchmark (ddpfab/launch/perfcheck.py)
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    if args.perf or args.history:
        return cmd_check_perf(args)
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.health.check import render

    try:
        cluster = api_cluster(args)
        master_port(args.master_port, offline=True)  # the one rule for a given port, before any host is contacted
    except (inventory.InventoryError, PlanError) as exc:
        return refuse(args, str(exc), "inventory" if isinstance(exc, inventory.InventoryError) else "master_port")
    try:
        nproc_per_node(args.nproc_per_node)  # run's rule, as for the port
    except PlanError as exc:
        return refuse(args, str(exc), "nproc_per_node")
    try:
        parse_floors(args.resource_floors)
    except PlanError as exc:
        return refuse(args, str(exc), "resource_floors")
    report = cluster.check(master_port=args.master_port, nproc_per_node=args.nproc_per_node, max_skew=args.max_skew,
                           fast=args.fast, exhaustive=args.exhaustive, resource_floors=args.resource_floors)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 1 if report.failures else 0
