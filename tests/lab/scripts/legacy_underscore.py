"""Test payload: a script written for torch 1.x's torch.distributed.launch, which declares only
``--local_rank`` (underscore) and would reject torch 2.x's ``--local-rank``."""

import argparse
import json
import socket

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--tag", default="")
args = parser.parse_args()

dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([1.0])
dist.all_reduce(value)
print("REPORT " + json.dumps({"rank": dist.get_rank(), "local_rank": args.local_rank, "tag": args.tag,
                              "hostname": socket.gethostname(), "sum": value.item()}), flush=True)
dist.barrier()
dist.destroy_process_group()
