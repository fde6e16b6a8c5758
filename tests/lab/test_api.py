"""The library API on real lab hosts: README's "As a library" example, exactly as printed there."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import ddpfab
from ddpfab.hosts.inventory import InventoryError
from ddpfab.launch.rerun import ReplayRefused
from ddpfab.planning.plan import PlanError
from ddpfab.remote.reaper import pid_alive

from .helpers import REPO, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")


def readme_example() -> str:
    """The python block of README's "As a library" section, as the README shows it."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## As a library\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "README's 'As a library' section shows one python example"
    return blocks[0]


def test_the_readme_api_example_runs_a_two_node_job_and_returns_its_result(lab, inventory2, tmp_path):
    # the example's relative paths, in a dir of its own (the lab hosts see the test's temp dirs)
    (tmp_path / "lab").mkdir()
    shutil.copy(inventory2, tmp_path / "lab" / "inventory.yml")
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "train.py", tmp_path / "examples" / "train.py")
    code = readme_example()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "NO_COLOR": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    # the example's last three lines: the run (ok, the nodes with an outcome, the manifest's path),
    # what fetch copied (rank 1's node's run dir), the doctor's verdict on the ended job
    ran, fetched, verdict = res.stdout.splitlines()[-3:]
    ok, rest = ran.split(" ", 1)
    nodes_text, manifest = rest.rsplit("] ", 1)
    assert ok == "True"
    assert ast.literal_eval(nodes_text + "]") == ["node1", "node2"]
    run_id = json.loads((tmp_path / manifest).read_text())["run_id"]
    local, files = fetched.rsplit(" ", 1)
    assert local == str(tmp_path / "node-logs" / run_id) and int(files) >= 3, fetched
    # the node's own record of its part: node2 (node rank 1) ran global ranks 2 and 3
    assert json.loads((tmp_path / "node-logs" / run_id / "result.json").read_text())["exit_code"] == 0
    assert "rank 3 done" in (tmp_path / "node-logs" / run_id / "output.log").read_text()
    assert verdict.startswith("the job has ended on every node") and "node1, node2 exit code 0" in verdict, verdict
    assert list((tmp_path / "runs" / run_id).glob("doctor-*.json")), "the doctor's record is kept with the run"
    record = json.loads((tmp_path / manifest).read_text())
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert {n: v["exit_code"] for n, v in record["nodes"].items()} == {"node1": 0, "node2": 0}
    # the job really ran: 2 nodes x 2 procs, every rank through its steps, with the env given
    assert record["plan"]["world_size"] == 4
    assert all(n["env"].get("OMP_NUM_THREADS") == "1" for n in record["plan"]["nodes"])
    for rank in range(4):
        assert f"rank {rank} done, parameter checksum" in res.stdout, res.stdout
    # the library printed the command's lines (prefixed output, the closing line where rank 0 is)
    assert re.search(r"^node2 r3\| rank 3 step 1 mean loss", res.stdout, re.M), res.stdout
    assert "ddpfab: rank 0's workdir: node1:" in res.stderr, res.stderr
    wait_no_processes(lab, timeout=5)


