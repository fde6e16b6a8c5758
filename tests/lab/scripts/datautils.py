"""The dataset module of pytorch/examples' DDP tutorial series, rewritten here with the same behaviour
(origin: https://github.com/pytorch/examples, distributed/ddp-tutorial-series/datautils.py, BSD-3):
2048 random (20 -> 1) samples held in memory. The tutorial scripts next to it import it by this name."""

import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]
