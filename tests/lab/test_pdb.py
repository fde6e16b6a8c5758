"""`ddpfab run --pdb` on real lab hosts, driven from a real terminal (a pty), as a user drives it.

- A 6-rank job (3 nodes x 2) with `--pdb 5`, rank 5 calls `breakpoint()`: the terminal gets a
  `(Pdb)` prompt naming node and rank; `p int(os.environ["RANK"])` answers 5; a Ctrl-C there is
  held (the job goes on; a second one would stop it); meanwhile the hang
  watch (`--hang-timeout 4`) calls nothing hung, though no rank prints for longer; `c` lets the
  job finish with exit 0.
- Post-mortem: rank 1 raises, `--pdb`: the prompt is at the raising line; `q` ends the job: the
  closing line names rank 1's exception and nothing is left running on any node.
- A rank outside RANKS keeps today's behaviour: its `breakpoint()` reads /dev/null and fails.
- `--pdb` with no value, before the script, is every rank (the script is not taken for RANKS).
- Two ranks stop: the run's terminal drives the first, `ddpfab debug RUN_ID --rank R` from a second
  terminal the other (a Ctrl-C there detaches: the rank waits on, and the next `debug` finds it
  where it was); both continue and the job ends 0.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from ddpfab import lab as labmod

from .helpers import Terminal, ddpfab, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

#: The ranks of STOP_RANK (comma-separated) stop after init: in breakpoint() (MODE=stop) or by raising (MODE=raise).
JOB = r'''
import os
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = int(os.environ["RANK"])
print("rank %d up" % rank, flush=True)
t = torch.tensor([float(rank)])
if str(rank) in os.environ["STOP_RANK"].split(","):
    marker = "inside rank %d" % rank
    if os.environ["MODE"] == "raise":
        raise ValueError("bad batch shape on rank %d" % rank)
    breakpoint()
dist.all_reduce(t)
print("rank %d sum %s" % (rank, t.item()), flush=True)
dist.destroy_process_group()
'''


@pytest.fixture
def job(lab, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    inv = tmp_path / "inventory.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2", "node3"]))
    return tmp_path, inv


def test_a_breakpoint_in_rank_5_waits_for_the_terminal_and_continue_finishes_the_job(lab, job):
    cwd, inv = job
    term = Terminal("run", "-i", str(inv), "--nproc-per-node", "2", "--pdb", "5", "--hang-timeout", "4",
                    "--env", "STOP_RANK=5", "--env", "MODE=stop", "job.py", cwd=cwd)
    term.expect(r"attached to rank 5 on node3 \(local rank 1, breakpoint at \S+job\.py:\d+\)", 120)
    term.expect(r"node3 rank 5 \(Pdb\) ")
    term.send('p int(os.environ["RANK"]), marker')
    term.expect(r"\(5, 'inside rank 5'\)")
    began = time.monotonic()
    # Ctrl-C at the prompt, a pdb habit, is held: the job goes on (it stopped every node)
    term.proc.send_signal(signal.SIGINT)
    term.expect(r"Ctrl-C while rank 5 on node3 .* is in the debugger does not stop the job")
    term.send("p 2 + 2")
    term.expect(r"\n4\r?\n")
    # a rank outside the --pdb ranks: said so (it said "not waiting in pdb (not stopped, or attached
    # from another terminal)")
    run_id = next((cwd / "runs").iterdir()).name
    refused = ddpfab("debug", run_id, "--rank", "0", cwd=cwd)
    assert refused.returncode == 2 and f"rank 0 of run {run_id} is not one of its --pdb ranks (5)" in refused.stderr, \
        refused.stderr
    # longer than --hang-timeout with no rank printing: the others wait for rank 5
    time.sleep(max(0.0, 6 - (time.monotonic() - began)))
    term.send("c")
    assert term.wait(120) == 0, term.text
    text = term.text
    for rank in range(6):
        assert f"rank {rank} sum 15.0" in text, text
    # while rank 5 was in the debugger the hang watch never looked (it says so when it does); after,
    # on a loaded machine, torchrun's teardown may be quieter than 4 s: that look is not this test's
    during = text[text.index("attached to rank 5"):text.index("rank 5 on node3 left the debugger")]
    assert "hang watch: no rank has printed" not in during and "ddpfab: hang:" not in during, text
    assert "the hang watch waits meanwhile" in text
    assert "rank 5 on node3 left the debugger" in text
    wait_no_processes(lab, timeout=10)


def test_post_mortem_stops_at_the_raising_line_and_quit_ends_the_job_everywhere(lab, job):
    cwd, inv = job
    term = Terminal("run", "-i", str(inv), "--nproc-per-node", "2", "--pdb", "--env", "STOP_RANK=1",
                    "--env", "MODE=raise", "job.py", cwd=cwd)
    term.expect(r"attached to rank 1 on node1 \(local rank 1, post-mortem: ValueError at \S+job\.py:\d+\)", 120)
    term.expect(r"-> raise ValueError\(.*\n.*node1 rank 1 \(Pdb\) ")
    term.send("p marker")
    term.expect(r"'inside rank 1'")
    term.send("q")
    code = term.wait(120)
    assert code == 1, term.text
    closing = [line for line in term.text.splitlines() if line.startswith("ddpfab: failed")]
    assert closing and "node1" in closing[-1] and "rank 1" in closing[-1] and "ValueError" in closing[-1], term.text
    wait_no_processes(lab, timeout=15)


def test_a_rank_outside_the_pdb_ranks_fails_at_its_breakpoint_as_before(lab, job):
    cwd, inv = job
    term = Terminal("run", "-i", str(inv), "--nproc-per-node", "2", "--pdb", "5", "--env", "STOP_RANK=2",
                    "--env", "MODE=stop", "job.py", cwd=cwd)
    assert term.wait(180) != 0, term.text
    assert "BdbQuit" in term.text and "waits in pdb" not in term.text, term.text
    wait_no_processes(lab, timeout=15)


def test_pdb_without_a_terminal_is_refused_before_anything_starts(lab, job):
    cwd, inv = job
    res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inv), "--pdb", "job.py"], cwd=cwd,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--pdb needs an input" in res.stderr, res.stderr
    assert not (cwd / "runs").exists()


def test_pdb_commands_piped_in_together_all_run_and_the_job_ends_0(lab, job):
    """A script driving pdb (the docs offer a pipe for it) writes its commands at once: only the
    first ran, the rest were dropped with pdb's first answer, and the job hung at the next prompt."""
    cwd, inv = job
    res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inv), "--nproc-per-node", "2",
                          "--pdb", "3", "--env", "STOP_RANK=3", "--env", "MODE=stop", "job.py"], cwd=cwd,
                         input='p marker\np int(os.environ["RANK"]) * 7\nc\n', capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "'inside rank 3'" in res.stdout and "\n21\n" in res.stdout.replace("(Pdb) ", "\n"), res.stdout[-3000:]
    wait_no_processes(lab, timeout=15)


