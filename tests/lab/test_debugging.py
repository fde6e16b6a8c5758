"""Reproducible manual debugging over SSH, on real lab hosts: --debug and per-rank logs, scripts
emitted by `plan --emit` run by hand with plain ssh, `replay` of a recorded run, and `exec`.

One real `ddpfab run --debug` (examples/train_dist.py, 2 nodes x 2 procs, static rendezvous,
torchrun, env://) is recorded once and shared by the tests below, which compare against it.
It runs from a scratch workdir in the lab's shared dir (every host sees it as it is, wherever the
checkout lies), so a test can change "the code" there without touching the repository.
"""

from __future__ import annotations

import re
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpfab import lab as labmod

from .helpers import REPO, ddpfab, reports, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")
ARGS = ["--report", "--steps", "2", "a b"]
SAME = ("rank", "world_size", "local_rank", "node_rank", "hostname", "hosts", "argv", "sum", "loss", "checksum")


def same_job(got: list[dict]) -> set:
    """What must be identical between two runs of one plan: who is which rank where, what they got."""
    return {json.dumps({k: r[k] for k in SAME}, sort_keys=True) for r in got}


@pytest.fixture(scope="module")
def recorded(lab, tmp_path_factory):
    workdir = Path(tempfile.mkdtemp(prefix="test-debugging-", dir=lab.shared_dir))
    shutil.copy(REPO / "examples" / "train_dist.py", workdir / "train_dist.py")  # imports the installed ddpfab
    tmp = tmp_path_factory.mktemp("debugging")
    inv = tmp / "inventory.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    runs = tmp / "runs"
    start = time.monotonic()
    res = ddpfab("run", "-i", str(inv), "--debug", "--nproc-per-node", "2", "--runs-dir", str(runs),
                 "--env", "HF_TOKEN=s3cret", "train_dist.py", *ARGS, cwd=workdir, timeout=180)
    took = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    manifest_path = next(runs.glob("*/manifest.json"))
    try:
        yield SimpleNamespace(workdir=workdir, inv=inv, runs=runs, res=res, got=reports(res.stdout), took=took,
                              manifest=json.loads(manifest_path.read_text()), run_id=manifest_path.parent.name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_recorded_run_trained(recorded):
    got = recorded.got
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3] and {r["sum"] for r in got} == {10.0}
    assert {(r["hostname"], r["node_rank"]) for r in got} == {("node1", 0), ("node2", 1)}
    m = recorded.manifest
    assert m["plan"]["debug"] is True and len(m["inventory_fingerprint"]) == 64
    assert m["script_file"] == str(recorded.workdir / "train_dist.py") and len(m["script_sha256"]) == 64
    assert {n["env"]["HF_TOKEN"] for n in m["plan"]["nodes"]} == {"***"}  # masked in the record


def test_debug_env_reaches_every_rank_and_rank_logs_are_fetched(recorded, tmp_path):
    for r in recorded.got:
        # lab hosts have no GPUs (gloo): TORCH_DISTRIBUTED_DEBUG is INFO there, DETAIL crashes DDP on gloo
        assert r["debug_env"] == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                                  "TORCH_DISTRIBUTED_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO"}
    res = ddpfab("logs", recorded.run_id, "--ranks", "--runs-dir", str(recorded.runs))
    assert res.returncode == 0, res.stdout + res.stderr
    base = recorded.runs / recorded.run_id / "ranks"
    for node, ranks in (("node1", (0, 1)), ("node2", (2, 3))):
        assert (recorded.runs / recorded.run_id / f"{node}.remote.log").exists()
        stdout_logs = sorted(base.joinpath(node).rglob("stdout.log"))
        stderr_logs = sorted(base.joinpath(node).rglob("stderr.log"))
        assert len(stdout_logs) == len(stderr_logs) == 2, list(base.joinpath(node).rglob("*"))
        text = "".join(p.read_text() for p in stdout_logs)
        for rank in ranks:
            assert f'REPORT {{"rank": {rank},' in text
        # the C++ side logs at INFO (TORCH_CPP_LOG_LEVEL): lines like "[I1130 10:09:41 ... reducer.cpp:132] ..."
        assert any(line.startswith("[I") or "]:[I" in line
                   for p in stderr_logs for line in p.read_text().splitlines()), stderr_logs


