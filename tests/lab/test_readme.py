"""README's try-out, run as printed on a fresh lab: its four lines, one after the other.

Two things differ from what a reader types, both so that the test can run beside the suite's
other labs: the lab's directory (a temp dir instead of /tmp/lab) and its subnet (a /24 of the
test session's, added to `lab up`). The commands run from a dir holding the README's
`examples/train.py`, with the checkout's venv first on PATH, as after `. .venv/bin/activate`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import extra_subnet
from .helpers import REPO

README_LAB = "/tmp/lab"


def tryout_lines() -> list[str]:
    """The command lines of README's "Try it on the local lab" block, as printed."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Try it on the local lab\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the try-out section shows one block of commands"
    return [line for line in blocks[0].splitlines() if line.strip()]


def test_the_readme_tryout_runs_as_printed_on_a_fresh_lab(tmp_path):
    lines = tryout_lines()
    assert [shlex.split(line)[:2] for line in lines] == [
        ["ddpfab", "lab"], ["ddpfab", "check"], ["ddpfab", "run"], ["ddpfab", "lab"]], lines
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "train.py", work / "examples" / "train.py")
    lab_dir = str(tmp_path / "lab")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "NO_COLOR": "1"}
    outputs = []
    try:
        for line in lines:
            argv = [lab_dir if word == README_LAB else word.replace(README_LAB + "/", lab_dir + "/")
                    for word in shlex.split(line)]
            if argv[1:3] == ["lab", "up"]:
                argv += ["--subnet", extra_subnet(180)]
            res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
            outputs.append(res)
            assert res.returncode == 0, f"{line}\n{res.stdout}\n{res.stderr}"
    finally:
        if os.path.exists(os.path.join(lab_dir, "inventory.yml")):
            subprocess.run([sys.executable, "-m", "ddpfab", "lab", "down", "--dir", lab_dir], capture_output=True,
                           timeout=120)
    up, check, run, down = outputs
    assert "node1" in up.stdout + up.stderr and "node2" in up.stdout + up.stderr
    # what the README says each one prints: check's table, each rank's prefixed lines, the record
    assert "all checks passed on 2 nodes" in check.stdout + check.stderr, check.stdout + check.stderr
    for rank in range(4):
        assert re.search(rf"^node[12] r{rank}\| rank {rank} done", run.stdout, re.M), run.stdout
    assert "rank 0's workdir: node1:" in run.stderr, run.stderr
    manifest = re.search(r"manifest: (runs/\S+/manifest\.json)", run.stdout + run.stderr)
    assert manifest and (work / manifest.group(1)).is_file(), run.stderr
    assert not (tmp_path / "lab").exists() or not (tmp_path / "lab" / "inventory.yml").exists()
