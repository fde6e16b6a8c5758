"""Test payload: a training loop that checkpoints every step and resumes, with ddpfab.dist's helpers.

Each step all-reduces (step + 1) and folds it into a float64 "weight" in an order-sensitive way
(w = 1.01 * w + sum), so the final weight equals the uninterrupted run's only if no step was lost
and none was applied twice. Every rank prints ``STEP {json}`` after the step's checkpoint is saved.

Env: CKPT_DIR (required), CKPT_SHARED (1: rank 0 writes a shared dir, 0: every node its own),
STEPS, STEP_S (seconds per step), FAIL_AT (raise at that step on every attempt).
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the synced checkout's ddpfab
from ddpfab import dist as ddist  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

env = ddist.init(timeout_s=120)
ckpt, shared = os.environ["CKPT_DIR"], os.environ.get("CKPT_SHARED", "1") == "1"
steps, step_s, fail_at = int(os.environ.get("STEPS", "20")), float(os.environ.get("STEP_S", "0.2")), \
    int(os.environ.get("FAIL_AT", "-1"))
found = ddist.resume(ckpt)
start, w = (found[0] + 1, found[1]["w"]) if found else (0, torch.zeros(1, dtype=torch.float64))
info = {"rank": env.rank, "world": env.world_size, "host": socket.gethostname(), "restart": ddist.restart_count(),
        "run_id": os.environ.get("DDPFAB_RUN_ID"), "lineage": ddist.run_lineage(), "resumed_from": start - 1}
print("RESUME " + json.dumps(info), flush=True)
for step in range(start, steps):
    if step == fail_at:
        raise RuntimeError(f"boom on purpose at step {step}")
    x = torch.tensor([float(step + 1)], dtype=torch.float64)
    dist.all_reduce(x)
    w = w * 1.01 + x
    ddist.save_checkpoint({"w": w, "step": step}, ckpt, step, shared=shared, keep=3)
    print("STEP " + json.dumps({**info, "step": step, "w": w.item(), "t": time.time()}), flush=True)
    time.sleep(step_s)
print("DONE " + json.dumps({**info, "w": w.item()}), flush=True)
ddist.finish()
