"""ddpfab.dist, the helper module for training scripts: env validation, backend and device choice.

There is no GPU on the test machine: CUDA availability and device counts are passed in (or
``torch.cuda`` is patched), never detected, in the backend and device tests below. One test starts
a real single-process gloo group (file:// init in a temp dir) to exercise init and the gathers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from ddpfab import dist as ddist

FULL = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_full_env_is_read():
    env = ddist.read_env(FULL, argv=[])
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 1, 2, 1)
    assert (env.master_addr, env.master_port, env.init_method) == ("10.0.0.1", 29500, "env://")
    assert not env.is_main


def test_plain_python_gets_one_error_listing_everything_missing():
    with pytest.raises(ddist.DistEnvError) as err:
        ddist.read_env({}, argv=[])
    text = str(err.value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        assert key in text
    assert "ddpfab run" in text and "torchrun" in text and "env://" in text


def test_only_what_is_missing_is_named():
    env = {k: v for k, v in FULL.items() if k not in ("MASTER_PORT", "WORLD_SIZE")}
    with pytest.raises(ddist.DistEnvError, match=r"variables WORLD_SIZE, MASTER_PORT \(init method env://\)"):
        ddist.read_env(env, argv=[])


def test_tcp_and_file_init_do_not_need_master_vars():
    base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    tcp = ddist.read_env({**base, "DDPFAB_INIT_METHOD": "tcp://10.0.0.1:29501"}, argv=[])
    assert tcp.init_method == "tcp://10.0.0.1:29501" and tcp.master_addr is None
    f = ddist.read_env({**base, "DDPFAB_INIT_METHOD": "file:///shared/ddpfab-r.init"}, argv=[])
    assert f.init_method == "file:///shared/ddpfab-r.init"
    with pytest.raises(ddist.DistEnvError, match="missing environment variable RANK"):
        ddist.read_env({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "DDPFAB_INIT_METHOD": "tcp://h:1"}, argv=[])


@pytest.mark.parametrize("env, message", [
    ({**FULL, "RANK": "x"}, "RANK='x' is not an integer"),
    ({**FULL, "RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
    ({**FULL, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({**FULL, "MASTER_PORT": "70000"}, "not a TCP port"),
    ({**FULL, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
    ({**FULL, "DDPFAB_INIT_METHOD": "nfs://x"}, "expected env://, tcp://HOST:PORT or file:///path"),
    ({**FULL, "DDPFAB_INIT_METHOD": "tcp://nohostport"}, "must be tcp://HOST:PORT"),
    ({**FULL, "DDPFAB_INIT_METHOD": "file://relative/f"}, "absolute path"),
])
def test_bad_values_are_named(env, message):
    with pytest.raises(ddist.DistEnvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ddist.read_env(env, argv=[])


def test_legacy_local_rank_argument():
    env = {k: v for k, v in FULL.items() if k != "LOCAL_RANK"}
    assert ddist.read_env(env, argv=["--local-rank=1", "--epochs", "2"]).local_rank == 1
    assert ddist.read_env(env, argv=["--local_rank", "0"]).local_rank == 0
    assert ddist.read_env(FULL, argv=["--local-rank=1"]).local_rank == 1
    with pytest.raises(ddist.DistEnvError, match="disagrees with LOCAL_RANK=1"):
        ddist.read_env(FULL, argv=["--local-rank=0"])
    with pytest.raises(ddist.DistEnvError, match="must be an integer"):
        ddist.read_env(env, argv=["--local-rank=abc"])


# -- backend and device: CUDA availability is mocked (no GPU on this machine) ---------------------
def test_backend_follows_cuda_availability():
    assert ddist.pick_backend(cuda_available=True) == "nccl"
    assert ddist.pick_backend(cuda_available=False) == "gloo"
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert ddist.pick_backend() == "nccl"
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert ddist.pick_backend() == "gloo"


def test_device_is_the_local_rank_gpu_or_the_cpu():
    import torch

    assert ddist.pick_device(3, cuda_available=True, device_count=8) == torch.device("cuda", 3)
    assert ddist.pick_device(3, cuda_available=False) == torch.device("cpu")
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=2):
        assert ddist.pick_device(1) == torch.device("cuda", 1)


def test_more_ranks_than_gpus_is_a_clear_error():
    with pytest.raises(ddist.DistEnvError, match="LOCAL_RANK=2 but this node has 2 visible GPUs.*nproc-per-node"):
        ddist.pick_device(2, cuda_available=True, device_count=2)


def test_init_sets_the_device_and_passes_rank_for_tcp(monkeypatch):
    """init() on a 'GPU node' (mocked): nccl, cuda:<local rank> set, rank/world_size passed for tcp://."""
    import torch
    import torch.distributed as dist

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    env = ddist.init(environ={"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                              "DDPFAB_INIT_METHOD": "tcp://10.0.0.1:29400"}, argv=[], timeout_s=42)
    assert env.backend == "nccl" and calls["device"] == torch.device("cuda", 1) == env.device
    kw = calls["init"]
    assert (kw["backend"], kw["init_method"], kw["rank"], kw["world_size"]) == ("nccl", "tcp://10.0.0.1:29400", 5, 8)
    assert kw["timeout"].total_seconds() == 42


def test_env_init_leaves_rank_to_the_env(monkeypatch):
    import torch
    import torch.distributed as dist

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    env = ddist.init(environ=FULL, argv=[])
    assert env.backend == "gloo" and env.device == torch.device("cpu")
    assert calls["init"]["init_method"] == "env://" and "rank" not in calls["init"]


def test_file_init_url_per_restart():
    env = ddist.read_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2",
                          "DDPFAB_INIT_METHOD": "file:///s/ddpfab-r.init"}, argv=[])
    assert ddist.init_url(env) == "file:///s/ddpfab-r.init.restart2"