def test_api_refusals_dry_run_and_exec_are_the_commands(lab, inventory2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print('never')\n")
    cluster = ddpfab.Cluster.load(str(inventory2))
    assert cluster.names == ["node1", "node2"]
    with pytest.raises(PlanError, match="nproc_per_nod"):  # a misspelt option names the one meant
        cluster.run("t.py", nproc_per_nod=2)
    with pytest.raises(PlanError, match="tain.py"):  # as `run`: a script not here is named before any contact
        cluster.run("tain.py")
    # a dry run is the real run minus starting: probed, planned, nothing recorded
    outcome = cluster.run("t.py", dry_run=True, runs_dir=str(tmp_path / "runs"))
    assert outcome.exit_code == 0 and outcome.manifest is None and not (tmp_path / "runs").exists()
    assert [n.name for n in outcome.plan.nodes] == ["node1", "node2"]
    # exec: per node results, a failure on one node is data next to the others
    results = cluster.exec("test $(hostname) = node1")
    assert {n: r.exit_code for n, r in results.items()} == {"node1": 0, "node2": 1}
    assert results.failed == {}
    with pytest.raises(InventoryError, match="node7"):
        cluster.exec("true", nodes=["node7"])


def test_ps_stop_and_logs_are_calls_of_the_api(lab, inventory2, tmp_path, monkeypatch):
    """A detached job: ``Cluster.ps`` lists it running on both nodes, ``Cluster.stop`` ends it on
    both (``.ok``: nothing left), ``ps`` then says stopped, ``Cluster.logs`` copies both nodes'
    output; an unreachable node is a problem of ``ps``, the other node still listed."""
    monkeypatch.chdir(REPO)
    runs = str(tmp_path / "runs")
    cluster = ddpfab.Cluster.load(str(inventory2))
    started = cluster.run("tests/lab/scripts/tmux_ranks.py", detach=True, sync=False, runs_dir=runs,
                          run_id="api-ps-1")
    assert started.ok, started
    jobs = cluster.ps(runs_dir=runs)
    assert jobs.ok and not jobs.problems
    row = next(r for r in jobs.runs if r["run_id"] == "api-ps-1")
    assert row["state"] == "running" and set(row["nodes"]) == {"node1", "node2"}, row
    remote = {n["name"]: n["remote_dir"] for n in json.loads((tmp_path / "runs" / "api-ps-1" / "manifest.json")
                                                              .read_text())["plan"]["nodes"]}
    deadline = time.monotonic() + 120
    while not all(r.exit_code == 0 for r in cluster.exec(f"grep -q ready {remote['node1']}/output.log").values()):
        assert time.monotonic() < deadline, "the ranks never said they were ready"
        time.sleep(0.5)
    stopped = cluster.stop("api-ps-1", runs_dir=runs)
    assert stopped.ok and stopped.left == [] and set(stopped.said) == {"node1", "node2"}, stopped
    wait_no_processes(lab, timeout=10)
    row = next(r for r in cluster.ps(runs_dir=runs).runs if r["run_id"] == "api-ps-1")
    assert row["state"] == "stopped", row
    # logs: each node's output copied next to the record, its lines counted; a run no node ran is
    # a problem per node, nothing copied
    logs = cluster.logs("api-ps-1", runs_dir=runs)
    assert logs.ok and set(logs.files) == {"node1", "node2"}, logs
    for name, path in logs.files.items():
        assert path == tmp_path / "runs" / "api-ps-1" / f"{name}.remote.log"
        assert logs.lines[name] == len(path.read_text().splitlines()), (name, path.read_text())
    assert "rank 0 on node1 ready" in logs.files["node1"].read_text()
    assert "rank 1 on node2 ready" in logs.files["node2"].read_text()
    none = cluster.logs("api-none-1", runs_dir=runs)
    assert not none.ok and none.files == {} and not (tmp_path / "runs" / "api-none-1").exists()
    assert sorted((p.node, p.check) for p in none.problems) == [("node1", "logs.no-run"), ("node2", "logs.no-run")]
    # a node that cannot be reached: a problem about it, the other node's jobs still listed
    inv = tmp_path / "broken.yml"
    inv.write_text(inventory2.read_text().replace(lab.host("node2").address, "10.255.255.1"))
    jobs = ddpfab.Cluster.load(str(inv)).ps(runs_dir=runs)
    assert not jobs.ok and [p.node for p in jobs.problems] == ["node2"], jobs.problems
    assert any(r["run_id"] == "api-ps-1" and set(r["nodes"]) == {"node1"} for r in jobs.runs), jobs.runs


def test_replay_is_a_call_of_the_api(lab, inventory2, tmp_path, monkeypatch):
    """``Cluster.replay``: a dry run plans the recorded run again (the plan shown through
    *on_plan*, nothing recorded); a replay runs it under a new id with the recorded env, recorded
    as a replay of it; once the script changed, a replay is refused and nothing starts."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from rank', os.environ['RANK'], os.environ['GREETING'])\n")
    runs = str(tmp_path / "runs")
    first = ddpfab.Cluster.load(str(inventory2)).run("hello.py", runs_dir=runs, env=["GREETING=hi"],
                                                     run_id="api-replay-1", out=io.StringIO())
    assert first.ok, first
    shown: list = []
    dry = ddpfab.Cluster.replay("api-replay-1", runs_dir=runs, dry_run=True,
                                on_plan=lambda plan, targets: shown.append((plan, targets)))
    assert dry.ok and dry.of == "api-replay-1" and dry.changed == [] and dry.manifest is None, dry
    assert [n.name for n in shown[0][0].nodes] == ["node1", "node2"] and set(shown[0][1]) == {"node1", "node2"}
    assert not (tmp_path / "runs" / dry.run_id).exists()
    out = io.StringIO()
    again = ddpfab.Cluster.replay("api-replay-1", runs_dir=runs, new_run_id="api-replay-2", out=out)
    assert again.ok and again.run_id == "api-replay-2" and again.of == "api-replay-1", again
    assert json.loads(again.manifest.read_text())["replay_of"] == "api-replay-1"
    assert re.search(r"^node2 r1\| hello from rank 1 hi$", out.getvalue(), re.M), out.getvalue()
    script.write_text("print('changed')\n")
    with pytest.raises(ReplayRefused, match="the code changed since the run") as refused:
        ddpfab.Cluster.replay("api-replay-1", runs_dir=runs, new_run_id="api-replay-3")
    assert refused.value.lines[0].startswith("replay of api-replay-1 refused:"), refused.value.lines
    assert not (tmp_path / "runs" / "api-replay-3").exists()
    wait_no_processes(lab, timeout=5)


def test_hold_held_and_release_are_calls_of_the_api(lab, inventory2):
    """``Cluster.hold`` starts the holder (both nodes connected), a second call finds it,
    ``held`` names it, ``exec`` runs over it, ``release`` ends its process; a bad idle is refused."""
    cluster = ddpfab.Cluster.load(str(inventory2))
    with pytest.raises(PlanError, match="idle"):
        cluster.hold(idle=0)
    held = cluster.hold(idle=120)
    try:
        assert held.ok and not held.already and held.connected == ["node1", "node2"], held
        assert pid_alive(held.pid)
        # no child of the caller: a long-lived caller would keep it a zombie once it ends
        assert int(open(f"/proc/{held.pid}/stat").read().rsplit(")", 1)[1].split()[1]) != os.getpid()
        again = cluster.hold(idle=120)
        assert again.already and again.pid == held.pid, again
        assert cluster.held().pid == held.pid
        results = cluster.exec("test $(hostname) = node1", printer=None)
        assert {n: (r.exit_code, r.held) for n, r in results.items()} == {"node1": (0, True), "node2": (1, True)}
    finally:
        released = cluster.release()
    assert released is not None and released.pid == held.pid
    assert not pid_alive(held.pid) and cluster.held() is None
    assert cluster.release() is None  # none: nothing to end
