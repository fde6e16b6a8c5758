"""Issue 25, the node's resources and left-overs, injected for real on one host of ONE 4-node lab
(two stand-in GPUs per host), one fault at a time (inject, assert, undo, next):

- a 16 MiB tmpfs on node3's /dev/shm (mounted in node3's own mount namespace: not seen elsewhere);
- a full 8 MiB tmpfs mounted at node2's workdir (inside its /root overlay);
- an open-files soft limit of 256 on node4's sshd (what every ssh login there, and so every rank, gets;
  the lab's sshd runs without PAM, so its own limit is the node's, as systemd's LimitNOFILE sets it);
- a process of an "earlier job" listening on the master port on node1 (the master);
- a process using GPU 0 of node4 without a lease (the stand-in nvidia-smi's compute apps).

For each, ``ddpfab check`` names that node, and only it, with what was found and the fix; and
``ddpfab run`` of a small DDP job (a DataLoader with 2 workers, a checkpoint into the workdir)
ends before anything starts, naming that node. A healthy run before and after proves the lab and
the job are fine without the fault.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import SCRIPTS, ddpfab, host_sh, reports

WORKDIR = "/root/ddpfab-reslab"
NAMES = ("node1", "node2", "node3", "node4")
PORT = 29517


@pytest.fixture(scope="module")
def rlab(tmp_path_factory):
    with own_lab(tmp_path_factory, "reslab", hosts=4, subnet=extra_subnet(173), gpus=2) as the_lab:
        yield the_lab


@pytest.fixture(scope="module")
def project(rlab, tmp_path_factory) -> Path:
    """The job's project dir (synced to WORKDIR on every node by the first run) and its inventory."""
    proj = tmp_path_factory.mktemp("resproj")
    shutil.copy(SCRIPTS / "res_train.py", proj / "res_train.py")
    inv = yaml.safe_load(labmod.render_inventory(rlab, sys.executable).split("\n", 1)[1])
    inv["all"]["vars"].update({"ddpfab_workdir": WORKDIR, "ddpfab_nproc_per_node": 2})
    (proj / "inv.yml").write_text(yaml.safe_dump(inv))
    return proj


def check(project: Path, *extra: str) -> dict:
    res = ddpfab("check", "-i", str(project / "inv.yml"), "--fast", "--json", *extra, timeout=240, cwd=project)
    report = json.loads(res.stdout)
    assert (res.returncode == 0) == report["ok"], res.stderr
    return report


def failed(report: dict) -> dict[str, set[str]]:
    """node -> its failed checks."""
    out: dict[str, set[str]] = {}
    for r in report["results"]:
        if r["status"] == "fail":
            out.setdefault(r["node"], set()).add(r["check"])
    return out


def run(project: Path, *extra: str, sync: bool = False) -> subprocess.CompletedProcess:
    return ddpfab("run", "-i", str(project / "inv.yml"), "--runs-dir", str(project / "runs"),
                  *([] if sync else ["--no-sync"]), *extra, "res_train.py", timeout=300, cwd=project)


def assert_named_alone(text: str, node: str) -> None:
    assert f"host {node}:" in text, text
    others = [n for n in NAMES if n != node and f"host {n}:" in text]
    assert not others, text


