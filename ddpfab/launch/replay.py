"""``ddpfab replay RUN_ID``: run a recorded run again, exactly, or refuse and say why.

A manifest is data, never a program: replay never runs a command string it reads. It checks the
manifest against its schema (``kind`` ``ddpfab-run-manifest``, ``schema_version`` 3 or 2, typed
``options``), then plans again from the recorded *options* (script, args, env, nproc, launch
style, ...) with the same planner and validators as ``ddpfab run`` (env keys, run id, ports,
styles), on the same nodes, under a new run id, on the old master port if it is still free (or a
new free one; with ``--same-port`` the old one or nothing).

It refuses, before connecting anywhere, when the run could not be the same:

- the inventory changed: the manifest records ``inventory_fingerprint``, a sha256 of the resolved
  node list (every connection and ddpfab_ variable of every node, in order);
- the code changed: the manifest's ``code.tree_hash`` (recorded by ``ddpfab sync``) against the
  tree now, or, without it, ``script_sha256`` (the script file as the controller sees it);
- an env value was masked in the manifest (secret-looking keys are stored as ``***``) and not
  given again with ``--env KEY=VALUE``;

and, after probing the nodes, when the plan those options make now differs in anything from the
plan the manifest records (an edited manifest, a node that moved): it prints every difference and
the plan, and runs it only with ``--force``.

``--force`` overrides the first two and the last (never the third: a masked value cannot be guessed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from ddpfab.hosts import inventory
from ddpfab.hosts.inventory import Inventory
from ddpfab.launch.runs import mask_env
from ddpfab.health import probe
from ddpfab.planning import render
from ddpfab.masking import holds_mask, was_masked
from ddpfab.optionnames import option
from ddpfab.planning.plan import (LATER_NODE_FIELDS, Plan, PlanError, RunOptions, choose_master, is_run_id,
                                  parse_env)
from ddpfab.problems import DdpfabError, Problem
from ddpfab.transfer import sync


def inventory_fingerprint(cluster: Inventory) -> str:
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


def manifest_fields(cluster: Inventory, plan: Plan) -> dict[str, Any]:
    """What a manifest needs so that ``replay`` can check it is replaying the same thing (and, for
    a repeated ``-i``, load the same inventories again: the plan's ``inventory`` only shows them)."""
    path = script_file(plan)
    several = {"inventory_sources": list(cluster.sources)} if len(cluster.sources) > 1 else {}
    return {"inventory_fingerprint": inventory_fingerprint(cluster), "script_file": path,
            "script_sha256": file_sha256(path) if path else None, **several}


def recorded_inventory(manifest: dict) -> str | list[str] | None:
    """The inventory a run was planned from, as :func:`ddpfab.hosts.inventory.load` takes it: the
    recorded ``inventory_sources`` (several ``-i``, validated), else the plan's ``inventory``
    (None when the manifest names none)."""
    sources = manifest.get("inventory_sources")
    if sources is None:
        plan = manifest.get("plan")
        found = plan.get("inventory") if isinstance(plan, dict) else None
        return found if isinstance(found, str) and found else None
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
        raise inventory.InventoryError(f"run {manifest.get('run_id')}: the manifest's inventory_sources must be a "
                                       f"list of inventories, found {json.dumps(sources)[:80]}; pass -i again")
    return sources


def recorded_selection(manifest: dict, given: Iterable[str] = (), fallback: Mapping[str, Any] | None = None
                       ) -> tuple[str | None, dict[str, Any], list[str]]:
    """How the run chose its nodes beyond inventory and group, read back as data: its ``limit``,
    its ``extra_vars`` with the ``-e`` *given* again over them (less those still masked), and the
    keys still masked (a secret's value: replay needs it given again). *fallback* (the project
    config's variables) gives the values of masked keys that *given* does not."""
    limit, recorded = manifest.get("limit"), manifest.get("extra_vars", {})
    if limit is not None and not (isinstance(limit, str) and limit):
        raise ManifestError(f"run {manifest.get('run_id')}: the manifest's limit must be a pattern, found "
                            f"{json.dumps(limit)[:80]}")
    if not isinstance(recorded, dict) or not all(isinstance(k, str) and k for k in recorded):
        raise ManifestError(f"run {manifest.get('run_id')}: the manifest's extra_vars must be a mapping of "
                            f"variables, found {json.dumps(recorded)[:80]}")
    again = inventory.parse_extra_vars(given)
    again.update({k: v for k, v in (fallback or {}).items()
                  if k not in again and k in recorded and holds_mask(recorded[k], k)})
    masked = [k for k, v in recorded.items() if holds_mask(v, k) and k not in again]
    return limit, {k: v for k, v in {**recorded, **again}.items() if k not in masked}, masked


def _current_tree(code: dict) -> sync.Selection:
    """The tree the run's code record names, selected as its sync selected it."""
    src = code.get("src")
    if not src:
        raise ValueError("the manifest's code record names no source dir")
    keep = code.get("keep") or []  # the run's runs dir inside the project (sync.runs_keep), as data
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise ValueError(f"the manifest's code.keep must be a list of patterns, found {json.dumps(keep)[:80]}")
    return sync.select(src, tuple(keep), with_git=bool(code.get("with_git")), include_keys=code.get("include_keys") is True)


def changed_since(sel: sync.Selection, started: object, limit: int = 5) -> str:
    """`` (changed since the run started, by their times: a.py, out.log)``: the files of *sel*
    modified after *started* (the record's, as data); "" when none or no time."""
    if type(started) not in (int, float):
        return ""
    since = float(started)  # type: ignore[arg-type]
    newer = []
    for rel in sel.files:
        with contextlib.suppress(OSError):
            if os.lstat(os.path.join(sel.root, rel)).st_mtime > since:
                newer.append(rel)
    if not newer:
        return ""
    more = f" and {len(newer) - limit} more" if len(newer) > limit else ""
    return f" (changed since the run started, by their times: {', '.join(newer[:limit])}{more})"


def check(manifest: dict, cluster: Inventory) -> list[str]:
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
            tree = _current_tree(code)
            now = sync.local_tree(tree)["tree_hash"]
        except Exception as exc:  # noqa: BLE001 - reported as a reason to refuse
            problems.append(f"cannot hash the code tree {code.get('src')} again: {exc}")
        else:
            if now != code["tree_hash"]:
                problems.append(f"the code changed since the run: tree {code.get('src')} hashed "
                                f"{code['tree_hash'][:12]} then, {now[:12]} now"
                                f"{changed_since(tree, manifest.get('started'))}")
    elif manifest.get("script_sha256"):
        path = manifest.get("script_file")
        digest = file_sha256(path) if path else None
        if digest is None:
            problems.append(f"the script {path} is gone")
        elif digest != manifest["script_sha256"]:
            problems.append(f"the code changed since the run: {path} sha256 was "
                            f"{manifest['script_sha256'][:12]}, is {digest[:12]}")
    else:
        problems.append("the manifest records no code hash (neither code.tree_hash nor script_sha256): "
                        "cannot tell whether the code changed")
    return problems


MANIFEST_KIND = "ddpfab-run-manifest"
#: Version 3: the plan is data, no rendered command in it. Version 2: ``options`` recorded, replay
#: re-plans from them; its plan's nodes also stored their rendered ``argv`` and ``command`` (compared
#: with what the plan renders now, never run). Version 1 replayed the stored plan: refused.
SCHEMA_VERSION = 3
READABLE_VERSIONS = (2, 3)
#: RunOptions field -> (type, may be null), as recorded in ``manifest["options"]``.
OPTION_FIELDS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "script": (str, False), "args": (list, False), "nproc_per_node": ((int, str), True), "master_port": (int, True),
    "env": (list, False), "max_restarts": (int, False), "run_id": (str, False), "remote_runs_dir": (str, False),
    "socket_ifname": (str, True), "rdzv": (str, False), "launcher": (str, False), "init_method": (str, False),
    "debug": (bool, False), "local_rank_arg": (str, False), "module": (bool, False), "secret_env": (list, False),
    "script_local_rank": (bool, False), "gpus_per_node": (int, True), "wait": (bool, False),
    "exit_guard": (str, False), "resource_floors": (str, True), "hang_timeout": ((int, float), False),
    "on_hang": (str, False), "pdb": (str, False), "debugpy": (str, False)}
