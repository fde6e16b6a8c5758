"""``ddpfab exec``: run a command on every node at once."""

from __future__ import annotations

import argparse
import time

from ddpfab.cli.common import add_cluster_args, api_cluster, positive_seconds
from ddpfab.cli.errors import EXIT_CLOSED_STDOUT, die, note
from ddpfab.hosts import inventory
from ddpfab.remote.output import FoldPrinter, LinePrinter, summary


def register(sub) -> None:
    p = sub.add_parser("exec", help="run a command on every node at once (output prefixed per host)",
                       description="Run CMD on every node in parallel. Several words are quoted for the remote "
                                   "shell; a single word is run by it as is (pipes, $VARS, && work).")
    add_cluster_args(p)
    p.add_argument("--nodes", help="only these nodes (comma-separated inventory names)")
    p.add_argument("--timeout", type=positive_seconds, help="give up on a node whose command is silent this long (s)")
    p.add_argument("--no-color", action="store_true")
    p.add_argument("--fold", action="store_true",
                   help="print each node's output once the command ended everywhere, nodes whose output and "
                        "exit code were the same once under their folded names (node[1-31,33] (32)), the odd "
                        "ones apart (as dshbak -c, clush -b)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=cmd_exec)


def cmd_exec(args: argparse.Namespace) -> int:
    words = list(args.cmd)
    if words and words[0] == "--":
        words = words[1:]
    try:
        cluster = api_cluster(args)
        # `--nodes ''` (an empty variable) names no node: an error, not every node
        wanted = None if args.nodes is None else [w.strip() for w in args.nodes.split(",") if w.strip()]
        names = [n for n in cluster.names if wanted is None or n in wanted]
        printer: LinePrinter | FoldPrinter = (FoldPrinter(names) if args.fold else
                                              LinePrinter(names, color=False if args.no_color else None))
        start = time.monotonic()
        try:
            results = cluster.exec(words, nodes=wanted, timeout=args.timeout, printer=printer)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: what the nodes said so far is not lost under --fold
            if isinstance(printer, FoldPrinter):
                printer.report_interrupted()
            raise
    except (ValueError, inventory.InventoryError) as exc:
        return die(str(exc))
    if isinstance(printer, FoldPrinter):
        printer.report(results)
    if printer.closed:  # a reader that went away is not a node's failure
        note("stdout was closed: the command was ended on every node")
        return EXIT_CLOSED_STDOUT
    code, text = summary(results, time.monotonic() - start)
    for r in results.values():
        if r.error:
            note(f"{r.name}: {r.error}")
    note(text)
    return code