def test_healthy_lab_passes_and_trains(rlab, project):
    report = check(project)
    assert failed(report) == {}, [r for r in report["results"] if r["status"] == "fail"]
    assert {r["check"] for r in report["results"]} >= {"shm", "disk", "nofile", "memlock", "memory", "leftovers"}
    res = run(project, sync=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(r["hostname"] for r in reports(res.stdout)) == sorted(NAMES * 2)


def test_small_dev_shm_on_one_node(rlab, project):
    mounted = host_sh(rlab, "node3", "mount -t tmpfs -o size=16m ddpfab-res-shm /dev/shm && df -k /dev/shm")
    assert mounted.returncode == 0, mounted.stderr
    try:
        # the mount is node3's alone: not in another host's mount namespace, nor the controller's
        assert "ddpfab-res-shm" in host_sh(rlab, "node3", "cat /proc/self/mountinfo").stdout
        assert "ddpfab-res-shm" not in host_sh(rlab, "node1", "cat /proc/self/mountinfo").stdout
        assert "ddpfab-res-shm" not in Path("/proc/self/mountinfo").read_text()
        report = check(project)
        assert failed(report) == {"node3": {"shm"}}
        (p,) = report["problems"]
        assert p["node"] == "node3" and "/dev/shm 16 MiB free of 16 MiB (tmpfs)" in p["found"]
        assert "mount -o remount,size=" in p["fix"]
        res = run(project)
        assert res.returncode != 0 and "preflight checks failed" in res.stderr, res.stderr
        assert_named_alone(res.stderr, "node3")
        assert "/dev/shm" in res.stderr
        assert not reports(res.stdout)  # nothing started
    finally:
        assert host_sh(rlab, "node3", "umount /dev/shm").returncode == 0
    assert failed(check(project)) == {}


def test_full_filesystem_under_the_workdir_of_one_node(rlab, project):
    # the workdir is inside node2's own /root overlay: a tmpfs mounted there stays node2's
    where = host_sh(rlab, "node2", f"findmnt -n -o FSTYPE,TARGET -T {WORKDIR}")
    assert where.stdout.split() == ["overlay", "/root"], where.stdout
    fill = (f"set -e; mkdir -p /tmp/res-keep && cp -a {WORKDIR}/res_train.py /tmp/res-keep/ && "
            f"mount -t tmpfs -o size=8m ddpfab-res-full {WORKDIR} && cp -a /tmp/res-keep/. {WORKDIR}/ && "
            f"rm -rf /tmp/res-keep && (dd if=/dev/zero of={WORKDIR}/.filler bs=1M 2>/dev/null || true) && "
            f"df -k {WORKDIR}")
    assert host_sh(rlab, "node2", fill).returncode == 0
    try:
        assert "ddpfab-res-full" not in host_sh(rlab, "node1", "cat /proc/self/mountinfo").stdout
        report = check(project)
        assert failed(report) == {"node2": {"disk"}}
        (p,) = report["problems"]
        assert p["found"].startswith(f"the workdir {WORKDIR}: 0 B free on {WORKDIR} (tmpfs)"), p
        res = run(project)
        assert res.returncode != 0 and "preflight checks failed" in res.stderr, res.stderr
        assert_named_alone(res.stderr, "node2")
        assert f"the workdir {WORKDIR}" in res.stderr
    finally:
        assert host_sh(rlab, "node2", f"umount {WORKDIR}").returncode == 0
    assert failed(check(project)) == {}


def test_low_open_files_limit_of_one_nodes_sshd(rlab, project):
    before = host_sh(rlab, "node4", "prlimit --pid 1 --nofile --raw -o SOFT,HARD --noheadings").stdout.split()
    assert len(before) == 2, before
    # the soft limit only: raising a hard limit back is refused even to root here, the soft one is not
    assert host_sh(rlab, "node4", f"prlimit --pid 1 --nofile=256:{before[1]}").returncode == 0
    try:
        report = check(project)
        assert failed(report) == {"node4": {"nofile"}}
        (p,) = report["problems"]
        assert p["found"] == f"open files limit 256 (hard {before[1]})" and "limits.conf" in p["fix"]
        res = run(project)
        assert res.returncode != 0 and "preflight checks failed" in res.stderr, res.stderr
        assert_named_alone(res.stderr, "node4")
    finally:
        assert host_sh(rlab, "node4", f"prlimit --pid 1 --nofile={before[0]}:{before[1]}").returncode == 0
    assert failed(check(project)) == {}


def test_leftover_listener_on_the_master_port(rlab, project):
    code = (f"import os,socket,time; s=socket.socket(); s.bind(('0.0.0.0',{PORT})); s.listen(); "
            "print(os.getpid(),flush=True); time.sleep(600)")
    holder = subprocess.Popen(["nsenter", "-t", str(labmod._child_pid(rlab.host("node1").pid)), "-a", "env",
                               "DDPFAB_JOB=r-earlier", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = holder.stdout.readline().strip()  # its pid in node1's pid namespace (nsenter forks it there)
    try:
        assert pid.isdigit()
        report = check(project, "--master-port", str(PORT))
        assert set(failed(report)) == {"node1"}
        (left,) = [r for r in report["results"] if r["check"] == "leftovers" and r["status"] == "fail"]
        assert left["found"].startswith(f"port {PORT} held by pid {pid} (") and "ddpfab run r-earlier" in left["found"]
        assert "user root" in left["found"] and "time.sleep(600)" in left["found"]
        assert left["fix"].startswith("ddpfab stop r-earlier")
        res = run(project, "--master-port", str(PORT))
        assert res.returncode != 0
        assert_named_alone(res.stderr, "node1")
        assert f"--master-port {PORT} is already in use there by pid {pid} (" in res.stderr, res.stderr
        assert "ddpfab stop r-earlier" in res.stderr
    finally:
        host_sh(rlab, "node1", f"kill {pid}")
        holder.wait(timeout=30)
    assert failed(check(project, "--master-port", str(PORT))) == {}


def test_gpu_used_without_a_lease_on_one_node(rlab, project):
    start = host_sh(rlab, "node4", "sleep 300 >/dev/null 2>&1 & echo $!")
    pid = int(start.stdout.strip())
    apps = f"{labmod.STAND_IN_CONF}/compute-apps"
    try:
        assert host_sh(rlab, "node4", f"echo '0 {pid} stale-trainer' > {apps}").returncode == 0
        report = check(project)
        assert failed(report) == {"node4": {"leftovers"}}
        (p,) = report["problems"]
        assert p["found"].startswith(f"GPU 0 in use without a ddpfab lease by pid {pid} (user root, `sleep 300`")
        assert p["fix"] == f"kill {pid} (if it is a left-over)"
        res = run(project)  # refused by the lease check (issue 27), which names the same process once
        assert res.returncode != 0
        assert_named_alone(res.stderr, "node4")
        assert f"GPU 0 busy without a lease: pid {pid}" in res.stderr
        assert res.stderr.count(f"pid {pid}") == 1, res.stderr
    finally:
        host_sh(rlab, "node4", f"rm -f {apps}; kill {pid}")
    res = run(project)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
