"""Settings for the whole suite: nothing it does may depend on what this machine already holds."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

#: Where the search for a free /16 for the session's labs starts (10.213.0.0/16 is the demo's).
FIRST_TEST_NET = 213

#: The test files that take longest, started first (seconds: the sum of each file's tests in
#: `--durations` of one CI run, 2 workers on 2 cores; docs/testing.md has the whole run). The first
#: five keep their order (two heavy files never run side by side); the suite runs them first:
#: pytest-xdist (`--dist loadfile`) hands a free worker the next file, so a long file started last
#: would be the tail both workers wait on. (xdist's own order, the most tests first, put these
#: few-test files last: the unit files have the most tests.) Files not listed follow: the other lab
#: files, then tests/infra, then tests/unit, each in collection order. A name here that no
#: collected file has is never matched (files still on other branches may be listed).
LONGEST_FIRST = [
    "tests/lab/test_exit_race.py",  # 158 s: upstream DDP scripts on 2 and 4 nodes, the abort drill
    "tests/lab/test_gpu_leases.py",  # 94 s: four launches at once, the queue
    "tests/lab/test_provision.py",  # 178 s: torch provisioned on 3 hosts, twice; testinfra twice
    "tests/lab/test_first_hour.py",  # 90 s: provisions 2 hosts from the wheel
    # 124 s: 30 jobs of three users; not beside the exit-race soak, whose load can stretch its waits
    # past their 8 s bound
    "tests/lab/test_gpu_users.py",
    "tests/lab/test_failure_story.py",  # 121 s: 12 crashes on 3 and 4 nodes, an OOM, a usage error
    "tests/lab/test_recover.py",  # 149 s: lost nodes found by silence, spares, restarts
    "tests/lab/test_doctor.py",  # 141 s: hangs found after their timeouts
    "tests/lab/test_preflight_load.py",  # 69 s: 8 nodes under a CPU hog, three runs
    "tests/lab/test_trust.py",  # 136 s
    "tests/lab/test_perf.py",  # 126 s: check --perf six times, one node briefly at a 1 % CPU quota
    "tests/lab/test_exit_abort.py",  # 37 s
    "tests/lab/test_sync_ownership.py",  # 92 s
    "tests/lab/test_faults.py",  # 106 s
    "tests/lab/test_preflight_resources.py",  # 38 s
    "tests/lab/test_sync.py",  # 49 s
    "tests/lab/test_preflight_dataplane.py",  # 54 s
    "tests/lab/test_peer_inventories.py",  # 46 s
    "tests/lab/test_sync_lock.py",  # 38 s
    "tests/lab/test_launch_styles.py",  # 51 s
    "tests/lab/test_debugging.py",  # 43 s
    "tests/lab/test_replicate.py",  # 18 s
    "tests/lab/test_bastion.py",  # 30 s
    "tests/infra/test_lint.py",  # 21 s
    "tests/lab/test_install.py",  # the wheel and its venv (shared with test_first_hour), a 1-host playbook twice
]
#: After LONGEST_FIRST: the rest of each directory, in this order.
DIR_ORDER = ["tests/lab/", "tests/infra/", "tests/unit/"]


def _used_networks() -> list[ipaddress.IPv4Network]:
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for iface in json.loads(out or "[]") for a in iface.get("addr_info", [])]


def pytest_configure(config):
    """Keep pytest-xdist from reordering the files by their number of tests: the order is
    pytest_collection_modifyitems' (longest first)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    _pick_test_subnet()


def pytest_collection_modifyitems(config, items):
    """The files in LONGEST_FIRST first, then the rest by DIR_ORDER; a file's tests keep their
    order (a file's tests share its fixtures and some run in file order)."""
    root = Path(str(config.rootpath))

    def rank(item) -> tuple[int, int]:
        path = Path(str(item.path)).relative_to(root).as_posix()
        if path in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(path))
        return (1, next((i for i, d in enumerate(DIR_ORDER) if path.startswith(d)), len(DIR_ORDER)))

    items.sort(key=rank)


def _pick_test_subnet() -> None:
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


#: With DDPFAB_TEST_TIMELINE=FILE, each worker appends a line per test phase to FILE: the time,
#: the worker, the phase's outcome, duration and node id (JSON). Set beside a CPU sampler, it shows
#: which tests wait instead of computing (the suite's time is the sum of its tests' over 2 workers).
TIMELINE = os.environ.get("DDPFAB_TEST_TIMELINE")


def pytest_runtest_logreport(report):
    if TIMELINE:  # under xdist the controller writes each report again, as worker "main"
        with open(TIMELINE, "a") as fh:
            fh.write(json.dumps({"t": round(time.time(), 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                 "when": report.when, "outcome": report.outcome, "s": round(report.duration, 2),
                                 "test": report.nodeid}) + "\n")

