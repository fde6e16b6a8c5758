"""A small DDP training that works under every launch style ddpfab offers, through ddpfab.dist.

    ddpfab run -i inv.yml examples/train_dist.py --steps 5                          # static, torchrun, env://
    ddpfab run -i inv.yml --rdzv c10d --init-method tcp examples/train_dist.py      # c10d rendezvous, tcp://
    ddpfab run -i inv.yml --launcher legacy examples/train_dist.py                  # torch.distributed.launch
    ddpfab run -i inv.yml --init-method file examples/train_dist.py                 # file:// in ddpfab_shared_dir

:func:`ddpfab.dist.init` reads and checks the environment the launcher set, picks nccl (CUDA) or
gloo (CPU), sets the device from LOCAL_RANK and initialises with the init method ddpfab chose
(``DDPFAB_INIT_METHOD``; env:// by default). The legacy launcher also passes ``--local-rank=N``;
it is accepted and checked against LOCAL_RANK.

Each rank prints the mean loss after every step (the same number on all ranks: an all_reduce) and
a final parameter checksum (the same on all ranks: DDP kept the replicas identical). ``--report``
adds one ``REPORT {json}`` line per rank (what the rank saw; the lab tests read it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

try:
    from ddpfab import dist as ddist
except ImportError:  # ddpfab not installed in the node's python: use the checkout this file is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ddpfab import dist as ddist

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--report", action="store_true", help="print one REPORT json line per rank")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="set by the legacy launcher (torch.distributed.launch); LOCAL_RANK otherwise")
    parser.add_argument("rest", nargs="*", help="ignored; shows how arguments arrive")
    args = parser.parse_args()

    env = ddist.init(timeout_s=120)
    device = env.device
    print(f"rank {env.rank}/{env.world_size} local_rank {env.local_rank} on {socket.gethostname()} "
          f"backend {env.backend} init {env.init_method}", flush=True)

    torch.manual_seed(0)  # same init everywhere; DDP also broadcasts rank 0's weights
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device),
                device_ids=[env.local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1234 + env.rank)  # each rank its own shard of synthetic data
    true_w = torch.arange(16, dtype=torch.float32) / 16
    mean = torch.zeros(())
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=gen)
        y = (x @ true_w).unsqueeze(1) + 0.01 * torch.randn(args.batch, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        mean /= env.world_size
        ddist.print0(f"step {step} mean loss {mean.item():.6f}")
    checksum = sum(p.detach().double().sum() for p in model.parameters()).item()
    print(f"rank {env.rank} done, parameter checksum {checksum:.6f}", flush=True)

    if args.report:
        total = torch.tensor([float(env.rank + 1)], device=device)
        torch.distributed.all_reduce(total)
        ranks = [int(t.item()) for t in ddist.all_gather(torch.tensor([env.rank], device=device))]
        print("REPORT " + json.dumps({
            "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "local_rank_arg": args.local_rank, "node_rank": env.node_rank, "hostname": socket.gethostname(),
            "hosts": ddist.all_gather_object(socket.gethostname()), "gathered_ranks": ranks,
            "init_method": env.init_method, "backend": env.backend, "sum": total.item(),
            "master_addr": env.master_addr, "master_port": env.master_port, "argv": args.rest,
            "loss": round(mean.item(), 6), "checksum": round(checksum, 6),
            "run_id": os.environ.get("DDPFAB_RUN_ID"),
            "debug_env": {k: os.environ.get(k) for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
                                                          "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL")},
        }, ensure_ascii=False), flush=True)
    ddist.finish()  # destroys the process group and exits, skipping the teardown gloo can abort


if __name__ == "__main__":
    main()
