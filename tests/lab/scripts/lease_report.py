"""Test payload for GPU leases: each rank reports its node, run and CUDA_VISIBLE_DEVICES (set by its
node's supervisor from the job's lease), holds for LEASE_HOLD seconds, and reports when it started
and ended holding, after a real all_reduce over the job's own ranks (a stray rank of another job
would change the sum or the world size)."""

import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

started = time.time()
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = int(os.environ["RANK"])
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
time.sleep(float(os.environ.get("LEASE_HOLD", "0")))
dist.barrier()
print("REPORT " + json.dumps({
    "rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "sum": value.item(),
    "hostname": socket.gethostname(), "run_id": os.environ.get("DDPFAB_RUN_ID"),
    "master_port": int(os.environ["MASTER_PORT"]),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": started, "end": time.time(),
}), flush=True)
dist.destroy_process_group()
