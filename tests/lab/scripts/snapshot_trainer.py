"""Test payload with the checkpoint behaviour of pytorch/examples' ddp-tutorial-series ``multinode.py``.

Our own script (no upstream code copied), written to behave as that example does where it matters
for checkpoints: a Trainer wraps a model in DDP (gloo, CPU); global rank 0 alone saves
``snapshot.pt`` = {"MODEL_STATE", "EPOCHS_RUN"} every SAVE_EVERY epochs into the current directory
(the node's workdir); at start every rank loads ``snapshot.pt`` when it exists and continues from
its EPOCHS_RUN; it trains TOTAL_EPOCHS. Without a shared filesystem only rank 0's node has the
snapshot, so the ranks of the next run disagree about where to start.

Each rank prints ``RESUMED {"rank": R, "epoch": E, "host": H}`` (E: the epoch it starts at, 0
without a snapshot) and, at the end, ``TRAINED {"rank": R, "epochs": N}``.

Usage: torchrun ... snapshot_trainer.py TOTAL_EPOCHS SAVE_EVERY
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SNAPSHOT = "snapshot.pt"


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer, save_every: int):
        self.rank = int(os.environ["RANK"])
        self.model, self.data, self.optimizer, self.save_every = model, data, optimizer, save_every
        self.epochs_run = 0
        if os.path.exists(SNAPSHOT):
            snap = torch.load(SNAPSHOT, map_location="cpu")
            self.model.load_state_dict(snap["MODEL_STATE"])
            self.epochs_run = snap["EPOCHS_RUN"]
        print("RESUMED " + json.dumps({"rank": self.rank, "epoch": self.epochs_run, "host": socket.gethostname()}),
              flush=True)
        self.ddp = DDP(self.model)

    def _epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)
        for x, y in self.data:
            self.optimizer.zero_grad()
            F.mse_loss(self.ddp(x), y).backward()  # gradients all-reduced across every rank
            self.optimizer.step()

    def train(self, total_epochs: int) -> None:
        for epoch in range(self.epochs_run, total_epochs):
            self._epoch(epoch)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.state_dict(), "EPOCHS_RUN": epoch + 1}, SNAPSHOT)
        print("TRAINED " + json.dumps({"rank": self.rank, "epochs": total_epochs - self.epochs_run}), flush=True)


def main(total_epochs: int, save_every: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = torch.nn.Linear(8, 1)
    loader = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), save_every).train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
