"""The firewall role's filter plugin (members' addresses, port lists), without hosts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

PLUGIN = Path(__file__).resolve().parents[2] / "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/plugins/filter/ddpfab_firewall.py"
spec = importlib.util.spec_from_file_location("ddpfab_firewall_filters", PLUGIN)
filters = importlib.util.module_from_spec(spec)
spec.loader.exec_module(filters)


def test_members_use_data_addr_then_ansible_host_then_name_sorted_and_unique():
    hostvars = {
        "b": {"ansible_host": "10.0.0.12", "ddpfab_data_addr": "10.50.0.12"},
        "a": {"ansible_host": "10.0.0.11"},
        "localhost": {},
        "dup": {"ansible_host": "10.0.0.11"},
    }
    got = filters.members(["b", "a", "localhost", "dup"], hostvars, ["192.168.7.0/24"])
    assert got == [
        {"name": "a", "addr": "10.0.0.11/32"},
        {"name": "b", "addr": "10.50.0.12/32"},
        {"name": "localhost", "addr": "127.0.0.1/32"},
        {"name": "extra", "addr": "192.168.7.0/24"},
    ]


def test_members_refuse_ipv6_unresolvable_names_and_bad_cidrs():
    with pytest.raises(AnsibleFilterError, match="IPv4 only"):
        filters.members(["a"], {"a": {"ansible_host": "fd00::1"}})
    with pytest.raises(AnsibleFilterError, match="cannot resolve"):
        filters.members(["a"], {"a": {"ansible_host": "no-such-host.invalid"}})
    with pytest.raises(AnsibleFilterError, match="not an IPv4 address or CIDR"):
        filters.members([], {}, ["10.0.0.0/33"])


def test_port_lists_are_merged_sorted_and_formatted_per_backend():
    assert filters.ports(["29400:29600", 29500, "40000 40999", "22"]) == ["22", "29400:29600", "40000:40999"]
    assert filters.ports(["40000-40999", "41000"], sep="-") == ["40000-41000"]
    assert filters.port_range("40000 40999") == [40000, 40999]
    with pytest.raises(AnsibleFilterError, match="LOW > HIGH"):
        filters.port_range("5 4")
    with pytest.raises(AnsibleFilterError, match="out of range"):
        filters.ports(["70000"])