def test_pdb_without_ranks_before_the_script_means_every_rank(job):
    cwd, inv = job
    res = ddpfab("run", "-i", str(inv), "--offline", "--dry-run", "--pdb", "job.py", "--pdb", cwd=cwd)
    assert res.returncode == 0, res.stderr
    assert "# pdb: ranks all wait in pdb" in res.stdout, res.stdout
    assert "job.py --pdb" in res.stdout  # the script's own --pdb stays the script's
    bad = ddpfab("run", "-i", str(inv), "--offline", "--dry-run", "--pdb", "9", "job.py", cwd=cwd)
    assert bad.returncode == 2 and "rank 9 is not in this job" in bad.stderr, bad.stderr


def test_two_ranks_stop_and_a_second_terminal_takes_the_one_that_waits(lab, job):
    cwd, inv = job
    run_id = "pdb-two-stops"
    term = Terminal("run", "-i", str(inv), "--nproc-per-node", "2", "--pdb", "--run-id", run_id,
                    "--env", "STOP_RANK=1,4", "--env", "MODE=stop", "job.py", cwd=cwd)
    first = int(term.expect(r"attached to rank ([14]) on", 120)[1])
    other = 5 - first
    term.expect(rf"pdb: rank {other} on node\d \(local rank \d, breakpoint at \S+\) waits too")
    # the doctor (real py-spy stacks) says both wait in pdb, where, and how to attach: no hang
    doc = ddpfab("doctor", run_id, cwd=cwd, timeout=120)
    for r in (first, other):
        assert re.search(rf"node\d rank {r} \(local rank \d, pid \d+\) waits in pdb at <module> \(job\.py:\d+\): "
                         rf"`ddpfab debug {run_id} --rank {r}` attaches to it", doc.stdout), doc.stdout + doc.stderr
    # Ctrl-C in `debug` detaches: the rank waits on where it was (it quit, and the job failed)
    leaving = Terminal("debug", run_id, "--rank", str(other), cwd=cwd)
    leaving.expect(rf"node\d rank {other} \(Pdb\) ", 60)
    leaving.proc.send_signal(signal.SIGINT)
    assert leaving.wait(30) == 130, leaving.text
    assert f"detached from rank {other} on node" in leaving.text, leaving.text
    second = Terminal("debug", run_id, "--rank", str(other), cwd=cwd)
    second.expect(rf"node\d rank {other} \(Pdb\) ", 60)
    second.send("p marker")
    second.expect(rf"'inside rank {other}'\r?\n")  # in the same frame
    second.send("p rank")
    second.expect(rf"\n{other}\r?\n")
    second.send("c")
    assert second.wait(60) == 0, second.text
    term.expect(rf"node\d rank {first} \(Pdb\) ")
    term.send("c")
    assert term.wait(120) == 0, term.text
    for rank in range(6):
        assert f"rank {rank} sum 15.0" in term.text, term.text
    # the run had none of the other rank's session: its relay was refused or never tried
    assert f"attached to rank {other} " not in term.text
    wait_no_processes(lab, timeout=10)
    late = Terminal("debug", run_id, "--rank", str(other), cwd=cwd)  # the job has ended: said so
    assert late.wait(60) == 1 and re.search(rf"the job has ended on node\d: rank {other} waits in pdb no more",
                                            late.text), late.text
