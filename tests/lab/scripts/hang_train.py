"""A small gloo data-parallel training loop that runs until told otherwise (the doctor's lab tests,
bench/hang.py).

Each step: forward/backward, the gradients averaged with ``all_reduce`` (as DDP does, here in
Python, so a rank waiting for them shows the collective in its stack), a pause (the step's compute
time), the loss all-reduced for the log, a line every ``--every`` steps. ``--steps`` ends it (0: run until stopped). With
``--odd-rank R`` rank R calls ``broadcast`` instead of ``all_reduce`` at step ``--odd-at``: one rank
in a different collective than the others (the doctor names it). Its broadcast is on a group of
its own with the next rank (made by every rank at the start, as new_group must be), so the two
collectives never exchange a message: a hang for certain, whatever gloo's algorithms. With
``--sleep-rank R`` rank R sleeps for good at step ``--sleep-at`` (``time.sleep`` in a loop, in no
collective) while the others wait for it in ``all_reduce``: the rank they wait for is outside any
collective.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def average_gradients(model: torch.nn.Module) -> None:
    world = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world


def sync_loss(loss: torch.Tensor) -> None:
    dist.all_reduce(loss)


def odd_call(loss: torch.Tensor, side, partner: int) -> None:
    dist.broadcast(loss, src=partner, group=side)


def stall(rank: int) -> None:
    print(f"rank {rank} stalls", flush=True)
    while True:
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--odd-rank", type=int, default=-1)
    p.add_argument("--odd-at", type=int, default=30)
    p.add_argument("--sleep-rank", type=int, default=-1)
    p.add_argument("--sleep-at", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    partner = (a.odd_rank + 1) % dist.get_world_size()
    side = dist.new_group([a.odd_rank, partner]) if a.odd_rank >= 0 else None
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"rank {rank} pid {os.getpid()} ready", flush=True)
    step = 0
    while a.steps == 0 or step < a.steps:
        x = torch.randn(32, 64)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        average_gradients(model)
        opt.step()
        time.sleep(a.sleep)
        value = loss.detach().clone()
        if rank == a.sleep_rank and step == a.sleep_at:
            stall(rank)
        if rank == a.odd_rank and step == a.odd_at:
            odd_call(value, side, partner)
        else:
            sync_loss(value)
        if step % a.every == 0:
            print(f"rank {rank} step {step} loss {value.item():.4f}", flush=True)
        step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
