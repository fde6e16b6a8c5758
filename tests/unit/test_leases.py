"""GPU leases without a network: the node side (real lease names in a private lease dir, the lab's
stand-in nvidia-smi on PATH), the plan's lease request, the controller's reading of what nodes
report (validated data) and its refusal, the queue's order and the go gate of ``--wait``."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import gate as golib
from ddpfab.planning import gpu_leases
from ddpfab.node import leases, ops
from ddpfab.planning.plan import PlanError, RunOptions, gpu_lease

STAND_IN = Path(leases.__file__).resolve().parents[1] / "lab" / "fake-nvidia-smi"


@pytest.fixture
def node_gpus(tmp_path, monkeypatch):
    """Four stand-in GPUs and a private lease dir."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(STAND_IN)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("DDPFAB_STANDIN_GPUS", "4")
    monkeypatch.setattr(leases, "LEASE_DIR", str(tmp_path / "leases"))
    return tmp_path / "leases"


def test_leases_are_never_granted_twice_and_name_their_holder(node_gpus):
    fds, got, _ = leases.take_leases(3, [], "first")
    assert got == ["0", "1", "2"]
    assert oct(node_gpus.stat().st_mode & 0o7777) == "0o1777"
    again, none, states = leases.take_leases(2, [], "second")
    assert again is None and none is None
    assert [s["state"] for s in states] == ["leased", "leased", "leased", "free"]
    assert states[0]["holder"]["run_id"] == "first" and states[0]["holder"]["pid"] == os.getpid()
    assert leases.describe_leases(states)[0].startswith("GPU 0 leased by run first (user ")
    pinned, gpus, _ = leases.take_leases(1, ["GPU-6f1b2c3d-0000-4000-8000-000000000003"], "third")
    assert gpus == ["3"]  # a UUID pin is the same GPU as its index: one lease name per GPU
    for fd in fds + pinned:
        os.close(fd)
    assert {s["state"] for s in leases.lease_state()} == {"free"}


def test_removing_every_file_of_the_lease_dir_neither_frees_nor_regrants_a_leased_gpu(node_gpus):
    """The lease is the abstract socket name, not a file: whoever can remove the holder records
    (their creator, the dir's owner) only removes what they say; the GPU stays leased, is never
    granted twice, and shows its holder as unknown until the holder ends."""
    fds, got, _ = leases.take_leases(2, [], "first")
    for f in node_gpus.iterdir():
        f.unlink()
    again, _, states = leases.take_leases(3, [], "second")
    assert again is None and [s["state"] for s in states] == ["leased", "leased", "free", "free"]
    assert states[0]["holder"] == {}
    assert leases.describe_leases(states)[0] == gpu_leases.parse({"gpus": states})[0].describe() == (
        "GPU 0 leased by a process that left no record of itself (as root, `ss -xap | grep ddpfab-lease-` names it)")
    (node_gpus / "gpu-0.holder").write_text(json.dumps({"run_id": "liar", "user": "x", "pid": 999999999}))
    assert leases.lease_state()[0]["holder"] == {}  # a record naming a process that is not there
    for fd in fds:
        os.close(fd)
    fds, got, _ = leases.take_leases(4, [], "next")
    assert got == ["0", "1", "2", "3"]
    for fd in fds:
        os.close(fd)


