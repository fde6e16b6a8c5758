"""``ddpfab run`` options for unattended runs (restarts, spares) and what they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ddpfab.hosts.inventory import Inventory

#: What ``--retry-on`` may name (ddpfab.launch.recover.RETRY_KINDS, which is slow to import).
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


def recovery_options(args: argparse.Namespace, cluster: Inventory) -> RecoveryOptions:
    """From the command line and the inventory: the library's rule
    (:func:`ddpfab.launch.recover.recovery_options`), which reads the same names."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import recover

    return recover.recovery_options(args, cluster)