#: Plan fields recorded only by newer versions, with the value a plan without them meant.
LATER_PLAN_FIELDS: dict[str, Any] = {"module": False, "secret_env": [], "script_local_rank": False, "wait": False,
                                     "exit_guard": "off", "hang_timeout": 0.0, "on_hang": "report", "pdb": "", "debugpy": ""}
#: Options recorded only by newer versions: a manifest without them gets RunOptions' defaults.
LATER_OPTION_FIELDS = ("module", "secret_env", "script_local_rank", "gpus_per_node", "wait", "exit_guard",
                       "resource_floors", "hang_timeout", "on_hang", "pdb", "debugpy")


class ManifestError(DdpfabError):
    """A manifest that cannot be replayed: malformed, foreign, or of another schema version."""

    check = "manifest"


def recorded_options(options: RunOptions, cwd: str | None, marked: tuple[str, ...] = ()) -> dict[str, Any]:
    """RunOptions as the manifest records them: plain JSON, secret env values masked
    (:mod:`ddpfab.masking`; *marked*: the plan's marked keys, the inventory's included)."""
    data = asdict(options)
    data["args"] = list(options.args)
    data["secret_env"] = list(options.secret_env)
    data["env"] = [list(kv) for kv in mask_env(dict(options.env), (*options.secret_env, *marked)).items()]
    return {**data, "cwd": cwd or os.getcwd()}


