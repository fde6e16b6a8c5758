"""A real, small DDP training: tiny model, synthetic data, a few steps.

gloo on CPU, nccl when CUDA is present. Every rank prints its rank, world size and, after each
step, the loss averaged over all ranks (an all_reduce), so all ranks print the same number;
the final parameter checksum shows that DDP kept the replicas identical.

    ddpfab run --inventory lab/inventory.yml examples/train.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} local_rank {local_rank} on {socket.gethostname()} backend {backend}", flush=True)

    torch.manual_seed(0)  # same init everywhere; DDP also broadcasts rank 0's weights
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device),
                device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard of synthetic data
    true_w = torch.arange(16, dtype=torch.float32) / 16
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=gen)
        y = (x @ true_w).unsqueeze(1) + 0.01 * torch.randn(args.batch, 1, generator=gen)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        print(f"rank {rank} step {step} mean loss {mean.item():.6f}", flush=True)
    checksum = sum(p.detach().double().sum() for p in model.parameters()).item()
    print(f"rank {rank} done, parameter checksum {checksum:.6f}", flush=True)
    dist.barrier()  # gloo: tearing down while a peer still finishes aborts it (torch 2.13)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads can abort the process there, after
    # all the work is done (SIGABRT, "terminate called without an active exception"; pytorch issue
    # 190489). ddpfab.dist.finish() does this for scripts that use ddpfab's helper.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
