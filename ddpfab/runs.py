"""Local run records: ``runs/<run-id>/manifest.json`` and one log per node.

The manifest is the plan plus what happened (per-node exit codes and timings, who failed first),
so a run can be understood, and redone by hand, long after it ended.
"""

from __future__ import annotations

import json
import os
import platform
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__

#: Env values whose key matches this are masked in manifests and printed plans.
SECRET_KEY = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE)", re.IGNORECASE)
MASK = "***"


def new_run_id() -> str:
    """Sortable by time, unique enough for two runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def mask_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if SECRET_KEY.search(k) else v) for k, v in env.items()}


def mask_plan(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a plan dict with secret env values masked, by key (the plan holds no rendered
    command: whatever is rendered from the masked plan shows no secret either)."""
    out = json.loads(json.dumps(plan_dict))
    for node in out["nodes"]:
        node["env"] = mask_env(node["env"])
    return out


#: Options whose value is ``KEY=VALUE`` for the ranks' environment.
ENV_OPTIONS = ("--env",)


def mask_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-looking ``--env KEY=VALUE`` options masked (for
    the manifest's record of how ddpfab was called)."""
    out, after_env = [], False
    for word in argv:
        if word == "--":
            out.append(word)
            after_env = False
            continue
        opt, eq, rest = word.partition("=")
        if after_env or (eq and opt in ENV_OPTIONS):
            pair = word if after_env else rest
            key, sep, value = pair.partition("=")
            if sep and SECRET_KEY.search(key):
                pair = f"{key}={MASK}"
            word = pair if after_env else f"{opt}={pair}"
        out.append(word)
        after_env = word in ENV_OPTIONS
    return out


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


def controller_info() -> dict[str, Any]:
    info = {"ddpfab": __version__, "python": platform.python_version(), "host": platform.node(),
            "argv": mask_argv(sys.argv)}
    # here, not at the top: importlib.metadata costs ~0.27 s (see LAZY in ddpfab/cli/__init__.py), and
    # render, and through it export and the command line's parser, import this module for mask_env
    from importlib.metadata import version

    try:
        info["fabric"] = version("fabric")
        info["ansible-core"] = version("ansible-core")
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return info
