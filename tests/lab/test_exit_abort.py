"""ddpfab.dist.finish() removes gloo's abort at interpreter exit (issue 20).

A rank that finished its training could still die by SIGABRT ("terminate called without an active
exception") while Python tore itself down around gloo's threads, failing the job (about 1 c10d run
in 9 of upstream examples). Scripts that end with ``ddist.finish()`` leave without that teardown.
This runs the DDP example RUNS times on 2 nodes x NPROC processes with c10d rendezvous (where the
race showed most) and requires every one of those RUNS * 2 * NPROC process exits to be clean.
``DDPFAB_EXIT_SOAK_RUNS`` raises RUNS for a longer soak.
"""

from __future__ import annotations

import os

import pytest

from ddpfab.health import hints

from .helpers import ddpfab

EXAMPLE = "examples/train_dist.py"
RUNS = int(os.environ.get("DDPFAB_EXIT_SOAK_RUNS", "3"))
NPROC = 4
pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_no_rank_aborts_at_exit_over_many_exits(lab, inventory2, tmp_path):
    exits = 0
    for i in range(RUNS):
        res = ddpfab("run", "-i", str(inventory2), "--rdzv", "c10d", "--nproc-per-node", str(NPROC),
                     "--runs-dir", str(tmp_path / "runs"), EXAMPLE, "--steps", "2", timeout=300)
        out = res.stdout + res.stderr
        assert hints.EXIT_ABORT_LINE not in out, f"run {i + 1}: a rank aborted at exit\n{out[-3000:]}"
        assert res.returncode == 0, f"run {i + 1}\n{out[-3000:]}"
        done = [ln for ln in res.stdout.splitlines() if " done, parameter checksum " in ln]
        assert len(done) == 2 * NPROC, out[-3000:]
        exits += len(done)
    assert exits == RUNS * 2 * NPROC
