"""ddpfab/remote/provision.py without hosts: finding ansible-playbook and the playbooks, the command line,
and naming failed hosts from Ansible's PLAY RECAP. (Fast; the real runs are in tests/lab.)"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpfab.remote import provision
from ddpfab.remote.target import HostKeyPolicy

REPO = Path(__file__).resolve().parents[2]

RECAP = """\
TASK [ddpfab_gpu : Check the GPU count against the inventory] ******************
fatal: [gpu02]: FAILED! => ...

PLAY RECAP *********************************************************************
gpu01                      : ok=54   changed=0    unreachable=0    failed=0    skipped=20   rescued=0    ignored=0
gpu02                      : ok=31   changed=1    unreachable=0    failed=1    skipped=9    rescued=0    ignored=0
\x1b[0;31mgpu03\x1b[0m                      : ok=0    changed=0    \x1b[1;31munreachable=1\x1b[0m    failed=0    skipped=0    rescued=0    ignored=0

"""


def test_parse_recap_reads_every_host_even_in_colour():
    hosts = provision.parse_recap(RECAP)
    assert [h.host for h in hosts] == ["gpu01", "gpu02", "gpu03"]
    assert hosts[0].counts["ok"] == 54 and hosts[0].changed == 0
    assert hosts[1].failed and not hosts[1].unreachable
    assert hosts[2].unreachable


def test_summary_names_each_failed_or_unreachable_host_once():
    lines = provision.summarize(provision.parse_recap(RECAP), rc=2)
    assert len(lines) == 2
    assert lines[0].startswith("ddpfab provision: gpu02: FAILED")
    assert lines[1].startswith("ddpfab provision: gpu03: UNREACHABLE")
    assert provision.summarize(provision.parse_recap(RECAP.replace("failed=1", "failed=0")
                                                     .replace("unreachable=1", "unreachable=0")), 0) == []


def test_summary_when_ansible_failed_before_any_host():
    assert "before any host ran" in provision.summarize([], rc=4)[0]


ANSIBLE_DIR = REPO / "ddpfab" / "ansible"


def test_ansible_dir_is_package_data_and_the_checkout_links_to_it():
    assert provision.ansible_dir() == ANSIBLE_DIR
    assert provision.playbook_path("firewall") == ANSIBLE_DIR / "firewall.yml"
    assert provision.collection_dir() == ANSIBLE_DIR / "collections/ansible_collections/ddpfab/cluster"
    # the checkout's quick-start paths are links into the package
    assert (REPO / "ansible.cfg").resolve() == ANSIBLE_DIR / "ansible.cfg"
    assert (REPO / "playbooks").resolve() == provision.collection_dir() / "playbooks"
    assert (REPO / "roles").resolve() == provision.collection_dir() / "roles"


def test_unknown_playbook_and_missing_inventory_are_clear(tmp_path):
    with pytest.raises(provision.ProvisionError, match="unknown playbook 'nope'"):
        provision.playbook_path("nope")
    with pytest.raises(provision.ProvisionError, match="inventory .*: no such file or directory"):
        provision.build_command(tmp_path / "missing.yml")


def test_command_line(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {a: {}}}\n")
    argv = provision.build_command(inv, "provision", tags=["firewall,gpu", "python"], check=True,
                                   limit="a", extra_args=["-e", "x=1"])
    assert Path(argv[0]).name == "ansible-playbook"
    assert argv[1:4] == ["-i", str(inv), str(ANSIBLE_DIR / "provision.yml")]
    assert argv[4:] == ["--tags", "firewall,gpu,python", "--check", "--diff", "--limit", "a", "-e", "x=1"]


def test_environment_layers_ddpfabs_settings_under_the_users(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    for k in list(os.environ):
        if k.startswith("ANSIBLE_"):
            monkeypatch.delenv(k)
    env = provision.ansible_env()
    assert "ANSIBLE_CONFIG" not in env  # never forced: Ansible finds the user's own config
    assert env["ANSIBLE_FORKS"] == "32" and env["ANSIBLE_PIPELINING"] == "True"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    # the user's ansible.cfg (here ./ansible.cfg) wins over ddpfab's, key by key
    (tmp_path / "ansible.cfg").write_text("[defaults]\nforks = 7\n[ssh_connection]\npipelining = False\n")
    env = provision.ansible_env()
    assert "ANSIBLE_FORKS" not in env and "ANSIBLE_PIPELINING" not in env
    assert env["ANSIBLE_TIMEOUT"] == "30"  # what the user did not set still comes from ddpfab
    # and the user's environment wins over both
    monkeypatch.setenv("ANSIBLE_TIMEOUT", "99")
    assert provision.ansible_env()["ANSIBLE_TIMEOUT"] == "99"
    # ANSIBLE_CONFIG names the user's file
    other = tmp_path / "site.cfg"
    other.write_text("[defaults]\ntimeout = 5\n")
    monkeypatch.delenv("ANSIBLE_TIMEOUT")
    monkeypatch.setenv("ANSIBLE_CONFIG", str(other))
    env = provision.ansible_env()
    assert env["ANSIBLE_CONFIG"] == str(other) and "ANSIBLE_TIMEOUT" not in env and env["ANSIBLE_FORKS"] == "32"


def test_every_setting_of_ddpfabs_cfg_has_its_variable():
    import configparser

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ANSIBLE_DIR / "ansible.cfg")
    keys = {k for s in cfg.sections() for k in cfg[s]}
    assert keys - set(provision.NOT_LAYERED) == set(provision.SETTING_ENV)


def test_pass_through_options_reach_ansible_playbook(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {a: {}}}\n")
    opts = provision.AnsibleOptions(verbosity=3, ask_become_pass=True, user="admin", vault_ids=("dev@prompt",),
                                    ask_vault_pass=True, vault_password_files=("vp.txt",), diff=True,
                                    limit="a", tags=("base,python",), skip_tags=("gpu",), extra_vars=("x=1", "@v.yml"))
    argv = provision.build_command(inv, options=opts)
    assert argv[4:] == ["-vvv", "-u", "admin", "--ask-become-pass", "--vault-id", "dev@prompt", "--ask-vault-pass",
                        "--vault-password-file", "vp.txt", "--tags", "base,python", "--skip-tags", "gpu", "--diff",
                        "--limit", "a", "-e", "x=1", "-e", "@v.yml"]
    assert opts.prompts
    # the CLI parses the same spellings as ansible-playbook
    from ddpfab import cli
    from ddpfab.cli import provision as provision_cli

    args = cli.build_parser().parse_args(["provision", "-i", str(inv), "-vv", "-K", "-u", "u", "-C", "-l", "a",
                                          "-t", "base", "-e", "k=v", "--vault-id", "x@prompt", "-J"])
    got = provision_cli.options_from_args(args)
    assert (got.verbosity, got.ask_become_pass, got.user, got.check, got.limit, got.tags, got.extra_vars,
            got.vault_ids, got.ask_vault_pass) == (2, True, "u", True, "a", ("base",), ("k=v",), ("x@prompt",), True)


def test_host_list_and_hostfile_inventories_become_files_ansible_reads(tmp_path):
    argv = provision.build_command("node1,node2,")
    assert Path(argv[2]).is_file() and "node1" in Path(argv[2]).read_text()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=4\n")
    text = Path(provision.build_command(str(hostfile))[2]).read_text()
    assert '"ddpfab_nproc_per_node": 4' in text


def test_missing_ansible_playbook_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(provision.ProvisionError, match="ansible-playbook not found .* pip install ansible-core"):
        provision.find_ansible_playbook()


def test_run_playbook_streams_output_and_names_failed_hosts(tmp_path, monkeypatch):
    """A stand-in ansible-playbook that prints a recap and exits 2, like a run with a failed host."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "ansible-playbook"
    recap_file = tmp_path / "recap.txt"
    recap_file.write_text(RECAP)
    fake.write_text(f"#!/bin/sh\necho \"forks=$ANSIBLE_FORKS args=$*\"\ncat {recap_file}\nexit 2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.chdir(tmp_path)  # not the checkout, whose ./ansible.cfg Ansible would read itself
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    monkeypatch.delenv("ANSIBLE_FORKS", raising=False)
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {gpu01: {}}}\n")
    out = io.StringIO()
    rc = provision.run_playbook(inv, "firewall", out=out)
    text = out.getvalue()
    assert rc == 2
    assert "forks=32" in text and str(ANSIBLE_DIR / "firewall.yml") in text
    assert "PLAY RECAP" in text
    assert text.rstrip().splitlines()[-2:] == [
        line for line in text.splitlines() if line.startswith("ddpfab provision: ")]
    assert "ddpfab provision: gpu02: FAILED" in text and "ddpfab provision: gpu03: UNREACHABLE" in text


def test_ansible_logs_in_as_the_user_ssh_does_so_its_become_decision_is_right(tmp_path):
    """Real ansible-playbook templating of ddpfab's extra-vars file: a host whose login user only
    the ssh_config names (``User root``) is that user for Ansible too (Ansible skips sudo for a root
    login, and wraps a non-root one in it); a host outside the inventory keeps Ansible's own user."""
    (tmp_path / "ssh_config").write_text("Host gpu01\n  HostName 10.9.9.1\n  User root\n")
    (tmp_path / "inv.ini").write_text("gpu01\ngpu02 ansible_host=10.9.9.2 ansible_user=alice\n")
    targets = provision.targets_of(str(tmp_path / "inv.ini"), HostKeyPolicy(), str(tmp_path / "ssh_config"))
    extra = provision.ssh_vars_file(targets, str(tmp_path))
    (tmp_path / "show.yml").write_text(
        "- hosts: all:localhost\n  gather_facts: false\n  connection: local\n  tasks:\n"
        "    - ansible.builtin.copy:\n        content: '{{ ansible_user }}'\n"
        "        dest: '" + str(tmp_path) + "/user-{{ inventory_hostname }}'\n      delegate_to: localhost\n")
    env = {**provision.ansible_env(), "USER": "ctl", "ANSIBLE_REMOTE_USER": "", "ANSIBLE_LOCALHOST_WARNING": "0"}
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "inv.ini"),
                           "-i", "localhost,", "-e", f"@{extra}", "-e", f"ansible_python_interpreter={sys.executable}",
                           str(tmp_path / "show.yml")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    users = {h: (tmp_path / f"user-{h}").read_text() for h in ("gpu01", "gpu02", "localhost")}
    assert users == {"gpu01": "root", "gpu02": "alice", "localhost": "ctl"}, json.dumps(users)
