"""testinfra checks of a provisioned ddpfab node: the state playbooks/provision.yml promises.

Run against provisioned hosts, with what to expect in a JSON file named by $DDPFAB_INFRA_EXPECT:

    DDPFAB_INFRA_EXPECT=expect.json pytest tests/infra/test_node.py \
        --hosts='ansible://all' --ansible-inventory=INVENTORY

expect.json: {"members": ["10.0.0.11", ...], "backend": "iptables", "venv": "/opt/ddpfab/venv",
"torch": "2.13.0", "ssh_ports": [22], "persist_file": "/etc/iptables/rules.v4"}.
tests/lab/test_provision.py runs it on lab hosts after provisioning; without the variable the
module is not collected (it would otherwise test the machine pytest runs on).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import pytest

EXPECT_FILE = os.environ["DDPFAB_INFRA_EXPECT"]  # collected only when set (see conftest.py)

CHAIN = "DDPFAB-INPUT"


@pytest.fixture(scope="module")
def expect() -> dict:
    with open(EXPECT_FILE) as f:
        data = json.load(f)
    data.setdefault("backend", "iptables")
    data.setdefault("venv", "/opt/ddpfab/venv")
    data.setdefault("torch", "2.13.0")
    data.setdefault("ssh_ports", [22])
    return data


_IS_ROOT: dict[str, bool] = {}


def _root(host):
    """Root for reading firewall state: sudo unless the connection already is root."""
    key = host.backend.get_pytest_id()
    if key not in _IS_ROOT:
        _IS_ROOT[key] = host.user().name == "root"
    return contextlib.nullcontext() if _IS_ROOT[key] else host.sudo()


def _iptables(host, *args: str) -> list[str]:
    return host.check_output("iptables -w -S " + " ".join(args)).splitlines()


def test_ssh_works_and_sshd_listens(host, expect):
    # this very test ran over SSH; also check the daemon still listens on an SSH port
    assert host.run("true").rc == 0
    listening = host.socket.get_listening_sockets()
    assert any(sock.startswith("tcp://") and sock.rsplit(":", 1)[1] in {str(p) for p in expect["ssh_ports"]}
               for sock in listening), listening


def test_iptables_jump_is_the_first_input_rule_exactly_once(host, expect):
    if expect["backend"] != "iptables":
        pytest.skip("this host was provisioned with the nftables backend: iptables checks do not apply "
                    "(test_provision.py runs this module once per backend)")
    with _root(host):
        rules = [r for r in _iptables(host, "INPUT") if r.startswith("-A ")]
    assert rules[0] == f"-A INPUT -j {CHAIN}"
    assert rules.count(f"-A INPUT -j {CHAIN}") == 1


def test_iptables_chain_accepts_ssh_before_members_and_only_members(host, expect):
    if expect["backend"] != "iptables":
        pytest.skip("this host was provisioned with the nftables backend: iptables checks do not apply "
                    "(test_provision.py runs this module once per backend)")
    with _root(host):
        chain = [r for r in _iptables(host, CHAIN) if r.startswith("-A ")]
    # loopback, established, ssh come first: nothing after them can lock the operator out
    assert chain[0] == f"-A {CHAIN} -i lo -j ACCEPT"
    assert "--ctstate RELATED,ESTABLISHED" in chain[1] and chain[1].endswith("-j ACCEPT")
    assert "--dports " + ",".join(map(str, expect["ssh_ports"])) in chain[2] and chain[2].endswith("-j ACCEPT")
    # every member's address has a TCP accept, and no other source has one
    tcp_sources = {m.group(1) for r in chain if "-p tcp" in r and r.endswith("-j ACCEPT")
                   for m in [re.search(r"-s (\S+)", r)] if m}
    assert tcp_sources == {f"{a}/32" for a in expect["members"]}
    # no duplicates, whatever the number of runs
    assert len(chain) == len(set(chain))


def test_iptables_rules_are_saved_for_boot(host, expect):
    if expect["backend"] != "iptables":
        pytest.skip("this host was provisioned with the nftables backend: iptables checks do not apply "
                    "(test_provision.py runs this module once per backend)")
    saved = host.file(expect.get("persist_file", "/etc/iptables/rules.v4"))
    assert saved.exists
    with _root(host):
        content = saved.content_string
    assert f"-A INPUT -j {CHAIN}" in content
    for addr in expect["members"]:
        assert f"-s {addr}/32" in content


def test_nftables_table_holds_the_members(host, expect):
    if expect["backend"] != "nftables":
        pytest.skip("this host was provisioned with the iptables backend: nftables checks do not apply "
                    "(test_provision.py runs this module once per backend)")
    with _root(host):
        table = host.check_output("nft list table inet ddpfab")
    for addr in expect["members"]:
        assert addr in table
    assert 'iifname "lo" accept' in table
    assert host.file("/etc/nftables.d/ddpfab.nft").exists


def test_venv_imports_the_pinned_torch(host, expect):
    out = host.check_output(f"{expect['venv']}/bin/python -c 'import torch, numpy; print(torch.__version__)'")
    assert out.split("+")[0] == expect["torch"]


def test_venv_is_not_tied_to_system_site_packages(host, expect):
    cfg = host.file(f"{expect['venv']}/pyvenv.cfg").content_string
    assert "include-system-site-packages = false" in cfg


def test_gpu_facts_file(host):
    fact = host.file("/etc/ansible/facts.d/ddpfab_gpu.fact")
    assert fact.exists and fact.mode == 0o644
    data = json.loads(fact.content_string)
    assert isinstance(data["count"], int) and data["count"] == len(data["gpus"])
    assert {"driver", "cuda", "gpus"} <= data.keys()


def test_python_facts_file(host, expect):
    data = json.loads(host.file("/etc/ansible/facts.d/ddpfab_python.fact").content_string)
    assert data["python"] == f"{expect['venv']}/bin/python"
    assert data["torch"].split("+")[0] == expect["torch"]


def test_base_dirs_and_tools(host):
    assert host.file("/opt/ddpfab").is_directory
    home = host.user().home
    assert host.file(f"{home}/.ddpfab/runs").is_directory
    assert host.exists("rsync")
