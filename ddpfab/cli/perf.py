"""Command line of the slow-node check: ``check --perf [--history]`` and ``run --perf-check``.

Kept apart from :mod:`ddpfab.launch.perfcheck` so building the parser imports nothing heavy (no Fabric).
"""

from __future__ import annotations

import json
import sys
import time

from ddpfab.cli.common import add_runs_dir_arg, load_cluster
from ddpfab.cli.errors import EXIT_USAGE, refuse
from ddpfab.health import perf
from ddpfab.hosts import inventory
from ddpfab.planning.plan import PlanError


def add_check_arguments(p) -> None:
    """The ``check`` options of the perf check (the rest of ``check``'s options are shared)."""
    p.add_argument("--perf", action="store_true",
                   help="benchmark every node and link through torchrun (compute, memory, point-to-point, "
                        "all_reduce) and name the stragglers; exit 1 if there are any")
    p.add_argument("--history", action="store_true", help="with --perf: each node's figures in past checks")
    add_runs_dir_arg(p, "where perf check records go")
    p.add_argument("--verbose", action="store_true", help="with --perf: show the benchmark job's output")


def cmd_check_perf(args) -> int:
    """``ddpfab check --perf [--history]``: 0 healthy, 1 stragglers, 2 could not run."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.perfcheck import PerfError, load_records, result_of, run_check
    from ddpfab.launch import runner
    from ddpfab.remote import ssh

    if args.history:
        records, bad = load_records(args.runs_dir)
        nodes = None
        if args.inventory:
            try:
                nodes = [n.name for n in load_cluster(args).nodes]
            except inventory.InventoryError as exc:
                return refuse(args, exc, "inventory")
        hist = perf.history(records, nodes)
        if args.json:
            print(json.dumps({"history": hist, "unreadable": bad}, indent=2))
        else:
            print(perf.render_history(hist, lambda t: time.strftime("%Y-%m-%d %H:%M", time.localtime(t))))
            for path in bad:
                sys.stderr.write(f"ddpfab: warning: {path} is not a perf record; skipped\n")
        return 0
    try:
        cluster = load_cluster(args)
        policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
        record, run_dir = run_check(cluster, policy, args.runs_dir, perf.PerfOptions(nproc_per_node=args.nproc_per_node),
                                    args.ssh_config, echo=args.verbose)
    except (inventory.InventoryError, PlanError) as exc:  # e.g. --nproc-per-node 0: nothing was started
        return refuse(args, str(exc), "perf")
    except (PerfError, runner.RunError) as exc:
        return refuse(args, exc.problems, "perf", getattr(exc, "code", EXIT_USAGE))
    if args.json:
        print(json.dumps({**record, "run_dir": str(run_dir), "report": str(run_dir / "report.html")}, indent=2))
    else:
        print(perf.render(result_of(record), str(run_dir / "report.html"), record["seconds"]))
    return 1 if record["result"]["findings"] else 0


def add_run_arguments(p) -> None:
    p.add_argument("--perf-check", action="store_true",
                   help="run `ddpfab check --perf` before the launch (results in the manifest); a straggler "
                        "stops the launch (nothing is started)")
    p.add_argument("--perf-check-warn", action="store_true",
                   help="--perf-check, but a straggler is only reported and the job starts anyway")
