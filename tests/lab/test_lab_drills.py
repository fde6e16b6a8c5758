"""The lab's CPU drill cleans up after a host that keeps forking (root and cgroup v1 cpu, as the
lab's CPU drill needs)."""

from __future__ import annotations

import os
import subprocess

from ddpfab.lab import drills


def test_a_group_whose_process_keeps_forking_is_emptied_and_removed():
    # a shell that forks a child without pause: a child forked while the group is emptied starts
    # inside it, and the kernel refuses to remove a group with a task in it (EBUSY, seen in CI)
    path = drills.CGROUP_CPU / f"ddpfab-test-drill-{os.getpid()}"
    path.mkdir()
    forker = subprocess.Popen(["sh", "-c", "while :; do /bin/true; done"])
    try:
        (path / "cgroup.procs").write_text(str(forker.pid))
        for _ in range(20):
            drills._empty_and_remove(path)
            assert not path.exists()
            path.mkdir()
            (path / "cgroup.procs").write_text(str(forker.pid))
        drills._empty_and_remove(path)
        assert not path.exists()
    finally:
        forker.kill()
        forker.wait()
        if path.exists():
            for pid in (path / "cgroup.procs").read_text().split():
                (drills.CGROUP_CPU / "cgroup.procs").write_text(pid)
            path.rmdir()