def test_a_fifo_planted_in_the_lease_dir_blocks_no_reader(node_gpus):
    """Another user's FIFO where a holder record or a ticket would be: every reader still answers
    (opening a FIFO to read would wait for a writer forever)."""
    fds, _, _ = leases.take_leases(1, [], "first")
    (node_gpus / "gpu-0.holder").unlink()
    os.mkfifo(node_gpus / "gpu-0.holder")
    os.mkfifo(node_gpus / f"wait-{leases.ticket_key(1.0, 'fifo')}.ticket")
    code = ("import sys, json; sys.path.insert(0, %r); from ddpfab.node import leases; leases.LEASE_DIR = %r; "
            "print(json.dumps([[s['state'] for s in leases.lease_state()], leases.tickets(), "
            "leases.take_leases(1, ['0'], 'x')[1]]))" % (str(Path(__file__).resolve().parents[2]), str(node_gpus)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert json.loads(res.stdout) == [["leased", "free", "free", "free"], [], None], res.stderr
    for fd in fds:
        os.close(fd)


def test_an_older_ddpfabs_flock_lease_still_counts_and_the_dir_is_one_however_spelled(node_gpus, monkeypatch):
    """A job of ddpfab before lease names holds GPU 0 by a flock on ``gpu-0.lock`` (the transition):
    it shows as leased and is not granted; and a lease dir spelled with a trailing slash is the
    same dir (the same names)."""
    leases.lease_dir()
    old = os.open(node_gpus / "gpu-0.lock", os.O_RDWR | os.O_CREAT, 0o666)
    os.write(old, json.dumps({"run_id": "older", "user": "u", "pid": os.getpid(), "since": 1.0}).encode())
    holder = subprocess.Popen(["flock", "-x", str(node_gpus / "gpu-0.lock"), "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while leases.lease_state()[0]["state"] != "leased":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert leases.lease_state()[0]["holder"]["run_id"] == "older"
        fds, got, _ = leases.take_leases(1, [], "new")
        assert got == ["1"]
        monkeypatch.setattr(leases, "LEASE_DIR", str(node_gpus) + "/")
        assert leases.take_leases(1, ["1"], "again")[1] is None
    finally:
        holder.kill()
        holder.wait()
        os.close(old)
    for fd in fds:
        os.close(fd)


def test_a_held_port_reservation_survives_the_removal_of_its_file(node_gpus):
    """The supervisor's reservation of its master port is its lease name too: removing
    ``port-P.lock`` (its creator or the dir's owner may) does not let another run reserve P."""
    held = leases.reserve_port(29611, "job", hold=True)
    assert held is not None
    (node_gpus / "port-29611.lock").unlink()
    assert leases.reserve_port(29611, "other") is None
    assert leases.reserve_port(29611, "other", hold=True) is None
    for fd in held:
        os.close(fd)
    again = leases.reserve_port(29611, "other")
    assert again is not None
    for fd in again:
        os.close(fd)


def test_sigkill_of_the_holder_releases_its_leases(node_gpus):
    code = ("import sys, time; sys.path.insert(0, %r); from ddpfab.node import leases; leases.LEASE_DIR = %r; "
            "fds, g, _ = leases.take_leases(4, [], 'doomed'); print(g, flush=True); time.sleep(60)"
            % (str(Path(__file__).resolve().parents[2]), str(node_gpus)))
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "['0', '1', '2', '3']"
        assert {s["state"] for s in leases.lease_state()} == {"leased"}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fds, got, _ = leases.take_leases(4, [], "next")
    assert got == ["0", "1", "2", "3"]
    for fd in fds:
        os.close(fd)


def test_a_gpu_used_without_a_lease_is_busy(node_gpus, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    script = STAND_IN.read_text().replace("conf=/etc/ddpfab-stand-in", f"conf={conf}")
    (tmp_path / "bin" / "nvidia-smi").unlink()
    (tmp_path / "bin" / "nvidia-smi").write_text(script)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    (conf / "compute-apps").write_text(f"1 {os.getpid()} other-tool\n")
    fds, got, _ = leases.take_leases(3, [], "r")
    assert got == ["0", "2", "3"]
    states = leases.lease_state()
    assert states[1]["state"] == "busy" and states[1]["procs"] == [{"pid": os.getpid(), "name": "other-tool"}]
    for fd in fds:
        os.close(fd)


def test_the_queue_keeps_gpus_for_the_job_first_in_line():
    """Two of four GPUs free; a 4-GPU job waits first in line: a 1-GPU job behind it gets none
    (no starvation of the large job), one with nobody ahead gets one."""
    states = [{"gpu": str(i), "uuid": f"u{i}", "state": s} for i, s in enumerate(["leased", "leased", "free", "free"])]
    big = {"key": "1", "count": 4, "pin": []}
    assert leases.grantable(states, [big], 1, []) is None
    assert leases.grantable(states, [], 1, []) == ["2", "3"]
    assert leases.grantable(states, [{"key": "1", "count": 0, "pin": ["u2"]}], 1, []) == ["3"]
    assert leases.grantable(states, [], 0, ["0"]) is None


def test_a_ticket_of_a_dead_waiter_leaves_the_queue(node_gpus):
    leases.lease_dir()
    fd, path = leases.make_ticket(leases.ticket_key(100.0, "alive"), {"run_id": "alive", "count": 2})
    dead = node_gpus / f"wait-{leases.ticket_key(50.0, 'dead')}.ticket"
    dead.write_text('{"run_id": "dead", "key": "%s"}' % leases.ticket_key(50.0, "dead"))  # no flock on it
    assert [t["run_id"] for t in leases.tickets()] == ["alive"]
    assert not dead.exists()  # our own user's dead ticket is removed on the way
    leases.drop_ticket(fd, path)
    assert leases.tickets() == []


def _node(name="n1", gpus=None, gpu_ids=None) -> Node:
    return Node(name=name, host=name, gpus=gpus, gpu_ids=gpu_ids)


def test_the_plan_leases_what_the_processes_need():
    opts = RunOptions("t.py")
    assert gpu_lease(_node(), opts, nproc=2, gpus=4) == 2
    assert gpu_lease(_node(), opts, nproc=8, gpus=4) == 4
    assert gpu_lease(_node(), opts, nproc=2, gpus=0) == 0  # a CPU node: nothing to lease
    assert gpu_lease(_node(), RunOptions("t.py", gpus_per_node=3), nproc=1, gpus=4) == 3
    assert gpu_lease(_node(gpu_ids=("1", "3")), opts, nproc=1, gpus=4) == 2
    with pytest.raises(PlanError, match="host n1: gpus_per_node=5, but it has 4 GPUs"):
        gpu_lease(_node(), RunOptions("t.py", gpus_per_node=5), nproc=1, gpus=4)
    with pytest.raises(PlanError, match="ddpfab_gpu_ids pins 2"):
        gpu_lease(_node(gpu_ids=("1", "3")), RunOptions("t.py", gpus_per_node=1), nproc=1, gpus=4)


def test_what_a_node_reports_is_read_as_data_and_a_held_gpu_is_refused_by_name():
    from ddpfab.planning.plan import Facts, make_plan

    cluster = Inventory(nodes=(_node("n1"), _node("n2")), source="inv.yml", group="all")
    plan = make_plan(cluster, RunOptions("t.py", gpus_per_node=2),
                     Facts(addresses={"n1": "10.0.0.1", "n2": "10.0.0.2"}, master_port=29500, cwd="/w",
                           gpus={"n1": 2, "n2": 2}))
    assert [n.gpus for n in plan.nodes] == [2, 2]
    free = {"gpus": [{"gpu": "0", "state": "free"}, {"gpu": "1", "state": "free"}]}
    held = {"gpus": [{"gpu": "0", "state": "leased", "holder": {"run_id": "other", "user": "bob", "pid": 7,
                                                                "since": "\x1b[2Jnot a number"}},
                     {"gpu": "1", "state": "busy", "procs": [{"pid": 9, "name": "tool\x1b]0;x"}, {"pid": "no"}]},
                     {"gpu": "2", "state": "exploded"}, "junk"]}
    assert gpu_leases.refusals(plan, {"n1": free, "n2": free}) == []
    (problem,) = gpu_leases.refusals(plan, {"n1": free, "n2": held})
    assert problem.node == "n2" and problem.check == "gpus_held"
    assert str(problem).startswith("host n2: 2 GPUs wanted, 0 free: GPU 0 leased by run other (user bob, pid 7); "
                                   "GPU 1 busy without a lease: pid 9 (tool\\x1b]0;x)")
    (missing,) = gpu_leases.refusals(plan, {"n1": free, "n2": {"error": "lease dir is a link"}})
    assert str(missing) == "host n2: cannot lease GPUs: lease dir is a link"


def test_the_gate_goes_in_two_phases_and_never_on_a_stale_or_partial_answer():
    """The go is two-phase: a complete set of grants opens a round (``p1;``); ``g`` only when every
    node said ready for that round. A node yielding during the round ends it (``u``), an answer
    to an old round does not count, and nothing is sent after the go."""
    sent: list[bytes] = []
    gate = golib.Gate(["n1", "n2"], sent.append)
    gate.saw("n1", golib.GRANTED + "0,1; waiting for the other nodes")
    gate.saw("n2", "ddpfab-agent: waiting: place 1 in this node's queue")
    assert sent == []
    gate.saw("n2", golib.GRANTED + "2")
    assert sent == [b"p1;"]
    gate.saw("n1", golib.READY + "1")
    gate.saw("n2", golib.YIELDED + "2 to run x, which came first")  # the race: n2 yields as the go would come
    assert sent == [b"p1;", b"u"]
    gate.saw("n2", golib.GRANTED + "2")
    assert sent == [b"p1;", b"u", b"p2;"]
    gate.saw("n2", golib.READY + "1")  # late: round 1 is over
    gate.saw("n1", golib.READY + "1")
    assert sent[-1] == b"p2;"
    gate.saw("n1", golib.READY + "2")
    gate.saw("n2", golib.READY + "2")
    assert sent == [b"p1;", b"u", b"p2;", b"g"]
    gate.saw("n1", golib.YIELDED + "0,1")
    gate.saw("n1", golib.GRANTED + "0,1")
    assert sent[-1] == b"g"  # gone: nothing more


class Waiter:
    """A node's waiting supervisor in its own interpreter (``agent.hold_leases`` with ``--wait``'s
    spec), stdin and stdout as ddpfab's channel, the lines read on a thread."""

    def __init__(self, lease_dir: Path, run_dir: Path, run_id: str, count: int, arrival: float,
                 apps_every: float | None = None):
        code = ("import json, sys; sys.path.insert(0, %r); from ddpfab.node import agent; %s"
                "spec = json.loads(sys.argv[1]); held, gpus = agent.hold_leases(spec, spec['dir'], "
                "open(spec['dir'] + '/output.log', 'ab')); sys.exit(0 if held else agent._recorded_code(spec['dir']))"
                % (str(Path(__file__).resolve().parents[2]),
                   f"agent.WAIT_APPS_S = {apps_every!r}; " if apps_every is not None else ""))
        spec = {"run_id": run_id, "dir": str(run_dir), "gpus": {"count": count}, "wait": {"arrival": arrival}}
        run_dir.mkdir(parents=True)
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(os.environ, DDPFAB_LEASE_DIR=str(lease_dir)))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(b.decode().rstrip()) for b in self.proc.stdout],
                         daemon=True).start()

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def said(self, prefix: str, within: float) -> list[str]:
        """The lines up to the first that starts with *prefix* (an AssertionError if none within)."""
        seen, deadline = [], time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                seen.append(self.lines.get(timeout=0.1))
            except queue.Empty:
                continue
            if seen[-1].startswith(prefix):
                return seen
        raise AssertionError(f"no {prefix!r} within {within} s: {seen}")


def test_a_node_that_said_ready_keeps_its_leases_until_the_go_and_a_go_without_ready_starts_nothing(
        node_gpus, tmp_path):
    """The race of the go, forced: a waiter holding its GPUs says ready for the round; an earlier
    job then queues for them: the waiter keeps them (it promised) until ddpfab ends the round
    (``u``), then yields; a ``g`` arriving after that starts nothing; the next round starts it."""
    waiter = Waiter(node_gpus, tmp_path / "runs" / "late", "late", 4, arrival=200.0)
    try:
        waiter.said(golib.GRANTED, 60)
        waiter.send(b"p1;")
        waiter.said(golib.READY + "1", 20)
        early, path = leases.make_ticket(leases.ticket_key(100.0, "early"), {"run_id": "early", "count": 4})
        time.sleep(1.5)  # 7 polls: a waiter that had not promised yields at the first
        assert {s["state"] for s in leases.lease_state()} == {"leased"}
        assert waiter.lines.empty(), waiter.lines.get()
        waiter.send(b"u")
        waiter.said(golib.YIELDED, 20)
        waiter.send(b"g")  # the go of the round that failed: must not start the job
        time.sleep(1)
        assert waiter.proc.poll() is None and {s["state"] for s in leases.lease_state()} == {"free"}
        leases.drop_ticket(early, path)
        waiter.said(golib.GRANTED, 20)
        waiter.send(b"p2;g")
        waiter.said("ddpfab-agent: leased GPU 0,1,2,3", 20)
        assert waiter.proc.wait(timeout=20) == 0
    finally:
        waiter.proc.kill()
        waiter.proc.wait()


def test_a_wait_cancelled_by_a_signal_records_the_signal_and_by_ddpfab_none(node_gpus, tmp_path):
    """A job queued behind an earlier one is cancelled by a SIGTERM (``ddpfab stop`` from elsewhere):
    its record says cancelled, with ``stop_signal`` 15 as data, so the run that follows it ends as a
    stop, not as a failure of the node. Cancelled by ddpfab (its link closed): no signal."""
    early, path = leases.make_ticket(leases.ticket_key(100.0, "early"), {"run_id": "early", "count": 4})
    try:
        for run_id, end in (("signalled", "term"), ("closed", "eof")):
            run_dir = tmp_path / "runs" / run_id
            waiter = Waiter(node_gpus, run_dir, run_id, 1, arrival=200.0)
            try:
                waiter.said("ddpfab-agent: waiting: place 2", 60)
                if end == "term":
                    waiter.proc.send_signal(signal.SIGTERM)
                else:
                    waiter.proc.stdin.close()
                assert waiter.proc.wait(timeout=20) == 143
            finally:
                waiter.proc.kill()
                waiter.proc.wait()
            record = json.loads((run_dir / "result.json").read_text())
            assert record["cancelled"] is True and record["failed_at"] is None, record
            assert record["stop_signal"] == (15 if end == "term" else None), record
    finally:
        leases.drop_ticket(early, path)


def test_a_waiting_job_asks_nvidia_smi_every_few_seconds_not_at_every_poll(node_gpus, tmp_path):
    """Each ask is a run of nvidia-smi (a program start and a driver query, and every waiting job
    on the node asks): a job waiting 3 s behind a holder asks which processes use
    the GPUs about every WAIT_APPS_S and the GPU list not at all (it asked both at each 0.2 s
    poll: 15 + 15 runs), and still takes the GPUs as soon as the holder lets them go."""
    from ddpfab.node.agent import WAIT_APPS_S

    asked = tmp_path / "asked"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.unlink()
    smi.write_text(f'#!/bin/sh\necho "$1" >> {asked}\nexec {STAND_IN} "$@"\n')
    smi.chmod(0o755)
    fds, _, _ = leases.take_leases(4, [], "holder")
    waiter = Waiter(node_gpus, tmp_path / "runs" / "behind", "behind", 2, arrival=100.0)
    try:
        waiter.said("ddpfab-agent: waiting: place 1", 60)
        asked.write_text("")
        time.sleep(3.0)
        during = asked.read_text().split()
        for fd in fds:
            os.close(fd)
        waiter.said(golib.GRANTED + "0,1", 20)
    finally:
        waiter.proc.kill()
        waiter.proc.wait()
    assert during.count("--query-gpu=index,uuid") == 0, during
    assert 1 <= during.count("--query-compute-apps=gpu_uuid,pid,process_name") <= 3.0 / WAIT_APPS_S + 1, during


def test_a_release_is_seen_at_once_though_nvidia_smi_listed_the_holders_processes(node_gpus, tmp_path):
    """nvidia-smi lists a holder's job processes on its GPUs (its own: no foreign use while it
    holds them). A waiter that asked nvidia-smi before the holder ended must not take those
    processes, gone with the release, for use without a lease: it asks again at the release and
    takes GPUs 0 and 1 (with the earlier answer kept, it said "GPU 0 busy without a lease" and
    took 2 and 3)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.unlink()
    smi.write_text(STAND_IN.read_text().replace("conf=/etc/ddpfab-stand-in", f"conf={conf}"))
    smi.chmod(0o755)
    fds, _, _ = leases.take_leases(4, [], "holder")  # this process holds them; its job is `sleep`
    job = subprocess.Popen(["sleep", "60"])
    (conf / "compute-apps").write_text("".join(f"{g} {job.pid} python\n" for g in range(4)))
    waiter = Waiter(node_gpus, tmp_path / "runs" / "next", "next", 2, arrival=100.0, apps_every=60.0)
    try:
        waiter.said("ddpfab-agent: waiting: place 1", 60)
        time.sleep(0.5)  # a few polls with nvidia-smi's answer kept
        job.kill()
        job.wait()
        (conf / "compute-apps").write_text("")  # the driver lists no process of a job that ended
        for fd in fds:
            os.close(fd)
        lines = waiter.said(golib.GRANTED, 20)
    finally:
        job.kill()
        waiter.proc.kill()
        waiter.proc.wait()
    assert lines[-1].startswith(golib.GRANTED + "0,1;"), lines
    assert not any("without a lease" in ln for ln in lines), lines


def test_a_waiter_cancelled_by_a_signal_leaves_a_record_ps_shows(node_gpus, tmp_path):
    """ddpfab stop TERMs a waiting supervisor: it leaves its queue and records "cancelled while
    waiting" (exit 143) instead of dying without a result; the node's ps says cancelled."""
    held, _, _ = leases.take_leases(4, [], "holder")
    runs = tmp_path / "runs"
    waiter = Waiter(node_gpus, runs / "waiter", "waiter", 2, arrival=100.0)
    try:
        (runs / "waiter" / "agent.json").write_text(json.dumps({"agent_pid": waiter.proc.pid, "started": 1.0}))
        waiter.said("ddpfab-agent: waiting: place 1", 60)
        waiter.proc.send_signal(signal.SIGTERM)
        assert waiter.proc.wait(timeout=20) == 143
    finally:
        waiter.proc.kill()
        for fd in held:
            os.close(fd)
    record = json.loads((runs / "waiter" / "result.json").read_text())
    assert record["cancelled"] is True and record["exit_code"] == 143
    assert record["stopped"] == "cancelled while waiting for GPUs (signal 15)"
    assert leases.tickets() == []
    (run,) = ops.op_ps({"root": str(runs)}, None)["runs"]
    assert (run["state"], run["exit_code"]) == ("cancelled", 143)


def test_the_dry_run_shows_each_nodes_lease_request_and_refuses_a_bad_one(tmp_path, monkeypatch, capsys):
    from ddpfab import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    (tmp_path / "inv.yml").write_text("all:\n  hosts:\n    n1: {ansible_host: 10.0.0.1, ddpfab_gpus: 4}\n"
                                      "    n2: {ansible_host: 10.0.0.2, ddpfab_gpus: 4, ddpfab_gpu_ids: [1, 3]}\n")
    assert cli.main(["plan", "--offline", "-i", "inv.yml", "--wait", "t.py"]) == 0
    assert "# GPU leases: n1 4, n2 2 (pinned 1,3); waits for them (--wait)\n" in capsys.readouterr().out
    assert cli.main(["plan", "--offline", "-i", "inv.yml", "--gpus-per-node", "3", "t.py"]) == 2
    assert "host n2: --gpus-per-node 3 but ddpfab_gpu_ids pins 2 (1,3)" in capsys.readouterr().err
    assert cli.main(["run", "-i", "inv.yml", "--wait", "--detach", "--dry-run", "t.py"]) == 2
    assert "--wait with --detach" in capsys.readouterr().err
