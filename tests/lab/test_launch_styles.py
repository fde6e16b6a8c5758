"""Every way users start PyTorch distributed, on real lab hosts with real torchrun/gloo.

One example (examples/train_dist.py, through ddpfab.dist) trains under rendezvous static and c10d,
launcher torchrun and legacy (torch.distributed.launch), init env://, tcp:// and file://. Each real
run costs ~10-20 s here, so the axes are combined, every value at least once:

    run                         rdzv    launcher  init
    test_debugging (recorded)   static  torchrun  env://   (examples/train_dist.py, --debug)
    file init                   static  torchrun  file://
    c10d + legacy + tcp         c10d    legacy    tcp://
    legacy-style script         c10d    legacy    env://   (examples/legacy_launch.py, unchanged)

Every run checks ranks, world size, hosts and a real all_reduce and all_gather result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod
from ddpfab.planning import render
from ddpfab.planning.plan import Plan

from .helpers import ddpfab, reports

EXAMPLE = "examples/train_dist.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def shared_dir(lab):
    """A directory every lab host sees with the same content, standing in for NFS.

    Lab hosts get private overlays of /etc /opt /var /root /usr /home /tmp (for /tmp the real /tmp
    is the lower layer: a host reads it live, but its writes stay its own, so a dir under /tmp is
    NOT shared, and neither is a checkout under /tmp, as in CI). The lab's own shared dir lies
    outside every overlay (``Lab.shared_dir``, under /srv), so all hosts read and write one copy.
    """
    path = Path(tempfile.mkdtemp(prefix="test-shared-", dir=lab.shared_dir))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def inventory_with(lab, path: Path, names=("node1", "node2"), **host_vars) -> Path:
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=list(names)))
    inv["all"]["vars"].update(host_vars)
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def manifest_of(runs: Path) -> dict:
    return json.loads(next(runs.glob("*/manifest.json")).read_text())


def check_training(got: list[dict], world: int) -> None:
    """Every rank of one job: all ranks once, one world, a right all_reduce, one model."""
    assert sorted(r["rank"] for r in got) == list(range(world))
    assert {r["world_size"] for r in got} == {world}
    assert {r["sum"] for r in got} == {world * (world + 1) / 2}
    # all_gather of each rank's rank, and all_gather_object of each rank's host, seen alike by all
    assert {tuple(r["gathered_ranks"]) for r in got} == {tuple(range(world))}
    by_rank = {r["rank"]: r["hostname"] for r in got}
    assert {tuple(r["hosts"]) for r in got} == {tuple(by_rank[i] for i in range(world))}
    assert len({r["checksum"] for r in got}) == 1 and len({r["loss"] for r in got}) == 1  # DDP in sync


def test_file_init_on_a_shared_dir(lab, tmp_path, shared_dir):
    """static rendezvous, torchrun, file:// in ddpfab_shared_dir."""
    inv = inventory_with(lab, tmp_path / "inv.yml", ddpfab_shared_dir=str(shared_dir))
    res = ddpfab("run", "-i", str(inv), "--init-method", "file", "--runs-dir", str(tmp_path / "runs"),
                 EXAMPLE, "--report", "--steps", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    check_training(got, 2)
    run_id = manifest_of(tmp_path / "runs")["run_id"]
    assert {r["init_method"] for r in got} == {f"file://{shared_dir}/ddpfab-{run_id}.init"}
    assert {(r["hostname"], r["rank"], r["node_rank"]) for r in got} == {("node1", 0, 0), ("node2", 1, 1)}
    manifest = manifest_of(tmp_path / "runs")
    assert (manifest["plan"]["rdzv"], manifest["plan"]["launcher"], manifest["plan"]["init_method"]) == \
        ("static", "torchrun", "file")


def test_c10d_rendezvous_legacy_launcher_tcp_init(lab, inventory2, tmp_path):
    """c10d rendezvous (torchrun assigns node ranks), torch.distributed.launch, tcp:// init, 2x2."""
    res = ddpfab("run", "-i", str(inventory2), "--rdzv", "c10d", "--launcher", "legacy", "--init-method", "tcp",
                 "--nproc-per-node", "2", "--runs-dir", str(tmp_path / "runs"), EXAMPLE, "--report", "--steps", "2",
                 "x y")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    check_training(got, 4)
    master = lab.host("node1").address
    plan = manifest_of(tmp_path / "runs")["plan"]
    assert (plan["rdzv"], plan["launcher"], plan["init_method"]) == ("c10d", "legacy", "tcp")
    assert {r["init_method"] for r in got} == {f"tcp://{master}:{plan['master_port']}"}
    # the legacy launcher handed each worker --local-rank=N, and it agrees with LOCAL_RANK
    assert all(r["local_rank_arg"] == r["local_rank"] for r in got)
    assert all(r["argv"] == ["x y"] for r in got)
    # c10d: a node's ranks are contiguous and its node rank (GROUP_RANK) is the same for both
    for host in ("node1", "node2"):
        mine = [r for r in got if r["hostname"] == host]
        assert sorted(r["local_rank"] for r in mine) == [0, 1]
        assert len({r["node_rank"] for r in mine}) == 1
        assert sorted(r["rank"] for r in mine) == [2 * mine[0]["node_rank"], 2 * mine[0]["node_rank"] + 1]
    # global ranks are torchrun's business under c10d: the prefix shows local ranks
    lines = res.stdout.splitlines()
    for r in got:
        assert any(ln.startswith(f"{r['hostname']} l{r['local_rank']}| REPORT") and f'"rank": {r["rank"]},' in ln
                   for ln in lines)
    recorded = Plan.from_dict(plan)  # the manifest's plan is data; render gives the argv the nodes ran
    assert (recorded.launcher, recorded.rdzv) == ("legacy", "c10d")
    for n in recorded.nodes:
        argv = render.argv(recorded, n)
        assert argv[1:3] == ("-m", "torch.distributed.launch")
        assert "--rdzv-backend=c10d" in argv and not any(a.startswith("--node-rank") for a in argv)


def test_script_written_for_torch_distributed_launch_runs_unchanged(lab, inventory2, tmp_path):
    """examples/legacy_launch.py requires --local-rank and inits env:// itself: --launcher legacy
    (here with c10d rendezvous) runs it as it is."""
    res = ddpfab("run", "-i", str(inventory2), "--launcher", "legacy", "--rdzv", "c10d", "--runs-dir",
                 str(tmp_path / "runs"), "examples/legacy_launch.py", "--epochs", "2", "--report")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1] and {r["world_size"] for r in got} == {2}
    assert {r["sum"] for r in got} == {3.0}
    assert {r["hostname"] for r in got} == {"node1", "node2"}
    assert all(r["local_rank"] == r["local_rank_env"] == 0 for r in got)


