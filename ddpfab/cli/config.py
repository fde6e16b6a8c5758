"""Defaults for the options every inventory command takes: flags > environment > project config.

The project config is ``ddpfab.yml`` (or ``.ddpfab.yml``) in the current directory or the nearest
parent that has one, a small YAML mapping::

    inventory: inventory/cluster.yml   # relative paths are relative to this file
    group: gpus
    limit: "gpus:!gpu07"
    ssh_config: ~/.ssh/config.d/cluster
    known_hosts: ~/.ssh/known_hosts_cluster
    extra_vars: {ddpfab_python: /opt/venv/bin/python}

Environment: ``DDPFAB_INVENTORY``, ``DDPFAB_GROUP``, ``DDPFAB_LIMIT``, ``DDPFAB_SSH_CONFIG``,
``DDPFAB_KNOWN_HOSTS``; ``DDPFAB_CONFIG`` names the config file (empty: none). A flag given on the
command line always wins; an environment variable wins over the file.

Every command that takes an inventory applies them (its parser is marked ``_cluster_args``;
tests/unit/test_cli_defaults.py walks the parser to hold that). ``stop``, ``logs``, ``attach`` and
``replay`` act on a recorded run: its local record's inventory and group win over these defaults,
never over a flag (:func:`given`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpfab.hosts.suggest import did_you_mean
from ddpfab.problems import DdpfabError

NAMES = ("ddpfab.yml", ".ddpfab.yml")
#: config key -> (argparse dest, environment variable, is a path)
KEYS: dict[str, tuple[str, str | None, bool]] = {
    "inventory": ("inventory", "DDPFAB_INVENTORY", True),
    "group": ("group", "DDPFAB_GROUP", False),
    "limit": ("limit", "DDPFAB_LIMIT", False),
    "ssh_config": ("ssh_config", "DDPFAB_SSH_CONFIG", True),
    "known_hosts": ("known_hosts", "DDPFAB_KNOWN_HOSTS", True),
    "extra_vars": ("extra_vars", None, False),
}
DEFAULT_GROUP = "all"


class ConfigError(DdpfabError):
    """The project config cannot be used; the message names the file, the key and the fix."""

    check = "config"


def find(cwd: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The project config file: ``$DDPFAB_CONFIG`` if set (empty: none), else ddpfab.yml or .ddpfab.yml
    in *cwd* or its nearest parent."""
    environ = os.environ if environ is None else environ
    if "DDPFAB_CONFIG" in environ:
        named = environ["DDPFAB_CONFIG"]
        if not named:
            return None
        path = Path(os.path.expanduser(named))
        if not path.is_file():
            raise ConfigError(f"DDPFAB_CONFIG={named}: no such file")
        return path
    here = Path(cwd or os.getcwd()).resolve()
    for d in (here, *here.parents):
        for name in NAMES:
            if (d / name).is_file():
                return d / name
    return None


def read(path: Path) -> dict[str, Any]:
    """The config's mapping, checked: known keys only, values of the right kind, paths made absolute."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config {path}: cannot be read: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of settings, found {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in KEYS:
            raise ConfigError(f"config {path}: unknown setting {key!r}{did_you_mean(str(key), KEYS)}; "
                              f"known: {', '.join(KEYS)}")
        if key == "extra_vars":
            if not isinstance(value, dict):
                raise ConfigError(f"config {path}: extra_vars must be a mapping of variables, found {value!r}")
            out[key] = value
            continue
        if key == "inventory" and isinstance(value, list) and value:
            # several inventories, merged in order (as a repeated -i)
            if not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"config {path}: inventory must be a string or a list of strings, found {value!r}")
            out[key] = [v if "," in v else str((path.parent / os.path.expanduser(v)).resolve()) for v in value]
            continue
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"config {path}: {key} must be a string, found {value!r}")
        value = str(value)
        if KEYS[key][2] and "," not in value:
            value = str((path.parent / os.path.expanduser(value)).resolve())
        out[key] = value
    return out


def apply(args: argparse.Namespace, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> None:
    """Fill the cluster options *args* left unset from the environment, then the project config.

    Only for parsers built with :func:`ddpfab.cli.common.add_cluster_args` (they mark the namespace).
    """
    if not getattr(args, "_cluster_args", False):
        return
    environ = os.environ if environ is None else environ
    config: dict[str, Any] | None = None
    # which options came from here, not the command line: a run's record (stop, logs, replay) names
    # its own inventory, which wins over these defaults but never over a flag
    args._defaulted = set()
    args._origins = {}  # ... and where each came from, with what to do about it (:func:`origin`)
    for key, (dest, env, _path) in KEYS.items():
        if not hasattr(args, dest):
            continue
        if key == "extra_vars":
            if config is None:
                path = find(cwd, environ)
                config = read(path) if path else {}
            if config.get("extra_vars"):
                # the config's come first: a -e on the command line wins over them
                args.extra_vars = [config["extra_vars"], *(args.extra_vars or [])]
            continue
        if getattr(args, dest) not in (None, []):
            continue
        if env and environ.get(env):
            setattr(args, dest, _as_given(key, environ[env]))
            args._defaulted.add(dest)
            args._origins[dest] = f"named by ${env}: give -i INVENTORY, or fix or unset the variable"
            continue
        if config is None:
            path = find(cwd, environ)
            config = read(path) if path else {}
        if key in config:
            setattr(args, dest, _as_given(key, config[key]))
            args._defaulted.add(dest)
            args._origins[dest] = f"named by `{key}:` in {path}: give -i INVENTORY, or fix it there"
    if getattr(args, "group", "") is None:
        args.group = DEFAULT_GROUP
        args._defaulted.add("group")


def origin(args: argparse.Namespace, dest: str) -> str | None:
    """Where option *dest*'s value came from when no flag gave it, and how to change it (``named by
    $DDPFAB_INVENTORY: give -i ...``, or the project config's key and path); None when it was given
    on the command line, or is unset."""
    return getattr(args, "_origins", {}).get(dest)


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether option *dest* was given on the command line (not filled by :func:`apply`)."""
    return getattr(args, dest, None) not in (None, []) and dest not in getattr(args, "_defaulted", set())


def _as_given(key: str, value: Any) -> Any:
    """*value* as its flag would have given it: ``-i`` is repeatable, so the inventory is a list."""
    if key == "inventory" and isinstance(value, str):
        return [value]
    return value


def default_inventory(flag: str | list[str] | None, environ: Mapping[str, str] | None = None,
                      cwd: str | None = None) -> list[str]:
    """The inventory to use: *flag*, else ``$DDPFAB_INVENTORY``, else the project config's, else an error."""
    ns = argparse.Namespace(_cluster_args=True, inventory=flag)
    apply(ns, environ, cwd)
    if not ns.inventory:
        raise ConfigError(MISSING_INVENTORY)
    return _as_given("inventory", ns.inventory)


MISSING_INVENTORY = ("no inventory: give -i INVENTORY (a file, a host list like node1,node2, or a hostfile), "
                     "set DDPFAB_INVENTORY, or put `inventory: PATH` in ./ddpfab.yml")