def test_emitted_scripts_run_by_hand_over_plain_ssh_reproduce_the_run(lab, recorded, tmp_path):
    out = tmp_path / "emitted"
    res = ddpfab("plan", "-i", str(recorded.inv), "--debug", "--nproc-per-node", "2", "--env", "HF_TOKEN=s3cret",
                 "--emit", str(out), "train_dist.py", *ARGS, cwd=recorded.workdir)
    assert res.returncode == 0, res.stderr
    scripts = sorted(out.glob("rank*-*.sh"))
    assert [s.name for s in scripts] == ["rank0-node1.sh", "rank1-node2.sh"]
    assert "ssh" in res.stdout and "rank1-node2.sh" in res.stdout  # the README: which to run where
    assert all(lab.processes(n) == [] for n in ("node1", "node2")), "plan must start nothing"
    # output to files, not pipes: a pipe not drained while we wait on the other node would stall
    # that node mid-run (--debug output is large) and with it the whole job
    logs = [tmp_path / f"{s.stem}.out" for s in scripts]
    procs = [subprocess.Popen(["ssh", "-F", str(lab.ssh_config), s.name.split("-", 1)[1][:-3], "bash -s"],
                              stdin=s.open(), stdout=log.open("w"), stderr=subprocess.STDOUT)
             for s, log in zip(scripts, logs)]
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], outs
    by_hand = reports("\n".join(outs))
    assert same_job(by_hand) == same_job(recorded.got)
    assert all(r["debug_env"] == recorded.got[0]["debug_env"] for r in by_hand)
    wait_no_processes(lab, timeout=5)


