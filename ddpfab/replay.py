"""``ddpfab replay RUN_ID``: run a recorded run again, exactly, or refuse and say why.

The manifest (``runs/<id>/manifest.json``) holds the run's plan. Replay re-executes that plan
(same nodes, node ranks, nproc, python, workdir, launcher, rendezvous, init method, script, args,
env) under a new run id, on the old master port if it is still free (or a new free one; with
``--same-port`` the old one or nothing). Argv and commands are rebuilt by
:func:`ddpfab.plan.replan`, the same code that built them.

It refuses, before connecting anywhere, when the run could not be the same:

- the inventory changed: the manifest records ``inventory_fingerprint``, a sha256 of the resolved
  node list (every connection and ddpfab_ variable of every node, in order);
- the code changed: the manifest's ``code.tree_hash`` (recorded by ``ddpfab sync``) against the
  tree now, or, without it, ``script_sha256`` (the script file as the controller sees it);
- an env value was masked in the manifest (secret-looking keys are stored as ``***``) and not
  given again with ``--env KEY=VALUE``.

``--force`` overrides the first two (never the third: a masked value cannot be guessed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .inventory import Cluster
    from .plan import Plan


def inventory_fingerprint(cluster: Cluster) -> str:
    """sha256 of the resolved node list: what each node is and how it is reached, in order."""
    nodes = [asdict(n) for n in cluster.nodes]
    blob = json.dumps({"group": cluster.group, "nodes": nodes}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: str | os.PathLike) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest() if hasattr(hashlib, "file_digest") \
                else hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def script_file(plan: Plan) -> str | None:
    """The plan's script as the controller sees it: at a node's workdir path (the default workdir
    is the controller's cwd, and with a shared or synced tree the path exists here too), else
    relative to the cwd."""
    if os.path.isabs(plan.script):
        return plan.script if os.path.isfile(plan.script) else None
    for candidate in [os.path.join(n.workdir, plan.script) for n in plan.nodes] + [os.path.abspath(plan.script)]:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def manifest_fields(cluster: Cluster, plan: Plan) -> dict[str, Any]:
    """What a manifest needs so that ``replay`` can check it is replaying the same thing."""
    path = script_file(plan)
    return {"inventory_fingerprint": inventory_fingerprint(cluster), "script_file": path,
            "script_sha256": file_sha256(path) if path else None}


def _current_tree_hash(code: dict) -> str:
    from . import sync

    src = code.get("src")
    if not src:
        raise ValueError("the manifest's code record names no source dir")
    sel = sync.select(src, with_git=bool(code.get("with_git")))
    return sync.local_tree(sel)["tree_hash"]


def check(manifest: dict, cluster: Cluster) -> list[str]:
    """Why replaying *manifest* on *cluster* would not be the same run (empty: it would)."""
    problems = []
    recorded = manifest.get("inventory_fingerprint")
    if recorded is None:
        problems.append("the manifest has no inventory fingerprint (recorded by an older ddpfab): "
                        "cannot tell whether the inventory changed")
    elif recorded != inventory_fingerprint(cluster):
        problems.append(f"the inventory changed since the run ({cluster.source}, group {cluster.group}: "
                        "nodes, addresses, connection or ddpfab_ variables differ)")
    code = manifest.get("code") or {}
    if code.get("tree_hash"):
        try:
            now = _current_tree_hash(code)
        except Exception as exc:  # noqa: BLE001 - reported as a reason to refuse
            problems.append(f"cannot hash the code tree {code.get('src')} again: {exc}")
        else:
            if now != code["tree_hash"]:
                problems.append(f"the code changed since the run: tree {code.get('src')} hashed "
                                f"{code['tree_hash'][:12]} then, {now[:12]} now")
    elif manifest.get("script_sha256"):
        path = manifest.get("script_file")
        now = file_sha256(path) if path else None
        if now is None:
            problems.append(f"the script {path} is gone")
        elif now != manifest["script_sha256"]:
            problems.append(f"the code changed since the run: {path} sha256 was "
                            f"{manifest['script_sha256'][:12]}, is {now[:12]}")
    else:
        problems.append("the manifest records no code hash (neither code.tree_hash nor script_sha256): "
                        "cannot tell whether the code changed")
    return problems


def masked_keys(plan_dict: dict) -> list[str]:
    from .runs import MASK, SECRET_KEY

    return sorted({k for n in plan_dict["nodes"] for k, v in n["env"].items() if v == MASK and SECRET_KEY.search(k)})


def register(sub) -> None:
    p = sub.add_parser("replay", help="run a recorded run again: same nodes, ranks, args, env",
                       description="Re-run runs/RUN_ID from its manifest under a new run id. Refuses if the "
                                   "inventory or the code changed (unless --force) or a masked secret is "
                                   "not given again with --env.")
    p.add_argument("run_id")
    p.add_argument("-i", "--inventory", help="inventory (default: the one the run recorded)")
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


def _err(lines: list[str] | str) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        sys.stderr.write(f"ddpfab: error: {line}\n")
    return 2


def cmd_replay(args: argparse.Namespace) -> int:
    from . import inventory, probe, runner, ssh
    from .launch import Printer
    from .plan import Plan, PlanError, parse_env, replan
    from .runs import mask_plan, new_run_id

    path = Path(args.runs_dir) / args.run_id / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        return _err(f"no run record {path} (pass --runs-dir where the run was recorded)")
    except ValueError as exc:
        return _err(f"{path} is not valid JSON: {exc}")
    from .recover import attempt_cluster, current_manifest

    latest = current_manifest(args.runs_dir, manifest)  # a run with restarts: its last attempt
    if latest is not manifest:
        sys.stderr.write(f"ddpfab: {args.run_id} ran {len(manifest['recovery']['attempts'])} attempts; "
                         f"replaying the last, {latest['run_id']} (its nodes)\n")
        manifest = latest
    try:
        source = args.inventory or manifest["plan"]["inventory"]
        if "attempt_nodes" in manifest:
            cluster = attempt_cluster(manifest, source, args.group)
        else:
            cluster = inventory.load(source, args.group or manifest["plan"]["group"])
        overrides = dict(parse_env(args.env))
    except (inventory.InventoryError, PlanError) as exc:
        return _err(str(exc))
    problems = check(manifest, cluster)
    if problems and not args.force:
        return _err([f"replay of {args.run_id} refused: {p}" for p in problems]
                    + ["nothing was started; --force replays anyway"])
    for p in problems:
        sys.stderr.write(f"ddpfab: warning: {p} (--force: replaying anyway)\n")
    missing = [k for k in masked_keys(manifest["plan"]) if k not in overrides]
    if missing:
        return _err([f"replay of {args.run_id} refused: the manifest stores {', '.join(missing)} masked (***); "
                     "give the value again with " + " ".join(f"--env {k}=..." for k in missing),
                     "nothing was started"])
    old = Plan.from_dict(manifest["plan"])
    if {n.name for n in old.nodes} - {n.name for n in cluster.nodes}:
        return _err(f"the run's nodes {sorted(n.name for n in old.nodes)} are not all in the inventory")
    policy = ssh.HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)
    try:
        conns = runner.connect_all(cluster, policy, args.ssh_config)
    except runner.RunError as exc:
        return _err(exc.problems + ["nothing was started"])
    try:
        port, facts, problems = _pick_port(cluster, conns, old, args.same_port, probe)
        if problems:
            return _err(problems + ["nothing was started"])
        plan = replan(old, run_id=args.new_run_id or new_run_id(), master_port=port, env=overrides)
        if args.dry_run:
            from .cli import _print_dry_run

            return _print_dry_run(plan, args.json, mask_plan, offline=False)
        prepared = runner.Prepared(cluster, plan, conns, facts)
        printer = Printer(plan, color=False if args.no_color else None)
        printer.note(f"replaying {args.run_id} as {plan.run_id} (master port {port}"
                     f"{', the recorded one' if port == old.master_port else f', the recorded {old.master_port} is taken'})")
        result, _ = runner.run(prepared, args.runs_dir, printer, extra={"replay_of": args.run_id})
    except PlanError as exc:
        return _err(str(exc))
    finally:
        for c in conns.values():
            c.close()
    if result.exit_code != 0:
        sys.stderr.write(f"ddpfab: {result.summary}\n")
    return result.exit_code


def _pick_port(cluster, conns, old: Plan, same_port: bool, probe):
    """One probe pass (torch, workdir, script, the old port on the master); a second look on the
    master for a free port only if the old one is taken and that is allowed."""
    master = cluster.node(old.master)
    # the controller's cwd at the time = the workdir of any node without ddpfab_workdir
    cwd = next((n.workdir for n in old.nodes if cluster.node(n.name).workdir is None), os.getcwd())
    facts, problems = probe.gather(cluster, conns, master, cwd=cwd, script=old.script, master_port=old.master_port)
    busy = master.name in facts and facts[master.name].port_free is False
    if not busy:
        return old.master_port, facts, problems
    problems = [p for p in problems if not p.startswith(f"host {master.name}: --master-port")]
    if same_port:
        return old.master_port, facts, problems + [
            f"host {master.name}: the recorded master port {old.master_port} is in use there (--same-port)"]
    found = probe.probe_node(conns[master.name], master, workdir=master.workdir or cwd, script=None,
                             find_port=True).free_port
    if found is None:
        problems.append(f"host {master.name}: no free port for the replay")
    return found or 0, facts, problems
