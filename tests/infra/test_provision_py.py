"""ddpfab/provision.py without hosts: finding ansible-playbook and the playbooks, the command line,
and naming failed hosts from Ansible's PLAY RECAP. (Fast; the real runs are in tests/lab.)"""

from __future__ import annotations

import io
import os
import stat
import sys
from pathlib import Path

import pytest

from ddpfab import provision

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


def test_project_dir_is_the_checkout_with_ansible_cfg():
    assert provision.project_dir() == REPO
    assert provision.playbook_path("firewall") == REPO / "playbooks" / "firewall.yml"


def test_unknown_playbook_and_missing_inventory_are_clear(tmp_path):
    with pytest.raises(provision.ProvisionError, match="unknown playbook 'nope'"):
        provision.playbook_path("nope")
    with pytest.raises(provision.ProvisionError, match="inventory .* does not exist"):
        provision.build_command(tmp_path / "missing.yml")


def test_command_line(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {a: {}}}\n")
    argv = provision.build_command(inv, "provision", tags=["firewall,gpu", "python"], check=True,
                                   limit="a", extra_args=["-e", "x=1"])
    assert Path(argv[0]).name == "ansible-playbook"
    assert argv[1:4] == ["-i", str(inv.resolve()), str(REPO / "playbooks/provision.yml")]
    assert argv[4:] == ["--tags", "firewall,gpu,python", "--check", "--diff", "--limit", "a", "-e", "x=1"]


def test_environment_points_ansible_at_the_project_config():
    env = provision.ansible_env()
    assert env["ANSIBLE_CONFIG"] == str(REPO / "ansible.cfg")
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


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
    fake.write_text(f"#!/bin/sh\necho \"cfg=$ANSIBLE_CONFIG args=$*\"\ncat {recap_file}\nexit 2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {hosts: {gpu01: {}}}\n")
    out = io.StringIO()
    rc = provision.run_playbook(inv, "firewall", out=out)
    text = out.getvalue()
    assert rc == 2
    assert f"cfg={REPO / 'ansible.cfg'}" in text and "playbooks/firewall.yml" in text
    assert "PLAY RECAP" in text
    assert text.rstrip().splitlines()[-2:] == [
        line for line in text.splitlines() if line.startswith("ddpfab provision: ")]
    assert "ddpfab provision: gpu02: FAILED" in text and "ddpfab provision: gpu03: UNREACHABLE" in text