def test_replay_reproduces_the_run_and_refuses_what_would_differ(lab, recorded, tmp_path):
    rid = recorded.run_id
    # the token was masked in the manifest: replay needs it again
    res = ddpfab("replay", rid, "--runs-dir", str(recorded.runs))
    assert res.returncode == 2 and "HF_TOKEN masked" in res.stderr and "--env HF_TOKEN=" in res.stderr, res.stderr

    res = ddpfab("replay", rid, "--runs-dir", str(recorded.runs), "--env", "HF_TOKEN=s3cret", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert same_job(reports(res.stdout)) == same_job(recorded.got)
    new = [p for p in recorded.runs.glob("*/manifest.json") if p.parent.name != rid]
    assert len(new) == 1
    replayed = json.loads(new[0].read_text())
    assert replayed["replay_of"] == rid and replayed["state"] == "succeeded"
    old_plan, new_plan = recorded.manifest["plan"], replayed["plan"]
    keep = ("name", "node_rank", "nproc", "workdir", "python", "data_addr")
    assert [{k: n[k] for k in keep} for n in new_plan["nodes"]] == [{k: n[k] for k in keep} for n in old_plan["nodes"]]
    assert (new_plan["script"], new_plan["args"], new_plan["master_addr"]) == \
        (old_plan["script"], old_plan["args"], old_plan["master_addr"])
    for old_n, new_n in zip(old_plan["nodes"], new_plan["nodes"]):
        assert {k: v for k, v in new_n["env"].items() if k != "DDPFAB_RUN_ID"} == \
            {k: v for k, v in old_n["env"].items() if k != "DDPFAB_RUN_ID"}

    # another inventory (one more variable) is another cluster
    changed = tmp_path / "inv.yml"
    changed.write_text(recorded.inv.read_text().replace("ddpfab_nproc_per_node: 1", "ddpfab_nproc_per_node: 2"))
    res = ddpfab("replay", rid, "-i", str(changed), "--runs-dir", str(recorded.runs), "--env", "HF_TOKEN=s3cret")
    assert res.returncode == 2 and "inventory changed" in res.stderr, res.stderr

    # the code changed: refused, nothing started; --dry-run --force shows it would go on
    script = recorded.workdir / "train_dist.py"
    script.write_text(script.read_text() + "\n# changed\n")
    res = ddpfab("replay", rid, "--runs-dir", str(recorded.runs), "--env", "HF_TOKEN=s3cret")
    assert res.returncode == 2 and "the code changed" in res.stderr and "nothing was started" in res.stderr
    assert "(changed since the run started, by their times: train_dist.py)" in res.stderr, res.stderr
    assert all(lab.processes(n) == [] for n in ("node1", "node2"))
    res = ddpfab("replay", rid, "--runs-dir", str(recorded.runs), "--env", "HF_TOKEN=s3cret", "--force", "--dry-run")
    assert res.returncode == 0 and "the code changed" in res.stderr and "--node-rank=1" in res.stdout


def test_replay_chooses_the_nodes_and_variables_the_run_had(lab, recorded, request):
    """A run's -e and --limit are recorded (a secret's value masked by its key) and replayed: without
    them, replay said "the inventory changed" and --force planned other nodes and variables."""
    (recorded.workdir / "hello.py").write_text("print('HELLO')\n")
    # a runs dir inside the project: its records are not synced (each run's record would change the
    # tree, and replay would say "the code changed")
    runs = recorded.workdir / "exp" / "runs"
    request.addfinalizer(lambda: shutil.rmtree(recorded.workdir / "exp"))
    res = ddpfab("run", "-i", str(recorded.inv), "--limit", "node2", "-e", "ddpfab_nproc_per_node=2",
                 "-e", "api_token=abc", "--runs-dir", str(runs), "hello.py", cwd=recorded.workdir, timeout=180)
    assert res.returncode == 0 and res.stdout.count("HELLO") == 2, res.stdout + res.stderr
    manifest = json.loads(next(runs.glob("*/manifest.json")).read_text())
    assert (manifest["limit"], manifest["extra_vars"]) == ("node2", {"ddpfab_nproc_per_node": "2", "api_token": "***"})
    rid = manifest["run_id"]
    assert manifest["code"]["keep"] == ["/exp/runs/"], manifest["code"]
    res = ddpfab("replay", rid, "--runs-dir", str(runs), "--dry-run", cwd=recorded.workdir)
    assert res.returncode == 2 and "-e api_token=..." in res.stderr, res.stderr
    res = ddpfab("replay", rid, "--runs-dir", str(runs), "-e", "api_token=abc", "--dry-run", cwd=recorded.workdir)
    assert res.returncode == 0, res.stderr
    assert "inventory changed" not in res.stderr and "differs" not in res.stderr
    assert "--nproc-per-node=2" in res.stdout and "node1" not in res.stdout
    # its ssh line is the one run's dry run prints: the inventory's key and known_hosts with it
    ssh = [ln for ln in res.stdout.splitlines() if ln.startswith("# node2 (node_rank 0")]
    ran = ddpfab("run", "-i", str(recorded.inv), "--limit", "node2", "-e", "ddpfab_nproc_per_node=2",
                 "--dry-run", "hello.py", cwd=recorded.workdir)
    assert ssh and ssh[0] in ran.stdout and f" -i {lab.key} " in ssh[0], (ssh, ran.stdout)
    # a new run id that names a run on a node already is refused before anything starts, as run refuses it
    res = ddpfab("replay", rid, "--runs-dir", str(runs), "-e", "api_token=abc", "--new-run-id", rid, "--dry-run",
                 cwd=recorded.workdir)
    assert res.returncode == 2 and "host node2: " in res.stderr and "run id was used on this node" in res.stderr
    # the job commands reach the run's nodes as the run did
    res = ddpfab("logs", rid, "--runs-dir", str(runs), cwd=recorded.workdir)
    assert res.returncode == 0 and res.stdout.startswith("node2: "), res.stdout + res.stderr
    path = re.match(r"node2: (.+) \(\d+ lines?\)$", res.stdout.splitlines()[0])  # node: PATH (N lines)
    assert path and "HELLO" in Path(path.group(1)).read_text(), res.stdout


def test_exec_runs_on_every_node_at_once_and_reports_failures(lab, tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable))  # all three hosts
    start = time.monotonic()
    res = ddpfab("exec", "-i", str(inv), "--", "sleep 2; hostname")
    wall = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["node1 | node1", "node2 | node2", "node3 | node3"]
    parallel = float(res.stderr.split(" in ")[1].split(" s:")[0])  # "3/3 nodes exited 0 in 2.31 s: ..."
    print(f"exec sleep 2 on 3 nodes: {parallel:.2f} s connect-to-last-exit, {wall:.2f} s whole CLI")
    assert parallel < 4, res.stderr  # sequentially it would take > 6 s (the CLI's start-up, ~1-3 s, comes on top)

    res = ddpfab("exec", "-i", str(inv), "--", 'echo out; echo err >&2; [ "$(hostname)" != node2 ] || exit 7')
    assert res.returncode == 7
    assert "2/3 nodes exited 0 in " in res.stderr and res.stderr.rstrip().endswith(" s: node[1,3]=0 node2=7")
    assert sorted(res.stdout.splitlines()) == ["node1 | out", "node2 | out", "node3 | out"]
    assert "node3 | err" in res.stderr
    # --fold: the nodes that said the same once, the odd one apart
    res = ddpfab("exec", "-i", str(inv), "--fold", "--", 'echo out; [ "$(hostname)" != node2 ] || echo odd')
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["-" * 15, "node[1,3] (2)", "-" * 15, "out", "-" * 15, "node2", "-" * 15, "out", "odd"]

    # several words: each one quoted for the remote shell; --nodes picks nodes
    res = ddpfab("exec", "-i", str(inv), "--nodes", "node1,node3", "--", "printf", "%s\\n", "a b", "$HOME")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["node1 | $HOME", "node1 | a b", "node3 | $HOME", "node3 | a b"]


