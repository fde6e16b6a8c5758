"""``ddpfab fetch``: copy a file or dir from a node to here."""

from __future__ import annotations

import argparse
import sys

from ddpfab.cli.common import add_cluster_args, load_cluster
from ddpfab.cli.errors import EXIT_SIGINT, die
from ddpfab.hosts import inventory
from ddpfab.transfer.fetch import FetchError, check_local_dir, pick_node


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fetch", help="copy a file or dir (a checkpoint, logs) from a node's workdir or run dir to here",
        description="Copy REMOTE_PATH (relative to the node's workdir, or absolute inside the workdir or "
                    "~/.ddpfab/runs) from one node to LOCAL_DIR over the same SSH settings as sync.")
    add_cluster_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--node", help="the inventory host to fetch from")
    which.add_argument("--rank", type=int, help="the node rank to fetch from (default: 0, the master)")
    p.add_argument("--overwrite", action="store_true", help="replace what is already at the destination")
    p.add_argument("remote_path", metavar="REMOTE_PATH",
                   help="what to copy: a path relative to the node's workdir, or absolute inside the workdir or "
                        "~/.ddpfab/runs")
    p.add_argument("local_dir", metavar="LOCAL_DIR", nargs="?", default=".",
                   help="where to put it here (default: the current dir)")
    p.set_defaults(func=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import ssh
    from ddpfab.transfer.fetch import fetch

    try:
        cluster = load_cluster(args)  # --limit and -e as every command: --rank counts the nodes they leave
        node = pick_node(cluster, args.node, args.rank)
        check_local_dir(args.local_dir)
    except (inventory.InventoryError, FetchError) as exc:
        return die(exc)  # nothing was contacted
    try:
        policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
        got = fetch(node, args.remote_path, args.local_dir, policy, ssh_config=args.ssh_config,
                    overwrite=args.overwrite)
    except FetchError as exc:
        return die(exc, exc.code)
    except KeyboardInterrupt:
        sys.stderr.write("ddpfab: fetch interrupted\n")
        return EXIT_SIGINT
    size = f"{got['bytes'] / 1e6:.1f} MB" if got["bytes"] >= 1e5 else f"{got['bytes']} bytes"
    what = f"{got['files']} files, {size}" if got["kind"] == "dir" else size
    print(f"fetched {got['node']}:{got['path']} -> {got['local']} ({what})")
    return 0
