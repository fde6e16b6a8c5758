"""``ddpfab hold``: keep one SSH connection per node open for repeated ``exec`` (:mod:`ddpfab.remote.holder`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from ddpfab.cli.common import add_cluster_args, api_cluster
from ddpfab.cli.errors import die, note, warn
from ddpfab.hosts import inventory

#: Seconds ``hold`` waits for the holder to have connected every node.
START_WAIT_S = 300.0


def register(sub) -> None:
    p = sub.add_parser("hold", help="keep one SSH connection per node open: later `exec` skips the handshakes",
                       description="Start a background process of yours that connects every node once and keeps "
                                   "the connections open; `ddpfab exec` with the same inventory runs over them "
                                   "(same output, same exit codes) until it ends: after --idle seconds without "
                                   "a command, or with --stop.")
    add_cluster_args(p)
    p.add_argument("--idle", type=float, default=None, metavar="SECONDS",
                   help="end after this long without a command (default 900)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--stop", action="store_true", help="end the holder of this inventory")
    which.add_argument("--status", action="store_true", help="show whether one holds this inventory (exit 1: none)")
    which.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the holder itself
    p.set_defaults(func=cmd_hold)


def cmd_hold(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import holder

    try:
        cluster = api_cluster(args)
    except (ValueError, inventory.InventoryError) as exc:
        return die(str(exc))
    name = holder.address(cluster.inventory or [], cluster.ssh_config, cluster.policy)
    if args.serve:
        return _serve(args, cluster, name)
    status = holder.request(name, {"op": "status"})
    if args.status:
        if not _valid_status(status):
            note("no holder for this inventory")
            return 1
        note(_describe(status))
        return 0
    if args.stop:
        if not _valid_status(status):
            note("no holder for this inventory: nothing to stop")
            return 0
        holder.request(name, {"op": "stop"})
        deadline = time.monotonic() + 10
        while holder.request(name, {"op": "status"}) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        note(f"stopped the holder (pid {status['pid']}); its connections are closed")
        return 0
    if _valid_status(status):
        if status["nodes"] == cluster.names:
            note(f"already held: {_describe(status)}")
            return 0
        note(f"the holder (pid {status['pid']}) holds other nodes ({len(status['nodes'])}); starting a new one")
        holder.request(name, {"op": "stop"})
        deadline = time.monotonic() + 10
        while holder.request(name, {"op": "status"}) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    return _start(args, cluster)


def _valid_status(status) -> bool:
    return (isinstance(status, dict) and isinstance(status.get("pid"), int) and isinstance(status.get("nodes"), list)
            and isinstance(status.get("connected"), list))


def _describe(status: dict) -> str:
    return (f"pid {status['pid']} holds {len(status['connected'])}/{len(status['nodes'])} connections "
            f"(idle limit {status.get('idle_s', 0):g} s)")


def _start(args: argparse.Namespace, cluster) -> int:
    """Start the holder as a process of its own session and wait for its one line (ready or why not)."""
    argv = [w for w in args.argv if w not in ("--serve",)]
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", *argv, "--serve"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_WAIT_S)
    proc.stdout.close()
    try:
        msg = json.loads(got[0]) if got and got[0] else None
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or not msg.get("ready"):
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        why = msg.get("error") if isinstance(msg, dict) and isinstance(msg.get("error"), str) else \
            f"the holder did not start within {START_WAIT_S:g} s (exit {proc.returncode})"
        return die(f"hold: {why}")
    failed = msg.get("failed") if isinstance(msg.get("failed"), dict) else {}
    for node, why in failed.items():
        warn(f"{node}: not connected now ({why}); a command there connects again")
    held = len(cluster.names) - len(failed)
    note(f"holding {held}/{len(cluster.names)} connections (pid {proc.pid}); `ddpfab exec` with this inventory "
         f"uses them; they end after {msg.get('idle_s', 0):g} s without a command or with `ddpfab hold --stop`")
    return 0


def _serve(args: argparse.Namespace, cluster, name: str) -> int:
    """The holder: connect, say ready on stdout (the one line ``_start`` reads), serve until done."""
    from ddpfab.remote import holder, ssh

    idle = args.idle if args.idle is not None else holder.IDLE_S
    keeper = holder.Holder(name, cluster.parsed.nodes,
                           lambda node: ssh.connect(node, cluster.policy, cluster.ssh_config), idle=idle)
    if not keeper.bind():
        print(json.dumps({"error": "the holder's socket name is taken: another holder started for this inventory "
                                   "at this moment, or another user's process has the name (never used)"}),
              flush=True)
        return 1
    failed = keeper.open_all()
    print(json.dumps({"ready": True, "pid": os.getpid(), "failed": failed, "idle_s": idle}), flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nobody reads on: the starter has gone
        os.dup2(devnull, fd)
    keeper.serve()
    return 0
