"""Known failure signatures in node output become one hint in the run's output and manifest."""

from __future__ import annotations

from types import SimpleNamespace

from ddpfab.cli import run as run_cli
from ddpfab.health import hints
from ddpfab.launch import execute as launch
from ddpfab.optionnames import spelled_by


def test_the_gloo_exit_abort_line_gets_the_known_cause_and_the_fix():
    line = "[default1]:terminate called without an active exception"
    sig = hints.signature_of(line)
    assert sig is not None
    assert "190489" in sig.hint and "exit_guard='on'" in sig.hint and "ddist.finish()" in sig.hint
    assert hints.signature_of("terminate called after throwing an instance of 'c10::Error'") is None
    assert hints.signature_of("step 3 mean loss 0.1") is None


def test_a_hint_names_options_as_its_reader_spells_them_when_it_is_read():
    sig, loopback = hints.signature_of(hints.EXIT_ABORT_LINE), hints.signature_of("Using the loopback address as fallback")
    assert sig is not None and loopback is not None
    assert "socket_ifname='auto'" in loopback.hint and hints.exit_abort_hint() == sig.hint
    with spelled_by(run_cli.flag):  # the command line's flags, for the same signatures
        assert "(--exit-guard on, the default)" in sig.hint and "--exit-guard on" in hints.exit_abort_hint()
        assert "Fix: --socket-ifname auto (or GLOO_SOCKET_IFNAME=IFACE)" in loopback.hint


def test_a_node_job_records_each_hint_once():
    job = launch._NodeJob.__new__(launch._NodeJob)  # only its line handling: no connection needed
    job.node = SimpleNamespace(name="node1")
    job.outcome = launch.NodeOutcome("node1", 0)
    lines = []
    job.printer = SimpleNamespace(line=lambda node, text, *fold: lines.append((node, text)))
    for text in ("rank 0 done", f"[default0]:{hints.EXIT_ABORT_LINE}", f"[default1]:{hints.EXIT_ABORT_LINE}"):
        job._line(text)
    assert job.outcome.lines == 3 and len(lines) == 3
    assert job.outcome.hints == [hints.exit_abort_hint()]
    assert job.outcome.to_dict()["hints"] == [hints.exit_abort_hint()]


# Each signature, in the text torch / gloo / NCCL print it (torch 2.x), as it reaches ddpfab through
# torchrun's --tee tag and torch.distributed's [rankN] prefix.
UPSTREAM = {
    "gloo_loopback": [
        "[default0]:[W1201 15:57:52.851626551 ProcessGroupGloo.cpp:516] Warning: Unable to resolve hostname to a "
        "(local) address. Using the loopback address as fallback. Manually set the network interface to bind to "
        "with GLOO_SOCKET_IFNAME. (function operator())"],
    "nccl_connect": [
        "[default1]:node2:2045:2101 [1] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.12<0>",  # not a failure
        "[default1]:node2:2045:2101 [1] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to "
        "10.0.0.11<40229> failed : Software caused connection abort",
        "[default0]:[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
        "NCCLUtils.cpp:77, remote process exited or there was a network error, NCCL version 2.21.5",
        "[default0]:[rank0]: ncclRemoteError: A call failed possibly due to a network error or a remote process "
        "exiting prematurely."],
    "collective_timeout": [
        "[default1]:[rank1]:[E1201 16:02:11.123456789 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, "
        "Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
        "[default0]:[rank2]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete"],
    "cuda_oom": [
        "[default3]:[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a "
        "total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
        "78.08 GiB memory in use.",
        "[default0]:RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"],
    "dataloader_bus_error": [
        "[default0]:ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared "
        "memory (shm).",
        "[default0]:[rank0]: RuntimeError: DataLoader worker (pid 4711) is killed by signal: Bus error. It is "
        "possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit."],
    "exit_abort": ["[default1]:terminate called without an active exception"],
    "module_not_found": ["[default0]:/opt/ddpfab/venv/bin/python3: No module named nosuchpkg",
                         "[default0]:/usr/bin/python3.11: Error while finding module specification for 'a.b' "
                         "(ModuleNotFoundError: No module named 'a')"],
}


def test_each_known_signature_is_recognised_in_upstream_text():
    for key, lines in UPSTREAM.items():
        found = [hints.signature_of(line) for line in lines]
        wanted = [s for s in found if s is not None]
        assert wanted and all(s.key == key for s in wanted), (key, [s and s.key for s in found])
    # the NCCL INFO line before the failure is not one
    assert hints.signature_of(UPSTREAM["nccl_connect"][0]) is None
    assert sorted(UPSTREAM) == sorted(s.key for s in hints.SIGNATURES)


def test_ordinary_lines_and_near_misses_match_no_signature():
    for line in ("[default0]:Epoch 3 | loss 0.12", "[default0]:torch.cuda.memory_allocated() = 1.2 GiB",
                 "[default0]:NCCL INFO Connected all rings", "[default1]:the DataLoader has 4 workers",
                 "[default0]:timed out waiting for the user", "[default0]:I use the loopback address on purpose"):
        assert hints.signature_of(line) is None, line


def test_a_failed_run_names_each_signature_with_its_nodes():
    outcomes = {}
    for i, (name, lines) in enumerate((("node1", ["[default0]:step 9"]),
                                      ("node2", UPSTREAM["dataloader_bus_error"] + UPSTREAM["cuda_oom"]),
                                      ("node3", UPSTREAM["cuda_oom"][:1]))):
        job = launch._NodeJob.__new__(launch._NodeJob)
        job.node = SimpleNamespace(name=name, node_rank=i)
        job.outcome = launch.NodeOutcome(name, i)
        job.printer = SimpleNamespace(line=lambda node, text, *fold: None)
        for line in lines:
            job._line(line)
        outcomes[name] = job.outcome
    assert [s.key for s in outcomes["node2"].signatures] == ["dataloader_bus_error", "cuda_oom"]
    assert outcomes["node2"].to_dict()["signatures"] == ["dataloader_bus_error", "cuda_oom"]
    found = [(n, s) for n, o in outcomes.items() for s in o.signatures]
    lines = hints.verdict_lines(found)
    assert lines[0].startswith("seen on node2: a DataLoader worker killed by a bus error")
    assert lines[1].startswith("seen on node2, node3: CUDA out of memory")
    assert len(lines) == 2
