"""Sync owns only what it placed, refuses what it cannot prove is its own, leaves nothing behind,
and brings results back: on real lab hosts.

Every workdir is under /opt on the nodes (an overlay: the nodes' own copy, never the controller's
directory). Tests that could destroy something first check that the path is inside an overlay
(`findmnt`), since a lab host's `/` is the real machine's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod

from .helpers import ddpfab, wait_no_processes
from .test_sync import NODES, git, listing_there, on_node, run_sync, write_inventory

TRAIN = r'''
import json, os
# a dataset that only the nodes have, in a gitignored dir
assert open("data/train.txt").read() == "node-only dataset\n", "the dataset is gone"
epoch = 0
if os.path.exists("snapshot.pt"):
    epoch = json.load(open("snapshot.pt"))["epoch"] + 1
    print("RESUMED from epoch", epoch - 1, flush=True)
json.dump({"epoch": epoch}, open("snapshot.pt", "w"))
os.makedirs("checkpoints", exist_ok=True)
open("checkpoints/epoch%d.pt" % epoch, "w").write("weights %d\n" % epoch)
os.makedirs("wandb/run-1", exist_ok=True)
with open("wandb/run-1/events.log", "a") as fh:
    fh.write("epoch %d\n" % epoch)
print("EPOCH", epoch, flush=True)
'''


def overlay(lab, node: str, path: str) -> None:
    """Fail unless *path* (or the nearest existing dir above it) is inside one of the node's
    overlays: a lab host writing anywhere else writes on the real machine."""
    probe = path
    while True:
        res = on_node(lab, node, f"test -e {probe!r} && findmnt -n -o FSTYPE --target {probe!r}", check=False)
        if res.returncode == 0:
            assert res.stdout.strip() == "overlay", f"{node}:{probe} is not inside an overlay: {res.stdout!r}"
            return
        probe = os.path.dirname(probe.rstrip("/")) or "/"


def snapshot(lab, node: str, path: str, shallow: bool = False) -> str:
    """Everything under *path* on *node* (names, sizes, mtimes, sha256), or that it is absent;
    *shallow*: its entries only (a system dir)."""
    depth = "-maxdepth 1" if shallow else ""
    sums = "" if shallow else " && find . -xdev -type f -exec sha256sum {} + | sort"
    cmd = (f"if [ -e {path!r} ]; then cd {path!r} && find . -xdev {depth} -printf '%p %s %y %T@\\n' | sort"
           f"{sums}; else echo ABSENT; fi")
    return on_node(lab, node, cmd).stdout


@pytest.fixture
def trainproj(tmp_path) -> Path:
    root = tmp_path / "trainproj"
    root.mkdir()
    (root / "train.py").write_text(TRAIN)
    (root / "model.py").write_text("LAYERS = 2\n")
    (root / ".gitignore").write_text("data/\nsnapshot.pt\ncheckpoints/\nwandb/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    return root


def test_training_outputs_and_node_data_survive_three_runs_and_the_second_resumes(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/outputs"
    for node in NODES:
        overlay(lab, node, workdir)
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    for node in NODES:  # the dataset is copied onto the nodes by hand, under the gitignored data/
        on_node(lab, node, f"mkdir -p {workdir}/data && echo node-only dataset > {workdir}/data/train.txt")
    runs = tmp_path / "runs"
    outputs = []
    for i in range(3):
        # a code change before every run: each run does a real copy, not only the hash check
        (trainproj / "model.py").write_text(f"LAYERS = {i + 3}\n")
        git(trainproj, "commit", "-qam", f"change {i}")
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=trainproj, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count(f"EPOCH {i}") == len(NODES), res.stdout
        assert f"rank 0's workdir: node1:{workdir}" in res.stderr
        outputs.append(res.stdout)
    assert outputs[1].count("RESUMED from epoch 0") == len(NODES)
    assert outputs[2].count("RESUMED from epoch 1") == len(NODES)
    for node in NODES:
        there = listing_there(lab, node, workdir)
        assert {"data/train.txt", "snapshot.pt", "checkpoints/epoch0.pt", "checkpoints/epoch1.pt",
                "checkpoints/epoch2.pt", "wandb/run-1/events.log"} <= set(there), node
        assert on_node(lab, node, f"cat {workdir}/wandb/run-1/events.log").stdout == "epoch 0\nepoch 1\nepoch 2\n"
        # torchrun's per-rank logs are in the node's run dir, never in the project's workdir
        assert not [p for p in there if "torchrun" in p or p.startswith("attempt_")], there


def test_a_keep_pattern_is_never_overwritten_deleted_or_hashed(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/keep"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    (trainproj / "configs").mkdir()
    (trainproj / "configs" / "local.yaml").write_text("lr: 0.1\n")
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    on_node(lab, "node1", f"echo 'lr: 0.5  # tuned on this node' > {workdir}/configs/local.yaml")
    (trainproj / "configs" / "local.yaml").write_text("lr: 0.2\n")
    res = run_sync("-i", str(inv), "--keep", "configs/", str(trainproj))
    assert res.returncode == 0, res.stderr
    assert "tuned on this node" in on_node(lab, "node1", f"cat {workdir}/configs/local.yaml").stdout
    (trainproj / "configs" / "local.yaml").unlink()
    (trainproj / ".ddpfabkeep").write_text("configs/\n")
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    assert "tuned on this node" in on_node(lab, "node1", f"cat {workdir}/configs/local.yaml").stdout


BAD_WORKDIRS = {
    "trailing newline": "/opt/ddpfab/nl\n",
    "tab": "/opt/ddpfab/a\tb",
    "dotdot": "/opt/ddpfab/x/../../ddpfab-escape",
    "other user's ~": "~ddpfabalice/proj",
    "another user's home": "/opt/ddpfab-homes/ddpfabalice",
    "system dir": "/var/lib",
    "symlink to a system dir": "/opt/ddpfab/to-etc",
    "non-empty foreign dir": "/opt/ddpfab/foreign",
}


@pytest.fixture(scope="module")
def hostile_nodes(lab):
    """On every node: a second user whose home is under /opt, a symlink to /etc, a foreign dir."""
    for node in NODES:
        overlay(lab, node, "/opt/ddpfab-homes")
        overlay(lab, node, "/etc/passwd")
        on_node(lab, node, "id ddpfabalice >/dev/null 2>&1 || (mkdir -p /opt/ddpfab-homes && "
                           "useradd -m -d /opt/ddpfab-homes/ddpfabalice ddpfabalice && "
                           "echo her thesis > /opt/ddpfab-homes/ddpfabalice/thesis.tex); "
                           "mkdir -p /opt/ddpfab/foreign && echo precious > /opt/ddpfab/foreign/results.csv && "
                           "ln -sfn /etc /opt/ddpfab/to-etc")
    return True


@pytest.mark.parametrize("case", list(BAD_WORKDIRS))
def test_a_bad_workdir_is_refused_and_nothing_on_the_node_changes(lab, tmp_path, trainproj, hostile_nodes, case):
    raw = BAD_WORKDIRS[case]
    def state(n: str) -> list[str]:
        return [snapshot(lab, n, "/opt/ddpfab"), snapshot(lab, n, "/opt/ddpfab-homes"),
                snapshot(lab, n, "/var/lib", shallow=True), snapshot(lab, n, "/etc", shallow=True)]

    before = {n: state(n) for n in NODES}
    inv = tmp_path / "inv.yml"
    data = yaml.safe_load(labmod.render_inventory(lab, sys.executable))
    data["all"]["vars"]["ddpfab_workdir"] = raw
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    res = run_sync("-i", str(inv), str(trainproj))
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ddpfab: error:")]
    assert errors and all("refusing to sync" in ln for ln in errors), res.stderr
    expected = {"trailing newline": "trailing newline", "tab": "control character", "dotdot": "'..'",
                "other user's ~": "~user", "another user's home": "home directory",
                "system dir": "system directory", "symlink to a system dir": "(/etc) is a system directory",
                "non-empty foreign dir": "--adopt"}[case]
    assert expected in errors[0], errors[0]
    assert {n: state(n) for n in NODES} == before
    # `ddpfab plan` takes the workdir through the same rules (the text ones; it does not log in)
    if case in ("trailing newline", "tab", "dotdot", "other user's ~"):
        plan = ddpfab("plan", "-i", str(inv), "--offline", "train.py", cwd=trainproj)
        assert plan.returncode == 2 and expected in plan.stderr, plan.stderr


def test_adopting_a_foreign_dir_deletes_nothing_that_was_there(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/adopt-me"
    for node in NODES:
        overlay(lab, node, workdir)
        on_node(lab, node, f"rm -rf {workdir} && mkdir -p {workdir} && echo precious > {workdir}/results.csv && "
                           f"echo their train > {workdir}/train.py")
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    refused = run_sync("-i", str(inv), "--json", str(trainproj))
    assert refused.returncode == 1, refused.stderr
    report = json.loads(refused.stdout)
    assert {n: r["state"] for n, r in report["nodes"].items()} == dict.fromkeys(NODES, "not-ours")
    assert [(p["node"], p["check"], p["fix"]) for p in report["problems"]] == [
        (n, "workdir", "ddpfab sync --adopt") for n in NODES]
    run = ddpfab("run", "-i", str(inv), "train.py", cwd=trainproj, timeout=180)  # the hint comes from that state
    assert run.returncode != 0 and "(to take such a directory over: `ddpfab sync --adopt`)" in run.stderr, run.stderr
    res = run_sync("-i", str(inv), "--adopt", str(trainproj))
    assert res.returncode == 0, res.stderr
    assert "moved to" in res.stderr
    for node in NODES:
        there = listing_there(lab, node, workdir, state=True)
        assert "results.csv" in there
        kept = [p for p in there if p.startswith(".ddpfab/kept/") and p.endswith("/train.py")]
        assert kept and on_node(lab, node, f"cat {workdir}/{kept[0]}").stdout == "their train\n"
    (trainproj / "model.py").unlink()
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0  # owned now: no --adopt needed
    assert "results.csv" in listing_there(lab, "node2", workdir)


# -- nothing is left behind ------------------------------------------------------------------
def _slow_links(lab, rate: str | None) -> None:
    """Shape (or unshape) what the controller sends to every node (the bridge side of its veth)."""
    for h in lab.hosts:
        subprocess.run(["tc", "qdisc", "del", "dev", h.veth, "root"], capture_output=True)
        if rate:
            subprocess.run(["tc", "qdisc", "add", "dev", h.veth, "root", "tbf", "rate", rate, "burst", "32kbit",
                            "latency", "400ms"], check=True)


def _descendants_ctl_dir(pid: int) -> str | None:
    """The sync's private temp dir, read from the ControlPath of an ssh that *pid* started."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat_line = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat_line.rsplit(")", 1)[1].split()[1])
        m = re.search(r"ControlPath=(/tmp/ddpfab-sync-[^/ ]+)/", cmd)
        if ppid == pid and m:
            return m.group(1)
    return None


