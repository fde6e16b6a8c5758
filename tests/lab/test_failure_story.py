"""The failure's story on real lab hosts (real sshd, torchrun, gloo): the closing line names the
rank that failed on its own, never a victim that lost its peer, run after run; a rank killed by
SIGKILL is its own failure, not "stopped by ddpfab"; a usage error is quoted; the crash's output
is short.

The peers of a rank that crashed raise gloo's "Connection closed by peer" within milliseconds, and
their nodes often end first: before, the closing line blamed such a victim in 15 of 16 runs. On 3
nodes each case runs once as it comes and FORCED times with that order made certain (the failing
rank closes its connections, then fails CRASH_DELAY_S later; each such run checks that a victim's
node did end first): a soak of ten runs as they came proved the same less surely."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import ddpfab, host_sh, start_ddpfab, wait_no_processes

CRASH = "tests/lab/scripts/crash_after_collective.py"
#: Runs per case with the victims' nodes made to end first (after one run as it comes)
FORCED = 2
#: How much later than its peers' failure the failing rank fails, in the forced runs: under the
#: settling time (execute.SETTLE_S) the run gives the others once a victim's node ended
CRASH_DELAY_S = 1.0
#: Runs of the 4 x 2 cases, as they come (their order cannot be forced: the failing rank's own
#: node has a victim, whose failure makes torchrun stop it before it fails)
RUNS_4 = 3
pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture(scope="module")
def lab4(tmp_path_factory):
    with own_lab(tmp_path_factory, "story4", hosts=4, subnet=extra_subnet(174)) as the_lab:
        yield the_lab


@pytest.fixture
def inventory3(lab, tmp_path) -> Path:
    path = tmp_path / "inventory3.yml"
    path.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2", "node3"]))
    return path


@pytest.fixture
def inventory4(lab4, tmp_path) -> Path:
    path = tmp_path / "inventory4.yml"
    path.write_text(labmod.render_inventory(lab4, sys.executable))
    return path


def crash(inventory: Path, runs: Path, nproc: int, rank: int, how: str, *extra: str):
    """One run whose *rank* fails (*how*); returns the result and its manifest. (Without the
    preflight checks after a test's first run: the story, not the checks, is under test.)"""
    if runs.exists():
        extra = ("--no-check", *extra)
    res = ddpfab("run", "-i", str(inventory), "--nproc-per-node", str(nproc), "--runs-dir", str(runs), "--no-sync",
                 "--env", f"CRASH_RANK={rank}", "--env", f"CRASH_HOW={how}", *extra, CRASH, timeout=120)
    manifests = sorted(runs.glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return res, json.loads(manifests[-1].read_text())


def closing_line(res) -> str:
    """The run's closing line: one, and nothing after it but a hint on how the command was given
    (where a user looks first; a new user's pass found the fetch line after it)."""
    printed = res.stderr.splitlines()
    lines = [ln for ln in printed if ln.startswith("ddpfab: failed: ")]
    assert len(lines) == 1, res.stdout + res.stderr
    assert all(ln.startswith("ddpfab: hint: ") for ln in printed[printed.index(lines[0]) + 1:]), res.stderr
    return lines[0]


def forced_order(i: int) -> tuple[str, ...]:
    """Run *i*'s extra options: the first as it comes, the others with the victims first."""
    return () if i == 0 else ("--env", f"CRASH_DELAY={CRASH_DELAY_S}")


def check_victims_ended_first(manifest: dict, node: str) -> None:
    """In a forced run: a victim's node ended before *node* (the order under test did happen)."""
    ended = {name: rec["ended"] for name, rec in manifest["nodes"].items()}
    assert min(t for name, t in ended.items() if name != node) < ended[node], ended


def check_named(res, manifest, node: str, node_rank: int, rank: int, local: int, kind: str, what: str) -> None:
    """The closing line and the manifest name *rank* on *node* and *what* ended it, as its own."""
    line = closing_line(res)
    assert line.startswith(f"ddpfab: failed: {node} (node_rank {node_rank}) "), line
    assert f"rank {rank} (local rank {local})" in line and what in line, line
    assert "Connection closed" not in line, line
    assert manifest["first_failure"] == node
    record = manifest["nodes"][node]
    assert record["stopped_by_ddpfab"] is False and record["cause"]["kind"] == kind, record
    assert record["cause"]["rank"] == rank and record["cause"]["local_rank"] == local, record
    # the live line named it too, and no victim was named as failing on its own
    live = [ln for ln in res.stdout.splitlines() if ln.endswith("stopping the other nodes")]
    assert len(live) == 1 and live[0].startswith(f"ddpfab: {node} (node_rank {node_rank}) failed ("), live


@pytest.mark.parametrize("how, kind, what", [
    ("raise", "exception", "ValueError: bad batch shape (3, 4) on rank 1"),
    ("kill", "signal", "was killed by signal 9 (SIGKILL)"),
])
def test_three_nodes_the_failing_rank_is_named_every_time(lab, inventory3, tmp_path, how, kind, what):
    for i in range(1 + FORCED):
        # the first forced run of a traceback is --verbose: what the short story folds is all there
        verbose = ("--verbose",) if how == "raise" and i == 1 else ()
        res, manifest = crash(inventory3, tmp_path / "runs", 1, 1, how, *forced_order(i), *verbose)
        assert res.returncode == 1, res.stdout + res.stderr
        check_named(res, manifest, "node2", 1, 1, 0, kind, what)
        if how == "kill":  # (root: the supervisor reads the kernel log, which has no OOM kill of it)
            assert "hint: no OOM kill of it is in node2's kernel log, so not the kernel's OOM killer" in res.stdout, res.stdout
        if i:
            check_victims_ended_first(manifest, "node2")
        assert "2 other ranks lost their peer" in closing_line(res), (i, closing_line(res))
        wait_no_processes(lab, timeout=10)
        if verbose:
            # everything: the victims' tracebacks (their peer closed first: certain in this order)
            # and torchrun's reports included
            assert "Connection closed by peer" in res.stdout and "lines folded" not in res.stdout
        if how == "raise" and i == 0:
            # the story is short: the cause's traceback, a line per other node, the closing line
            shown = (res.stdout + res.stderr).splitlines()
            assert len(shown) <= 30, "\n".join(shown)
            traceback = [ln for ln in res.stdout.splitlines() if ln.startswith("node2 r1|")]
            assert sum("ValueError: bad batch shape" in ln for ln in traceback) == 1, traceback
            assert not any("ChildFailedError" in ln or "Connection closed by peer" in ln for ln in shown), shown
            assert any("lines folded" in ln and "--verbose" in ln for ln in shown)
            others = [ln for ln in res.stdout.splitlines() if ln.startswith("ddpfab:   node")]
            assert others == ["ddpfab:   node1 (node_rank 0): rank 0 (local rank 0) lost its peer (its peer: node2)",
                              "ddpfab:   node3 (node_rank 2): rank 2 (local rank 0) lost its peer (its peer: node2)"]


@pytest.mark.parametrize("how, kind, what", [
    ("raise", "exception", "ValueError: bad batch shape (3, 4) on rank 5"),
    ("kill", "signal", "was killed by signal 9 (SIGKILL)"),
])
def test_four_nodes_two_procs_the_failing_rank_is_named_every_time(lab4, inventory4, tmp_path, how, kind, what):
    for _ in range(RUNS_4):
        res, manifest = crash(inventory4, tmp_path / "runs", 2, 5, how)
        assert res.returncode == 1, res.stdout + res.stderr
        check_named(res, manifest, "node3", 2, 5, 1, kind, what)
        wait_no_processes(lab4, timeout=10, names=("node1", "node2", "node3", "node4"))


def test_a_culprit_ended_by_torchrun_before_it_said_why_still_leads(lab, inventory3, tmp_path):
    """3 x 2: rank 3 (node2's local rank 1) closes its connections and would fail 2 s later; its
    sibling loses its peer at once, so torchrun ends rank 3 before its error. Only victims speak;
    a victim's node often ended first and led the line (a new user's pass, 2 of 3 runs). node2,
    where their errors point, leads every time, and is the run's first failure."""
    for _ in range(2):
        res, manifest = crash(inventory3, tmp_path / "runs", 2, 3, "raise", "--env", "CRASH_DELAY=2")
        assert res.returncode == 1, res.stdout + res.stderr
        assert closing_line(res).startswith("ddpfab: failed: node2 (node_rank 1) exit code 1"), closing_line(res)
        assert manifest["first_failure"] == "node2", manifest["first_failure"]
        wait_no_processes(lab, timeout=10)


def test_a_rank_the_oom_killer_ends_is_said_to_be(lab, inventory3, tmp_path):
    """A real OOM kill: the rank moves itself into a memory cgroup with a small limit (cgroup v1 is
    the machine's; a lab host mounts the same hierarchy) and allocates; the kernel's OOM killer
    ends it, its supervisor reads the kernel log."""
    group = f"ddpfab-test-oom-{uuid.uuid4().hex[:8]}"
    try:
        res, manifest = crash(inventory3, tmp_path / "runs", 1, 1, "oom", "--env", f"CRASH_MEMCG={group}")
        assert res.returncode == 1, res.stdout + res.stderr
        check_named(res, manifest, "node2", 1, 1, 0, "oom", "was killed by the OOM killer (SIGKILL)")
        assert manifest["nodes"]["node2"]["cause"]["signal"] == 9
        wait_no_processes(lab, timeout=10)
    finally:
        host_sh(lab, "node2", "umount /tmp/ddpfab-memcg; rmdir /tmp/ddpfab-memcg")
        cgroup = Path("/sys/fs/cgroup/memory") / group
        deadline = time.monotonic() + 10
        while cgroup.exists():  # (empty once its process is reaped)
            try:
                cgroup.rmdir()
            except OSError:
                assert time.monotonic() < deadline, f"{cgroup} left behind"
                time.sleep(0.1)


@pytest.mark.parametrize(("node", "guard"), [(2, "on"), (1, "off")])
def test_a_node_whose_rank_ended_early_leads_the_closing_line(lab, inventory3, tmp_path, node, guard):
    """Rank 1 (node2) exits 0 while the others wait for it in an all_reduce (a new user's pass:
    the line led with a victim, "failed: node3 ... only secondary failures were seen", and the
    manifest named it): node2 leads, as having ended while the others waited, the victim after.
    Also the master's rank, without the ranks' exit guard: the worker watch alone sees it end (its
    torchrun then waits at its exit barrier; the line led with a victim, node1 "was stopped")."""
    res, manifest = crash(inventory3, tmp_path / "runs", 1, node - 1, "exit0", "--exit-guard", guard)
    assert res.returncode != 0, res.stdout + res.stderr
    line = closing_line(res)
    assert line.startswith(f"ddpfab: failed: node{node} (node_rank {node - 1}) exited 0 while the others still waited for it"), line
    assert "; then node" in line and "lost its peer" in line, line
    assert manifest["first_failure"] == f"node{node}", manifest["first_failure"]
    wait_no_processes(lab, timeout=15)


def test_a_rank_that_ended_early_beside_a_victim_is_named(lab, inventory3, tmp_path):
    """3 x 2: rank 3 (node2's local rank 1) exits 0 while the others wait for it; its sibling
    loses its peer like the ranks elsewhere. The line read "only secondary failures were seen",
    rank 3 in no word of it (a new user's pass). It names rank 3 as the one that left."""
    res, manifest = crash(inventory3, tmp_path / "runs", 2, 3, "exit0")
    assert res.returncode == 1, res.stdout + res.stderr
    line = closing_line(res)
    assert line.startswith("ddpfab: failed: node2 (node_rank 1) exit code 1"), line
    assert "rank 3 (local rank 1) exited 0 while the others still waited" in line, line
    assert manifest["first_failure"] == "node2", manifest["first_failure"]
    wait_no_processes(lab, timeout=15)


def test_a_usage_error_is_quoted_with_where_ddpfabs_option_belongs(lab, inventory3, tmp_path):
    res = ddpfab("run", "-i", str(inventory3), "--runs-dir", str(tmp_path / "runs"), "--no-sync", CRASH,
                 "--steps", "1", "--nproc-per-node", "2", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    line = closing_line(res)
    assert "exit code 2: crash_after_collective.py: error: unrecognized arguments: --nproc-per-node 2" in line, line
    assert "ddpfab: hint: --nproc-per-node is an option of ddpfab run" in res.stderr
    assert "before the script" in res.stderr.splitlines()[-1]
    manifest = json.loads(next((tmp_path / "runs").glob("*/manifest.json")).read_text())
    assert manifest["nodes"][manifest["first_failure"]]["cause"]["kind"] == "usage"


def test_a_second_rank_failing_another_way_is_said_and_no_node_is_called_stopped(lab, inventory3, tmp_path):
    """3 x 2: rank 1 (node1) raises ValueError, rank 4 (node3) KeyError, the others lose their
    peer (a new user's pass: the line ended "the others were stopped", rank 4 in no word of it)."""
    res, manifest = crash(inventory3, tmp_path / "runs", 2, 1, "raise", "--env", "CRASH_ALSO=4")
    assert res.returncode == 1, res.stdout + res.stderr
    line = closing_line(res)
    assert "rank 1 (local rank 1): ValueError" in line or "rank 4 (local rank 0): KeyError" in line, line
    assert "also on its own: " in line and "ValueError" in line and "KeyError" in line, line
    assert "stopped" not in line, line  # every other rank lost its peer: none was stopped before it failed
    wait_no_processes(lab, timeout=10)


def test_a_syntax_error_on_every_rank_leaves_no_node_called_stopped(lab, inventory3, tmp_path):
    """Every rank fails within a moment of starting, before the supervisors' first look at their
    workers; ddpfab's stop then reached the nodes before their torchrun ended: ps, doctor and the
    manifest called them "stopped by ddpfab: another node failed" (a new user's pass)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "broken.py").write_text("import os\ndef f(:\n    pass\n")
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory3), "--no-sync", "--runs-dir", str(runs), "--nproc-per-node", "2",
                 "--env", "PYTHONDONTWRITEBYTECODE=1", "broken.py", cwd=job)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "SyntaxError: invalid syntax" in closing_line(res) and "failed the same way" in closing_line(res)
    manifest = json.loads(next(runs.glob("*/manifest.json")).read_text())
    for name, node in manifest["nodes"].items():
        assert node["exit_code"] == 1 and not node["stopped_by_ddpfab"], (name, node)
        assert "stopped by ddpfab" not in (node["stopped_reason"] or ""), (name, node)
    listed = ddpfab("ps", "-i", str(inventory3), "--runs-dir", str(runs), cwd=job)
    row = [ln for ln in listed.stdout.splitlines() if ln.startswith(manifest["run_id"])]
    assert row and row[0].endswith("node1:exited(1) node2:exited(1) node3:exited(1)"), listed.stdout + listed.stderr
    wait_no_processes(lab, timeout=10)


#: node2's rank (a worker: a ticker.py process that is not torchrun), killed with SIGTERM
KILL_A_RANK = ("for p in $(pgrep -f '[t]icker.py'); do tr '\\0' ' ' < /proc/$p/cmdline | grep -q torch.distributed.run "
               "|| { kill -TERM $p; exit 0; }; done; exit 1")


@pytest.mark.parametrize("kill, said, hint", [
    ("pkill -KILL -f '[t]orch.distributed.run'", ("torchrun (pid ",), "hint: SIGKILL comes from"),
    # torchrun says it got it ("Received 15 death signal"), then ends its ranks with it
    ("pkill -TERM -f '[t]orch.distributed.run'", ("torchrun got signal 15 (SIGTERM) from outside the run",),
     "hint: neither ddpfab nor torchrun sent"),
    (KILL_A_RANK, ("rank 1 (local rank 0) was killed by signal 15 (SIGTERM)",), "hint: neither ddpfab nor torchrun"),
])
def test_a_signal_from_outside_the_run_is_named_as_the_cause(lab, inventory3, tmp_path, kill, said, hint):
    """`pkill -KILL` / `pkill -TERM` of node2's torchrun, `kill` of its rank, mid-job (a new
    user's pass): with SIGKILL the line gave no cause ("exit code 137"); with SIGTERM it read "only
    secondary failures were seen". Now each names what was killed by which signal, and where such
    a signal comes from."""
    proc = start_ddpfab("run", "-i", str(inventory3), "--runs-dir", str(tmp_path / "runs"), "--no-sync",
                        "tests/lab/scripts/ticker.py")
    try:
        seen: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # every rank up (the run ends by itself if one never comes)
            seen.append(line)
            if sum("READY" in ln for ln in seen) == 3:
                break
        assert sum("READY" in ln for ln in seen) == 3, "".join(seen)
        killed = host_sh(lab, "node2", kill)
        assert killed.returncode == 0, killed.stderr
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in rest.splitlines() if ln.startswith("ddpfab: failed: ")]
    assert len(lines) == 1 and lines[0].startswith("ddpfab: failed: node2 (node_rank 1) "), rest
    assert any(text in lines[0] for text in said) and "secondary" not in lines[0], lines[0]
    assert f"ddpfab: {hint}" in rest, rest
    wait_no_processes(lab, timeout=10)


def test_with_torchrun_restarts_the_first_failure_is_named(lab, inventory3, tmp_path):
    """--max-restarts 1, 3 x 2, rank 3 killed by SIGKILL: torchrun restarts node2's ranks, whose
    rendezvous then fails (the others are gone): the line named a restarted rank's "Gloo
    connectFullMesh failed", the SIGKILL nowhere (a new user's pass)."""
    res, manifest = crash(inventory3, tmp_path / "runs", 2, 3, "kill", "--max-restarts", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    check_named(res, manifest, "node2", 1, 3, 1, "signal", "was killed by signal 9 (SIGKILL)")
    assert "torchrun's restarts after it (--max-restarts) failed too" in closing_line(res), closing_line(res)
    assert "connectFullMesh" not in closing_line(res)
    wait_no_processes(lab, timeout=15)


#: A job that imports, after its ranks met, a package one node's python lacks.
IMPORTS_DEP = """\
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} up", flush=True)
import ddpfab_test_dep
dist.barrier()
print(f"rank {dist.get_rank()} has {ddpfab_test_dep.VALUE}", flush=True)
"""


def test_a_package_one_node_lacks_is_named_by_check_and_by_its_failed_run(lab, inventory3, tmp_path):
    """A venv every node runs (it sees this python's packages through a .pth) with one package
    more, in a dir of its own that node2 does not see (an empty tmpfs over it, in node2's own
    mounts). Before, check passed and the failed run ended with the ModuleNotFoundError alone;
    now check warns with the package and how to install it there, and the run's closing lines
    give the same hint."""
    venv, job, extra = tmp_path / "venv", tmp_path / "job", tmp_path / "extra"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # this python's packages (torch and the rest), then the one more (where a .pth's dir exists)
    (site / "main.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{extra}/site-packages\n")
    (extra / "site-packages" / "ddpfab_test_dep").mkdir(parents=True)
    (extra / "site-packages" / "ddpfab_test_dep" / "__init__.py").write_text("VALUE = 7\n")
    (extra / "site-packages" / "ddpfab_test_dep-1.2.dist-info").mkdir()
    (extra / "site-packages" / "ddpfab_test_dep-1.2.dist-info" / "METADATA").write_text(
        "Name: ddpfab-test-dep\nVersion: 1.2\n")
    job.mkdir()
    (job / "train.py").write_text(IMPORTS_DEP)
    hidden = host_sh(lab, "node2", f"findmnt -no PROPAGATION / | grep -qx private && mount -t tmpfs ddpfab-test {extra}")
    assert hidden.returncode == 0, hidden.stderr  # (a private root: the mount stays node2's)
    try:
        assert (extra / "site-packages").is_dir()
        python = ("-e", f"ddpfab_python={venv}/bin/python")
        res = ddpfab("check", "--fast", "-i", str(inventory3), *python, cwd=job)
        assert res.returncode == 0, res.stdout + res.stderr  # a warning: a package no job imports fails nothing
        assert (f"warn host node2: packages: expected the packages most nodes have, in their versions, found lacks "
                f"ddpfab-test-dep 1.2; fix: provision again (`ddpfab provision -l node2 -t python` installs the "
                f"pinned set), or install them there: `ddpfab exec -l node2 -- {venv}/bin/python -m pip install "
                f"ddpfab-test-dep==1.2`") in res.stdout, res.stdout
        res = ddpfab("run", "-i", str(inventory3), *python, "--no-sync", "--runs-dir", str(tmp_path / "runs"),
                     "--env", "PYTHONDONTWRITEBYTECODE=1", "train.py", cwd=job)  # (no __pycache__ left on the hosts)
        assert res.returncode == 1, res.stdout + res.stderr
        assert closing_line(res).startswith("ddpfab: failed: node2 (node_rank 1) exit code 1; rank 1 (local rank 0): "
                                            "ModuleNotFoundError: No module named 'ddpfab_test_dep'"), closing_line(res)
        hint = [ln for ln in res.stdout.splitlines() if ln.startswith("ddpfab: hint: node2's python")]
        assert hint and f"({venv}/bin/python) lacks ddpfab-test-dep 1.2, unlike most nodes" in hint[0], res.stdout
        wait_no_processes(lab, timeout=10)
    finally:
        host_sh(lab, "node2", f"umount {extra}")
