"""Collated batches as nested structures of tensors: their length, micro-batch splits, device moves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (or list leaf)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_len(value)
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, tuple, list)):
            return batch_len(batch[0])  # a collated structure: [inputs, targets, ...]
        return len(batch)  # a list of per-sample leaves (strings, ids)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a collated batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, tuple, list)):
            items = [slice_batch(v, start, stop) for v in batch]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        return batch[start:stop]
    return batch


def split_batch(batch: Any, micro: int) -> list[Any]:
    """Consecutive micro-batches of at most `micro` samples (the last may be smaller)."""
    n = batch_len(batch)
    return [slice_batch(batch, i, min(i + micro, n)) for i in range(0, n, micro)]


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch
