"""A rank that fails on its own after a collective, its peers then lose it (the failure-story tests).

CRASH_RANK: the rank that fails; CRASH_ALSO (optional): another rank that fails too, at once (a
KeyError); CRASH_HOW: raise (a ValueError), kill (SIGKILL to itself, as the
OOM killer would), exit0 (it ends early with exit code 0), oom (the kernel's OOM killer ends it: it moves itself into a memory cgroup named
CRASH_MEMCG, limited to what it uses plus 64 MiB, and allocates until killed); a usage error comes
from an argument the test passes. The others wait in a second all_reduce, which the crash breaks.

CRASH_DELAY (seconds, optional): the failing rank first closes its connections (its peers fail with
"Connection closed by peer" at once) and fails that much later, so its peers' nodes always end
before its own: the order in which a victim is most easily blamed, made certain."""

import argparse
import os
import signal
import subprocess
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


def out_of_memory(name: str) -> None:
    """Into a memory cgroup of its own (cgroup v1, mounted in this host's /tmp), then allocate."""
    root = "/tmp/ddpfab-memcg"
    os.makedirs(root, exist_ok=True)
    if not os.path.ismount(root):
        subprocess.run(["mount", "-t", "cgroup", "-o", "memory", "none", root], check=True)
    group = os.path.join(root, name)
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
    with open(os.path.join(group, "memory.usage_in_bytes")) as fh:
        used = int(fh.read())
    with open(os.path.join(group, "memory.limit_in_bytes"), "w") as fh:
        fh.write(str(used + (64 << 20)))
    hog = []
    while True:
        hog.append(bytearray(16 << 20))


if rank == int(os.environ.get("CRASH_RANK", "1")):
    how = os.environ.get("CRASH_HOW", "raise")
    if os.environ.get("CRASH_DELAY"):
        dist.destroy_process_group()
        time.sleep(float(os.environ["CRASH_DELAY"]))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "oom":
        out_of_memory(os.environ["CRASH_MEMCG"])
    if how == "exit0":  # ends early, well: no error of its own, its peers wait for it
        os._exit(0)
    raise ValueError(f"bad batch shape (3, 4) on rank {rank}")
if rank == int(os.environ.get("CRASH_ALSO", "-1")):  # a second rank failing on its own, another way
    raise KeyError(f"no step on rank {rank}")
time.sleep(0.2)
dist.all_reduce(t)  # broken by the crash: "Connection closed by peer"
time.sleep(30)
