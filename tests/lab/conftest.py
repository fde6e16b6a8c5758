"""Fixtures for tests on real lab hosts (network namespaces with sshd, see ddpfab/lab/__init__.py).

These tests need root and namespaces; CI runs as root. They do not skip elsewhere: a lab test that
cannot run is a failure to look at, not a green mark.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpfab import lab as labmod

REPO = Path(__file__).resolve().parents[2]


def worker_subnet(base: str) -> str:
    """*base* for the first (or only) pytest worker, the next subnets of its size for the others:
    with pytest-xdist each worker process brings up a lab of its own, and labs must not share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    net = ipaddress.ip_network(base, strict=False)
    return str(ipaddress.ip_network((int(net.network_address) + index * net.num_addresses, net.prefixlen)))


#: The session's /24 of its /16 (chosen free in tests/conftest.py, or DDPFAB_TEST_SUBNET), the
#: next /24s for the other pytest workers.
TEST_SUBNET = worker_subnet(os.environ.get("DDPFAB_TEST_SUBNET", "10.213.9.0/24"))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/lab/" in str(item.fspath):
            item.add_marker(pytest.mark.lab)


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """Three lab hosts for the whole session; torn down at the end, whatever happened."""
    with own_lab(tmp_path_factory, "lab", hosts=3, subnet=TEST_SUBNET) as the_lab:
        yield the_lab


@contextlib.contextmanager
def own_lab(tmp_path_factory, name: str, hosts: int, subnet: str, gpus: int = 0):
    """A lab in a new temp dir, taken down whatever happens. Its hosts see the tests' own temp
    dirs (scripts, inventories) as a shared filesystem would show them; the rest of the
    controller's /tmp stays out of their sight."""
    lab_dir = tmp_path_factory.mktemp(name)
    the_lab, _ = labmod.up(lab_dir, hosts=hosts, subnet=subnet, share=[tmp_path_factory.getbasetemp()], gpus=gpus)
    try:
        yield the_lab
    finally:
        labmod.down(lab_dir)


@pytest.fixture
def inventory2(lab, tmp_path) -> Path:
    """An inventory of node1 and node2 (node3 stays out: a bystander that must stay untouched)."""
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    return path




@pytest.fixture(scope="session")
def dist(tmp_path_factory) -> dict[str, Path]:
    """ddpfab as a user gets it: the wheel and the sdist built from the checkout offline (no build
    isolation), and a fresh venv outside the checkout with the wheel installed (no torch: a
    controller does not need it). Tests run ddpfab from that venv and never change it.

    Made once per test session: under pytest-xdist the first worker that needs it builds it in
    the session's shared temp dir, holding a lock; a worker that comes later waits on the lock and
    reuses it (test_install and test_first_hour each installed the wheel on their own before)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, shared by its workers
    out = root / "ddpfab-dist"
    done = out / "done.json"
    with open(root / "ddpfab-dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            out.mkdir(exist_ok=True)
            for argv, cwd in (
                    ([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, REPO], out),
                    ([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})"],
                     REPO),
                    ([sys.executable, "-m", "venv", out / "venv"], out)):
                _logged(argv, cwd)
            wheel = next(out.glob("ddpfab-*.whl"))
            _logged([out / "venv" / "bin" / "pip", "install", "-q", "--disable-pip-version-check", wheel], out)
            done.write_text(json.dumps({"wheel": str(wheel), "sdist": str(next(out.glob("ddpfab-*.tar.gz"))),
                                        "venv": str(out / "venv")}))
    return {k: Path(v) for k, v in json.loads(done.read_text()).items()}


def _logged(argv: list, cwd: Path) -> None:
    """Run *argv*; its output is in the failure's message when it fails."""
    res = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "NO_COLOR": "1"})
    assert res.returncode == 0, f"$ {' '.join(map(str, argv))}  (exit {res.returncode})\n{(res.stdout + res.stderr)[-4000:]}"


@pytest.fixture
def no_leftovers(lab):
    """After the test: no process, no listener but sshd, no temp file on any lab host."""
    yield
    from .helpers import assert_no_leftovers

    assert_no_leftovers(lab)


def session_subnet(third_octet: int) -> str:
    """10.NN.<third_octet>.0/24 in the session's /16 (TEST_SUBNET = 10.NN.9.0/24). Fixed uses:
    8 (test_lab's second lab), 9, 10, ... (the workers' session labs), 50 (provisioning),
    131-132 (test_bench); a test's own lab takes extra_subnet() from 140 up."""
    a, b = TEST_SUBNET.split(".")[:2]
    return f"{a}.{b}.{third_octet}.0/24"


def extra_subnet(third_octet: int) -> str:
    """A /24 for a test's own lab inside the session's /16 (10.NN.x.0/24 with TEST_SUBNET =
    10.NN.9.0/24), so engineers' and CI's labs never collide. Take *third_octet* from 140 up: the
    pytest workers' session labs use 9, 10, 11, ... and other fixed labs 8, 50 and 101-132."""
    assert third_octet >= 140, "below 140 the third octet may be a worker's session lab"
    return session_subnet(third_octet)

