"""``ddpfab exec``: run a command on every node at once."""

from __future__ import annotations

import argparse
import time

from ddpfab.cli.common import add_cluster_args, load_cluster
from ddpfab.cli.errors import EXIT_CLOSED_STDOUT, die, note
from ddpfab.hosts import inventory


def register(sub) -> None:
    p = sub.add_parser("exec", help="run a command on every node at once (output prefixed per host)",
                       description="Run CMD on every node in parallel. Several words are quoted for the remote "
                                   "shell; a single word is run by it as is (pipes, $VARS, && work).")
    add_cluster_args(p)
    p.add_argument("--nodes", help="only these nodes (comma-separated inventory names)")
    p.add_argument("--timeout", type=float, help="give up on a node whose command is silent this long (s)")
    p.add_argument("--no-color", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=cmd_exec)


def cmd_exec(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import ssh
    from ddpfab.remote.command import LinePrinter, exec_all, remote_command, summary

    words = list(args.cmd)
    if words and words[0] == "--":
        words = words[1:]
    try:
        command = remote_command(words)
        cluster = load_cluster(args)
    except (ValueError, inventory.InventoryError) as exc:
        return die(str(exc))
    nodes = list(cluster.nodes)
    if args.nodes:
        wanted = [w.strip() for w in args.nodes.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in {n.name for n in nodes}]
        if unknown:
            return die(f"--nodes: {', '.join(unknown)} not in group {cluster.group} of "
                       f"{cluster.source} (nodes: {', '.join(n.name for n in nodes)})")
        nodes = [n for n in nodes if n.name in wanted]
    policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
    printer = LinePrinter([n.name for n in nodes], color=False if args.no_color else None)
    start = time.monotonic()
    results = exec_all(nodes, command, policy, args.ssh_config, printer, args.timeout)
    if printer.closed:  # a reader that went away is not a node's failure
        note("stdout was closed: the command was ended on every node")
        return EXIT_CLOSED_STDOUT
    code, text = summary(results, time.monotonic() - start)
    for r in results.values():
        if r.error:
            note(f"{r.name}: {r.error}")
    note(text)
    return code
