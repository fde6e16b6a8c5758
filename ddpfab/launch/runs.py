"""Local run records: ``runs/<run-id>/manifest.json`` and one log per node.

The manifest is the plan plus what happened (per-node exit codes and timings, who failed first),
so a run can be understood, and redone by hand, long after it ended.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from ddpfab.version import __version__
from ddpfab import masking
from ddpfab.hosts import inventory
from ddpfab.planning.plan import Plan, is_run_id
from ddpfab.problems import DdpfabError

#: The masking rule lives in :mod:`ddpfab.masking` (re-exported here for the run record's users).
SECRET_KEY, MASK = masking.SECRET_KEY, masking.MASK


class RunRecordError(DdpfabError):
    """A local run record that cannot be read as one; the message names the file and the fix."""

    check = "record"


def load_manifest(runs_dir: str | os.PathLike, run_id: str) -> dict | None:
    """``RUNS_DIR/RUN_ID/manifest.json`` as JSON, unchecked (None when there is none)."""
    path = Path(runs_dir) / run_id / "manifest.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data is None:  # a file that holds `null` is a broken record, not a missing one
        raise ValueError(f"{path}: null")
    return data


def read_record(runs_dir: str | os.PathLike, run_id: str) -> dict | None:
    """``RUNS_DIR/RUN_ID/manifest.json`` (None when there is none), checked as data before anything
    reads it: an object with the run's id and a plan whose nodes have names and remote dirs.

    Raises:
        RunRecordError: the file is there but is no run record (the message names it and the fix).
    """
    where = Path(runs_dir) / run_id / "manifest.json"
    try:
        manifest = load_manifest(runs_dir, run_id)
    except (OSError, ValueError) as exc:
        raise RunRecordError(f"{where} cannot be read as a run record ({type(exc).__name__}); move it out of "
                             f"{runs_dir} (then -i INVENTORY names the nodes)") from None
    if manifest is None:
        return None
    plan = manifest.get("plan") if isinstance(manifest, dict) else None
    nodes = plan.get("nodes") if isinstance(plan, dict) else None
    ok = (is_run_id(manifest.get("run_id") if isinstance(manifest, dict) else None)
          and isinstance(plan, dict) and isinstance(nodes, list)
          and plan.get("run_id", manifest["run_id"]) == manifest["run_id"]  # (doctor writes under the plan's)
          and all(isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("remote_dir"), str)
                  for n in nodes)
          and all(isinstance(plan.get(k), (str, type(None))) for k in ("inventory", "group")))
    if not ok:
        raise RunRecordError(f"{where} is not a ddpfab run record (expected an object with run_id and a plan whose "
                             "nodes have a name and remote_dir); move it out of "
                             f"{runs_dir} (then -i INVENTORY names the nodes)")
    return manifest


def record_plan(manifest: dict, runs_dir: str | os.PathLike, command: str) -> Plan:
    """A run record's plan, read back as data (checked, never trusted); *command* names what needs it."""
    try:
        return Plan.from_dict(manifest["plan"], legacy=manifest.get("schema_version") == 2)
    except (KeyError, TypeError, ValueError):
        raise RunRecordError(f"{Path(runs_dir) / manifest['run_id']}/manifest.json: its plan cannot be read "
                             f"back; {command} needs the record of a run this ddpfab started") from None


def new_run_id() -> str:
    """Sortable by time, unique enough for two runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def mask_env(env: dict[str, str], marked: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """*env* as shown and recorded (:func:`ddpfab.masking.mask_env`); *marked*: keys marked secret."""
    return masking.mask_env(env, marked)


def mask_plan(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a plan dict with secret env values masked, by key and URL structure, the plan's
    own marked keys (``secret_env``) included (the plan holds no rendered command: whatever is
    rendered from the masked plan shows no secret either)."""
    out = json.loads(json.dumps(plan_dict))
    marked = out.get("secret_env") or ()
    for node in out["nodes"]:
        node["env"] = mask_env(node["env"], marked)
        if isinstance(node.get("setup"), list):
            node["setup"] = list(masking.mask_setup(node["setup"], marked))
    return out


#: Options whose value is ``KEY=VALUE`` for the ranks' environment.
ENV_OPTIONS = ("--env",)
#: Options whose value marks a key secret (``--secret-env KEY``).
SECRET_ENV_OPTIONS = ("--secret-env",)


