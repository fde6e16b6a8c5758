"""A run that waits says why: with no rank printing, ddpfab names the nodes it waits for (grouped
by state), at a growing interval, and the manifest keeps each node's last state."""

from __future__ import annotations

import json
import re

import pytest

from .helpers import ddpfab

pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_a_silent_run_reports_which_nodes_it_waits_for(lab, inventory2, tmp_path):
    (tmp_path / "quiet.py").write_text("import time\ntime.sleep(8)\n")  # no rank ever prints
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), "quiet.py",
                 cwd=tmp_path, env={"DDPFAB_WAIT_REPORT_S": "2"})
    assert res.returncode == 0, res.stdout + res.stderr
    notes = [ln for ln in res.stdout.splitlines() if ln.startswith("ddpfab: waiting:")]
    # after 2 s of silence, then 4 s later, 8 s later...: a growing interval, not a note every 2 s
    assert notes, res.stdout
    quiet = [int(re.search(r"for (\d+) s", n).group(1)) for n in notes]
    gaps = [b - a for a, b in zip(quiet, quiet[1:])]
    assert quiet[0] in (2, 3) and all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), notes
    assert "node1" in notes[0] and "node2" in notes[0]
    assert "in rendezvous" in notes[0] or "silent since start" in notes[0]
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert {n: o["last_state"] for n, o in manifest["nodes"].items()} == {"node1": "ended", "node2": "ended"}
