"""The suite's results do not depend on what the controller already holds (issue 20).

Lab hosts used to see the controller's /tmp through an overlay: where the controller had torch's
``/tmp/torchinductor_root`` (any machine that ever ran DDP locally), a job on a host wrote nothing
there; on a fresh machine it wrote the dir and every later test failed its no-leftover check. Now
each host has its own /tmp (lab.PRIVATE_TMP) and its own ~/.cache, and the leftover check tells a
library's cache from a job's files (helpers.LIBRARY_CACHES).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import REPO, assert_no_leftovers, ddpfab, host_tmp_leftovers, reports

EXAMPLE = "examples/train_dist.py"
INDUCTOR = Path("/tmp/torchinductor_root")


@pytest.fixture(scope="module")
def fresh_lab(tmp_path_factory):
    """Two hosts of their own, new for this module: whatever is in a host's /tmp was put there by
    these tests (the session's lab has run DDP jobs, whose torch cache is there legitimately)."""
    with own_lab(tmp_path_factory, "fresh-lab", hosts=2, subnet=extra_subnet(141)) as the_lab:
        yield the_lab


@pytest.fixture
def inventory2(fresh_lab, tmp_path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(fresh_lab, sys.executable))
    return path


@pytest.fixture
def controller_tmp_and_cache():
    """Controller-only files where a host used to see them: in /tmp, torch's cache dir, ~/.cache."""
    marker = Path(tempfile.mkdtemp(prefix="ddpfab-controller-only-", dir="/tmp"))
    made_inductor = not INDUCTOR.exists()
    INDUCTOR.mkdir(exist_ok=True)
    cache = Path.home() / ".cache"
    cache_marker = Path(tempfile.mkdtemp(prefix="ddpfab-controller-only-", dir=cache if cache.is_dir() else None))
    try:
        yield marker, cache_marker
    finally:
        shutil.rmtree(marker, ignore_errors=True)
        shutil.rmtree(cache_marker, ignore_errors=True)
        if made_inductor:
            try:
                INDUCTOR.rmdir()  # only if nothing else started to use it meanwhile
            except OSError:
                pass


def _upper_tmp(lab, name: str) -> Path:
    return Path(lab.store) / name / "upper_tmp"


def test_hosts_see_neither_the_controllers_tmp_nor_its_caches(fresh_lab, inventory2, controller_tmp_and_cache,
                                                             tmp_path):
    marker, cache_marker = controller_tmp_and_cache
    probe = (f"for p in {marker} {INDUCTOR} {cache_marker}; do test -e $p && echo SEES $p; done; "
             f"test -d {tmp_path} && test -d {REPO} && echo SHARED-OK; "
             "echo CACHE-$(findmnt -n -o FSTYPE --target /root/.cache)")
    res = ddpfab("exec", "-i", str(inventory2), "--", probe)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SEES" not in res.stdout, res.stdout
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    # both hosts still see what the lab shares (the checkout, the tests' temp dirs) ...
    assert sum("SHARED-OK" in ln for ln in lines) == 2, res.stdout
    # ... and have a ~/.cache of their own, empty at the lab's start
    assert sum("CACHE-tmpfs" in ln for ln in lines) == 2, res.stdout


def test_a_ddp_job_writes_torch_cache_on_its_own_tmp_whatever_the_controller_has(
        fresh_lab, inventory2, controller_tmp_and_cache, tmp_path):
    """With the controller holding /tmp/torchinductor_root, a DDP job still creates its own on each
    host (so the outcome is the same on a fresh machine), and the leftover check accepts it while
    still catching a job's own temp file."""
    lab = fresh_lab
    for name in ("node1", "node2"):
        assert not (_upper_tmp(lab, name) / INDUCTOR.name).exists()  # a fresh host, and the last test ran no DDP
    res = ddpfab("run", "-i", str(inventory2), "--runs-dir", str(tmp_path / "runs"), EXAMPLE,
                 "--steps", "1", "--report", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(reports(res.stdout)) == 2
    for name in ("node1", "node2"):
        assert (_upper_tmp(lab, name) / INDUCTOR.name).is_dir(), f"{name}: DDP wrote no {INDUCTOR} of its own"
        assert host_tmp_leftovers(lab, name) == []
    # strict for everything else: a file a job leaves in /tmp is a leftover
    res = ddpfab("exec", "-i", str(inventory2), "--", "touch /tmp/left-by-a-job")
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        for name in ("node1", "node2"):
            assert host_tmp_leftovers(lab, name) == ["/tmp/left-by-a-job"]
    finally:
        ddpfab("exec", "-i", str(inventory2), "--", "rm -f /tmp/left-by-a-job")
    assert_no_leftovers(lab)