def test_real_single_process_group_gathers(tmp_path, monkeypatch, capsys):
    """A real gloo group of one (file:// init, no network): init, gathers, print0, cleanup."""
    import torch

    monkeypatch.setenv("RANK", "0")
    env = ddist.init(environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                              "DDPFAB_INIT_METHOD": f"file://{tmp_path}/init"}, argv=[], timeout_s=30)
    try:
        assert env.backend == "gloo"
        assert [t.tolist() for t in ddist.all_gather(torch.tensor([7, 8]))] == [[7, 8]]
        assert ddist.all_gather_object({"host": "me"}) == [{"host": "me"}]
        assert ddist.broadcast_object("x") == "x"
        ddist.print0("only on rank 0")
        assert capsys.readouterr().out == "only on rank 0\n"
    finally:
        ddist.cleanup()
        ddist.cleanup()  # twice is fine


def test_object_collectives_name_numpy_when_it_is_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_numpy(name, *a, **kw):
        if name == "numpy":
            raise ImportError("no numpy")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_numpy)
    with pytest.raises(RuntimeError, match="need numpy.*pip install numpy"):
        ddist.all_gather_object(1)


def test_print0_is_silent_on_other_ranks(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    ddist.print0("hidden")
    assert capsys.readouterr().out == ""


def test_detail_debug_is_lowered_on_gloo_so_ddp_does_not_crash(tmp_path):
    """torch 2.13 segfaults in the DDP constructor on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL
    (c10d::Logger::set_env_variables); init() lowers it to INFO and says so. In a fresh interpreter:
    a regression would be a SIGSEGV, and this process has ansible loaded (it patches sys.intern,
    which torch._dynamo, imported by DDP, rejects)."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from ddpfab import dist as ddist\n"
        "ddist.init(timeout_s=30)\n"
        "assert dist.get_debug_level() == dist.DebugLevel.INFO, dist.get_debug_level()\n"
        "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
        "ddist.cleanup()\n"
        "print('DDP OK')\n")
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "DDPFAB_INIT_METHOD": f"file://{tmp_path}/init"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0 and "DDP OK" in res.stdout, (res.returncode, res.stderr[-2000:])
    assert "lowered to INFO" in res.stderr


def test_finish_exits_like_sys_exit_but_skips_the_teardown(tmp_path):
    """finish(): the group is destroyed, non-daemon threads joined, atexit handlers run, buffered
    output flushed, the status passed on; and nothing of the interpreter's teardown runs (a
    finalizer that would print during module teardown stays silent)."""
    code = (
        "import atexit, sys, threading, time\n"
        "import torch.distributed as dist\n"
        "from ddpfab import dist as ddist\n"
        "ddist.init(timeout_s=30)\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "class Teardown:\n"
        "    def __del__(self): print('TEARDOWN RAN', flush=True)\n"
        "keep = Teardown()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "ddist.finish(7)\n"
        "print('NOT REACHED')\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "DDPFAB_INIT_METHOD": f"file://{tmp_path}/init"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 7, (res.returncode, res.stderr[-2000:])
    assert res.stdout.index("thread done") < res.stdout.index("atexit ran")
    assert "buffered, no newline" in res.stdout
    assert "NOT REACHED" not in res.stdout and "TEARDOWN RAN" not in res.stdout


# --- checkpoints and restarts -------------------------------------------------------------------

def test_restart_count_and_lineage():
    assert ddist.restart_count({}) == 0
    assert ddist.restart_count({"DDPFAB_RESTART_COUNT": "2"}) == 2
    with pytest.raises(ddist.DistEnvError, match="DDPFAB_RESTART_COUNT='x'"):
        ddist.restart_count({"DDPFAB_RESTART_COUNT": "x"})
    assert ddist.run_lineage({"DDPFAB_RUN_LINEAGE": "R,R-r1", "DDPFAB_RUN_ID": "R-r1"}) == ["R", "R-r1"]
    assert ddist.run_lineage({"DDPFAB_RUN_ID": "R"}) == ["R"]


def test_save_finds_latest_and_prunes_only_its_own_files(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("RANK", "0")
    (tmp_path / "user-notes.txt").write_text("mine")
    (tmp_path / "ddpfab-ckpt-x.pt").write_text("not a checkpoint name of ours")
    for step in range(5):
        assert ddist.save_checkpoint({"w": torch.tensor([float(step)])}, tmp_path, step, keep=2)
    assert [s for s, _ in ddist.checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ddpfab-ckpt-000000003.pt", "ddpfab-ckpt-000000004.pt", "ddpfab-ckpt-x.pt", "user-notes.txt"]
    step, state = ddist.resume(tmp_path)  # no process group: what this process sees
    assert step == 4 and state["w"].item() == 4.0
    assert ddist.resume(tmp_path / "none") is None


def test_only_the_writer_rank_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ddist.save_checkpoint({"a": 1}, tmp_path, 0) is None  # shared: rank 0 only
    assert ddist.save_checkpoint({"a": 1}, tmp_path, 0, shared=False)  # node-local: local rank 0 of each node
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ddist.save_checkpoint({"a": 1}, tmp_path, 1, shared=False) is None


RESUME_WORKER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ddpfab import dist as ddist
import torch
env = ddist.init(timeout_s=60)
found = ddist.resume(os.environ["CKPT"])
print(json.dumps({"rank": env.rank, "step": found[0] if found else None,
                  "w": found[1]["w"].tolist() if found else None}))
ddist.cleanup()
"""


@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_resume_hands_the_newest_checkpoint_to_a_rank_that_has_none(tmp_path, method):
    """Two real gloo processes on loopback: rank 0 sees steps 3 and 7 in its dir, rank 1 (a spare
    that just joined) sees none; both resume at step 7 with rank 0's state, under every init method."""
    import socket

    import torch

    dirs = [tmp_path / "r0", tmp_path / "r1"]
    dirs[0].mkdir()
    dirs[1].mkdir()
    for step in (3, 7):
        torch.save({"w": torch.tensor([step * 1.5])}, ddist.checkpoint_path(dirs[0], step))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = {"env": None, "tcp": f"tcp://127.0.0.1:{port}", "file": f"file://{tmp_path}/init"}[method]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "CKPT": str(dirs[rank])}
        if init:
            env["DDPFAB_INIT_METHOD"] = init
        procs.append(subprocess.Popen([sys.executable, "-c", RESUME_WORKER, str(ddist.__file__).rsplit("/ddpfab/", 1)[0]],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert got == [{"rank": 0, "step": 7, "w": [10.5]}, {"rank": 1, "step": 7, "w": [10.5]}]
