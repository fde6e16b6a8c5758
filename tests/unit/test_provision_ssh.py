"""ddpfab provision reaches hosts with ddpfab's own ssh decision, whatever Ansible's settings say.

A real ansible-playbook runs against an inventory whose ``ansible_ssh_executable`` is a stand-in
that records the ssh argv Ansible built and fails (no connection is made); OpenSSH's own reading
of that argv (``ssh -G``, local) must be ddpfab's host-key policy and route.
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from ddpfab.hosts.inventory import InventoryError, load
from ddpfab.remote.provision import run_playbook
from ddpfab.remote.target import HostKeyPolicy


def _ssh_g(argv: list[str]) -> dict[str, str]:
    """OpenSSH's own reading of an ssh argv (``ssh -G``: no connection)."""
    out = subprocess.run(["ssh", "-G", *argv], capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def test_ansible_settings_cannot_turn_host_key_checking_off_or_reroute(tmp_path, monkeypatch):
    record = tmp_path / "argv"
    record.mkdir()
    fake = tmp_path / "fake-ssh"
    fake.write_text(f'#!/bin/sh\nf=$(mktemp {record}/a.XXXXXX)\nprintf "%s\\0" "$@" > "$f"\nexit 255\n')
    fake.chmod(0o755)
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    # every way Ansible lets a user turn host-key checking off or add ssh options ahead of ddpfab's
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[defaults]\nhost_key_checking = False\n[ssh_connection]\n"
                   "ssh_args = -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o Port=2299\n")
    monkeypatch.setenv("ANSIBLE_CONFIG", str(cfg))
    monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "False")
    inv = tmp_path / "inv.yml"
    inv.write_text(f"""
all:
  hosts:
    n1:
      ansible_host: 127.0.0.1
      ansible_port: 1
      ansible_user: root
      ansible_ssh_executable: {fake}
      ansible_ssh_common_args: -o UserKnownHostsFile={kh} -o ConnectTimeout=2
""")
    play = tmp_path / "play.yml"
    play.write_text("- hosts: all\n  gather_facts: false\n  tasks:\n    - ansible.builtin.ping:\n")
    out = io.StringIO()
    assert run_playbook(inv, str(play), out=out, policy=HostKeyPolicy()) != 0
    calls = [f.read_bytes().split(b"\0")[:-1] for f in sorted(record.iterdir())]
    assert calls, out.getvalue()
    for call in calls:
        seen = _ssh_g([w.decode() for w in call])
        assert seen["stricthostkeychecking"] == "true", call
        assert seen["userknownhostsfile"] == str(kh), call
        assert (seen["hostname"], seen["port"], seen["user"]) == ("127.0.0.1", "1", "root"), call


def test_ansible_ssh_args_in_the_inventory_mean_the_same_for_every_path(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("""
all:
  hosts:
    n1:
      ansible_host: 10.0.0.5
      ansible_ssh_args: -o ProxyJump=bastion -o ConnectTimeout=4
      ansible_ssh_common_args: -o ProxyJump=other -o ConnectTimeout=9
""")
    n = load(str(inv), group="all").nodes[0]
    # Ansible puts ssh_args first, and OpenSSH keeps the first value
    assert n.ssh_options["proxyjump"] == "bastion" and n.ssh_options["connecttimeout"] == "4"
    inv.write_text("all:\n  hosts:\n    n1:\n      ansible_ssh_args: -A\n")
    with pytest.raises(InventoryError, match="ansible_ssh_args .*'-A'"):
        load(str(inv), group="all")


def test_a_common_arg_wins_over_an_extra_arg_as_in_ansible(tmp_path):
    inv = Path(tmp_path / "inv.yml")
    inv.write_text("""
all:
  hosts:
    n1:
      ansible_ssh_common_args: -o UserKnownHostsFile=/etc/kh
      ansible_ssh_extra_args: -o UserKnownHostsFile=/other
""")
    assert load(str(inv), group="all").nodes[0].ssh_options["userknownhostsfile"] == "/etc/kh"


@pytest.mark.parametrize("var", ["ansible_host_key_checking", "ansible_ssh_host_key_checking"])
def test_host_key_checking_off_in_the_inventory_is_refused(tmp_path, var):
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    n1:\n  vars:\n    {var}: false\n")
    with pytest.raises(InventoryError, match=rf"host n1: {var}=False cannot be honoured.*accept_new_host_keys=True"):
        load(str(inv), group="all")
    inv.write_text(f"all:\n  hosts:\n    n1:\n  vars:\n    {var}: true\n")
    assert load(str(inv), group="all").nodes[0].name == "n1"