def _marked_in(argv: list[str]) -> set[str]:
    """The keys ``--secret-env KEY`` / ``--secret-env=KEY`` marks in *argv* (before any ``--``)."""
    marked: set[str] = set()
    for i, word in enumerate(argv):
        if word == "--":
            break
        opt, eq, rest = word.partition("=")
        if eq and opt in SECRET_ENV_OPTIONS:
            marked.add(rest)
        elif word in SECRET_ENV_OPTIONS and i + 1 < len(argv):
            marked.add(argv[i + 1])
    return marked


def mask_argv(argv: list[str], marked: tuple[str, ...] | list[str] = ()) -> list[str]:
    """A command line with the values of secret ``--env KEY=VALUE`` options masked (for the
    manifest's record of how ddpfab was called): by :mod:`ddpfab.masking`'s rule, with the keys
    the command line itself marks (``--secret-env``) and *marked* (e.g. the inventory's)."""
    marked = tuple(set(marked) | _marked_in(argv))
    out, after_env, after_vars = [], False, False
    for word in argv:
        if word == "--":
            out.append(word)
            after_env = after_vars = False
            continue
        opt, eq, rest = word.partition("=")
        if after_vars or (eq and opt in EXTRA_VARS_OPTIONS):
            word = masked_extra_vars(word) if after_vars else f"{opt}={masked_extra_vars(rest)}"
        elif after_env or (eq and opt in ENV_OPTIONS):
            pair = word if after_env else rest
            key, sep, value = pair.partition("=")
            if sep:
                pair = f"{key}={masking.mask_value(key, value, marked)}"
            word = pair if after_env else f"{opt}={pair}"
        out.append(word)
        after_env, after_vars = word in ENV_OPTIONS, word in EXTRA_VARS_OPTIONS
    return out


#: Options whose value is extra vars (Ansible's ``-e``).
EXTRA_VARS_OPTIONS = ("-e", "--extra-vars")


def masked_extra_vars(value: str) -> str:
    """An ``-e`` value as recorded: as given when nothing in it is secret, else its variables as
    JSON with the secrets masked (:func:`ddpfab.masking.recordable`: by key, and the assignments in
    setup lines); a file (``@vars.yml``) is recorded by name."""
    if value.startswith("@"):
        return value
    try:
        parsed = inventory.parse_extra_vars([value])
    except inventory.InventoryError:  # not variables (the run refuses it): its assignments masked anyway
        return masking.mask_setup_line(value)
    shown = masking.recordable(parsed)
    return value if shown == parsed else json.dumps(shown)


def runs_dir_problem(root: str | os.PathLike, writable: bool = True) -> str | None:
    """Why no run dir can be made under *root* (a file there, or in its path; with *writable*, not
    writable), None when one can. Nothing is created: the dry run asks it too (without
    *writable*: it writes nothing, and may run from a read-only checkout)."""
    path = Path(os.path.abspath(root))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a directory"
    if writable and not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this user"
    return None


class RunDir:
    """A private local directory for one run."""

    def __init__(self, root: str | os.PathLike, run_id: str):
        self.path = Path(root) / run_id
        self.path.mkdir(parents=True, exist_ok=False, mode=0o700)
        os.chmod(self.path, 0o700)

    @classmethod
    def existing(cls, root: str | os.PathLike, run_id: str) -> RunDir:
        """The directory of a run recorded already (to update its manifest)."""
        self = cls.__new__(cls)
        self.path = Path(root) / run_id
        if not self.path.is_dir():
            raise FileNotFoundError(f"no run record {self.path}")
        return self

    def log_path(self, node: str) -> Path:
        return self.path / f"{node}.log"

    def write_manifest(self, manifest: dict[str, Any]) -> Path:
        return self.write_json("manifest.json", manifest)

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        """Write *name* in the run dir whole or not at all (a reader never sees half a file)."""
        path = self.path / name
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        os.replace(tmp, path)
        return path


def controller_info(marked: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """ddpfab's own side of a run record; *marked*: env keys marked secret (masked in the argv too)."""
    info = {"ddpfab": __version__, "python": platform.python_version(), "host": platform.node(),
            "argv": mask_argv(sys.argv, marked)}
    # here, not at the top: importlib.metadata costs ~0.27 s (see LAZY in ddpfab/cli/__init__.py), and
    # render, and through it export and the command line's parser, import this module for mask_env
    from importlib.metadata import version

    try:
        info["fabric"] = version("fabric")
        info["ansible-core"] = version("ansible-core")
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return info