def _typed(where: str, value: Any, kind: type | tuple[type, ...], nullable: bool) -> None:
    if value is None and nullable:
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (int in kinds and isinstance(value, bool))
    if not ok:
        raise ManifestError(f"{where}: expected {' or '.join(k.__name__ for k in kinds)}{' or null' if nullable else ''}, "
                            f"found {type(value).__name__} {json.dumps(value)[:60]}")


def validate(manifest: Any, source: str) -> tuple[RunOptions, str]:
    """The recorded options (and the controller's cwd then) of a manifest, checked field by field
    against :data:`OPTION_FIELDS`; a ManifestError naming the field otherwise. Values are
    validated again by :func:`ddpfab.planning.plan.make_plan` when they are planned."""
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise ManifestError(f"{source} is not a ddpfab run manifest (expected \"kind\": \"{MANIFEST_KIND}\")")
    version = manifest.get("schema_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ManifestError(f"{source}: manifest schema version {json.dumps(version)}, this ddpfab replays versions "
                            f"{' and '.join(map(str, READABLE_VERSIONS))}; start the run again with ddpfab run")
    opts, plan = manifest.get("options"), manifest.get("plan")
    if not isinstance(opts, dict):
        raise ManifestError(f"{source}: options: expected an object, found {type(opts).__name__}")
    unknown = sorted(set(opts) - set(OPTION_FIELDS) - {"cwd"})
    missing = sorted(set(OPTION_FIELDS) - set(opts) - set(LATER_OPTION_FIELDS))
    if unknown or missing:
        raise ManifestError(f"{source}: options: " + "; ".join(
            part for part in (f"unknown {', '.join(unknown)}" if unknown else "",
                              f"missing {', '.join(missing)}" if missing else "") if part))
    for name, (kind, nullable) in OPTION_FIELDS.items():
        if name in opts:
            _typed(f"{source}: options.{name}", opts[name], kind, nullable)
    for i, key in enumerate(opts.get("secret_env", [])):
        _typed(f"{source}: options.secret_env[{i}]", key, str, False)
    for i, arg in enumerate(opts["args"]):
        _typed(f"{source}: options.args[{i}]", arg, str, False)
    for i, pair in enumerate(opts["env"]):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ManifestError(f"{source}: options.env[{i}]: expected [KEY, VALUE] strings, found {json.dumps(pair)[:60]}")
    cwd = opts.get("cwd")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise ManifestError(f"{source}: options.cwd: expected an absolute path, found {json.dumps(cwd)[:60]}")
    if not isinstance(plan, dict) or not isinstance(plan.get("nodes"), list):
        raise ManifestError(f"{source}: plan: expected an object with a list of nodes")
    for key, kind in (("inventory", str), ("group", str), ("run_id", str), ("master_port", int)):
        _typed(f"{source}: plan.{key}", plan.get(key), kind, False)
    if not is_run_id(plan["run_id"]):  # (a run id names directories here and on the nodes)
        raise ManifestError(f"{source}: plan.run_id: expected 1-80 letters, digits, '.', '_' or '-' (no '..'), "
                            f"found {json.dumps(plan['run_id'])[:60]}")
    for key, default in LATER_PLAN_FIELDS.items():
        _typed(f"{source}: plan.{key}", plan.get(key, default), type(default), False)
    for i, key in enumerate(plan.get("secret_env", [])):
        _typed(f"{source}: plan.secret_env[{i}]", key, str, False)
    try:
        env = parse_env([f"{k}={v}" for k, v in opts["env"]])
    except PlanError as exc:
        raise ManifestError(f"{source}: options.env: {exc}") from None
    fields = {k: opts[k] for k in OPTION_FIELDS if k in opts}
    fields.setdefault("exit_guard", LATER_PLAN_FIELDS["exit_guard"])  # runs before the guard had none
    fields.setdefault("hang_timeout", LATER_PLAN_FIELDS["hang_timeout"])  # ... and before the hang watch
    return RunOptions(**{**fields, "args": tuple(opts["args"]), "env": env,
                         "secret_env": tuple(opts.get("secret_env", ()))}), cwd


