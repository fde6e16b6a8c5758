"""``ddpfab run`` options for unattended runs (restarts, spares) and what they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ddpfab.hosts.inventory import Cluster
from ddpfab.planning.plan import PlanError

#: What ``--retry-on`` may name: a lost node, or a failure of the script itself.
RETRY_KINDS = ("node", "script")

if TYPE_CHECKING:
    from ddpfab.launch.recover import RecoveryOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ddpfab run` options for unattended runs."""
    p.add_argument("--max-job-restarts", type=int, default=0, metavar="N",
                   help="start the whole job again up to N times after a node is lost (on a spare, without "
                        "the lost node); see --spares, --retry-on, --min-nodes (default 0)")
    p.add_argument("--spares", metavar="GROUP",
                   help="inventory group of standby hosts that replace lost nodes (default: the inventory's "
                        "ddpfab_spares_group); its hosts are never among the first nodes")
    p.add_argument("--retry-on", action="append", choices=RETRY_KINDS, metavar="node|script",
                   help="which failures are retried: node (default) and/or script (the same error on healthy "
                        "nodes; give it only if the script can succeed on a second try)")
    p.add_argument("--min-nodes", type=int, metavar="N",
                   help="with no healthy spare left, go on with fewer nodes, down to N (the script must cope "
                        "with a smaller world); default: never shrink")


def recovery_options(args: argparse.Namespace, cluster: Cluster) -> RecoveryOptions:
    """From the command line and the inventory; an impossible combination is an error."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import RecoveryOptions

    if args.max_job_restarts < 0:
        raise PlanError(f"--max-job-restarts must be >= 0, got {args.max_job_restarts}")
    if args.min_nodes is not None and args.min_nodes < 1:
        raise PlanError(f"--min-nodes must be >= 1, got {args.min_nodes}")
    groups = {n.spares_group for n in cluster.nodes if n.spares_group}
    if len(groups) > 1 and not args.spares:
        raise PlanError(f"inventory {cluster.source}: hosts disagree on ddpfab_spares_group ({', '.join(sorted(groups))});"
                        " set it once (in all:vars) or pass --spares GROUP")
    spares = args.spares or (groups.pop() if groups else None)
    retry = frozenset(args.retry_on or ("node",))
    return RecoveryOptions(args.max_job_restarts, spares, retry, args.min_nodes)


def check_sizes(ropts: RecoveryOptions, nodes: int, spares: int) -> None:
    """What the job's size makes impossible, refused before anything starts (the dry run too):
    a --min-nodes above the number of nodes it starts with can never be met."""
    if ropts.min_nodes is not None and ropts.min_nodes > nodes:
        raise PlanError(f"--min-nodes {ropts.min_nodes}: the job starts on {nodes} node{'s' * (nodes != 1)} "
                        f"({spares} spare{'s' * (spares != 1)} aside), so it can never shrink to {ropts.min_nodes}; "
                        f"give --min-nodes 1..{nodes}, or leave it out (never shrink)")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.max_job_restarts or args.retry_on or args.min_nodes)
