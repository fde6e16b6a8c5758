"""The benchmark harness itself, on a small lab: each script runs end to end with its real tools
(pdsh, ssh, ansible, torchrun) and writes a result the report can read. The numbers are not
judged here (speed is measured by the benchmarks, not by timed tests); what is checked is that
every tool ran, answered from every host, and that a crash left nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import session_subnet
from .helpers import REPO


def bench(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "DDPFAB_BENCH_WORK": str(tmp_path / "work"), "NO_COLOR": "1"}
    res = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--quick", "--out", str(out), *args],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_fanout_runs_every_tool_against_every_host(tmp_path):
    data = bench(tmp_path, "fanout", "--sizes", "2", "--no-profile", "--subnet", session_subnet(131))
    tools = {s["tool"] for s in data["series"] if s["hosts"] == 2 and s["median"] is not None}
    # (each tool's output was checked for every host's hostname inside the script, or it fails)
    assert tools == {"ddpfab exec", "pdsh", "ssh loop", "ansible", "ansible (warm)", "ddpfab startup",
                     "ddpfab exec (held)", "in-process cold", "in-process warm"}, tools
    assert data["meta"]["quick"] and "busy_before" in data["meta"]
    assert [c["hosts"] for c in data["controller_cpu"]] == [2] and data["controller_cpu"][0]["median"] > 0


def test_teardown_of_a_ddpfab_run_leaves_no_process(tmp_path):
    data = bench(tmp_path, "teardown", "--sizes", "2", "--launchers", "ddpfab run", "--subnet", session_subnet(132))
    got = {s["scenario"]: s for s in data["series"] if s["tool"] == "ddpfab run" and s["hosts"] == 2}
    assert set(got) == {"crash", "sigint"}, data["series"]
    for scenario, s in got.items():  # gone before the cap: the script polled every host's processes
        assert s["capped"] == 0 and s["median"] is not None and s["median"] < data["config"]["cap_s"], (scenario, s)
    assert got["crash"]["noticed"]["median"] is not None  # ddpfab said which node failed