def test_exec_fold_interrupted_shows_how_the_ended_nodes_ended(lab, tmp_path):
    """Ctrl-C under ``exec --fold``: what the nodes said is printed, folded; node1 and node3, whose
    command had ended, as they ended; node2, still running, ``(interrupted)`` (every node was
    marked interrupted). Nothing is left running."""
    inv = tmp_path / "inv.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable))
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "exec", "-i", str(inv), "--fold", "--",
                             'echo said; [ "$(hostname)" != node2 ] || exec sleep 60'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not any("sleep 60" in cmd for _, cmd in lab.processes("node2")):
            assert time.monotonic() < deadline and proc.poll() is None, "node2's command never started"
            time.sleep(0.1)
        wait_no_processes(lab, timeout=30, names=("node1", "node3"))  # their commands ended there ...
        time.sleep(1)  # ... and their exit statuses reach the controller
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert out.splitlines() == ["-" * 15, "node[1,3] (2)", "-" * 15, "said",
                                "-" * 19, "node2 (interrupted)", "-" * 19, "said"], out
    wait_no_processes(lab, timeout=5)


def test_exec_with_a_closed_stdout_ends_the_command_everywhere_with_141(lab, tmp_path):
    """`ddpfab exec ... | head -1`: a reader that went away is not an unreachable node (it was
    255, `node1: BrokenPipeError`, `node1=unreachable`); the commands end, nothing is left."""
    inv = tmp_path / "inv.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable))
    read, write = os.pipe()
    os.close(read)  # `| head` that has had enough
    try:
        res = subprocess.run([sys.executable, "-m", "ddpfab", "exec", "-i", str(inv), "--",
                              "for i in $(seq 1 60); do echo $i; sleep 0.1; done"],
                             stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=60)
    finally:
        os.close(write)
    assert res.returncode == 141, res.stderr
    assert "unreachable" not in res.stderr and "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr
    wait_no_processes(lab, timeout=5)
