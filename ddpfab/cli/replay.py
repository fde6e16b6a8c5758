"""``ddpfab replay``: run a recorded run again."""

from __future__ import annotations

import argparse
import sys

from ddpfab.cli.common import add_runs_dir_arg, run_id_type
from ddpfab.cli.config import given
from ddpfab.cli.errors import die, print_problems, refuse
from ddpfab.cli.run import print_plan
from ddpfab.hosts import inventory
from ddpfab.planning.plan import PlanError


def register(sub) -> None:
    p = sub.add_parser("replay", help="run a recorded run again: same nodes, ranks, args, env",
                       description="Re-run runs/RUN_ID from its manifest under a new run id. Refuses if the "
                                   "inventory or the code changed (unless --force) or a masked secret is "
                                   "not given again with --env.")
    p.add_argument("run_id", type=run_id_type)
    # the defaults of every inventory command (cli/config.py) fill --ssh-config and --known-hosts; the
    # nodes are the recorded ones unless -i/--group are given on the command line
    p.set_defaults(_cluster_args=True)
    p.add_argument("-i", "--inventory", action="append",
                   help="inventory, repeatable: merged in order (default: the one the run recorded)")
    p.add_argument("--group", help="inventory group (default: the recorded one)")
    add_runs_dir_arg(p, "where run records are")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="give a masked (secret) value again, or replace one; every node")
    p.add_argument("-e", "--extra-vars", dest="replay_extra_vars", action="append", default=[], metavar="VARS",
                   help="give a masked extra var of the run again, or replace one (the run's -e and --limit "
                        "are replayed)")
    p.add_argument("--same-port", action="store_true",
                   help="use the recorded master port or refuse (default: it if free, else a free one)")
    p.add_argument("--force", action="store_true", help="replay even if the inventory or the code changed")
    p.add_argument("--new-run-id", dest="new_run_id", help="the new run's id (default: time + random suffix)")
    p.add_argument("--dry-run", action="store_true", help="print the replayed plan; start nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument("--accept-new-host-keys", action="store_true")
    p.add_argument("--known-hosts")
    p.add_argument("--ssh-config")
    p.add_argument("--no-color", action="store_true")
    p.set_defaults(func=cmd_replay, renamed={"run_id": "new_run_id"})  # (its RUN_ID is the old run's)


def cmd_replay(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.api import Cluster
    from ddpfab.launch import rerun, runner
    from ddpfab.launch.replay import ManifestError

    def show(plan, targets: dict) -> None:
        print_plan(plan, args.json, offline=False, targets=targets)

    try:
        replayed = Cluster.replay(
            args.run_id, runs_dir=args.runs_dir, inventory=args.inventory if given(args, "inventory") else None,
            group=args.group if given(args, "group") else None, env=args.env, extra_vars=args.replay_extra_vars,
            same_port=args.same_port, force=args.force, new_run_id=args.new_run_id, dry_run=args.dry_run,
            ssh_config=args.ssh_config, known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
            say=lambda line: sys.stderr.write(f"ddpfab: {line}\n"), color=False if args.no_color else None,
            on_plan=show)
    except (ManifestError, inventory.InventoryError, PlanError) as exc:
        return refuse(args, str(exc), "replay")
    except rerun.ReplayRefused as exc:
        if args.json and exc.reported:
            print_problems(exc.problems, "replay")
        return die(exc.lines)
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "replay")
        return die(exc.problems + ["nothing was started"])
    return replayed.exit_code  # (its closing line was printed with the run's output)
