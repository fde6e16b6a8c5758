"""Filters for role ddpfab_firewall: who the cluster members are, and which ports to open.

They run on the controller while templating, so a member's address is resolved the way Ansible
itself reaches the host, and a bad inventory fails before any rule is touched.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from ansible.errors import AnsibleFilterError


def _resolve_ipv4(name: str, what: str) -> ipaddress.IPv4Address:
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        if addr.version != 4:
            raise AnsibleFilterError(
                f"ddpfab_firewall: {what} is the IPv6 address {name}; the firewall role handles IPv4 "
                f"only: set ddpfab_data_addr to the host's IPv4 data address")
        return addr
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise AnsibleFilterError(
            f"ddpfab_firewall: cannot resolve {what} '{name}' to an IPv4 address on the controller "
            f"({exc}); set ddpfab_data_addr (or ansible_host) to an IP address") from None
    return ipaddress.IPv4Address(infos[0][4][0])


def members(names, hostvars, extra_sources=()):
    """The cluster's sources: [{'name': host, 'addr': 'a.b.c.d/32'}], one per distinct address, sorted.

    *names* are the inventory hosts of the members group; a host's address is its
    ddpfab_data_addr, else ansible_host, else its name. *extra_sources* are IPv4 addresses or
    CIDRs that count as members too.
    """
    found: dict[ipaddress.IPv4Network, str] = {}
    for name in names:
        hv = hostvars[name]
        raw = hv.get("ddpfab_data_addr") or hv.get("ansible_host") or name
        addr = _resolve_ipv4(str(raw).strip(), f"the data address of member {name}")
        found.setdefault(ipaddress.IPv4Network(addr), str(name))
    for src in extra_sources or ():
        try:
            net = ipaddress.IPv4Network(str(src).strip(), strict=False)
        except ValueError:
            raise AnsibleFilterError(
                f"ddpfab_firewall: ddpfab_firewall_extra_sources entry {src!r} is not an IPv4 "
                f"address or CIDR") from None
        found.setdefault(net, "extra")
    return [{"name": re.sub(r"[^A-Za-z0-9_.:-]", "_", name), "addr": str(net)}
            for net, name in sorted(found.items(), key=lambda kv: (int(kv[0].network_address), kv[0].prefixlen))]


def _port(value, what: str) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        raise AnsibleFilterError(f"ddpfab_firewall: {what}: {value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise AnsibleFilterError(f"ddpfab_firewall: {what}: port {port} is out of range 1-65535")
    return port


def port_range(value, what: str = "ddpfab_firewall_local_port_range"):
    """'40000 40999' / '40000-40999' / '40000:40999' / [40000, 40999] -> [40000, 40999]."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [p for p in re.split(r"[\s:,-]+", str(value).strip()) if p]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise AnsibleFilterError(f"ddpfab_firewall: {what}: {value!r} is not a port or a range 'LOW HIGH'")
    lo, hi = (_port(p, what) for p in parts)
    if lo > hi:
        raise AnsibleFilterError(f"ddpfab_firewall: {what}: {value!r} has LOW > HIGH")
    return [lo, hi]


def ports(values, sep: str = ":"):
    """Ports and ranges, merged and sorted, as iptables multiport ('a:b') or nft ('a-b', sep='-') items."""
    ranges = sorted(port_range(v, "ddpfab_firewall ports") for v in (values or ()))
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [str(lo) if lo == hi else f"{lo}{sep}{hi}" for lo, hi in merged]


class FilterModule:
    def filters(self):
        return {
            "ddpfab_firewall_members": members,
            "ddpfab_firewall_port_range": port_range,
            "ddpfab_firewall_ports": ports,
        }
