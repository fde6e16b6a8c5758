"""A small DDP job that uses what issue 25's resource checks guard: a DataLoader with 2 worker
processes (batches through /dev/shm), all_reduces, and a checkpoint written into the workdir by
each node's local rank 0 (``ckpt-<hostname>.pt``, ~8 MiB). Prints ``REPORT {json}`` per rank.

    torchrun ... res_train.py [STEPS]
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TensorDataset(torch.randn(256, 64), torch.randn(256, 1))
    loader = DataLoader(data, batch_size=16, num_workers=2, sampler=DistributedSampler(data))
    model = DDP(torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        done += 1
        if done >= steps:
            break
    big = torch.ones(1 << 20)
    dist.all_reduce(big)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save({"model": model.module.state_dict(), "pad": torch.zeros(2 << 20)},
                   f"ckpt-{socket.gethostname()}.pt")
    dist.barrier()
    print("REPORT " + json.dumps({"rank": rank, "world": world, "hostname": socket.gethostname(), "steps": done,
                                  "sum": float(big[0])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
