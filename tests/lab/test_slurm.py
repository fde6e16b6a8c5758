"""The exported sbatch script on a real Slurm: slurmctld and one slurmd per lab host.

Debian's slurm-wlm (slurmctld, slurmd, slurm-client) and munge run inside the lab hosts (node1,
node2; node3 stays out). Lab hosts have private /etc, /var and /run, so nothing is configured
system-wide: every daemon and client gets the config by path (``SLURM_CONF``, ``munged
--key-file``), state lives under a dir of this test, and the fixture stops every daemon it
started, by pid, before the other lab tests look at the hosts' process tables.

Slurm without cgroups: ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``. slurmd
22.05 still probes for a cgroup hierarchy at start ("No filesystem mounted on /sys/fs/cgroup";
``ip netns exec`` gives each host a fresh /sys without the cgroup mounts), so each host gets a
private tmpfs on /sys/fs/cgroup with an empty, controller-less named v1 hierarchy
(``none,name=systemd``) in it: enough for the probe, and nothing is ever put in a cgroup.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ddpfab.planning.export import plan_for_export, to_sbatch
from ddpfab.planning.plan import RunOptions

from .helpers import REPO, host_tmp_leftovers, reports

REPORT = "tests/lab/scripts/report.py"
HOSTS = ("node1", "node2")
SPOOL = "/var/spool/ddpfab-test-slurm"
NASTY = ["with space", "it's \"quoted\"", "$HOME and ${PATH}", "`id` $(id)", "héllo wörld ✓ 日本", "", "a;b | c",
         "new\nline", "--master-addr=evil"]

SLURM_CONF = """# slurm.conf for the ddpfab lab test: two nodes, no cgroups, root everywhere.
ClusterName=ddpfablab
SlurmctldHost={ctl}({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait=5
StateSaveLocation={spool}/ctld
SlurmdSpoolDir={spool}/d
SlurmctldPidFile=/run/ddpfab-slurmctld.pid
SlurmdPidFile=/run/ddpfab-slurmd.pid
SlurmctldLogFile={spool}/slurmctld.log
SlurmdLogFile={spool}/slurmd.log
{nodes}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

HOST_SETUP = """set -e
mkdir -p {spool}/ctld {spool}/d /run/munge
if ! mountpoint -q /sys/fs/cgroup; then mount -t tmpfs -o mode=755 ddpfab-cgroup /sys/fs/cgroup; fi
mkdir -p /sys/fs/cgroup/systemd
if ! mountpoint -q /sys/fs/cgroup/systemd; then mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; fi
munged --force --key-file={key} --socket=/run/munge/munge.socket.2 --pid-file=/run/munge/munged.pid \
  --log-file={spool}/munged.log --seed-file={spool}/munged.seed
"""
#: torchrun's per-rank logs of this test's jobs (the plan's remote run dirs), removed at the end
RUNS = "~/.ddpfab/runs/slurm-ok ~/.ddpfab/runs/slurm-fail"
PIDFILES = ("/run/ddpfab-slurmd.pid", "/run/ddpfab-slurmctld.pid", "/run/munge/munged.pid")
HOST_TEARDOWN = """for f in {pidfiles}; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
for i in $(seq 100); do
  alive=0; for f in {pidfiles}; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 0.1
done
for f in {pidfiles}; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
umount /sys/fs/cgroup/systemd 2>/dev/null; umount /sys/fs/cgroup 2>/dev/null
rm -rf {spool} /run/munge {runs}
true
"""


class Slurm:
    def __init__(self, lab, conf: Path):
        self.lab = lab
        self.conf = conf

    def ssh(self, host: str, command: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        full = f"export SLURM_CONF={shlex.quote(str(self.conf))}; {command}"
        res = subprocess.run(["ssh", "-F", str(self.lab.ssh_config), host, full], capture_output=True, text=True,
                             timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{host}: `{command}` failed ({res.returncode}): {res.stderr or res.stdout}")
        return res

    def log(self, host: str) -> str:
        return self.ssh(host, f"tail -n 30 {SPOOL}/*.log", check=False).stdout

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.ssh("node1", "sinfo -h -N -o '%N %t'", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(h) == "idle" for h in HOSTS):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"slurm nodes not idle after {timeout} s: {states}\n"
                                     + "\n".join(self.log(h) for h in HOSTS))
            time.sleep(0.3)

    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.ssh("node1", f"scontrol show job -o {job_id}").stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state
            if time.monotonic() > deadline:
                self.ssh("node1", f"scancel {job_id}", check=False)
                raise AssertionError(f"job {job_id} still {state['JobState']} after {timeout} s")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def slurm(lab, tmp_path_factory):
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(t)]
    assert not missing, f"{', '.join(missing)} missing: run scripts/setup.sh (slurmctld slurmd slurm-client munge)"
    d = tmp_path_factory.mktemp("slurm")
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    nodes = "\n".join(f"NodeName={h} NodeAddr={lab.host(h).address} CPUs={os.cpu_count()} State=UNKNOWN"
                      for h in HOSTS)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(ctl="node1", ctl_addr=lab.host("node1").address, spool=SPOOL, nodes=nodes))
    cluster = Slurm(lab, conf)
    try:
        for h in HOSTS:
            cluster.ssh(h, HOST_SETUP.format(spool=SPOOL, key=shlex.quote(str(key))))
        cluster.ssh("node1", "slurmctld")
        for h in HOSTS:
            cluster.ssh(h, "slurmd")
        cluster.wait_idle(timeout=30)
        yield cluster
    finally:
        for h in HOSTS:
            cluster.ssh(h, HOST_TEARDOWN.format(pidfiles=" ".join(PIDFILES), spool=SPOOL, runs=RUNS), check=False)
        deadline = time.monotonic() + 10
        while any(lab.processes(h) for h in HOSTS) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {h: lab.processes(h) for h in HOSTS if lab.processes(h)}
        assert not left, f"slurm test left processes on the lab hosts: {left}"
        for h in HOSTS:
            listening = lab.netns_exec(h, ["ss", "-Htln"], capture_output=True, text=True).stdout.splitlines()
            ports = sorted({ln.split()[3].rsplit(":", 1)[1] for ln in listening if ln.strip()})
            assert ports == ["22"], f"{h} has listeners left: {ports}"
            left = host_tmp_leftovers(lab, h)
            assert not left, f"{h} has files left in /tmp: {left[:5]}"


def submit(slurm: Slurm, plan, d: Path) -> tuple[dict[str, str], str]:
    """Submit the exported script from node1 and wait for the job; (its state, its output)."""
    script = d / f"{plan.run_id}.sbatch"
    # output under the spool dir, not /tmp: nothing of this test may stay in a host's /tmp
    script.write_text(to_sbatch(plan, output=f"{SPOOL}/{plan.run_id}-%j.out"))
    job_id = slurm.ssh("node1", f"cd {SPOOL} && sbatch --parsable {shlex.quote(str(script))}").stdout
    job_id = job_id.strip().split(";")[0]
    state = slurm.wait_job(job_id, timeout=90)
    # the batch step runs on node1, the first node of the allocation: the output is there
    out = slurm.ssh("node1", f"cat {SPOOL}/{plan.run_id}-{job_id}.out", check=False).stdout
    return state, out


def test_exported_sbatch_runs_a_two_node_job_on_real_slurm(slurm, inventory2, tmp_path):
    options = RunOptions(REPORT, args=tuple(NASTY), nproc_per_node=2, env=(("DDPFAB_TEST_ENV", "a b $HOME `x`"),),
                         run_id="slurm-ok")
    _, plan = plan_for_export(str(inventory2), "all", options, cwd=str(REPO))
    state, out = submit(slurm, plan, tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out
    got = reports(out)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3], out
    assert {r["world_size"] for r in got} == {4}
    # node rank from Slurm ($SLURM_NODEID), master = the allocation's first node, the plan's port
    assert {(r["hostname"], r["node_rank"]) for r in got} == {("node1", 0), ("node2", 1)}
    assert {(r["master_addr"], r["master_port"]) for r in got} == {("node1", plan.master_port)}
    assert {r["sum"] for r in got} == {1 + 2 + 3 + 4}  # the all_reduce: all ranks agree
    assert all(r["argv"] == NASTY for r in got)  # byte for byte through sbatch, srun and bash
    assert {r["run_id"] for r in got} == {"slurm-ok"}


def test_a_failing_rank_fails_the_slurm_job_and_ends_the_other_node(slurm, inventory2, tmp_path):
    options = RunOptions(REPORT, nproc_per_node=1, run_id="slurm-fail",
                         env=(("REPORT_FAIL_RANK", "1"), ("REPORT_FAIL_CODE", "3"), ("REPORT_FAIL_AFTER", "0")))
    _, plan = plan_for_export(str(inventory2), "all", options, cwd=str(REPO))
    start = time.monotonic()
    state, out = submit(slurm, plan, tmp_path)
    assert state["JobState"] == "FAILED", out
    assert state["ExitCode"] != "0:0"
    assert "failing on purpose" in out
    # rank 0 would wait 120 s in init_process_group; srun --kill-on-bad-exit ends it
    assert time.monotonic() - start < 60
