"""Test payload: a small DDP job on gloo that ends like the upstream tutorial scripts
(``destroy_process_group()``, then a plain interpreter exit), with switches that make one rank end
badly, each at a chosen moment:

- ``DRILL_EXIT_ABORT_RANK=R``: rank R finishes its work, then aborts (SIGABRT) in the C library's
  exit handlers, after the interpreter has finalised: where gloo's teardown race aborts a rank, but
  every time (a libc ``on_exit`` handler that calls ``abort``);
- ``DRILL_EARLY_ABORT_RANK=R``: rank R aborts in the middle of training (it never finishes);
- ``DRILL_RAISE_RANK=R``: rank R raises in the middle of training.
"""

import ctypes
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def rank_is(var):
    return os.environ.get(var) == os.environ["RANK"]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(20, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        if step == 1 and rank_is("DRILL_EARLY_ABORT_RANK"):
            print(f"rank {rank} aborting in the middle of training", flush=True)
            os.abort()
        if step == 1 and rank_is("DRILL_RAISE_RANK"):
            raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
        opt.zero_grad()
        model(torch.rand(8, 20)).sum().backward()
        opt.step()
    print(f"REPORT rank {rank} finished its work", flush=True)
    dist.destroy_process_group()
    if rank_is("DRILL_EXIT_ABORT_RANK"):
        libc = ctypes.CDLL("libc.so.6")
        libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)


if __name__ == "__main__":
    main()
