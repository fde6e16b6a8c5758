"""The node side of ``ddpfab check --perf``: a short benchmark that torchrun runs on every node.

``ddpfab check --perf`` ships this file and :mod:`ddpfab.dist` (as ``dist.py``, next to it) into a
private run dir on each node and starts it with the same launcher path as a real job (torchrun,
nccl on GPU nodes, gloo on CPU nodes). It needs the standard library and torch only (the torch
wheel has no numpy, so no object collectives), and imports nothing else from ddpfab.

Phases, all nodes at once, separated by barriers so one phase never disturbs another:

1. compute: a matmul loop on every GPU (bf16), or on the CPU of a CPU node (local rank 0, float32,
   all its threads). Timed in windows longer than a CFS period (100 ms), so a CPU quota shows
   as the fraction it really grants; the best of a few windows is kept (another process's burst
   on a shared host lowers one window, not all).
2. host memory bandwidth: a tensor copy in host memory on local rank 0 (bytes read + written).
3. links, in rounds given by the controller: each round is a set of disjoint node pairs (a
   matching, so no node is in two transfers at once), all of them ``passes`` times (a link's best
   pass counts). Each pair's local rank 0 processes measure latency (ping-pong of one element,
   the fastest round trip / 2) and bandwidth (both
   directions at once, message sizes growing x4 until the pair's transfer takes longer than
   ``step_s``; each pair stops on its own, so a throttled pair neither stretches the round nor
   cuts the other pairs' sizes short).
4. all_reduce of the whole set at a few sizes (every rank): time, algorithm and bus bandwidth; a
   size the previous one predicts to take longer than ``allreduce_cap_s`` is skipped.

Every node's local rank 0 prints one line ``DDPFAB_PERF {json}`` with its figures; the controller
(:mod:`ddpfab.launch.perfcheck`) reads those lines from the job's output. A budget (``budget_s``) bounds the
link rounds: past it the remaining rounds are skipped (and reported as skipped).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import dist as ddist  # the shipped copy of ddpfab/dist.py, next to this file
import torch
import torch.distributed as tdist

MARKER = "DDPFAB_PERF "


def timed_windows(work, sync, window_s: float, samples: int) -> list[tuple[int, float]]:
    """Run ``work()`` repeatedly for *samples* windows of at least *window_s* seconds each.

    Returns (iterations, seconds) per window. ``sync`` waits for queued device work (CUDA)."""
    out = []
    for _ in range(samples):
        sync()
        start = time.perf_counter()
        n = 0
        while True:
            work()
            n += 1
            if n % 4 == 0 or n < 4:
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= window_s:
                    break
        out.append((n, elapsed))
    return out


def compute_bench(device: torch.device, window_s: float, samples: int) -> dict:
    """Matmul throughput in GFLOP/s: best window and all windows."""
    if device.type == "cuda":
        size, dtype = 4096, torch.bfloat16
        sync = torch.cuda.synchronize
    else:
        size, dtype = 512, torch.float32
        sync = lambda: None  # noqa: E731 - CPU ops are synchronous
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=c)  # warm-up: kernels, thread pool
    sync()
    flop = 2.0 * size ** 3
    windows = timed_windows(lambda: torch.matmul(a, b, out=c), sync, window_s, samples)
    rates = [n * flop / t / 1e9 for n, t in windows]
    return {"gflops": max(rates), "windows": [round(r, 2) for r in rates], "size": size,
            "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads()}


def memory_bench(window_s: float, samples: int, nbytes: int) -> dict:
    """Host memory bandwidth in GB/s of a tensor copy (bytes read + bytes written)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    windows = timed_windows(lambda: dst.copy_(src), lambda: None, window_s, samples)
    rates = [2 * nbytes * n / t / 1e9 for n, t in windows]
    return {"gbs": max(rates), "windows": [round(r, 3) for r in rates], "bytes": nbytes}


