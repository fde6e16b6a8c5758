"""Helpers for lab tests: run the real CLI, read rank reports, inspect hosts' process tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "lab" / "scripts"


def ddpfab(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ddpfab", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def start_ddpfab(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpfab", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env={**os.environ, "NO_COLOR": "1"})


def reports(stdout: str) -> list[dict]:
    return [json.loads(line.split("REPORT ", 1)[1]) for line in stdout.splitlines() if "REPORT {" in line]


def job_processes(lab, names=("node1", "node2", "node3")) -> dict[str, list[tuple[int, str]]]:
    """Every non-sshd process on each host: after a job ends this must be empty."""
    return {n: lab.processes(n) for n in names}


def wait_no_processes(lab, timeout: float, names=("node1", "node2", "node3")) -> float:
    """Seconds until no job process is left on any host; fails the test after *timeout*."""
    start = time.monotonic()
    while True:
        left = {n: p for n, p in job_processes(lab, names).items() if p}
        if not left:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"processes left on hosts after {timeout} s: {left}")
        time.sleep(0.05)


def host_tmp_leftovers(lab, name: str) -> list[str]:
    """What host *name* wrote to its /tmp (its overlay's upper layer): files and empty dirs.

    Python's bytecode cache of the checkout itself does not count: when the checkout lies under
    /tmp (as in CI) the hosts import ddpfab from it (shared code, as on NFS), which writes
    ``__pycache__`` there; parent dirs of what is listed do not count either."""
    tmp_upper = Path(lab.store) / name / "upper_tmp"
    left = []
    for p in tmp_upper.rglob("*"):
        if p.is_dir() and any(p.iterdir()):
            continue
        real = Path("/tmp") / p.relative_to(tmp_upper)
        if real.is_relative_to(REPO) and "__pycache__" in real.relative_to(REPO).parts:
            continue
        left.append(str(p.relative_to(tmp_upper)))
    return left
