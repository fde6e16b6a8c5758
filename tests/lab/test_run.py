"""`ddpfab run` on real lab hosts: real sshd, real torchrun with gloo, real process tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .helpers import REPO, ddpfab, reports, start_ddpfab, wait_no_processes

REPORT = "tests/lab/scripts/report.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_two_nodes_two_procs_agree_on_everything(lab, inventory2, tmp_path):
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--runs-dir", str(tmp_path / "runs"),
                 REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3]
    assert {r["world_size"] for r in got} == {4}
    # node_rank follows inventory order: node1 is 0, node2 is 1
    assert {(r["hostname"], r["node_rank"]) for r in got} == {("node1", 0), ("node2", 1)}
    assert {(r["master_addr"], r["master_port"]) for r in got} == {(lab.host("node1").address, got[0]["master_port"])}
    assert {r["sum"] for r in got} == {1 + 2 + 3 + 4}
    # the printed prefix carries host and global rank
    for r in got:
        assert any(line.startswith(f"{r['hostname']} r{r['rank']}| REPORT") for line in res.stdout.splitlines())

    manifest_path = next((tmp_path / "runs").glob("*/manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    assert manifest["state"] == "succeeded" and manifest["exit_code"] == 0
    assert {n: v["exit_code"] for n, v in manifest["nodes"].items()} == {"node1": 0, "node2": 0}
    assert [n["node_rank"] for n in manifest["plan"]["nodes"]] == [0, 1]
    assert manifest["plan"]["master_port"] == got[0]["master_port"]
    assert {r["run_id"] for r in got} == {manifest["run_id"]}
    run_dir = manifest_path.parent
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    # the preflight's full report (what `check --json` prints) is kept with the run
    assert manifest["check"] == "check.json"
    check = json.loads((run_dir / "check.json").read_text())
    assert check["ok"] is True and check["nodes"] == ["node1", "node2"]
    assert check["mesh"]["pairs_probed"] == check["mesh"]["pairs_total"] == 2
    assert {(r["node"], r["status"]) for r in check["results"] if r["check"] == "mesh"} == {
        ("node1", "pass"), ("node2", "pass")}
    for node in ("node1", "node2"):
        assert "REPORT" in (run_dir / f"{node}.log").read_text()
    wait_no_processes(lab, timeout=5)
    # its id names this run on the nodes too: from another runs dir, the id is refused before anything
    # starts, on each node (it failed both nodes with exit code 125 and wrote a failed record)
    for dry in ((), ("--dry-run",)):
        again = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "other"), "--run-id",
                       manifest["run_id"], *dry, REPORT)
        assert again.returncode == 2, again.stdout + again.stderr
        for node in ("node1", "node2"):
            assert f"host {node}: " in again.stderr and "this run id was used on this node already" in again.stderr
        assert not (tmp_path / "other" / manifest["run_id"]).exists()


def test_script_args_arrive_byte_for_byte(lab, inventory2, tmp_path):
    nasty = ["with space", "it's \"quoted\"", "$HOME and ${PATH}", "a;b && c | d", "`id` $(id)",
             "non-ascii: héllo wörld ✓ 日本", "", "--flag=x y", "*", "\\back\\slash", "new\nline"]
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), REPORT, *nasty)
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert len(got) == 2
    for r in got:
        assert r["argv"] == nasty


def test_failing_rank_stops_every_node_within_seconds(lab, inventory2, tmp_path):
    start = time.monotonic()
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--runs-dir", str(tmp_path / "runs"),
                 "--env", "REPORT_FAIL_RANK=3", "--env", "REPORT_FAIL_AFTER=2", "--env", "REPORT_FAIL_RAISE=1",
                 REPORT, timeout=90)
    elapsed = time.monotonic() - start
    assert res.returncode != 0
    assert "node2" in res.stderr and "node_rank 1" in res.stderr, res.stderr
    assert "failing on purpose" in res.stdout
    # ddpfab's own closing line quotes the cause: node, rank, exit code and the rank's exception line
    closing = [ln for ln in res.stderr.splitlines() if ln.startswith("ddpfab: failed: ")]
    assert len(closing) == 1, res.stderr
    assert closing[0].startswith("ddpfab: failed: node2 (node_rank 1) exit code ")
    assert "rank 3 (local rank 1)" in closing[0] and closing[0].count("RuntimeError: rank 3 failing on purpose") == 1
    # without ddpfab the other ranks would wait in init for the 120 s process-group timeout
    assert elapsed < 45, f"took {elapsed:.1f} s"
    wait_no_processes(lab, timeout=3)
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert manifest["state"] == "failed" and manifest["first_failure"] == "node2"
    assert manifest["nodes"]["node1"]["stopped_by_ddpfab"] is True
    cause = manifest["nodes"]["node2"]["cause"]
    assert (cause["rank"], cause["local_rank"], cause["exception"]) == (3, 1, "RuntimeError: rank 3 failing on purpose")
    assert "RuntimeError: rank 3 failing on purpose" in manifest["summary"]


def _wait_for_lines(proc: subprocess.Popen, marker: str, count: int, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while sum(marker in ln for ln in lines) < count:
        assert time.monotonic() < deadline, "ranks never got ready:\n" + "".join(lines)
        line = proc.stdout.readline()
        assert line, "ddpfab ended early:\n" + "".join(lines)
        lines.append(line)
    return lines


def test_sigint_stops_every_process_on_every_host(lab, inventory2, tmp_path):
    proc = start_ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--runs-dir",
                        str(tmp_path / "runs"), "--env", "REPORT_HANG=300", REPORT)
    try:
        _wait_for_lines(proc, "READY", 4, timeout=90)
        assert lab.processes("node1") and lab.processes("node2")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    took = wait_no_processes(lab, timeout=5)
    assert took < 5
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert manifest["state"] == "interrupted"


def test_two_quick_sigints_leave_at_once_and_still_end_the_record(lab, inventory2, tmp_path):
    """The second signal is the way out of a run that does not stop in time; it left the record at
    "running" for good (3 times in 3)."""
    proc = start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"),
                        "--env", "REPORT_HANG=300", REPORT)
    try:
        _wait_for_lines(proc, "READY", 2, timeout=90)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    wait_no_processes(lab, timeout=10)
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert (manifest["state"], manifest["exit_code"], manifest["interrupted"]) == ("interrupted", 130, "SIGINT")
    assert manifest["ended"] >= manifest["started"]


def test_a_closed_stdout_stops_the_job_says_so_and_records_it(lab, inventory2, tmp_path):
    """`ddpfab run ... | head`: the reader going away ends the run as an interrupt would (the job
    stopped on every node, one line on stderr, the manifest finished), exit 141. It used to fail
    a node with a BrokenPipeError and leave the manifest "running"."""
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "run", "-i", str(inventory2), "--runs-dir",
                             str(tmp_path / "runs"), "tests/lab/scripts/ticker.py"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "NO_COLOR": "1"})
    try:
        _wait_for_lines(proc, "READY", 2, timeout=90)
        proc.stdout.close()  # `| head` has had enough; the ranks' next lines meet a closed pipe
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    assert "stdout was closed" in err and "the job was stopped on every node" in err and "Traceback" not in err
    wait_no_processes(lab, timeout=5)
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert (manifest["state"], manifest["exit_code"]) == ("interrupted", 141)
    assert all(not o.get("error") for o in manifest["nodes"].values()), manifest["nodes"]


def test_attach_with_a_closed_stdout_detaches_and_the_job_goes_on(lab, inventory2, tmp_path):
    """`ddpfab attach RUN | head`: the follow ends (141, one line), the detached job does not."""
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(runs), "--detach", "tests/lab/scripts/ticker.py")
    assert res.returncode == 0, res.stdout + res.stderr
    run_id = next(runs.glob("*/manifest.json")).parent.name
    try:
        att = subprocess.Popen([sys.executable, "-m", "ddpfab", "attach", "--no-color", "--runs-dir", str(runs), run_id],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            att.stdout.readline()
            att.stdout.close()
            _, err = att.communicate(timeout=20)
        finally:
            att.kill()
        assert att.returncode == 141 and "the job goes on" in err and "Traceback" not in err, err
        assert lab.processes("node1") and lab.processes("node2")
    finally:
        stop = ddpfab("stop", "--runs-dir", str(runs), run_id)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_no_processes(lab, timeout=8)


def test_sigkill_of_ddpfab_leaves_no_orphan(lab, inventory2, tmp_path):
    """The supervisor notices the controller's link is gone (stdin EOF) and ends the job tree."""
    proc = start_ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"),
                        "--env", "REPORT_HANG=300", REPORT)
    try:
        _wait_for_lines(proc, "READY", 2, timeout=90)
        proc.kill()
        proc.wait(timeout=5)
    finally:
        proc.kill()
    wait_no_processes(lab, timeout=8)


