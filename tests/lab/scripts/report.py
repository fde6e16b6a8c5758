"""Test payload: report what this rank sees, as one JSON line, after a real all_reduce.

Also obeys a few environment switches so the lab tests can make one rank fail or hang.
"""

import json
import os
import socket
import sys
import time
from datetime import timedelta

# REPORT_FAIL_PLAN="RANK:DELAY:NOISE_KB,...": that rank prints NOISE_KB of lines, then fails at DELAY s
# (before importing torch, whose import time varies by seconds on a loaded machine). A DELAY of
# "gate" fails once the file $REPORT_FAIL_GATE/fail-RANK exists: the test decides when.
for item in filter(None, os.environ.get("REPORT_FAIL_PLAN", "").split(",")):
    r, delay, noise_kb = item.split(":")
    if int(r) == int(os.environ["RANK"]):
        start = time.time()
        sys.stdout.write(("noise " * 170 + "\n") * int(noise_kb))
        sys.stdout.flush()
        if delay == "gate":
            while not os.path.exists(os.path.join(os.environ["REPORT_FAIL_GATE"], f"fail-{r}")):
                time.sleep(0.01)
        else:
            time.sleep(max(0.0, float(delay) - (time.time() - start)))
        print(f"rank {r} failing on purpose at {time.time():.3f}", flush=True)
        os._exit(4)  # at once: no interpreter teardown to blur the failure time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
fail_rank = os.environ.get("REPORT_FAIL_RANK")
if fail_rank is not None and int(fail_rank) == rank:
    time.sleep(float(os.environ.get("REPORT_FAIL_AFTER", "1")))
    print(f"rank {rank} failing on purpose", flush=True)
    if os.environ.get("REPORT_FAIL_RAISE"):  # a traceback, as a crashing script leaves
        raise RuntimeError(f"rank {rank} failing on purpose")
    sys.exit(int(os.environ.get("REPORT_FAIL_CODE", "3")))

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print("REPORT " + json.dumps({
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "node_rank": int(os.environ["GROUP_RANK"]),
    "master_addr": os.environ["MASTER_ADDR"],
    "master_port": int(os.environ["MASTER_PORT"]),
    "hostname": socket.gethostname(),
    "argv": sys.argv[1:],
    "sum": value.item(),
    "run_id": os.environ.get("DDPFAB_RUN_ID"),
}, ensure_ascii=False), flush=True)
hang = float(os.environ.get("REPORT_HANG", "0"))
if hang:
    print(f"rank {rank} READY", flush=True)
    time.sleep(hang)
dist.barrier()  # gloo: tearing down while a peer still finishes aborts it (torch 2.13)
dist.destroy_process_group()
