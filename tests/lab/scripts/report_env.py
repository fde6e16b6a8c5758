"""Test payload: after a real all_reduce, report this rank's identity, its arguments, and the
environment variables named in REPORT_ENV_KEYS (comma-separated), as one JSON line."""

import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
value = torch.tensor([1.0])
dist.all_reduce(value)
keys = [k for k in os.environ.get("REPORT_ENV_KEYS", "").split(",") if k]
print("REPORT " + json.dumps({
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
    "node_rank": int(os.environ["GROUP_RANK"]), "hostname": socket.gethostname(), "argv": sys.argv[1:],
    "env": {k: os.environ.get(k) for k in keys}, "sum": value.item(),
}), flush=True)
dist.barrier()
dist.destroy_process_group()
