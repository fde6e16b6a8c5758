"""Node run records are pruned to the newest N by the supervisor itself: only ddpfab's records,
never a running job's (a live process stands in for a running supervisor)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ddpfab.node.agent import prune_records


def record(root, name, pid=999999, run_id=None):
    d = root / name
    d.mkdir()
    (d / "agent.json").write_text(json.dumps({"run_id": run_id or name, "agent_pid": pid}))
    (d / "output.log").write_text("x")
    return d


def _wait_for_exec(pid: int, word: str) -> None:
    """Until the child has exec'd, its cmdline is still this process's (a real supervisor writes
    its record after it started, so it never meets this race)."""
    deadline = time.monotonic() + 30
    while word.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.01)


def test_keeps_the_newest_and_everything_not_provably_its_own(tmp_path):
    names = [f"20261130-10{m:02d}00-abcdef" for m in range(30)]
    for n in names:
        record(tmp_path, n)
    running_id = "20261130-090000-000001"  # the oldest of all, but its supervisor runs
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", running_id])
    _wait_for_exec(live.pid, running_id)
    try:
        record(tmp_path, running_id, pid=live.pid)
        (tmp_path / "checkpoints").mkdir()                       # the user's: wrong name
        (tmp_path / "20261130-080000-aaaaaa").mkdir()            # no agent.json: not provably ours
        record(tmp_path, "20261130-070000-bbbbbb", run_id="20261130-070000-cccccc")  # record of another id
        (tmp_path / "20261130-060000-dddddd").symlink_to(tmp_path / "checkpoints")  # a link: never followed
        own = names[-1]
        removed = prune_records(str(tmp_path), own, keep=5)
    finally:
        live.kill()
        live.wait()
    assert removed == names[:24]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(names[24:] + [running_id, "checkpoints", "20261130-080000-aaaaaa",
                                        "20261130-070000-bbbbbb", "20261130-060000-dddddd"])
    assert (tmp_path / "checkpoints").is_dir()
