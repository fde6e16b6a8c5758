"""Fixtures for tests on real lab hosts (network namespaces with sshd, see ddpfab/lab.py).

These tests need root and namespaces; CI runs as root. They do not skip elsewhere: a lab test that
cannot run is a failure to look at, not a green mark.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ddpfab import lab as labmod

#: A subnet of its own so a demo lab (10.213.0.0/24) can run beside the tests.
TEST_SUBNET = os.environ.get("DDPFAB_TEST_SUBNET", "10.213.9.0/24")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/lab/" in str(item.fspath):
            item.add_marker(pytest.mark.lab)


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """Three lab hosts for the whole session; torn down at the end, whatever happened."""
    lab_dir = tmp_path_factory.mktemp("lab")
    the_lab, _ = labmod.up(lab_dir, hosts=3, subnet=TEST_SUBNET)
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




@pytest.fixture
def no_leftovers(lab):
    """After the test: no process, no listener but sshd, no temp file on any lab host."""
    yield
    from .helpers import host_tmp_leftovers, wait_no_processes

    names = [h.name for h in lab.hosts]
    wait_no_processes(lab, timeout=5, names=names)
    for name in names:
        listening = lab.netns_exec(name, ["ss", "-Htln"], capture_output=True, text=True).stdout.split("\n")
        ports = sorted({ln.split()[3].rsplit(":", 1)[1] for ln in listening if ln.strip()})
        assert ports == ["22"], f"{name} has listeners left: {ports}"
        left = host_tmp_leftovers(lab, name)
        assert not left, f"{name} has temp files left in /tmp: {left[:10]}"

