"""Unattended training: checkpoint every N steps, resume after `ddpfab run --max-job-restarts`.

    ddpfab run -i inv.yml --max-job-restarts 3 --spares spares examples/train_resume.py /shared/ckpt

A lost node stops the job; ddpfab starts it again on a spare, and resume() picks up the latest
checkpoint (shared dir: rank 0 writes; pass --local for node-local disks: every node keeps a copy).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # or pip install ddpfab[node]
from ddpfab import dist as ddist  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ckpt_dir, shared, steps, every = sys.argv[1], "--local" not in sys.argv, 100, 10
env = ddist.init()
model = DDP(nn.Linear(16, 1).to(env.device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
found = ddist.resume(ckpt_dir)  # every rank: None, or (step, state) of the newest checkpoint any rank has
if found:
    model.module.load_state_dict(found[1]["model"])
    opt.load_state_dict(found[1]["opt"])
start = found[0] + 1 if found else 0
ddist.print0(f"restart {ddist.restart_count()} of {ddist.run_lineage()}: from step {start}")
for step in range(start, steps):
    x = torch.randn(32, 16, device=env.device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % every == every - 1 or step == steps - 1:
        ddist.save_checkpoint({"model": model.module.state_dict(), "opt": opt.state_dict()}, ckpt_dir, step,
                              shared=shared)
ddist.finish()
