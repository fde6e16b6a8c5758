"""Inventories and launch habits users bring from Ansible, pdsh, DeepSpeed and torch.distributed.launch,
on real lab hosts: host lists with the lab's ssh_config, hostfile slots, --limit on run/check/sync,
per-host env and GPU lists, legacy --local_rank scripts, per-node placeholders in script args.

CUDA_VISIBLE_DEVICES is only checked to arrive at the right ranks: the lab has no GPU (torch's CPU
build ignores the variable)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod

from .helpers import ddpfab, reports

REPORT_ENV = "tests/lab/scripts/report_env.py"
LEGACY = "tests/lab/scripts/legacy_underscore.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


def via_ssh_config(lab) -> list[str]:
    """How a host list reaches the lab: its ssh_config (HostName, key, known_hosts), its python by -e."""
    return ["--ssh-config", str(lab.ssh_config), "-e", f"ddpfab_python={sys.executable}"]


def inventory3(lab, tmp_path: Path, **host_vars) -> Path:
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=["node1", "node2", "node3"]))
    del inv["all"]["vars"]["ddpfab_nproc_per_node"]  # the default (1 on a CPU host, else the GPU list)
    for name, extra in host_vars.items():
        inv["all"]["hosts"][name].update(extra)
    path = tmp_path / "inventory3.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def by_host(got: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(got, key=lambda r: r["rank"]):
        out.setdefault(r["hostname"], []).append(r)
    return out


def test_ansible_host_list_with_the_labs_ssh_config(lab, tmp_path):
    res = ddpfab("run", "-i", "node2,node1,", *via_ssh_config(lab), "--runs-dir", str(tmp_path / "runs"),
                 REPORT_ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    got = by_host(reports(res.stdout))
    # the list's order is the node order; the master is node2, reached at its ssh_config HostName
    assert {h: [r["node_rank"] for r in rs] for h, rs in got.items()} == {"node2": [0], "node1": [1]}
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert manifest["plan"]["master_addr"] == lab.host("node2").address
    assert manifest["plan"]["inventory"] == "node2,node1,"
    # a single host is `host,` as in Ansible; without the comma the error says so
    res = ddpfab("exec", "-i", "node3,", *via_ssh_config(lab), "--", "hostname")
    assert res.returncode == 0 and "node3" in res.stdout, res.stdout + res.stderr
    res = ddpfab("exec", "-i", "node3", *via_ssh_config(lab), "--", "hostname")
    assert res.returncode == 2 and "a host list ends with a comma" in res.stderr


def test_deepspeed_hostfile_slots_are_each_hosts_nproc(lab, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed / MPI style\nnode1 slots=2\nnode3 slots=1\n")
    dry = ddpfab("run", "-i", str(hostfile), *via_ssh_config(lab), "--dry-run", "--json", REPORT_ENV)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert [(n["name"], n["nproc"]) for n in plan["nodes"]] == [("node1", 2), ("node3", 1)]
    res = ddpfab("run", "-i", str(hostfile), *via_ssh_config(lab), "--runs-dir", str(tmp_path / "runs"), REPORT_ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    got = by_host(reports(res.stdout))
    assert {h: [r["local_rank"] for r in rs] for h, rs in got.items()} == {"node1": [0, 1], "node3": [0]}
    assert {r["world_size"] for rs in got.values() for r in rs} == {3}


def test_limit_on_run_check_and_sync(lab, tmp_path):
    inv = inventory3(lab, tmp_path)
    res = ddpfab("run", "-i", str(inv), "--limit", "all:!node2", "--runs-dir", str(tmp_path / "runs"), REPORT_ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    got = by_host(reports(res.stdout))
    assert {h: [r["node_rank"] for r in rs] for h, rs in got.items()} == {"node1": [0], "node3": [1]}
    res = ddpfab("check", "-i", str(inv), "--limit", "node3", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [ln.split()[0] for ln in res.stdout.splitlines()[1:] if ln.startswith("node")]
    assert rows == ["node3"], res.stdout
    res = ddpfab("check", "-i", str(inv), "--limit", "nod3")
    assert res.returncode == 2 and "did you mean 'node3'" in res.stderr, res.stderr
    # sync: only the limited host gets the tree (a workdir only nodes have, inside their /opt overlay)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    workdir = f"/opt/ddpfab-limit-{tmp_path.name}"
    # a destructive path must be inside the nodes' own overlay (else a node writes on the real machine)
    fs = ddpfab("exec", "-i", str(inv), "--", "findmnt", "-n", "-o", "FSTYPE", "--target", "/opt")
    assert fs.returncode == 0 and fs.stdout.count("overlay") == 3, fs.stdout + fs.stderr
    try:
        res = ddpfab("sync", "-i", str(inv), "--limit", "node3", "-e", f"ddpfab_workdir={workdir}", str(project))
        assert res.returncode == 0, res.stdout + res.stderr
        have = ddpfab("exec", "-i", str(inv), "--", "test", "-e", f"{workdir}/train.py")
        # exit codes per node: only node3 has the file
        assert have.returncode != 0 and "node[1-2]=1 node3=0" in have.stderr, have.stdout + have.stderr
    finally:
        ddpfab("exec", "-i", str(inv), "--", "rm", "-rf", workdir)


def test_per_host_env_and_gpu_lists_reach_the_right_ranks(lab, tmp_path):
    inv = inventory3(lab, tmp_path, node1={"ddpfab_gpu_ids": [0, 2], "ddpfab_env": {"SITE": "node1-only"}},
                     node2={"ddpfab_gpu_ids": [1]})
    text = yaml.safe_load(inv.read_text())
    text["all"]["vars"]["ddpfab_env"] = {"SITE": "group", "NCCL_IB_HCA": "mlx5_0"}
    inv.write_text(yaml.safe_dump(text, sort_keys=False))
    keys = ["--env", "REPORT_ENV_KEYS=CUDA_VISIBLE_DEVICES,SITE,NCCL_IB_HCA"]
    dry = ddpfab("run", "-i", str(inv), "--limit", "node1:node2", *keys, "--dry-run", "--json", REPORT_ENV)
    assert dry.returncode == 0, dry.stderr
    plan = {n["name"]: n for n in json.loads(dry.stdout)["nodes"]}
    assert (plan["node1"]["nproc"], plan["node2"]["nproc"]) == (2, 1)  # the GPU list's length
    assert plan["node1"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,2" and plan["node2"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    # the per-host env, per host, as the real run below gets it: node1's mapping replaces the group's
    assert (plan["node1"]["env"]["SITE"], "NCCL_IB_HCA" in plan["node1"]["env"]) == ("node1-only", False)
    assert (plan["node2"]["env"]["SITE"], plan["node2"]["env"]["NCCL_IB_HCA"]) == ("group", "mlx5_0")
    res = ddpfab("run", "-i", str(inv), "--limit", "node1:node2", *keys, "--runs-dir", str(tmp_path / "runs"),
                 REPORT_ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    got = by_host(reports(res.stdout))
    assert [r["env"] for r in got["node1"]] == [{"CUDA_VISIBLE_DEVICES": "0,2", "SITE": "node1-only",
                                                 "NCCL_IB_HCA": None}] * 2  # the host's mapping replaces the group's
    assert [r["env"] for r in got["node2"]] == [{"CUDA_VISIBLE_DEVICES": "1", "SITE": "group", "NCCL_IB_HCA": "mlx5_0"}]


def test_a_local_rank_underscore_script_runs_under_the_legacy_launcher(lab, inventory2, tmp_path):
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--launcher", "legacy",
                 "--runs-dir", str(tmp_path / "runs"), LEGACY, "--tag", "old")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert sorted((r["hostname"], r["local_rank"]) for r in got) == [("node1", 0), ("node1", 1), ("node2", 0),
                                                                    ("node2", 1)]
    assert {r["tag"] for r in got} == {"old"} and {r["sum"] for r in got} == {4.0}
    # what happened before: torch 2.x's dashed flag, which this script rejects
    res = ddpfab("run", "-i", str(inventory2), "--launcher", "legacy", "--local-rank-style", "dash",
                 "--runs-dir", str(tmp_path / "runs"), LEGACY)
    assert res.returncode != 0 and "the following arguments are required: --local_rank" in res.stdout, res.stdout


def test_placeholders_arrive_expanded_per_node(lab, inventory2, tmp_path):
    # (argument names torchrun's own parser cannot mistake for an abbreviation of one of its flags)
    args = ["--shard", "{{node_rank}}/{{nnodes}}", "--peer={{master_addr}}:{{master_port}}",
            "--save=ckpt/{{run_id}}/{{node_name}}", "--total={{world_size}}", "{{ untouched"]
    dry = ddpfab("run", "-i", str(inventory2), "--run-id", "ph1", "--dry-run", REPORT_ENV, *args)
    assert dry.returncode == 0, dry.stderr
    assert "--shard 0/2" in dry.stdout and "--shard 1/2" in dry.stdout and "--save=ckpt/ph1/node2" in dry.stdout
    res = ddpfab("run", "-i", str(inventory2), "--run-id", "ph2", "--runs-dir", str(tmp_path / "runs"), REPORT_ENV, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    got = by_host(reports(res.stdout))
    manifest = json.loads((tmp_path / "runs" / "ph2" / "manifest.json").read_text())
    master = f"{lab.host('node1').address}:{manifest['plan']['master_port']}"
    for rank, host in enumerate(("node1", "node2")):
        assert got[host][0]["argv"] == ["--shard", f"{rank}/2", f"--peer={master}", f"--save=ckpt/ph2/{host}",
                                        "--total=2", "{{ untouched"]
    res = ddpfab("run", "-i", str(inventory2), "--dry-run", REPORT_ENV, "{{nodes}}")
    assert res.returncode == 2 and "did you mean 'nnodes'" in res.stderr


def test_user_at_ip_port_host_lists_reach_the_nodes(lab, tmp_path):
    """pdsh's and ssh's habit, `user@host:port,`: the user and port are the node's ansible_user and
    ansible_port, so exec and check connect as that user to that port (no inventory file, no
    ssh_config: the key, known_hosts and python come by -e and flags, a quoted -e value too)."""
    a, b = lab.host("node1").address, lab.host("node2").address
    how = ["--ssh-config", "/dev/null", "--known-hosts", str(lab.known_hosts),
           "-e", f"ansible_ssh_private_key_file='{lab.key}' ddpfab_python='{sys.executable}'"]
    res = ddpfab("exec", "-i", f"root@{a}:22,root@{b}:22,", *how, "--", "sh", "-c", 'echo "$(id -un)@$(hostname)"')
    assert res.returncode == 0, res.stdout + res.stderr
    assert "root@node1" in res.stdout and "root@node2" in res.stdout
    res = ddpfab("check", "--fast", "--json", "-i", f"root@{a}:22,", "-i", f"root@{b},", *how)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(json.loads(res.stdout)["nodes"]) == sorted([a, b])
    # the port is the one connected to: a port nothing listens on fails, naming the node and port
    res = ddpfab("exec", "-i", f"root@{a}:2999,", *how, "--", "true")
    assert res.returncode != 0 and a in res.stderr and "2999" in res.stderr, res.stdout + res.stderr
