"""``ddpfab hold``: keep one SSH connection per node open for repeated ``exec`` (:meth:`ddpfab.api.
Cluster.hold`, :mod:`ddpfab.remote.holder`)."""

from __future__ import annotations

import argparse
import math

from ddpfab.cli.common import add_cluster_args, api_cluster
from ddpfab.cli.errors import die, note, warn
from ddpfab.hosts import inventory
from ddpfab.planning.plan import PlanError
from ddpfab.remote.holder import HolderError


def register(sub) -> None:
    p = sub.add_parser("hold", help="keep one SSH connection per node open: later commands skip the handshakes",
                       description="Start a background process of yours that connects every node once and keeps "
                                   "the connections open; the commands that reach those nodes with the same "
                                   "inventory (run, check, sync, exec, fetch, ps, stop, logs, doctor, debug, "
                                   "queue) run over them (same output, same exit codes) until it "
                                   "ends: after --idle seconds without a command, or with --stop.")
    add_cluster_args(p)
    p.add_argument("--idle", type=float, default=None, metavar="SECONDS",
                   help="end after this long without a command (default 900)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--stop", action="store_true", help="end the holder of this inventory")
    which.add_argument("--status", action="store_true", help="show whether one holds this inventory (exit 1: none)")
    p.set_defaults(func=cmd_hold)


def cmd_hold(args: argparse.Namespace) -> int:
    if args.idle is not None and not (math.isfinite(args.idle) and args.idle > 0):
        return die(f"--idle {args.idle:g}: give a number of seconds above 0")
    try:
        cluster = api_cluster(args)
    except (ValueError, inventory.InventoryError) as exc:
        return die(str(exc))
    try:
        if args.status:
            held = cluster.held()
            note(_describe(held) if held else "no holder for this inventory")
            return 0 if held else 1
        if args.stop:
            held = cluster.release()
            note(f"stopped the holder (pid {held.pid}); its connections are closed" if held
                 else "no holder for this inventory: nothing to stop")
            return 0
        held = cluster.hold(idle=args.idle)
    except (PlanError, HolderError) as exc:
        return die(f"hold: {exc}")
    if held.already:
        note(f"already held: {_describe(held)}")
        return 0
    for problem in held.problems:
        warn(f"{problem.node}: not connected now ({problem.found}); a command there connects again")
    note(f"holding {len(held.connected)}/{len(held.nodes)} connections (pid {held.pid}); commands with this "
         f"inventory (run, check, exec, ...) use them; they end after {held.idle_s:g} s without a command or "
         "with `ddpfab hold --stop`")
    return 0


def _describe(held) -> str:
    return f"pid {held.pid} holds {len(held.connected)}/{len(held.nodes)} connections (idle limit {held.idle_s:g} s)"
