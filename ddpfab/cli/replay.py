"""``ddpfab replay``: run a recorded run again."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from ddpfab.cli.config import given
from ddpfab.cli.errors import die, print_problems, refuse
from ddpfab.cli.run import _print_dry_run
from ddpfab.hosts import inventory
from ddpfab.planning import scriptfile
from ddpfab.planning.plan import PlanError, make_plan, parse_env


def register(sub) -> None:
    p = sub.add_parser("replay", help="run a recorded run again: same nodes, ranks, args, env",
                       description="Re-run runs/RUN_ID from its manifest under a new run id. Refuses if the "
                                   "inventory or the code changed (unless --force) or a masked secret is "
                                   "not given again with --env.")
    p.add_argument("run_id")
    # the defaults of every inventory command (cli/config.py) fill --ssh-config and --known-hosts; the
    # nodes are the recorded ones unless -i/--group are given on the command line
    p.set_defaults(_cluster_args=True)
    p.add_argument("-i", "--inventory", action="append",
                   help="inventory, repeatable: merged in order (default: the one the run recorded)")
    p.add_argument("--group", help="inventory group (default: the recorded one)")
    p.add_argument("--runs-dir", default=os.environ.get("DDPFAB_RUNS_DIR", "runs"),
                   help="where run records are (default: ./runs, or $DDPFAB_RUNS_DIR)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="give a masked (secret) value again, or replace one; every node")
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
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner
    from ddpfab.launch.execute import Printer
    from ddpfab.launch.replay import (
        ManifestError,
        _pick_port,
        check,
        differences,
        masked_keys,
        recorded_inventory,
        validate,
    )
    from ddpfab.launch.runs import new_run_id
    from ddpfab.planning import probe
    from ddpfab.remote import ssh

    path = Path(args.runs_dir) / args.run_id / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        return refuse(args, f"no run record {path} (pass --runs-dir where the run was recorded)", "replay")
    except ValueError as exc:
        return refuse(args, f"{path} is not a ddpfab run manifest (not JSON: {exc})", "replay")
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.recover import attempt_cluster, current_manifest

    try:
        validate(manifest, str(path))
        latest = current_manifest(args.runs_dir, manifest)  # a run with restarts: its last attempt
        if latest is not manifest:
            sys.stderr.write(f"ddpfab: {args.run_id} ran {len(manifest['recovery']['attempts'])} attempts; "
                             f"replaying the last, {latest['run_id']} (its nodes)\n")
            manifest = latest
        recorded, cwd = validate(manifest, str(path))
        source = args.inventory if given(args, "inventory") else recorded_inventory(manifest)
        group = args.group if given(args, "group") else None
        if "attempt_nodes" in manifest:
            cluster = attempt_cluster(manifest, source, group)
        else:
            cluster = inventory.load(source, group or manifest["plan"]["group"])
        overrides = dict(parse_env(args.env, dict(os.environ)))
    except (ManifestError, inventory.InventoryError, PlanError) as exc:
        return refuse(args, str(exc), "replay")
    problems = check(manifest, cluster)
    if problems and not args.force:
        if args.json:
            print_problems(problems, "replay")
        return die([f"replay of {args.run_id} refused: {p}" for p in problems]
                    + ["nothing was started; --force replays anyway"])
    for p in problems:
        sys.stderr.write(f"ddpfab: warning: {p} (--force: replaying anyway)\n")
    missing = [k for k in masked_keys(recorded, manifest["plan"].get("secret_env") or ()) if k not in overrides]
    if missing:
        return die([f"replay of {args.run_id} refused: the manifest stores {', '.join(missing)} masked (***); "
                     "give the value again with " + " ".join(f"--env {k}=..." for k in missing),
                     "nothing was started"])
    env = dict(recorded.env)
    env.update(overrides)
    old_rid, old_port = manifest["plan"]["run_id"], manifest["plan"]["master_port"]
    policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
    try:
        conns = runner.connect_all(cluster, policy, args.ssh_config)
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "replay")
        return die(exc.problems + ["nothing was started"])
    try:
        port, facts, problems = _pick_port(cluster, conns, old_port,
                                           scriptfile.file_to_check(recorded.script, recorded.module, cwd), cwd,
                                           args.same_port)
        if problems:
            if args.json:
                print_problems(problems, "replay")
            return die(problems + ["nothing was started"])
        cluster = probe.decide(cluster, facts)  # the python the probe ran, as a run decides it
        # the recorded options planned again under the old id and port must give the recorded plan
        again = make_plan(cluster, replace(recorded, run_id=old_rid), runner.plan_facts(facts, old_port, cwd))
        changed = differences(manifest["plan"], again, manifest["schema_version"])
        options = replace(recorded, run_id=args.new_run_id or new_run_id(), env=tuple(env.items()), master_port=port)
        plan = make_plan(cluster, options, runner.plan_facts(facts, port, cwd))
        if changed or args.dry_run:
            for line in changed:
                sys.stderr.write(f"ddpfab: differs from the recorded plan: {line}\n")
            _print_dry_run(plan, args.json, offline=False)
            if args.dry_run:
                return 0
            if not args.force:
                return die([f"replay of {args.run_id} refused: what its options plan now differs from the plan "
                             "it recorded (above); nothing was started; --force runs the plan shown"])
        prepared = runner.Prepared(cluster, plan, conns, facts, policy, args.ssh_config, options, cwd)
        printer = Printer(plan, color=False if args.no_color else None)
        printer.note(f"replaying {args.run_id} as {plan.run_id} (master port {port}"
                     f"{', the recorded one' if port == old_port else f', the recorded {old_port} is taken'})")
        result, _ = runner.run(prepared, args.runs_dir, printer, extra={"replay_of": args.run_id})
    except PlanError as exc:
        return die(str(exc))
    finally:
        for c in conns.values():
            c.close()
    if result.exit_code != 0:
        sys.stderr.write(f"ddpfab: {result.summary}\n")
    return result.exit_code
