"""`ddpfab shell` on real lab hosts, driven from a real terminal (a pty).

- `shell --run-id RUN --rank 3` after a 2 nodes x 2 run: on rank 3's node, in the workdir, after
  the inventory's setup line, with the rank's environment (`echo $RANK $MASTER_ADDR ...` prints
  the values the run gave rank 3) and the node's python first on PATH; a secret the record masks
  is named, not set, and given again with `--env`; the start file is gone once the shell runs;
  input that is not a terminal is a script: its bytes run as they are, one over 1 MiB is refused.
- `shell NODE`: the node as ddpfab starts things there, no rank's variables; a resized window
  resizes the node's terminal.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest
import yaml

from ddpfab import lab as labmod

from .helpers import Terminal, ddpfab, host_sh, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

JOB = 'import os\nprint("rank", os.environ["RANK"], "ok", flush=True)\n'


@pytest.fixture
def setup_inventory(lab, tmp_path):
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    inv["all"]["vars"]["ddpfab_setup"] = ["export SITE_FLAG=from-setup"]
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    (tmp_path / "job.py").write_text(JOB)
    return path


def test_a_shell_that_is_rank_3_of_a_recorded_run(lab, setup_inventory, tmp_path):
    run = ddpfab("run", "-i", str(setup_inventory), "--nproc-per-node", "2", "--run-id", "shell-run",
                 "--no-check", "--env", "HF_TOKEN=hunter2", "job.py", cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    plan = json.loads((tmp_path / "runs" / "shell-run" / "manifest.json").read_text())["plan"]
    term = Terminal("shell", "--run-id", "shell-run", "--rank", "3", cwd=tmp_path)
    term.expect(r"masked in the run's record\): HF_TOKEN", 60)
    term.expect(r"\[ddpfab node2 rank 3\] \S+ \$ ", 60)
    term.send('echo "R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE G=$GROUP_RANK M=$MASTER_ADDR:$MASTER_PORT '
              'F=$SITE_FLAG T=${HF_TOKEN-unset} P=$(pwd)"')
    term.expect(rf"R=3 L=1 W=4 G=1 M={plan['master_addr']}:{plan['master_port']} F=from-setup T=unset "
                rf"P={tmp_path}\r?\n")
    term.send('python -c "import sys; print(\'py=\' + sys.executable)"; ls ~/.ddpfab/shell | wc -l')
    term.expect(rf"py={sys.executable}\r?\n0\r?\n")  # the node's python first on PATH; no start file left
    term.send("exit 0")
    assert term.wait(30) == 0, term.text
    # a masked value given again
    term = Terminal("shell", "--run-id", "shell-run", "--rank", "0", "--env", "HF_TOKEN=hunter2", cwd=tmp_path)
    term.expect(r"\[ddpfab node1 rank 0\] \S+ \$ ", 60)
    term.send('echo "R=$RANK T=$HF_TOKEN"; exit 3')
    term.expect(r"R=0 T=hunter2\r?\n")
    assert term.wait(30) == 3
    assert "masked" not in term.text
    # input that is not a terminal: its commands run (no pty: stderr apart), and its end ends the
    # shell with the last command's status (with a pty it waited at a prompt for ever)
    piped = ddpfab("shell", "--run-id", "shell-run", "--rank", "3", cwd=tmp_path, timeout=60,
                   input='echo "R=$RANK F=$SITE_FLAG O=$OMP_NUM_THREADS"\necho oops >&2\nfalse\n')
    assert piped.returncode == 1 and piped.stdout == "R=3 F=from-setup O=1\n", piped.stdout + piped.stderr
    assert "oops\n" in piped.stderr and "R=3" not in piped.stderr
    # a script's bytes arrive as they were (a Latin-1 byte in it was an encoding error before), and
    # one over the bound is refused before any connection
    raw = subprocess.run([sys.executable, "-m", "ddpfab", "shell", "--run-id", "shell-run", "--rank", "3"],
                         cwd=tmp_path, input=b"printf %s '\xe9' | od -An -tx1\n", capture_output=True, timeout=60)
    assert raw.returncode == 0 and raw.stdout.split() == [b"e9"], raw.stdout + raw.stderr
    big = subprocess.run([sys.executable, "-m", "ddpfab", "shell", "--run-id", "shell-run", "--rank", "3"],
                         cwd=tmp_path, input=b"#" * (2 << 20), capture_output=True, timeout=60)
    assert big.returncode == 2 and b"over 1 MiB" in big.stderr and b"Traceback" not in big.stderr, big.stderr
    # and its commands end with the connection: ddpfab killed, nothing of them is left on the node
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "shell", "--run-id", "shell-run", "--rank", "3"],
                            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"echo started; sleep 307\n")
    proc.stdin.close()
    assert proc.stdout.readline() == b"started\n"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while any("sleep 307" in cmd for _, cmd in lab.processes("node2")):
        assert time.monotonic() < deadline, lab.processes("node2")
        time.sleep(0.2)
    assert host_sh(lab, "node2", "ls -A ~/.ddpfab/shell").stdout == ""
    wait_no_processes(lab, timeout=10)


def test_a_shell_on_a_node_is_the_node_as_ddpfab_starts_things_there(lab, setup_inventory, tmp_path):
    term = Terminal("shell", "-i", str(setup_inventory), "node1", cwd=tmp_path)
    term.expect(r"\[ddpfab node1\] \S+ \$ ", 60)
    term.send('echo "F=$SITE_FLAG R=${RANK-none} P=$(pwd)"')
    term.expect(rf"F=from-setup R=none P={tmp_path}\r?\n")
    # a resized window: the node's terminal follows (stty there reads its pty's size)
    term.resize(41, 123)
    deadline = time.monotonic() + 30
    try:
        # each look numbered: one that answered before the resize reached the node must not answer for
        # the later looks (expect matches the output so far, and reads on only while nothing matches)
        for look in itertools.count():
            term.send(f'echo "SIZE{look}=$(stty size)"')
            if term.expect(rf"SIZE{look}=(\d+ \d+)\r?\n").group(1) == "41 123":
                break
            assert time.monotonic() < deadline, f"the node's terminal kept its size:\n{term.text[-2000:]}"
            time.sleep(0.2)
        term.send("exit")
        assert term.wait(30) == 0, term.text
    finally:
        if term.proc.poll() is None:  # a failure above: its shell on the node ends with the connection
            term.proc.kill()


def test_a_rank_shell_runs_the_inventorys_secret_setup_line_not_the_records_mask(lab, tmp_path):
    """The run's record keeps a setup line's secret as ``HF_TOKEN=***``; a rank's shell ran that
    line as recorded, so HF_TOKEN was ``***`` there (a review's find). It runs the inventory's."""
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    inv["all"]["vars"]["ddpfab_setup"] = ["export HF_TOKEN=hf-from-setup SITE_FLAG=on"]
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    (tmp_path / "job.py").write_text(JOB)
    run = ddpfab("run", "-i", str(path), "--run-id", "shell-mask", "--no-check", "job.py", cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    recorded = (tmp_path / "runs" / "shell-mask" / "manifest.json").read_text()
    assert "hf-from-setup" not in recorded and "HF_TOKEN=***" in recorded
    piped = ddpfab("shell", "--run-id", "shell-mask", "--rank", "1", cwd=tmp_path, timeout=60,
                   input='echo "R=$RANK T=$HF_TOKEN F=$SITE_FLAG"\n')
    assert piped.returncode == 0 and piped.stdout == "R=1 T=hf-from-setup F=on\n", piped.stdout + piped.stderr
