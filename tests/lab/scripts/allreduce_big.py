"""A small DDP-style job whose first collective is large: all-reduces of a 16 MiB tensor on gloo,
so every rank's first transfer needs full-size segments (what a path-MTU black hole stalls)."""

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    t = torch.ones(4 * 1024 * 1024)
    for _ in range(3):
        dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce ok, {t[0].item():.0f}", flush=True)
    dist.destroy_process_group()
