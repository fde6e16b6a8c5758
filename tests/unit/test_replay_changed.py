"""replay's refusal of a changed tree names the files changed since the run started."""

from __future__ import annotations

import os

from ddpfab.launch import replay
from ddpfab.transfer import sync


def test_the_files_changed_since_the_run_started_are_named(tmp_path):
    for name in ("train.py", "a.py", "out.log"):
        (tmp_path / name).write_text("x\n")
    os.utime(tmp_path / "train.py", (1000.0, 1000.0))
    sel = sync.select(tmp_path)
    assert replay.changed_since(sel, 2000.0) == " (changed since the run started, by their times: a.py, out.log)"
    assert replay.changed_since(sel, 2000.0, limit=1) == \
        " (changed since the run started, by their times: a.py and 1 more)"
    assert replay.changed_since(sel, "2000") == "" and replay.changed_since(sel, None) == ""
    assert replay.changed_since(sel, 4e9) == ""