def test_dry_run_commands_reproduce_the_run_over_plain_ssh(lab, inventory2, tmp_path):
    """The commands --dry-run prints, pasted into plain `ssh` sessions, give the same run."""
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--dry-run", REPORT, "x y")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    commands = {}
    for i, line in enumerate(lines):
        if line.startswith("# node") and "ssh" in line:
            commands[line.split()[1]] = lines[i + 1]
    assert set(commands) == {"node1", "node2"}
    assert all(lab.processes(n) == [] for n in ("node1", "node2")), "dry-run must start nothing"
    # output to files, not pipes: an undrained pipe would stall one node and with it the job
    logs = {name: tmp_path / f"{name}.out" for name in commands}
    procs = [subprocess.Popen(["ssh", "-F", str(lab.ssh_config), name, cmd], stdout=logs[name].open("w"),
                              stderr=subprocess.STDOUT) for name, cmd in commands.items()]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs.values()]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = reports("\n".join(outs))
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3]
    assert {r["sum"] for r in got} == {10.0}
    assert all(r["argv"] == ["x y"] for r in got)


def test_the_dry_run_refuses_what_the_real_run_would_and_nothing_more(lab, inventory2, tmp_path):
    """A fresh workdir on the nodes: the real run copies the code there first, so its dry run
    plans it (the script checked here); with --no-sync the real run would refuse it, and so does
    its dry run; a script missing here is refused either way."""
    fresh = f"/tmp/ddpfab-fresh-{uuid.uuid4().hex[:8]}"
    common = ["run", "-i", str(inventory2), "-e", f"ddpfab_workdir={fresh}", "--dry-run"]
    synced = ddpfab(*common, REPORT)
    assert synced.returncode == 0, synced.stderr
    assert synced.stdout.count(f"cd {fresh} && ") == 2
    unsynced = ddpfab(*common, "--no-sync", REPORT)
    assert unsynced.returncode == 2 and f"workdir {fresh} does not exist" in unsynced.stderr, unsynced.stderr
    missing = ddpfab(*common, "tests/lab/scripts/nope.py")
    assert missing.returncode == 2 and "script tests/lab/scripts/nope.py not found" in missing.stderr
    assert all(lab.processes(n) == [] for n in ("node1", "node2")), "a dry run starts nothing"


