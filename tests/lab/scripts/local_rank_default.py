"""Test payload: a script that takes its local rank only from ``--local_rank`` with a default of 0
(as many scripts written for torch.distributed.launch do) and never reads LOCAL_RANK: under
torchrun alone every rank would get 0. Reports both."""

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--tag", default="")
args = parser.parse_args()

dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([1.0])
dist.all_reduce(value)
print("REPORT " + json.dumps({"rank": dist.get_rank(), "local_rank_arg": args.local_rank, "tag": args.tag,
                              "local_rank_env": int(os.environ["LOCAL_RANK"]), "hostname": socket.gethostname(),
                              "sum": value.item()}), flush=True)
dist.barrier()
dist.destroy_process_group()
