"""``ddpfab hold``: keep one SSH connection per node open for repeated ``exec`` (:mod:`ddpfab.remote.holder`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time

from ddpfab.cli.common import add_cluster_args, api_cluster
from ddpfab.cli.errors import die, note, warn
from ddpfab.hosts import inventory
from ddpfab.remote import holder
from ddpfab.remote.reaper import pid_alive

#: Seconds ``hold`` waits for the holder to have connected every node.
START_WAIT_S = 300.0
#: Seconds ``hold --stop`` waits for the holder's process to end.
STOP_WAIT_S = 15.0


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
    if args.idle is not None and not (math.isfinite(args.idle) and args.idle > 0):
        return die(f"--idle {args.idle:g}: give a number of seconds above 0")
    try:
        cluster = api_cluster(args)
    except (ValueError, inventory.InventoryError) as exc:
        return die(str(exc))
    name = holder.address(cluster.inventory or [], cluster.ssh_config, cluster.policy)
    if args.serve:
        return _serve(args, cluster, name)
    status = _status(name)
    if args.status:
        if status is None:
            note("no holder for this inventory")
            return 1
        note(_describe(status))
        return 0
    if args.stop:
        if status is None:
            note("no holder for this inventory: nothing to stop")
            return 0
        return 0 if _stop(name, status) else die(f"hold: the holder (pid {status['pid']}) did not end; "
                                                 f"end it with `kill {status['pid']}`")
    idle = args.idle if args.idle is not None else holder.IDLE_S
    wanted = {n.name: holder.fingerprint(n) for n in cluster.parsed.nodes}
    if status is not None:
        if status["prints"] == wanted and status["idle_s"] == idle:
            note(f"already held: {_describe(status)}")
            return 0
        note(f"the holder (pid {status['pid']}) holds these nodes otherwise (other variables, hosts or --idle); "
             "starting a new one")
        if not _stop(name, status):
            return die(f"hold: the holder (pid {status['pid']}) did not end; end it with `kill {status['pid']}`")
    return _start(args, cluster, name)


def _status(name: str) -> dict | None:
    """The holder's status reply, validated; None when there is none (or it answers nonsense)."""
    got = holder.request(name, {"op": "status"})
    ok = (isinstance(got, dict) and isinstance(got.get("pid"), int) and isinstance(got.get("nodes"), list)
          and isinstance(got.get("connected"), list) and isinstance(got.get("prints"), dict)
          and isinstance(got.get("idle_s"), (int, float)))
    return got if ok else None


def _stop(name: str, status: dict) -> bool:
    """Ask the holder to end and wait until its process has (its connections closed)."""
    holder.request(name, {"op": "stop"})
    pid, deadline = status["pid"], time.monotonic() + STOP_WAIT_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        return False
    note(f"stopped the holder (pid {pid}); its connections are closed")
    return True


def _describe(status: dict) -> str:
    return (f"pid {status['pid']} holds {len(status['connected'])}/{len(status['nodes'])} connections "
            f"(idle limit {status['idle_s']:g} s)")


#: The holder's interpreter: this python, without the current directory on sys.path (a checkout's
#: ddpfab/ there must not become the long-lived holder), running the command line.
_CHILD = "import sys; sys.path.pop(0); from ddpfab.cli import main; sys.exit(main(sys.argv[1:]))"


def _start(args: argparse.Namespace, cluster, name: str) -> int:
    """Start the holder as a process of its own session; wait for its one line (ready or why not)."""
    argv = [w for w in args.argv if w != "--serve"]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, *argv, "--serve"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=errors, start_new_session=True)
        line = b""
        ready, _, _ = select.select([proc.stdout], [], [], START_WAIT_S)
        if ready:
            line = proc.stdout.readline()  # the child writes its one line whole, or exits (EOF)
        try:
            msg = json.loads(line) if line else None
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not msg.get("ready"):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            errors.seek(0)
            tail = " ".join(errors.read()[-300:].decode(errors="replace").split())
            if isinstance(msg, dict) and isinstance(msg.get("error"), str):
                taken = _status(name)
                if taken is not None:  # another `hold` of this inventory started it at the same moment
                    note(f"already held: {_describe(taken)}")
                    return 0
                return die(f"hold: {msg['error']}")
            why = (f"the holder did not connect within {START_WAIT_S:g} s" if not ready
                   else f"the holder exited ({proc.returncode}){': ' + tail if tail else ''}")
            return die(f"hold: {why}")
    proc.stdout.close()
    failed = msg.get("failed") if isinstance(msg.get("failed"), dict) else {}
    for node, why in failed.items():
        warn(f"{node}: not connected now ({why}); a command there connects again")
    held = len(cluster.names) - len(failed)
    note(f"holding {held}/{len(cluster.names)} connections (pid {proc.pid}); `ddpfab exec` with this inventory "
         f"uses them; they end after {msg.get('idle_s', 0):g} s without a command or with `ddpfab hold --stop`")
    return 0


def _serve(args: argparse.Namespace, cluster, name: str) -> int:
    """The holder: take the name, connect every node while serving, say ready on stdout (the one
    line ``_start`` reads), serve until done; then leave at once (no thread keeps it alive)."""
    # slow to import (the SSH stack): see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote import holdserver, ssh

    idle = args.idle if args.idle is not None else holder.IDLE_S
    keeper = holdserver.Holder(name, cluster.parsed.nodes,
                               lambda node: ssh.connect(node, cluster.policy, cluster.ssh_config), idle=idle)
    if not keeper.bind():
        print(json.dumps({"error": "the holder's socket name is taken: another holder started for this inventory "
                                   "at this moment, or another user's process has the name (never used)"}),
              flush=True)
        return 1

    def ready(failed: dict[str, str]) -> None:
        print(json.dumps({"ready": True, "pid": os.getpid(), "failed": failed, "idle_s": idle}), flush=True)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # nobody reads on: the starter has gone
            os.dup2(devnull, fd)
        os.close(devnull)

    keeper.serve(ready)
    os._exit(0)  # commands still answering (a stop) end with their connections; nothing to join
