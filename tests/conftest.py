"""Settings for the whole suite: nothing it does may depend on what this machine already holds."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess

import pytest

#: Where the search for a free /16 for the session's labs starts (10.213.0.0/16 is the demo's).
FIRST_TEST_NET = 213


def _used_networks() -> list[ipaddress.IPv4Network]:
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for iface in json.loads(out or "[]") for a in iface.get("addr_info", [])]


def pytest_configure(config):
    """Pick the labs' /16 once, in the process that starts the workers (they inherit the
    environment): the first 10.N.0.0/16 from N = 213 that no interface on this machine uses.
    Every lab of the session takes a /24 of it, so a lab left up by another session (a killed run,
    an engineer's own lab) never makes this one fail. DDPFAB_TEST_SUBNET set by hand wins."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("DDPFAB_TEST_SUBNET"):
        return
    used = _used_networks()
    for second in range(FIRST_TEST_NET, 255):
        net = ipaddress.ip_network(f"10.{second}.0.0/16")
        if not any(net.overlaps(u) for u in used):
            os.environ["DDPFAB_TEST_SUBNET"] = f"10.{second}.9.0/24"
            return


@pytest.fixture(scope="session", autouse=True)
def _own_caches(tmp_path_factory):
    """The controller's caches (ddpfab's inventory cache among them) start empty for every session,
    so a result never depends on an earlier run's leftovers in ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous
