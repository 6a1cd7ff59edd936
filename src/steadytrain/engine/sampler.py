"""The resumable sampler: one item per optimizer step, the indices of `batch_size` samples.

Each epoch's order is a permutation drawn from its own generator seeded by (seed, epoch), so the
order of epoch e never depends on what ran before, and resuming at (epoch, position) is exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class OptimizerBatchSampler:
    """Yields lists of dataset indices, one optimizer batch each, from (epoch, start) on."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.start = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for step in range(self.start, self.steps_per_epoch):
            yield order[step * self.batch_size : (step + 1) * self.batch_size]

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start
