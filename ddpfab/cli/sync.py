"""``ddpfab sync`` (also ``python -m ddpfab sync``): copy the project to every node and verify it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ddpfab.cli.common import add_cluster_args, add_include_keys_arg, add_runs_dir_arg, api_cluster
from ddpfab.cli.config import MISSING_INVENTORY
from ddpfab.cli.errors import die, refuse
from ddpfab.hosts import inventory

if TYPE_CHECKING:
    from ddpfab.transfer.sync import SyncResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p, inventory_required=False, inventory_help="Ansible inventory of the nodes (not needed "
                                                                 "with --list)")
    p.add_argument("--fanout", choices=("star", "tree"), default="star",
                   help="star: this machine sends to every node; tree: it sends to one node and nodes forward "
                        "(for a slow uplink; needs the inventory key in a file, see docs/sync.md)")
    p.add_argument("--compress", action="store_true", help="compress on the wire (rsync -z; off by default)")
    p.add_argument("--checksum", action="store_true",
                   help="compare files by content, not size+mtime (repairs files changed in place on a node)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                   help="a path (gitignore syntax, e.g. 'checkpoints/') that sync never sends, overwrites, deletes "
                        "or hashes, even where ddpfab placed it earlier; adds to .ddpfabkeep")
    p.add_argument("--with-git", action="store_true", help="send .git too")
    add_include_keys_arg(p)
    add_runs_dir_arg(p, "the run records, never sent when inside PATH (give run's --runs-dir)")
    p.add_argument("--adopt", action="store_true",
                   help="take over a workdir that exists, is not empty and was not made by ddpfab (nothing there "
                        "is deleted; a file the project overwrites is moved to .ddpfab/kept/ first)")
    p.add_argument("--dry-run", action="store_true",
                   help="change nothing; list per node what would be copied, updated and deleted")
    p.add_argument("--verify-only", action="store_true", help="copy nothing; compare every node's tree hash")
    p.add_argument("--no-wait", action="store_true",
                   help="when another sync is changing a node's workdir, refuse at once (exit 2, nothing changed) "
                        "instead of waiting for it (at most 10 minutes)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--list", action="store_true", help="print the files that would be sent, and stop")
    p.add_argument("path", nargs="?", default=".", help="the project directory to send (default: .)")


def register(subparsers) -> None:
    """Add the ``sync`` subcommand to ddpfab's command line."""
    p = subparsers.add_parser(
        "sync", help="copy the project to every node (rsync over SSH) and verify it by hash",
        description="Place this project's files (git ls-files, .ddpfabignore) in every node's workdir, delete "
                    "there only files ddpfab placed and you deleted or renamed here, and check a content hash "
                    "computed on each node. Nothing else on the nodes is touched.")
    add_arguments(p)
    p.set_defaults(func=cmd_sync, negated={"no_wait": "wait"})  # (run's --wait is another option)


def print_dry_run(result: SyncResult, out) -> None:
    """``sync --dry-run``: per node, one heading with the counts, then one line per change."""
    for rec in result.nodes.values():
        if rec.source == "shared":
            out.write(f"{rec.name}: {rec.workdir}: shared with this machine: nothing would be copied or deleted\n")
            continue
        counts = {a: sum(1 for x, _ in rec.items if x == a) for a in ("copy", "update", "delete")}
        state = {"missing": " (would be created)", "empty": " (empty: would be adopted)",
                 "adopted": " (would be adopted)"}.get(rec.state, "")
        out.write(f"{rec.name}: {rec.workdir}{state}: {counts['copy']} to copy, {counts['update']} to update, "
                  f"{counts['delete']} to delete\n")
        for action, path in rec.items:
            out.write(f"  {action:<6}  {path}\n")


def _write_json(result, out) -> None:
    """The result as JSON, with ``problems``: each node that did not sync, as a problem record."""
    data = {**result.to_dict(), "problems": [p.to_dict() for p in result.problems]}
    out.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def cmd_sync(args: argparse.Namespace) -> int:
    try:
        return _cmd_sync(args)
    except KeyboardInterrupt:  # at any stage; sync_cluster has ended its helpers by now
        sys.stderr.write("ddpfab: sync interrupted: nothing is left running; files already copied stay, the next "
                         "sync completes them\n")
        return 130


def _cmd_sync(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.transfer.keys import left_out_line
    from ddpfab.transfer.sync import BUSY, SyncError, megabytes, runs_keep, select

    out = sys.stdout
    if args.list:
        try:
            sel = select(args.path, (*args.keep, *runs_keep(args.path, args.runs_dir)), args.with_git,
                         args.include_keys)
        except SyncError as exc:
            die(exc.problems[0])
            return 2
        if sel.left_out:
            sys.stderr.write(f"ddpfab: {left_out_line(sel.left_out)}\n")
        for rel in sel.files:
            out.write(rel + "\n")
        return 0
    if not args.inventory:
        return refuse(args, MISSING_INVENTORY + " (or --list)", "inventory")
    try:
        cluster = api_cluster(args)
    except inventory.InventoryError as exc:
        return refuse(args, exc, "inventory")
    say = (lambda line: None) if args.json or args.dry_run else (lambda line: sys.stderr.write(line + "\n"))
    try:
        result = cluster.sync(args.path, fanout=args.fanout, compress=args.compress, checksum=args.checksum,
                              keep=args.keep, with_git=args.with_git, verify_only=args.verify_only, adopt=args.adopt,
                              dry_run=args.dry_run, wait=not args.no_wait, runs_dir=args.runs_dir, progress=say,
                              include_keys=args.include_keys)
    except SyncError as exc:
        if args.json and exc.result is not None:
            _write_json(exc.result, out)
        for line in exc.problems:
            die(line)
        return 2 if exc.code == BUSY else 1  # refused before anything changed
    if args.json:
        _write_json(result, out)
        return 0
    if args.dry_run:
        print_dry_run(result, out)
        return 0
    git = ""
    if result.git_commit:
        git = f", git {result.git_commit[:10]}{' (dirty)' if result.git_dirty else ''}"
    verb = ("verified" if args.verify_only else "verified (nothing changed)" if result.fanout == "none"
            else f"synced ({result.fanout})")
    out.write(f"{verb} {len(result.nodes)} nodes in {result.duration_s:.1f} s: {result.files} files, "
              f"{megabytes(result.bytes)}, tree {result.tree_hash[:12]}{git}\n")
    return 0
