"""Collated batches as nested structures of tensors: their length, micro-batch splits, device moves.

A batch is what `engine.collate.collate` (or the user's collate_fn) made of one optimizer batch:
tensors whose first dimension is the sample, `PerSample` lists (one item per sample), lists of
per-sample strings as `default_collate` leaves them, and containers of these. Other leaves
(a scalar a custom collate_fn adds, None) belong to the whole batch and go to every micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from steadytrain.engine.collate import PerSample


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor with one, or the
    length of its first list of per-sample items."""
    size = _find_len(batch)
    if size is None:
        raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")
    return size


def _find_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, PerSample):
        return len(batch)
    if isinstance(batch, Mapping):
        values: Sequence = list(batch.values())
    elif isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        if batch and not any(_is_container(v) for v in batch):
            return len(batch)  # a list of per-sample leaves (strings, ids)
        values = batch
    else:
        return None
    for value in values:
        size = _find_len(value)
        if size is not None:
            return size
    return None


def _is_container(value: Any) -> bool:
    return isinstance(value, torch.Tensor | Mapping | tuple | list)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a collated batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() else batch
    if isinstance(batch, PerSample):
        return batch.like(batch[start:stop])
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        if batch and any(_is_container(v) for v in batch):
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
    if isinstance(batch, PerSample):
        return batch.like(to_device(v, device, non_blocking) for v in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch
