"""The address each node is reached at for the job's traffic (its data address, as an IP literal):
one rule, resolved on the controller, for the real run (with the node's open connection) and for
offline plans and exports (no host contacted)."""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.remote import ssh
from ddpfab.remote.target import Target

if TYPE_CHECKING:  # (slow to import: see ddpfab.remote.ssh.connect)
    from fabric import Connection


def resolve(node: Node, conn: Connection | None = None, target: Target | None = None) -> str:
    """The node's data address as an IP literal (names are resolved here, on the controller): the
    one rule for the real run and for offline plans (:func:`offline_addresses`).

    An IP literal is itself. The default data address (no ddpfab_data_addr: the name or
    ansible_host) is first what ssh connects to: ssh_config's HostName (*target*, else the
    connection's), when ssh goes straight there (behind a jump host, the jump host resolves it).
    Then the controller's resolver; a name it cannot resolve is, last, the address the node's open
    SSH connection *conn* goes to: the one way ddpfab reaches the node."""
    try:
        return str(ipaddress.ip_address(node.data_addr))
    except ValueError:
        pass
    default = node.data_addr in (node.host, node.name)
    target = target or getattr(conn, "target", None)
    name = node.data_addr
    if default and target is not None and target.host and target.jump is None and not target.proxy_command:
        try:
            return str(ipaddress.ip_address(target.host))
        except ValueError:
            name = target.host
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a label longer than DNS allows
        peer = _peer_address(conn, target) if default else None
        if peer:
            return peer
        shown = f"{node.data_addr!r}" + (f" (ssh_config HostName {name!r})" if name != node.data_addr else "")
        found = (f"data address {shown} does not resolve ({getattr(exc, 'strerror', None) or exc}); "
                 "set ddpfab_data_addr to an IP address")
        raise ssh.SSHError(node.name, f"host {node.name}: {found}", found=found) from None
    return str(infos[0][4][0])


def offline_addresses(cluster: Inventory, targets: dict[str, Target]) -> tuple[dict[str, str], tuple[str, ...]]:
    """Each node's address as the real run's :func:`resolve` finds it, with no host contacted, and
    the nodes whose name did not resolve here (kept as given: an offline plan marks them, where
    the real run, which also has the open connection's peer address, resolves or refuses)."""
    addresses: dict[str, str] = {}
    unresolved: list[str] = []
    for n in cluster.nodes:
        try:
            addresses[n.name] = resolve(n, target=targets.get(n.name))
        except ssh.SSHError:
            addresses[n.name] = n.data_addr
            unresolved.append(n.name)
    return addresses, tuple(unresolved)


def _peer_address(conn: Connection | None, target: Target | None = None) -> str | None:
    """The address ddpfab reaches the node at: its target's (ssh_config's HostName; *target*, else
    the connection's), not the socket's peer, which behind a jump host is the jump host."""
    target = target or getattr(conn, "target", None)
    if target is not None:
        try:
            return str(ipaddress.ip_address(target.host))
        except ValueError:
            if target.jump is not None or target.proxy_command:
                return None
    transport = conn.client.get_transport() if conn is not None and conn.is_connected else None
    try:
        return str(ipaddress.ip_address(transport.getpeername()[0])) if transport else None
    except (OSError, ValueError, IndexError):
        return None
