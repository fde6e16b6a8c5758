"""A script written for ``python -m torch.distributed.launch`` (the pre-torchrun launcher), unchanged.

Such scripts take the local rank as an argument (``--local-rank=N``, older ones ``--local_rank``)
instead of reading LOCAL_RANK, and call ``init_process_group(init_method="env://")`` themselves.
ddpfab runs them as they are with ``--launcher legacy`` (torch.distributed.launch, still shipped,
deprecated, in torch 2.13; it passes ``--local-rank=N`` to each worker):

    ddpfab run -i inv.yml --launcher legacy examples/legacy_launch.py --epochs 2

With ``--launcher torchrun`` it fails at once: argparse reports the missing --local-rank.
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", type=int, required=True, dest="local_rank")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--report", action="store_true")
args = parser.parse_args()

if torch.cuda.is_available():
    torch.cuda.set_device(args.local_rank)
    backend, device = "nccl", torch.device("cuda", args.local_rank)
else:
    backend, device = "gloo", torch.device("cpu")
dist.init_process_group(backend=backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()

model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Linear(4, 1).to(device), device_ids=[args.local_rank] if device.type == "cuda" else None)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
torch.manual_seed(rank)
for epoch in range(args.epochs):
    x = torch.randn(8, 4, device=device)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

total = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(total)
print(f"rank {rank}/{world} local_rank {args.local_rank} on {socket.gethostname()}: sum {total.item():g}", flush=True)
if args.report:
    print("REPORT " + json.dumps({"rank": rank, "world_size": world, "local_rank": args.local_rank,
                                  "local_rank_env": int(os.environ["LOCAL_RANK"]), "hostname": socket.gethostname(),
                                  "node_rank": int(os.environ["GROUP_RANK"]), "sum": total.item()}), flush=True)
dist.barrier()  # gloo: tearing down while a peer still finishes aborts it (torch 2.13)
dist.destroy_process_group()
# Leave without the interpreter's teardown, where gloo's threads can still abort a finished rank
# (pytorch issue 190489); scripts that may import ddpfab call ddpfab.dist.finish() instead.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