def masked_keys(options: RunOptions, marked: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Env keys whose value the manifest stores masked (to be given again with --env); *marked*:
    the recorded plan's marked keys (``secret_env``, the inventory's included)."""
    return sorted({k for k, v in options.env if was_masked(k, v, (*options.secret_env, *marked))})


def as_recorded(now: Plan, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """*now* as a manifest of schema *version* records it: masked, and for version 2 with each
    node's ``argv`` and ``command`` rendered (:mod:`ddpfab.planning.render`) as that version stored them."""
    shown = render.masked(now)
    data = shown.to_dict()
    if version == 2:
        for node, plan_node in zip(data["nodes"], shown.nodes, strict=True):
            node["argv"] = list(render.argv(shown, plan_node))
            node["command"] = render.shell_line(shown, plan_node)
    return json.loads(json.dumps(data))


def differences(recorded: dict, now: Plan, version: int = SCHEMA_VERSION) -> list[str]:
    """Every way the recorded plan (as stored: masked, by a manifest of schema *version*) differs
    from *now* (masked here), by field."""
    planned = as_recorded(now, version)
    recorded = {**LATER_PLAN_FIELDS, **recorded}  # a plan recorded before these fields had their defaults

    def short(value: Any) -> str:
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 120 else text[:117] + "..."

    out = [f"{key}: recorded {short(recorded.get(key))}, planned now {short(planned.get(key))}"
           for key in sorted(set(recorded) | set(planned)) if key != "nodes" and recorded.get(key) != planned.get(key)]
    rec_nodes = {n.get("name"): n for n in recorded.get("nodes", []) if isinstance(n, dict)}
    if list(rec_nodes) != [n["name"] for n in planned["nodes"]]:
        out.append(f"nodes: recorded {short(list(rec_nodes))}, planned now {short([n['name'] for n in planned['nodes']])}")
    for node in planned["nodes"]:
        old = rec_nodes.get(node["name"])
        if old is None:
            continue
        for key in sorted(set(old) | set(node)):
            if old.get(key) == node.get(key) or (key in LATER_NODE_FIELDS and key not in old):
                continue
            if key == "env" and isinstance(old.get(key), dict):
                keys = sorted(k for k in set(old[key]) | set(node[key]) if old[key].get(k) != node[key].get(k))
                out.append(f"{node['name']}: env differs in {', '.join(keys)}")
            else:
                out.append(f"{node['name']}: {key}: recorded {short(old.get(key))}, planned now {short(node.get(key))}")
    return out


def choose_port(cluster, conns, old_port: int, script: str, cwd: str, same_port: bool, run_id: str | None = None):
    """One probe pass (torch, workdir, script, the old port on the master; with *run_id*, that the
    new run's dir is on no node yet), then the port (:func:`ddpfab.health.probe.pick_port`: a
    second look on the master for a free port only if the old one is taken and that is allowed)."""
    master = choose_master(cluster)
    facts, problems = probe.gather(cluster, conns, master, cwd=cwd, script=script, master_port=old_port,
                                   run_id=run_id)
    if same_port and master.name in facts and facts[master.name].port_free is False:
        problems = [p for p in problems if not p.about(master.name, "master_port")] + [Problem(
            master.name, "master_port", expected=f"the recorded port {old_port} free ({option('same_port', True)})",
            found="in use",
            text=f"host {master.name}: the recorded master port {old_port} is in use there ({option('same_port', True)})")]
    port, problems = probe.pick_port(conns, master, facts, problems, old_port, cwd=cwd, replace_taken=not same_port)
    return port or 0, facts, problems
