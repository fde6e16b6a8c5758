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
#: `--durations` of one CI run, 2 workers on 2 cores; docs/testing.md has the whole run):
#: pytest-xdist (`--dist loadfile`) hands a free worker the next file, so a long file started last
#: would be the tail both workers wait on. (xdist's own order, the most tests first, put these
#: few-test files last: the unit files have the most tests.) Files not listed follow: the other lab
#: files, then tests/infra, then tests/unit, each in collection order. A name here that no
#: collected file has is never matched (files still on other branches may be listed).
LONGEST_FIRST = [
    "tests/lab/test_exit_race.py",  # 171 s: upstream DDP scripts on 2 and 4 nodes, the abort drill
    "tests/lab/test_gpu_leases.py",  # 100 s: four launches at once, the queue
    "tests/lab/test_provision.py",  # 201 s: torch provisioned on 3 hosts, twice; testinfra twice
    "tests/lab/test_first_hour.py",  # 99 s: provisions 2 hosts from the wheel
    "tests/lab/test_gpu_users.py",  # 154 s: 30 jobs of three users
    "tests/lab/test_failure_story.py",  # 134 s: 12 crashes on 3 and 4 nodes, an OOM, a usage error
    "tests/lab/test_recover.py",  # 150 s: lost nodes found by silence, spares, restarts
    "tests/lab/test_doctor.py",  # 145 s: hangs found after their timeouts
    "tests/lab/test_trust.py",  # 160 s
    "tests/lab/test_perf.py",  # 96 s: check --perf six times, one node briefly at a 1 % CPU quota
    "tests/lab/test_sync_ownership.py",  # 104 s
    "tests/lab/test_faults.py",  # 103 s
    "tests/lab/test_hold.py",  # 74 s
    "tests/lab/test_preflight_load.py",  # 65 s: 8 nodes under a CPU hog, three runs
    "tests/lab/test_handrun.py",  # 62 s
    "tests/lab/test_sync.py",  # 57 s
    "tests/lab/test_run.py",  # 55 s
    "tests/lab/test_preflight_dataplane.py",  # 54 s
    "tests/lab/test_launch_styles.py",  # 54 s
    "tests/lab/test_debugpy.py",  # 50 s
    "tests/lab/test_peer_inventories.py",  # 48 s
    "tests/lab/test_api.py",  # 45 s
    "tests/lab/test_debugging.py",  # 45 s
    "tests/lab/test_tmux.py",  # 44 s
    "tests/lab/test_exit_abort.py",  # 43 s
    "tests/lab/test_preflight_resources.py",  # 40 s
    "tests/lab/test_sync_lock.py",  # 38 s
    "tests/lab/test_check.py",  # 36 s
    "tests/lab/test_one_connection.py",  # 35 s
    "tests/lab/test_bastion.py",  # 30 s
    "tests/lab/test_pdb.py",  # 28 s
    "tests/lab/test_bench.py",  # 27 s
    "tests/infra/test_lint.py",  # 25 s
    "tests/lab/test_install.py",  # the wheel and its venv (shared with test_first_hour), a 1-host playbook twice
]
#: After LONGEST_FIRST: the rest of each directory, in this order.
DIR_ORDER = ["tests/lab/", "tests/infra/", "tests/unit/"]

#: The files that mostly wait (for a timeout, a hang to be found, a terminal, a slowed link): the
#: machine was about half idle while two of them ran side by side, and fully busy while two of
#: the others did. The scheduler below runs one of these beside one of the others while both
#: kinds are left, and the unit and infra files (short, light: test_lint aside) count as these.
MOSTLY_WAITING = frozenset({
    "tests/lab/test_recover.py", "tests/lab/test_doctor.py", "tests/lab/test_hold.py", "tests/lab/test_handrun.py",
    "tests/lab/test_sync.py", "tests/lab/test_preflight_dataplane.py", "tests/lab/test_debugpy.py",
    "tests/lab/test_api.py", "tests/lab/test_tmux.py", "tests/lab/test_sync_lock.py", "tests/lab/test_check.py",
    "tests/lab/test_one_connection.py", "tests/lab/test_pdb.py", "tests/lab/test_bench.py",
    "tests/lab/test_slurm.py", "tests/lab/test_socket_ifname.py", "tests/lab/test_errors.py",
    "tests/lab/test_sync_keys.py", "tests/lab/test_run_waits.py", "tests/lab/test_shell.py",
})


def _mostly_waiting(path: str) -> bool:
    return path in MOSTLY_WAITING or (path.startswith(("tests/unit/", "tests/infra/")) and path not in LONGEST_FIRST)


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


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` that pairs the kinds: a free worker gets the first file (in the
    collection's order) of the kind the other worker is not running, so a file that mostly waits
    runs beside one that computes instead of beside another that waits."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PairedKinds(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            running = [next((scope for scope, unit in work.items() if not all(unit.values())), None)
                       for other, work in self.assigned_work.items() if other is not node]
            others_wait = [_mostly_waiting(scope) for scope in running if scope is not None]
            want = not others_wait[0] if others_wait else False  # alone: a computing file first
            pick = next((scope for scope in self.workqueue if _mostly_waiting(scope) == want), None)
            if pick is not None:
                self.workqueue.move_to_end(pick, last=False)
            super()._assign_work_unit(node)

    return PairedKinds(config, log)


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

