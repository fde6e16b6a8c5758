"""The first hour on real machines, as docs/on-your-machines.md describes it.

- The wheel installed in a fresh venv outside the checkout (a controller without torch): from a
  directory that is not the checkout, its `ddpfab lab up` (which points the nodes at the venv
  `ddpfab provision` makes), an inventory of host names only (the lab's ssh_config maps each
  `Host` alias to its address; no IP and no ddpfab_python anywhere); `provision` with the wheel's
  collection, then `check`, `run` (dry run first), `fetch`, and its `lab down`. The run uses the
  venv provision made: the manifest says so, and so does each rank about itself and its torchrun
  (the process that started it, read from the node's /proc).
- A setup line that activates another environment (a second venv made here, with a marker
  package) changes what `check` reports and what the job imports; a failing setup line is named
  with its node by `check`, `run` and `exec`.

One lab of 2 hosts for the module (its hosts see the tests' temp dirs, as a shared filesystem).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
import yaml

from ddpfab import __version__
from ddpfab import lab as labmod
from ddpfab.hosts import nodeenv
from ddpfab.remote import provision

from .conftest import extra_subnet
from .helpers import ddpfab, reports
from .test_install import sh

#: The job: who am I, which python, which torchrun started me (the node's /proc), one all_reduce,
#: a file for `fetch`. With the marker env's package importable, its name too.
JOB = r'''
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
try:
    import ddpfab_marker_env
    marker = ddpfab_marker_env.NAME
except ImportError:
    marker = None
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
t = torch.tensor([1.0])
dist.all_reduce(t)
with open("/proc/%d/cmdline" % os.getppid(), "rb") as fh:
    parent = [w.decode() for w in fh.read().split(b"\0") if w]
out = {"rank": rank, "sum": t.item(), "executable": sys.executable, "prefix": sys.prefix, "parent": parent,
       "marker": marker, "site": os.environ.get("SITE_FLAG"), "chosen": os.environ.get("DDPFAB_PYTHON")}
os.makedirs("out", exist_ok=True)
with open("out/rank%d.json" % rank, "w") as fh:
    json.dump(out, fh)
print("REPORT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def wheel_env(dist) -> dict[str, str]:
    """The environment of a user whose PATH starts with the wheel's venv (and no PYTHONPATH)."""
    return {"PATH": f"{dist['venv'] / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}


@pytest.fixture(scope="module")
def hosts(dist, tmp_path_factory):
    """2 lab hosts brought up, and taken down whatever happens, by the wheel's own `ddpfab lab`
    from a directory that is not the checkout. Its hosts see the tests' temp dirs."""
    ddpfab_bin = dist["venv"] / "bin" / "ddpfab"
    where = tmp_path_factory.mktemp("firsthour")
    lab_dir = where / "lab"
    # shared besides the tests' temp dirs: this test's venv (its torch is what the second test's env
    # imports; the wheel's `lab up` shares its own venv only), where a checkout in /tmp has it
    res = sh([ddpfab_bin, "lab", "up", "--hosts", "2", "--dir", lab_dir, "--subnet", extra_subnet(147),
              "--share", tmp_path_factory.getbasetemp(), "--share", sys.prefix], cwd=where, env=wheel_env(dist))
    try:
        assert res.returncode == 0
        # this python has no torch: the lab's own inventory points the nodes at provision's venv
        assert f"python:    {labmod.PROVISIONED_PYTHON} (this python has no torch" in res.stdout
        yield labmod.Lab.load(lab_dir)
    finally:
        assert sh([ddpfab_bin, "lab", "down", "--dir", lab_dir], cwd=where, env=wheel_env(dist)).returncode == 0
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert labmod.lab_id(lab_dir.resolve()) not in netns


def names_inventory(the_lab, path: Path, **group_vars) -> Path:
    """An inventory of host names only: how to reach them is the ssh_config's (the lab's, named
    with -F as any Ansible inventory can), no ansible_host, no ddpfab_python. (ansible_user: the
    play's become needs to know it connects as root, which ssh_config's User does not tell it.)"""
    inv = {"all": {"hosts": {h.name: None for h in the_lab.hosts},
                   "vars": {"ansible_ssh_common_args": f"-F {the_lab.ssh_config}", "ansible_user": "root",
                            "ansible_python_interpreter": "/usr/bin/python3", **group_vars}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def project(tmp_path: Path) -> Path:
    proj = tmp_path / "project"
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    return proj


def test_readme_first_hour_with_host_names_provisions_and_runs_in_the_provisioned_venv(dist, hosts, tmp_path):
    vbin = dist["venv"] / "bin"  # the wheel installed in a fresh venv (the session's `dist` fixture)
    env = wheel_env(dist)
    proj = project(tmp_path)  # the user's project: not the checkout
    assert sh([vbin / "python", "-c", "import torch"], cwd=proj).returncode != 0  # a controller without torch
    # what `ddpfab provision` runs is beside it in the venv (what a pipx install, whose PATH has only
    # `ddpfab`, relies on), and the command answers from outside the checkout
    assert (vbin / "ansible-playbook").is_file()
    res = sh([vbin / "ddpfab", "--version"], cwd=proj)
    assert res.returncode == 0 and __version__ in res.stdout + res.stderr
    inv = names_inventory(hosts, proj / "inv.yml", ddpfab_workdir="/opt/ddpfab-first-hour")
    text = inv.read_text()
    assert "ddpfab_python" not in text and not any(h.address in text for h in hosts.hosts)
    ddpfab_bin = vbin / "ddpfab"

    # provision from the wheel: its collection, over no ansible.cfg of the user's
    res = sh([ddpfab_bin, "provision", "-i", inv, "-e", "ddpfab_python_pip_compile=false",
              "-e", '{"ddpfab_python_pip_environment": {"PIP_RETRIES": "0"}}'], cwd=proj, env=env)
    assert res.returncode == 0
    assert "ddpfab.cluster.ddpfab_python : " in res.stdout  # the roles of the wheel's collection ran
    recap = {h.host: h.counts for h in provision.parse_recap(res.stdout)}
    assert sorted(recap) == ["node1", "node2"] and all(c["failed"] == 0 for c in recap.values())

    venv_python = "/opt/ddpfab/venv/bin/python"
    res = sh([ddpfab_bin, "check", "-i", inv, "--json"], cwd=proj, env=env)
    assert res.returncode == 0
    found = {(r["node"], r["check"]): r["found"] for r in json.loads(res.stdout)["results"]}
    for name in ("node1", "node2"):
        assert found[(name, "interpreter")] == f"{venv_python} (from provisioned venv)"

    # (the dry run does not copy the code, and refuses a workdir not there yet: sync first)
    assert sh([ddpfab_bin, "sync", "-i", inv], cwd=proj, env=env).returncode == 0
    res = sh([ddpfab_bin, "run", "-i", inv, "--dry-run", "job.py"], cwd=proj, env=env)
    assert res.returncode == 0 and all(
        f"# python on {n}: {venv_python} (from provisioned venv)" in res.stdout for n in ("node1", "node2"))
    assert f"{venv_python} -m torch.distributed.run" in res.stdout

    res = sh([ddpfab_bin, "run", "-i", inv, "job.py"], cwd=proj, env=env, timeout=300)
    assert res.returncode == 0
    got = {r["rank"]: r for r in reports(res.stdout)}
    assert sorted(got) == [0, 1] and {r["sum"] for r in got.values()} == {2.0}
    for r in got.values():  # the rank itself, and the torchrun that started it, on the node
        assert r["executable"] == venv_python and r["prefix"] == "/opt/ddpfab/venv"
        assert r["parent"][:3] == [venv_python, "-m", "torch.distributed.run"], r["parent"]
    manifest = json.loads(next((proj / "runs").glob("*/manifest.json")).read_text())  # in the user's project
    for node in manifest["plan"]["nodes"]:
        assert (node["python"], node["python_from"]) == (venv_python, "provisioned venv")
    for facts in manifest["nodes_facts"].values():
        assert (facts["executable"], facts["python_from"]) == (venv_python, "provisioned venv")
    # the recorded run replays: the inventory's fingerprint is of the nodes as it gives them (it
    # was taken after the probe had chosen the venv, so every replay said "the inventory changed")
    res = sh([ddpfab_bin, "replay", "--dry-run", manifest["run_id"]], cwd=proj, env=env, timeout=300)
    assert res.returncode == 0 and "changed" not in res.stderr, res.stdout + res.stderr

    res = sh([ddpfab_bin, "fetch", "-i", inv, "--node-rank", "1", "out/rank1.json", proj / "fetched"], cwd=proj, env=env)
    assert res.returncode == 0
    fetched = json.loads(next((proj / "fetched").rglob("rank1.json")).read_text())
    assert fetched["rank"] == 1 and fetched["executable"] == venv_python


def test_a_setup_line_activates_another_env_for_check_and_job_and_a_failing_one_is_named(hosts, tmp_path):
    other = tmp_path / "other-env"
    venv.create(other, with_pip=False)
    site = next(other.glob("lib/python*/site-packages"))
    (site / "torch_from_here.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    (site / "ddpfab_marker_env").mkdir()
    (site / "ddpfab_marker_env" / "__init__.py").write_text('NAME = "the second env"\n')
    proj = project(tmp_path)
    setup = [f". {other}/bin/activate", "export SITE_FLAG=from-setup"]
    inv = names_inventory(hosts, proj / "inv.yml", ddpfab_workdir="/opt/ddpfab-first-hour-setup", ddpfab_setup=setup)

    res = ddpfab("check", "-i", str(inv), "--json", cwd=proj)
    assert res.returncode == 0, res.stdout + res.stderr
    found = {(r["node"], r["check"]): r["found"] for r in json.loads(res.stdout)["results"]}
    for name in ("node1", "node2"):
        assert found[(name, "interpreter")] == f"{other}/bin/python (from ddpfab_setup)"
        assert "VIRTUAL_ENV" in found[(name, "environment")] and "SITE_FLAG" in found[(name, "environment")]

    # the first run copies the code after the setup lines ran in its preparation: each node's supervisor
    # starts in a session of its own, which runs them on the new tree; the second copies nothing, and its
    # preparation's programs go on as the supervisors. The job sees the same either way (not the
    # DDPFAB_PYTHON the preparation's choice of python exported)
    for adopted in (False, True):
        res = ddpfab("run", "-i", str(inv), "job.py", cwd=proj, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        got = {r["rank"]: r for r in reports(res.stdout)}
        assert sorted(got) == [0, 1]
        for r in got.values():
            assert r["marker"] == "the second env" and r["site"] == "from-setup" and r["chosen"] is None
            assert r["executable"] == f"{other}/bin/python" and r["parent"][0] == f"{other}/bin/python"
        manifest = json.loads(max((proj / "runs").glob("*/manifest.json"), key=os.path.getmtime).read_text())
        for facts in manifest["nodes_facts"].values():
            assert facts["python_from"] == "ddpfab_setup"
            assert facts["env_changes"]["set"]["SITE_FLAG"] == "from-setup"
        assert [n["setup"] for n in manifest["plan"]["nodes"]] == [setup, setup]
        for name in ("node1", "node2"):
            record = sh(["ssh", "-F", hosts.ssh_config, name, f"cat .ddpfab/runs/{manifest['run_id']}/agent.json"],
                        cwd=proj)
            assert json.loads(record.stdout)["adopted"] is adopted, record.stdout + record.stderr

    # node2's own setup line fails: every command names node2 and the line; node1 is fine
    data = yaml.safe_load(inv.read_text())
    data["all"]["hosts"]["node2"] = {"ddpfab_setup": ["test -d /nonexistent-ddpfab-setup"]}
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    line = "setup line 1 `test -d /nonexistent-ddpfab-setup` failed there (exit 1)"
    res = ddpfab("check", "-i", str(inv), "--json", cwd=proj)
    assert res.returncode != 0
    failed = {(r["node"], r["check"]): r["found"] for r in json.loads(res.stdout)["results"] if r["status"] == "fail"}
    # its environment failed, not its SSH (it was filed under ssh: "probe failed: ...")
    assert list(failed) == [("node2", "environment")] and line in failed[("node2", "environment")], failed
    res = ddpfab("run", "-i", str(inv), "job.py", cwd=proj, timeout=300)
    assert res.returncode == 2 and f"host node2: {line}" in res.stderr, res.stdout + res.stderr
    assert "node1: setup" not in res.stderr
    # no sync advice for it (it said "sync: host node2: ..." and "(skip syncing with --no-sync)")
    assert "sync" not in res.stderr, res.stderr
    res = ddpfab("exec", "-i", str(inv), "--", "echo ran-here", cwd=proj)
    assert res.returncode == nodeenv.SETUP_FAILED
    assert "node1 | ran-here" in res.stdout and "node2 | ran-here" not in res.stdout
    assert f"node2 | ddpfab: {line}" in res.stderr and nodeenv.SETUP_MARK not in res.stderr, res.stderr
    shutil.rmtree(other)
