"""Test payload: a script written for torch 1.x's torch.distributed.launch, which declares only
``--local_rank`` (underscore) and would reject torch 2.x's ``--local-rank``.

With LOCAL_RANK_DEFAULT=N in its environment the argument is optional with that default, as in the
many scripts that parse it with ``default=0`` and never read LOCAL_RANK (under torchrun alone every
rank would get the default). Reports the argument and LOCAL_RANK."""

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
default = os.environ.get("LOCAL_RANK_DEFAULT")
parser.add_argument("--local_rank", type=int, required=default is None, default=int(default or 0))
parser.add_argument("--tag", default="")
args = parser.parse_args()

dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([1.0])
dist.all_reduce(value)
print("REPORT " + json.dumps({"rank": dist.get_rank(), "local_rank": args.local_rank, "tag": args.tag,
                              "local_rank_env": int(os.environ["LOCAL_RANK"]),
                              "hostname": socket.gethostname(), "sum": value.item()}), flush=True)
dist.barrier()
dist.destroy_process_group()
