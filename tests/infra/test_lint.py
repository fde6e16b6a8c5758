"""ansible-lint (production profile) and yamllint over playbooks/ and roles/, so CI enforces both.

Configuration: .ansible-lint and .yamllint at the repo root. Missing tools are a failure, not a
skip: they are in the `test` extra (pip install -e '.[test]').
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    # no ANSIBLE_* of this process: ddpfab.inventory makes Ansible's inventory parsing strict through
    # them when another test loaded an inventory in this worker, and a syntax check has none to parse
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env = {**clean, "NO_COLOR": "1", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(argv, cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=300)


def test_yamllint_passes_on_playbooks_and_roles():
    proc = _run([_tool("yamllint"), "--strict", "playbooks", "roles", ".yamllint", ".ansible-lint"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ansible_lint_production_profile_passes():
    proc = _run([_tool("ansible-lint"), "--profile", "production", "--offline", "playbooks", "roles"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out
