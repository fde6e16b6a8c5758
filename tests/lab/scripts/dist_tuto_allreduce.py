"""The all-reduce example of PyTorch's "Writing Distributed Applications with PyTorch" tutorial
(dist_tuto), as a torchrun script.

Origin: https://github.com/pytorch/tutorials, intermediate_source/dist_tuto.rst (BSD-3), rewritten
here with the same calls: ``run(rank, size)`` all-reduces a one-element tensor of ones with SUM over
a group of every rank and prints ``Rank R has data ...``, on gloo. The tutorial starts its
processes with ``mp.Process`` on 127.0.0.1; under torchrun the launcher starts them and sets the
env, so ``init_process`` reads it (env://). It ends as the tutorial's ``init_process`` does, with
``destroy_process_group()``, then a plain interpreter exit.
"""

import os

import torch
import torch.distributed as dist


def run(rank, size):
    group = dist.new_group(list(range(size)))
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


def init_process(fn, backend="gloo"):
    dist.init_process_group(backend)
    fn(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    init_process(run)
