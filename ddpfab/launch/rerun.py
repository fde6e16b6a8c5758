"""``ddpfab replay``'s pipeline: read the record, refuse what would not be the same run, connect,
probe, pick the port, plan again, compare, start.

The rules (what is refused, and why) are :mod:`ddpfab.launch.replay`'s; this module puts them in
order around the runner, so that the command line only parses and prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ddpfab.hosts import inventory
from ddpfab.launch import runner
from ddpfab.launch.execute import Printer, RunResult
from ddpfab.launch.recover import attempt_cluster, current_manifest
from ddpfab.launch.replay import (ManifestError, choose_port, check, differences, masked_keys, recorded_inventory,
                                  recorded_selection, validate)
from ddpfab.launch.debugger import refuse_without_input
from ddpfab.launch.runs import new_run_id
from ddpfab.health import probe
from ddpfab.planning import scriptfile
from ddpfab.masking import recordable
from ddpfab.optionnames import option
from ddpfab.planning.plan import Plan, RunOptions, check_run_id, make_plan, parse_env
from ddpfab.problems import DdpfabError, Problem
from ddpfab.remote.ssh import HostKeyPolicy


class ReplayRefused(DdpfabError):
    """The replay would not be the same run, and nothing was started.

    Args:
        lines: what to say, one line each.
        problems: the same as problems (``--json`` reports them), or None when they are not
            reported so (then the problems are the lines').
    """

    check = "replay"

    def __init__(self, lines: list[str], problems: list[str | Problem] | None = None):
        super().__init__(problems if problems is not None else lines)
        self.lines, self.reported = lines, problems is not None


@dataclass
class Replaying:
    """A replay made ready: its nodes connected and probed, its plan made; nothing started.

    Args:
        of: the replayed run's id.
        prepared: the plan and the open connections (:meth:`close` them, or :meth:`run`).
        changed: how the plan its recorded options make now differs from the recorded plan.
        port: the master port; *old_port* the recorded one.
    """

    of: str
    prepared: runner.Prepared
    changed: list[str]
    port: int
    old_port: int
    #: the run's --limit and -e as recorded (its ``limit``/``extra_vars``): the replay records them too
    selection: dict = field(default_factory=dict)

    @property
    def plan(self) -> Plan:
        return self.prepared.plan

    def run(self, runs_dir: str | os.PathLike, printer: Printer) -> tuple[RunResult, Path]:
        """Start it and record it (``replay_of``); the connections are closed after."""
        try:
            printer.note(f"replaying {self.of} as {self.plan.run_id} (master port {self.port}"
                         f"{', the recorded one' if self.port == self.old_port else f', the recorded {self.old_port} is taken'})")
            return runner.run(self.prepared, runs_dir, printer, extra={"replay_of": self.of, **self.selection})
        finally:
            self.close()

    def close(self) -> None:
        self.prepared.close()


def _load(path: Path) -> dict:
    """The manifest at *path*, validated (ManifestError: none there, not JSON, not a manifest)."""
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        raise ManifestError(f"no run record {path} (pass {option('runs_dir')} where the run was recorded)") from None
    except ValueError as exc:
        raise ManifestError(f"{path} is not a ddpfab run manifest (not JSON: {exc})") from None
    validate(manifest, str(path))
    return manifest


def _latest(run_id: str, runs_dir: str | os.PathLike, path: Path, say: Callable[[str], object]) -> dict:
    """The manifest at *path* that a replay of *run_id* replays: for a run with restarts, its last
    attempt's (the nodes it ended on), said with *say*; else the run's own."""
    manifest = _load(path)
    latest = current_manifest(runs_dir, manifest)  # a run with restarts: its last attempt
    if latest is not manifest:
        say(f"{run_id} ran {len(manifest['recovery']['attempts'])} attempts; replaying the last, "
            f"{latest['run_id']} (its nodes)")
    return latest


def _cluster(run_id: str, manifest: dict, inventory_source: str | list[str] | None, group: str | None,
             extra_vars: Iterable[str]) -> tuple[inventory.Inventory, str | None, dict]:
    """The cluster the replay runs on (an attempt of a run with restarts: its nodes, in its order),
    with the run's --limit and -e as recorded (those given again over them); extra vars the
    manifest stores masked and not given again are refused: the run cannot be the same without."""
    source = inventory_source if inventory_source is not None else recorded_inventory(manifest)
    limit, variables, masked_vars = recorded_selection(manifest, extra_vars)
    if masked_vars:
        raise ReplayRefused([f"replay of {run_id} refused: the manifest stores the extra vars "
                             f"{', '.join(masked_vars)} masked (***); give the value again with "
                             + " ".join(f"{option('extra_vars')} {k}=..." for k in masked_vars), "nothing was started"])
    chosen = (variables,) if variables else ()
    if "attempt_nodes" in manifest:
        cluster = attempt_cluster(manifest, source, group, extra_vars=chosen)
    else:
        cluster = inventory.load(source, group or manifest["plan"]["group"], limit=limit, extra_vars=chosen)
    return cluster, limit, variables


def _refuse_changes(run_id: str, manifest: dict, recorded: RunOptions, cluster: inventory.Inventory,
                    overrides: dict[str, str], force: bool, say: Callable[[str], object]) -> None:
    """Refuse a replay that would not be the same run: a changed inventory or code (unless
    *force*, which says each with *say* instead), or a secret env var stored masked and not given
    again in *overrides*."""
    problems = check(manifest, cluster)
    if problems and not force:
        raise ReplayRefused([f"replay of {run_id} refused: {p}" for p in problems]
                            + [f"nothing was started; {option('force', True)} replays anyway"], list(problems))
    for p in problems:
        say(f"warning: {p} ({option('force', True)}: replaying anyway)")
    missing = [k for k in masked_keys(recorded, manifest["plan"].get("secret_env") or ()) if k not in overrides]
    if missing:
        raise ReplayRefused([f"replay of {run_id} refused: the manifest stores {', '.join(missing)} masked (***); "
                             "give the value again with " + " ".join(f"{option('env')} {k}=..." for k in missing),
                             "nothing was started"])


def _connect_and_plan(manifest: dict, recorded: RunOptions, cwd: str, cluster: inventory.Inventory,
                      overrides: dict[str, str], same_port: bool, new_rid: str, policy: HostKeyPolicy,
                      ssh_config: str | None) -> tuple[runner.Prepared, list[str], int]:
    """Connect and probe *cluster*, pick the master port, and plan the replay as *new_rid*: the
    Prepared, how the recorded options planned again differ from the recorded plan, and the
    port. The connections are closed when anything fails (RunError: the nodes' problems)."""
    old_rid, old_port = manifest["plan"]["run_id"], manifest["plan"]["master_port"]
    conns = runner.connect_all(cluster, policy, ssh_config)
    try:
        port, facts, problems = choose_port(cluster, conns, old_port,
                                           scriptfile.file_to_check(recorded.script, recorded.module, cwd), cwd,
                                           same_port, run_id=new_rid)
        if problems:
            raise runner.RunError(problems)
        loaded, cluster = cluster, probe.decide(cluster, facts)  # the python the probe ran, as a run decides it
        # the recorded options planned again under the old id and port must give the recorded plan
        again = make_plan(cluster, replace(recorded, run_id=old_rid), runner.plan_facts(facts, old_port, cwd))
        changed = differences(manifest["plan"], again, manifest["schema_version"])
        options = replace(recorded, run_id=new_rid, env=tuple({**dict(recorded.env), **overrides}.items()),
                          master_port=port)
        plan = make_plan(cluster, options, runner.plan_facts(facts, port, cwd))
    except BaseException:
        for c in conns.values():
            c.close()
        raise
    return runner.Prepared(cluster, plan, conns, facts, policy, ssh_config, options, cwd, loaded=loaded), changed, port


def prepare(run_id: str, runs_dir: str | os.PathLike, *, inventory_source: str | list[str] | None = None,
            group: str | None = None, env: Iterable[str] = (), extra_vars: Iterable[str] = (),
            same_port: bool = False, force: bool = False,
            new_id: str | None = None, policy: HostKeyPolicy | None = None, ssh_config: str | None = None,
            say: Callable[[str], object] = lambda line: None) -> Replaying:
    """Everything before the start of a replay of *run_id* (from *runs_dir*): ManifestError,
    InventoryError or PlanError for a record or input that cannot be replayed, ReplayRefused for a
    run that would not be the same (*force* lets a changed inventory or code pass, with a line to
    *say*), RunError for the nodes' problems; nothing has started then. *inventory_source* and
    *group*: instead of the recorded ones; *env*: ``K=V`` given again (masked secrets) or replaced."""
    if new_id:  # named as the caller gave it, before anything is read ("": make one, as run does)
        check_run_id(new_id, option("new_run_id"))
    path = Path(runs_dir) / run_id / "manifest.json"
    manifest = _latest(run_id, runs_dir, path, say)
    recorded, cwd = validate(manifest, str(path))
    refuse_without_input(str(manifest["plan"].get("pdb") or ""))  # a --pdb run replays attached
    cluster, limit, variables = _cluster(run_id, manifest, inventory_source, group, extra_vars)
    overrides = dict(parse_env(list(env), dict(os.environ)))
    _refuse_changes(run_id, manifest, recorded, cluster, overrides, force, say)
    policy = policy or HostKeyPolicy()
    new_rid = new_id or new_run_id()
    prepared, changed, port = _connect_and_plan(manifest, recorded, cwd, cluster, overrides, same_port, new_rid,
                                                policy, ssh_config)
    selection: dict = {"limit": limit} if limit else {}
    if variables:  # the recorded ones and those given again, recorded as a run records them
        selection["extra_vars"] = recordable(variables)
    return Replaying(run_id, prepared, changed, port, manifest["plan"]["master_port"], selection)
