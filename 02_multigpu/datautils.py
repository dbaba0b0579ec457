"""A seeded synthetic regression dataset, so every step runs without downloads.

Targets follow a fixed linear rule plus a little noise, so the loss has a known floor
(the noise variance, 0.01) and a falling loss means the model really learns.
"""
import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    """`size` samples of 20 features -> 1 target, identical for the same seed on every rank."""

    def __init__(self, size: int, seed: int = 0):
        # A private generator: building the data never touches (or depends on) the global RNG,
        # so every process that builds it gets exactly the same samples.
        g = torch.Generator().manual_seed(seed)
        self.size = size
        self.x = torch.randn(size, 20, generator=g)
        true_w = torch.randn(20, 1, generator=g)
        self.y = torch.tanh(self.x @ true_w) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]
