"""Issue 25: no false preflight alarm on a healthy 8-node lab under a CPU hog. Three runs of the
small DDP job (tests/lab/scripts/res_train.py: a DataLoader with 2 workers, all_reduces, a
checkpoint into the workdir) while two busy-looping processes (one per core of the test machine)
compete with the job: each run finishes, and its preflight report (the run dir's check.json)
has no failure and no resource warning on any node."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import SCRIPTS, ddpfab, reports

RESOURCE_CHECKS = {"shm", "disk", "nofile", "memlock", "memory", "leftovers"}


@pytest.fixture(scope="module")
def lab8(tmp_path_factory):
    with own_lab(tmp_path_factory, "loadlab", hosts=8, subnet=extra_subnet(172)) as the_lab:
        yield the_lab


def test_healthy_8_nodes_under_a_cpu_hog_three_runs_no_false_alarm(lab8, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(SCRIPTS / "res_train.py", proj / "res_train.py")
    inv = yaml.safe_load(labmod.render_inventory(lab8, sys.executable).split("\n", 1)[1])
    inv["all"]["vars"]["ddpfab_workdir"] = "/root/ddpfab-loadlab"
    (proj / "inv.yml").write_text(yaml.safe_dump(inv))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(3):
            res = ddpfab("run", "-i", str(proj / "inv.yml"), "--runs-dir", str(proj / "runs"), "--run-id", f"load{i}",
                         *(["--no-sync"] if i else []), "res_train.py", "2", timeout=600, cwd=proj)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            assert "preflight" not in res.stderr, res.stderr
            assert len(reports(res.stdout)) == 8
            check = json.loads((proj / "runs" / f"load{i}" / "check.json").read_text())
            assert check["ok"] and not check["problems"]
            seen = [r for r in check["results"] if r["check"] in RESOURCE_CHECKS]
            assert {r["node"] for r in seen} == {f"node{k}" for k in range(1, 9)}
            assert all(r["status"] == "pass" for r in seen), [r for r in seen if r["status"] != "pass"]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
