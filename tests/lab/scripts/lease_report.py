"""Test payload for GPU leases: each rank reports its node, run and CUDA_VISIBLE_DEVICES (set by its
node's supervisor from the job's lease), holds for LEASE_HOLD seconds, and reports when it started
and ended holding, after a real all_reduce over the job's own ranks (a stray rank of another job
would change the sum or the world size).

With LEASE_MEET=N a rank first waits (up to 300 s) until its node shows N GPUs leased, and reports
that table: the proof that N jobs held their leases at the same moment, without depending on how
fast a loaded machine starts them. It then marks its job's record on the node as met and holds
until every job in that table has met there too."""

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

started = time.time()
dist.init_process_group("gloo", timeout=timedelta(seconds=360))  # the barrier waits for the meet
rank = int(os.environ["RANK"])
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
met = met_at = None
if os.environ.get("LEASE_MEET"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the synced checkout's ddpfab
    from ddpfab.node import leases  # the node program's own reading (what ps, check and the probe show)

    deadline = time.monotonic() + 300  # four controllers starting on two loaded cores
    while met is None and time.monotonic() < deadline:
        table = leases.lease_state()
        held = {g["gpu"]: g["holder"].get("run_id") for g in table if g["state"] == "leased"}
        if len(held) >= int(os.environ["LEASE_MEET"]):
            met, met_at = held, time.time()
        else:
            time.sleep(0.3)
    # then hold until every job seen there has met too: a job whose rank starts late (its torch
    # import on loaded cores) still finds the others' leases held
    runs = Path.home() / ".ddpfab" / "runs"  # each job's record on the node (its supervisor made it)
    (runs / os.environ["DDPFAB_RUN_ID"] / "lease-met").write_text("")
    while met and time.monotonic() < deadline and not all((runs / r / "lease-met").exists() for r in met.values()):
        time.sleep(0.3)
time.sleep(float(os.environ.get("LEASE_HOLD", "0")))
dist.barrier()
print("REPORT " + json.dumps({
    "rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "sum": value.item(),
    "hostname": socket.gethostname(), "run_id": os.environ.get("DDPFAB_RUN_ID"),
    "master_port": int(os.environ["MASTER_PORT"]),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": started, "end": time.time(), "met": met,
    "met_at": met_at,
}), flush=True)
dist.destroy_process_group()