class Runner:
    def __init__(self, env, cfg: dict):
        self.env, self.cfg = env, cfg
        self.device = env.device
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        self.local_rank = env.local_rank
        self.node_rank = env.node_rank if env.node_rank is not None else int(os.environ.get("GROUP_RANK", 0))
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.started = time.perf_counter()
        # who is who: every rank's (node rank, local rank); the node's local rank 0 is its leader
        mine = torch.tensor([self.node_rank, self.local_rank], dtype=torch.int64, device=self.device)
        table = [torch.zeros_like(mine) for _ in range(self.world)]
        tdist.all_gather(table, mine)
        self.node_of = [int(t[0]) for t in table]
        self.leaders = {int(t[0]): r for r, t in enumerate(table) if int(t[1]) == 0}
        self.nodes = len(self.leaders)

    def agree_max(self, *values: float) -> list[float]:
        """The maximum of each value over all ranks (a tiny all_reduce every rank joins)."""
        t = torch.tensor(values, dtype=torch.float64 if self.device.type == "cpu" else torch.float32,
                         device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return [float(x) for x in t.cpu()]

    def gather_floats(self, value: float) -> list[float]:
        t = torch.tensor([value], dtype=torch.float32, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        tdist.all_gather(out, t)
        return [float(x[0]) for x in out]

    # -- links -------------------------------------------------------------------------------
    def latency(self, peer_rank: int, initiator: bool, reps: int) -> float:
        """One-way latency in microseconds: the fastest ping-pong round trip / 2 (scheduling delays on
        a busy host only ever add to a round trip, so the minimum is the link's own figure)."""
        box = torch.zeros(1, device=self.device)
        rtts = []
        for i in range(reps + 2):
            self.sync()
            start = time.perf_counter()
            if initiator:
                tdist.send(box, peer_rank)
                tdist.recv(box, peer_rank)
            else:
                tdist.recv(box, peer_rank)
                tdist.send(box, peer_rank)
            self.sync()
            if i >= 2:  # the first two set up the connection
                rtts.append(time.perf_counter() - start)
        return min(rtts) / 2 * 1e6

    def exchange(self, peer_rank: int, send: torch.Tensor, recv: torch.Tensor) -> float:
        """Both directions at once; seconds until this side has sent and received."""
        self.sync()
        start = time.perf_counter()
        ops = [tdist.P2POp(tdist.isend, send, peer_rank), tdist.P2POp(tdist.irecv, recv, peer_rank)]
        for req in tdist.batch_isend_irecv(ops):
            req.wait()
        self.sync()
        return time.perf_counter() - start

    def link_round(self, pairs: list[list[int]]) -> dict | None:
        """One round of disjoint pairs, each pair on its own: the message grows x4 until the pair's
        slower end took ``step_s`` for a size, so a throttled pair stops early without cutting the
        other pairs of the round short. Returns this node's figures (a leader in a pair) or None;
        the next all-rank collective ends the round for everyone."""
        cfg = self.cfg
        peer = next((b if self.node_rank == a else a for a, b in pairs if self.node_rank in (a, b)), None)
        if self.local_rank != 0 or peer is None:
            return None
        peer_rank = self.leaders[peer]
        result = {"peer": peer, "lat_us": round(self.latency(peer_rank, self.node_rank < peer, cfg["latency_reps"]), 1),
                  "steps": []}
        limit = cfg["max_bytes_gpu" if self.device.type == "cuda" else "max_bytes"]
        big = torch.empty(limit // 4, dtype=torch.float32, device=self.device)
        big_in = torch.empty_like(big)
        mine = torch.zeros(1, dtype=torch.float32, device=self.device)
        theirs = torch.zeros_like(mine)
        size = cfg["min_bytes"]
        while True:
            n = size // 4
            best = min(self.exchange(peer_rank, big[:n], big_in[:n]) for _ in range(cfg["step_reps"]))
            result["steps"].append({"bytes": size, "s": round(best, 6), "gbs": round(size / best / 1e9, 4)})
            mine[0] = best * cfg["step_reps"]
            self.exchange(peer_rank, mine, theirs)  # both ends stop at the same size
            if max(float(mine[0]), float(theirs[0])) >= cfg["step_s"] or size * 4 > limit:
                break
            size *= 4
        result["gbs"] = max(s["gbs"] for s in result["steps"])
        return result

    # -- all_reduce ----------------------------------------------------------------------------
    def all_reduce(self, nbytes: int) -> dict:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        tdist.all_reduce(t)  # warm-up (and connection setup for this size's algorithm)
        self.sync()
        start = time.perf_counter()
        tdist.all_reduce(t)
        self.sync()
        first, = self.agree_max(time.perf_counter() - start)
        reps = int(max(1, min(self.cfg["allreduce_max_reps"], self.cfg["step_s"] / max(first, 1e-6))))
        self.sync()
        start = time.perf_counter()
        for _ in range(reps):
            tdist.all_reduce(t)
        self.sync()
        each, = self.agree_max((time.perf_counter() - start) / reps)
        size = t.numel() * 4
        algbw = size / each / 1e9
        return {"bytes": size, "s": round(each, 6), "reps": reps, "algbw_gbs": round(algbw, 4),
                "busbw_gbs": round(algbw * 2 * (self.world - 1) / self.world, 4) if self.world > 1 else None}

    # -- everything -----------------------------------------------------------------------------
    def run(self) -> dict:
        """Every phase in order, barriers between them (so one never disturbs another); returns
        this node's report (complete on its local rank 0, the one that prints it)."""
        cfg = self.cfg
        is_gpu = self.device.type == "cuda"
        report: dict = {"node_rank": self.node_rank, "hostname": socket.gethostname(), "backend": self.env.backend,
                        "device": torch.cuda.get_device_name(self.device) if is_gpu else "cpu",
                        "world_size": self.world, "nproc": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
        tdist.barrier()
        self.compute_phase(report, is_gpu)
        tdist.barrier()
        if self.local_rank == 0:
            report["memory"] = memory_bench(cfg["window_s"], cfg["samples"], cfg["mem_bytes"])
        tdist.barrier()
        report["links"], report["rounds_skipped"] = self.link_phase()
        tdist.barrier()
        self.all_reduce_phase(report, report["links"], is_gpu)
        report["seconds"] = round(time.perf_counter() - self.started, 3)
        return report

    def compute_phase(self, report: dict, is_gpu: bool) -> None:
        """The compute figures into *report* (on local rank 0): every GPU, or the CPU once per node
        (local rank 0 with all its threads); every rank joins the gather of the per-GPU figures."""
        gflops = 0.0
        if is_gpu or self.local_rank == 0:
            comp = compute_bench(self.device, self.cfg["window_s"], self.cfg["samples"])
            gflops = comp["gflops"]
            if self.local_rank == 0:
                report["compute"] = comp
        per_rank = self.gather_floats(gflops)
        if self.local_rank == 0:  # one figure per GPU of this node (its ranks, in rank order)
            report["compute"]["per_device"] = ([round(g, 2) for r, g in enumerate(per_rank)
                                                if self.node_of[r] == self.node_rank] if is_gpu else
                                               [round(gflops, 2)])

    def link_phase(self) -> tuple[list[dict], int]:
        """(this node's links, the rounds skipped): every round once per pass until the budget runs
        out, every rank agreeing when it has."""
        cfg = self.cfg
        # every round once per pass; a link's figure is its best pass (a load burst on a shared
        # host slows one pass, a bad NIC or cable every pass)
        best: dict[int, dict] = {}
        skipped, total = 0, len(cfg["rounds"]) * cfg["passes"]
        for i in range(total):
            over, = self.agree_max(float(time.perf_counter() - self.started > cfg["budget_s"]))
            if over:
                skipped = total - i
                break
            got = self.link_round(cfg["rounds"][i % len(cfg["rounds"])])
            if got is None:
                continue
            got["round"] = i
            prev = best.get(got["peer"])
            if prev is None:
                best[got["peer"]] = got
            else:
                prev["passes"] = prev.get("passes", 1) + 1
                prev["gbs"] = max(prev["gbs"], got["gbs"])
                prev["lat_us"] = min(prev["lat_us"], got["lat_us"])
        return list(best.values()), skipped

    def all_reduce_phase(self, report: dict, links: list[dict], is_gpu: bool) -> None:
        """The all_reduce figures into *report*: each size in turn (every rank), skipping a size the
        slowest link of the whole set (from *links*, agreed over all ranks) would take too long for."""
        cfg = self.cfg
        sizes = cfg["allreduce_sizes_gpu" if is_gpu else "allreduce_sizes"]
        # a ring all_reduce sends 2(n-1)/n of the message over its slowest link: a size that would
        # take longer than the cap there is skipped (over a throttled link 16 MiB takes seconds a
        # repetition, and the verdict is in already)
        mine = min((ln["gbs"] for ln in links), default=0.0)
        inverse, = self.agree_max(1.0 / mine if mine > 0 else 0.0)
        report["all_reduce"], report["all_reduce_skipped"] = [], []
        for size in sizes if self.world > 1 else ():  # one rank alone: an all_reduce moves nothing
            if inverse and 2 * size / 1e9 * inverse > cfg["allreduce_cap_s"]:
                report["all_reduce_skipped"].append(size)
            else:
                report["all_reduce"].append(self.all_reduce(size))


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    env = ddist.init(timeout_s=float(cfg.get("timeout_s", 120)))
    report = Runner(env, cfg).run()
    if env.local_rank == 0:
        sys.stdout.write(MARKER + json.dumps(report, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    ddist.finish(0)  # cleanup, then exit without the teardown where gloo can abort a finished rank


if __name__ == "__main__":
    sys.exit(main(sys.argv))
