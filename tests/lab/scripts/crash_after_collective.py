"""A rank that fails on its own after a collective, its peers then lose it (the failure-story tests).

CRASH_RANK: the rank that fails; CRASH_HOW: raise (a ValueError), kill (SIGKILL to itself, as the
OOM killer would), usage (argparse refuses an argument: the test passes one). The others wait in
a second all_reduce, which the crash breaks."""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} step 0 ok", flush=True)
if rank == int(os.environ.get("CRASH_RANK", "1")):
    if os.environ.get("CRASH_HOW", "raise") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"bad batch shape (3, 4) on rank {rank}")
time.sleep(0.2)
dist.all_reduce(t)  # broken by the crash: "Connection closed by peer"
time.sleep(30)
