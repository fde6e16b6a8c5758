"""``ddpfab fetch``: copy a file or dir from a node to here."""

from __future__ import annotations

import argparse
import sys

from ddpfab.cli.common import add_cluster_args, api_cluster
from ddpfab.cli.errors import EXIT_SIGINT, die
from ddpfab.hosts import inventory
from ddpfab.transfer.fetch import FetchError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fetch", help="copy a file or dir (a checkpoint, logs) from a node's workdir or run dir to here",
        description="Copy REMOTE_PATH (relative to the node's workdir, or absolute inside the workdir or "
                    "~/.ddpfab/runs) from one node to LOCAL_DIR over the same SSH settings as sync.")
    add_cluster_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--node", help="the inventory host to fetch from")
    which.add_argument("--node-rank", "--rank", dest="rank", type=int, metavar="N",
                       help="the node to fetch from by its node rank, its place in the inventory's order after "
                            "--limit (default: 0, the master); not a process's global rank, as `debug --rank` "
                            "and `shell --rank` take (--rank: the same as --node-rank)")
    p.add_argument("--overwrite", action="store_true", help="replace what is already at the destination")
    p.add_argument("remote_path", metavar="REMOTE_PATH",
                   help="what to copy: a path relative to the node's workdir, or absolute inside the workdir or "
                        "~/.ddpfab/runs")
    p.add_argument("local_dir", metavar="LOCAL_DIR", nargs="?", default=".",
                   help="where to put it here (default: the current dir)")
    p.set_defaults(func=cmd_fetch, renamed={"rank": "node_rank"})  # (its messages say --node-rank)


def cmd_fetch(args: argparse.Namespace) -> int:
    try:  # --limit and -e as every command: --node-rank counts the nodes they leave
        got = api_cluster(args).fetch(args.remote_path, args.local_dir, node=args.node, rank=args.rank,
                                      overwrite=args.overwrite)
    except inventory.InventoryError as exc:
        return die(exc)  # nothing was contacted
    except FetchError as exc:
        return die(exc, exc.code)
    except KeyboardInterrupt:
        sys.stderr.write("ddpfab: fetch interrupted\n")
        return EXIT_SIGINT
    size = f"{got.size / 1e6:.1f} MB" if got.size >= 1e5 else f"{got.size} bytes"
    what = f"{got.files} files, {size}" if got.kind == "dir" else size
    print(f"fetched {got.node}:{got.path} -> {got.local} ({what})")
    return 0