def test_module_mode_and_nproc_auto_run_as_the_dry_run_shows(lab, inventory2, tmp_path):
    """``-- -m pkg.mod`` (torchrun's module mode) with ``--nproc_per_node auto`` (torchrun's word and
    spelling): the dry run and the real run plan the same launch; auto is each node's CPU count
    (the lab hosts have no GPU), decided from the probe."""
    words = ["--nproc_per_node", "auto", "--", "-m", "tests.lab.scripts.report", "--lr", "1"]
    dry = ddpfab("run", "-i", str(inventory2), "--dry-run", "--json", "--run-id", "mod-dry", *words)
    assert dry.returncode == 0, dry.stderr
    shown = Plan.from_dict(json.loads(dry.stdout))
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), *words)
    assert res.returncode == 0, res.stdout + res.stderr
    cpus = os.cpu_count()  # the lab hosts are namespaces of this machine
    got = reports(res.stdout)
    assert sorted(r["rank"] for r in got) == list(range(2 * cpus)) and {r["world_size"] for r in got} == {2 * cpus}
    for host in ("node1", "node2"):
        assert sorted(r["local_rank"] for r in got if r["hostname"] == host) == list(range(cpus))
    assert all(r["argv"] == ["--lr", "1"] for r in got)
    ran = Plan.from_dict(manifest_of(tmp_path / "runs")["plan"])
    assert (ran.module, ran.script, [n.nproc for n in ran.nodes]) == (True, "tests.lab.scripts.report", [cpus, cpus])
    for node in ran.nodes:  # one launch: the same argv but for the run's own id and port
        same = dataclasses.replace(shown, run_id=ran.run_id, master_port=ran.master_port,
                                   nodes=tuple(dataclasses.replace(n, remote_dir=ran.node(n.name).remote_dir,
                                                                   env=ran.node(n.name).env) for n in shown.nodes))
        assert render.argv(ran, node) == render.argv(same, same.node(node.name))
        assert render.argv(ran, node)[-4:] == ("-m", "tests.lab.scripts.report", "--lr", "1")
    # a module of this tree that is not there: refused before anything starts, dry run or not
    for dry_run in ([], ["--dry-run"]):
        bad = ddpfab("run", "-i", str(inventory2), *dry_run, "--runs-dir", str(tmp_path / "runs2"),
                     "--", "-m", "tests.lab.scripts.nope")
        assert bad.returncode == 2 and "module tests.lab.scripts.nope not found" in bad.stderr, bad.stderr
        assert not (tmp_path / "runs2").exists()