def test_ini_and_yaml_inventories_launch_the_same_job(lab, tmp_path):
    """An INI inventory with a group and a host range, against the lab, runs like the YAML one."""
    n1, n2 = lab.host("node1").address, lab.host("node2").address
    assert n1.rsplit(".", 1)[0] == n2.rsplit(".", 1)[0]
    ini = tmp_path / "inv.ini"
    common = Path(lab.inventory).read_text().split("ansible_ssh_common_args: ")[1].split("\n    ansible_python")[0]
    common = " ".join(common.split())
    ini.write_text(
        "[trainers]\n"
        f"node[1:2] ansible_user=root ansible_ssh_private_key_file={lab.key}\n\n"
        "[trainers:vars]\n"
        f"ansible_ssh_common_args='{common}'\n"
        f"ddpfab_python={__import__('sys').executable}\n\n"
        "[spare]\nnode3\n")
    # the names resolve through the controller's view: give the lab names addresses via host vars
    hv = tmp_path / "host_vars"
    hv.mkdir()
    (hv / "node1.yml").write_text(f"ansible_host: {n1}\n")
    (hv / "node2.yml").write_text(f"ansible_host: {n2}\n")
    res = ddpfab("run", "-i", str(ini), "--group", "trainers", "--runs-dir", str(tmp_path / "runs"), REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert {(r["hostname"], r["node_rank"]) for r in got} == {("node1", 0), ("node2", 1)}
    assert {r["sum"] for r in got} == {3.0}


def test_cwd_is_the_default_workdir(lab, inventory2, tmp_path):
    """Without ddpfab_workdir the nodes run in the controller's cwd (a relative script resolves)."""
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), "scripts/report.py",
                 cwd=REPO / "tests" / "lab")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(reports(res.stdout)) == 2
