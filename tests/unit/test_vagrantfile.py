"""The Vagrantfile: Ruby syntax, Vagrant's own validation, and the inventory it makes for ddpfab.

No VM starts here (CI has no hypervisor): ``vagrant validate --ignore-provider`` checks every
setting Vagrant knows without a provider, and a stand-in for Vagrant's config object records
what the Vagrantfile configures, so the test can rebuild the inventory Vagrant's ansible
provisioner generates and load it the way ``ddpfab run`` does.
Needs Debian's ``vagrant`` and ``ruby`` packages (scripts/setup.sh installs them).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddpfab.hosts import inventory
from ddpfab.planning import export
from ddpfab.planning.plan import RunOptions, make_plan

REPO = Path(__file__).resolve().parents[2]
VAGRANTFILE = REPO / "Vagrantfile"

# Records every setting and block of `Vagrant.configure`, then prints them as JSON.
RECORDER_RB = r'''
require "json"
class Rec
  def initialize; @data = {}; end
  def method_missing(name, *args, **kw, &block)
    key = name.to_s
    return @data[key.chomp("=")] = args.first if key.end_with?("=")
    if block
      child = Rec.new
      block.call(child)
      (@data[key] ||= []) << { "args" => args, "opts" => kw, "config" => child }
      return child
    end
    return (@data[key] ||= Rec.new) if args.empty? && kw.empty?
    (@data[key] ||= []) << { "args" => args, "opts" => kw }
    nil
  end
  def respond_to_missing?(*) = true
  def to_json(*a) = @data.to_json(*a)
end
module Vagrant
  def self.configure(version)
    rec = Rec.new
    yield rec
    puts JSON.generate({ "version" => version, "config" => rec })
  end
end
load ARGV[0]
'''


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: run scripts/setup.sh (Debian package {name})"
    return path


def vagrant(*args: str, tmp_path: Path, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """Vagrant with its state in *tmp_path*: no .vagrant/ in the repo, no update check, no network."""
    full_env = {**os.environ, "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_HOME": str(tmp_path / "vagrant.d"),
                "VAGRANT_DOTFILE_PATH": str(tmp_path / "dotvagrant"), "VAGRANT_NO_COLOR": "1", **env}
    return subprocess.run([tool("vagrant"), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=120)


def recorded(tmp_path: Path, **env: str) -> dict:
    rb = tmp_path / "record.rb"
    rb.write_text(RECORDER_RB)
    out = subprocess.run([tool("ruby"), str(rb), str(VAGRANTFILE)], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, **env}, timeout=60)
    return json.loads(out.stdout)


def test_ruby_syntax():
    out = subprocess.run([tool("ruby"), "-c", str(VAGRANTFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Syntax OK" in out.stdout, out.stderr


def test_vagrant_validate(tmp_path):
    had_dotvagrant = (REPO / ".vagrant").exists()
    res = vagrant("validate", "--ignore-provider", tmp_path=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "validated successfully" in res.stdout
    assert (REPO / ".vagrant").exists() == had_dotvagrant  # its state went to tmp_path
    res = vagrant("validate", "--ignore-provider", tmp_path=tmp_path, DDPFAB_VAGRANT_NODES="3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [f"node{i}" for i in (1, 2, 3)] == [w.rstrip(":") for w in res.stdout.split() if w.startswith("node")]


def test_vagrant_validate_catches_a_wrong_setting(tmp_path):
    """The validation above is not vacuous: a misspelt provisioner option fails it."""
    work = tmp_path / "copy"
    work.mkdir()
    (work / "Vagrantfile").write_text(VAGRANTFILE.read_text().replace("ansible.limit =", "ansible.limitt ="))
    res = vagrant("validate", "--ignore-provider", tmp_path=tmp_path, cwd=work)
    assert res.returncode != 0 and "limitt" in res.stdout + res.stderr


def machines(rec: dict) -> list[dict]:
    return rec["config"]["vm"]["define"]


def test_n_vms_with_distinct_private_addresses_and_the_provider_settings(tmp_path):
    rec = recorded(tmp_path, DDPFAB_VAGRANT_NODES="4", DDPFAB_VAGRANT_CPUS="3", DDPFAB_VAGRANT_MEMORY="2048")
    vm = rec["config"]["vm"]
    assert rec["version"] == "2" and vm["box"]
    names = [m["args"][0] for m in machines(rec)]
    assert names == ["node1", "node2", "node3", "node4"]
    addrs = [m["config"]["vm"]["network"][0]["opts"]["ip"] for m in machines(rec)]
    assert len(set(addrs)) == 4 and all(ipaddress.ip_address(a).is_private for a in addrs)
    assert [m["config"]["vm"]["hostname"] for m in machines(rec)] == names
    for provider in vm["provider"]:
        assert (provider["config"]["cpus"], provider["config"]["memory"]) == (3, 2048)


def test_one_ansible_pass_over_all_vms_from_the_last_one(tmp_path):
    rec = recorded(tmp_path)
    provisioners = [(m["args"][0], p) for m in machines(rec) for p in m["config"]["vm"].get("provision", [])]
    assert [(name, p["args"]) for name, p in provisioners] == [("node2", ["ansible"])]
    ansible = provisioners[0][1]["config"]
    assert ansible["limit"] == "all"
    assert ansible["playbook"] == "playbooks/provision.yml"  # the one `ddpfab provision` runs
    assert (REPO / ansible["config_file"]).is_file()
    assert ansible["extra_vars"]["ddpfab_group"] in ansible["groups"]


def generated_inventory(ansible: dict, names: list[str]) -> str:
    """The INI inventory Vagrant's ansible provisioner writes (vagrant 2.3's generate_inventory):
    one line per machine with its SSH endpoint and host_vars, then each group and its :vars."""
    lines = ["# Generated by Vagrant", ""]
    for i, name in enumerate(names):
        host_vars = " ".join(f"{k}={v}" for k, v in ansible["host_vars"].get(name, {}).items())
        lines.append(f"{name} ansible_host=127.0.0.1 ansible_port={2222 + i} ansible_user='vagrant' "
                     f"ansible_ssh_private_key_file='/v/.vagrant/machines/{name}/virtualbox/private_key' {host_vars}")
    for group, members in ansible["groups"].items():
        lines += ["", f"[{group}]"]
        if group.endswith(":vars"):
            lines += [f"{k}={v}" for k, v in members.items()]
        else:
            lines += [m for m in members if m in names]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("nodes", ["2", "3"])
def test_the_generated_inventory_is_what_ddpfab_run_reads(tmp_path, nodes):
    rec = recorded(tmp_path, DDPFAB_VAGRANT_NODES=nodes)
    names = [m["args"][0] for m in machines(rec)]
    addrs = {m["args"][0]: m["config"]["vm"]["network"][0]["opts"]["ip"] for m in machines(rec)}
    ansible = machines(rec)[-1]["config"]["vm"]["provision"][0]["config"]
    path = tmp_path / "vagrant_ansible_inventory"
    path.write_text(generated_inventory(ansible, names))

    cluster = inventory.load(path, ansible["extra_vars"]["ddpfab_group"])
    assert [n.name for n in cluster.nodes] == names
    for node in cluster.nodes:
        assert node.host == "127.0.0.1" and node.user == "vagrant"  # SSH through Vagrant's forwarded port
        assert node.data_addr == addrs[node.name]  # training over the private network
        assert node.python == "/opt/ddpfab/venv/bin/python"  # the venv the python role makes
        assert node.workdir == "/vagrant"  # the synced repository
    plan = make_plan(cluster, RunOptions("examples/train.py"), export.offline_facts(cluster, None, "/x"))
    assert plan.master_addr == addrs["node1"]
    assert [n.node_rank for n in plan.nodes] == list(range(len(names)))
    assert plan.world_size == len(names) * 2