def test_a_local_rank_script_gets_each_ranks_local_rank_under_torchrun(lab, inventory2, tmp_path):
    """A script that parses --local_rank (default 0) and never reads LOCAL_RANK, started with the
    default launcher on 2 nodes x 2 procs: each rank gets its own local rank, never 0 everywhere."""
    res = ddpfab("run", "-i", str(inventory2), "--nproc-per-node", "2", "--runs-dir", str(tmp_path / "runs"),
                 "--env", "LOCAL_RANK_DEFAULT=0", "tests/lab/scripts/legacy_underscore.py", "--tag", "t")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3] and {r["sum"] for r in got} == {4.0}
    for host in ("node1", "node2"):
        mine = [r for r in got if r["hostname"] == host]
        assert sorted(r["local_rank"] for r in mine) == [0, 1]
    assert all(r["local_rank"] == r["local_rank_env"] and r["tag"] == "t" for r in got)
    plan = manifest_of(tmp_path / "runs")["plan"]
    assert (plan["launcher"], plan["script_local_rank"], plan["local_rank_arg"]) == ("torchrun", True, "--local_rank")


def test_nproc_gpu_counts_what_nvidia_smi_lists_on_each_node(lab, tmp_path, shared_dir):
    """``--nproc-per-node gpu`` on nodes whose nvidia-smi (ddpfab/lab/fake-nvidia-smi, first on the
    PATH of the nodes' python through a wrapper in the shared dir) lists two GPUs: two ranks each,
    decided from the probe; the CPU-only torch runs them on gloo."""
    fake_bin = shared_dir / "bin"
    fake_bin.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "ddpfab" / "lab" / "fake-nvidia-smi", fake_bin / "nvidia-smi")
    wrapper = shared_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nPATH={fake_bin}:$PATH exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    inv = inventory_with(lab, tmp_path / "inv.yml", ddpfab_python=str(wrapper))
    res = ddpfab("run", "-i", str(inv), "--nproc-per-node", "gpu", "--runs-dir", str(tmp_path / "runs"),
                 "tests/lab/scripts/report.py")
    assert res.returncode == 0, res.stdout + res.stderr
    got = reports(res.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3] and {r["world_size"] for r in got} == {4}
    for host in ("node1", "node2"):
        assert sorted(r["local_rank"] for r in got if r["hostname"] == host) == [0, 1]
    assert [n["nproc"] for n in manifest_of(tmp_path / "runs")["plan"]["nodes"]] == [2, 2]