def _controller_processes_with(text: str) -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(f"{entry}: {cmd[:200]}")
    return out


def _start_slow_sync(lab, tmp_path, trainproj, workdir: str, *extra: str) -> tuple[subprocess.Popen, str]:
    (trainproj / "weights.bin").write_bytes(os.urandom(12 * 2**20))  # ~12 s at 8 Mbit/s
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "sync", "-i", str(inv), *extra, str(trainproj)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_COLOR": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the copy runs on the nodes
        if any("rsync --server" in cmd for n in NODES for _, cmd in lab.processes(n)):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    else:
        pytest.fail("the copy never started")
    ctl = _descendants_ctl_dir(proc.pid)
    assert ctl and os.path.isdir(ctl)
    return proc, ctl


def _assert_nothing_left(lab, ctl: str, workdir: str) -> None:
    deadline = time.monotonic() + 10
    while (os.path.exists(ctl) or _controller_processes_with(ctl)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(ctl), f"{ctl} left behind"
    assert not _controller_processes_with(ctl), _controller_processes_with(ctl)  # masters, rsync, agent, watcher
    wait_no_processes(lab, timeout=10, names=list(NODES))  # the remote rsync ends too
    for node in NODES:
        there = listing_there(lab, node, workdir, state=True)
        partial = [p for p in there if re.search(r"(^|/)\.[^/]+\.[A-Za-z0-9]{6}$", p)]
        assert not partial, f"{node}: rsync temp files left: {partial}"
        assert not [p for p in there if p.startswith(".ddpfab/stage/s-")], there


@pytest.mark.parametrize("fanout", ["star", "tree"])
def test_sigkill_mid_sync_leaves_no_master_agent_or_temp_dir(lab, tmp_path, trainproj, fanout):
    workdir = f"/opt/ddpfab/killed-{fanout}"
    _slow_links(lab, "8mbit")
    try:
        proc, ctl = _start_slow_sync(lab, tmp_path, trainproj, workdir, "--fanout", fanout)
        if fanout == "tree":
            assert _controller_processes_with(f"ssh-agent -D -a {ctl}/agent.sock")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        _assert_nothing_left(lab, ctl, workdir)
    finally:
        _slow_links(lab, None)


def test_ctrl_c_mid_sync_exits_130_with_one_line(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/interrupted"
    _slow_links(lab, "8mbit")
    try:
        proc, ctl = _start_slow_sync(lab, tmp_path, trainproj, workdir)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert err.strip().splitlines() == [
            "ddpfab: sync interrupted: nothing is left running; files already copied stay, the next sync completes "
            "them"], err
        _assert_nothing_left(lab, ctl, workdir)
    finally:
        _slow_links(lab, None)
    assert run_sync("-i", str(tmp_path / "inv.yml"), str(trainproj)).returncode == 0  # and the next sync completes


# -- results come back -------------------------------------------------------------------------
def test_fetch_a_checkpoint_from_rank_0_matches_its_sha256_there(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/fetch"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    for node in NODES:
        on_node(lab, node, f"mkdir -p {workdir}/checkpoints && head -c 20000000 /dev/urandom > "
                           f"{workdir}/checkpoints/model.pt")
    there = on_node(lab, "node1", f"sha256sum {workdir}/checkpoints/model.pt").stdout.split()[0]
    local = tmp_path / "results"
    res = ddpfab("fetch", "-i", str(inv), "--rank", "0", "checkpoints/model.pt", str(local))
    assert res.returncode == 0, res.stderr
    assert hashlib.sha256((local / "model.pt").read_bytes()).hexdigest() == there
    assert f"fetched node1:{workdir}/checkpoints/model.pt" in res.stdout
    assert "100%" in res.stderr  # rsync's progress line, for a large file
    # a dir, from another node, by name; an existing destination is not overwritten
    res = ddpfab("fetch", "-i", str(inv), "--node", "node2", "checkpoints", str(local))
    assert res.returncode == 0 and (local / "checkpoints" / "model.pt").exists(), res.stderr
    again = ddpfab("fetch", "-i", str(inv), "--node", "node2", "checkpoints", str(local))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    for bad, why in (("../../../etc/shadow", "'..'"), ("/etc/shadow", "outside the workdir")):
        res = ddpfab("fetch", "-i", str(inv), bad, str(tmp_path / "nope"))
        assert res.returncode == 1 and why in res.stderr, res.stderr
        assert not (tmp_path / "nope").exists()
