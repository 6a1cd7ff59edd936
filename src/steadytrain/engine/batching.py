"""Collated batches as nested structures of tensors: their length and micro-batch splits (moving
one to a device is the device layer's `device.batches.to_device`).

A batch is what `engine.collate.collate` (or the user's collate_fn) made of one optimizer batch:
tensors whose first dimension is the sample, `PerSample` lists (one item per sample), lists of
per-sample strings as `default_collate` leaves them, and containers of these (dicts and other
mappings, lists, tuples, namedtuples, dataclass instances: each keeps its type). Other leaves
(a scalar a custom collate_fn adds, None) belong to the whole batch and go to every micro-batch.
`SampleFirst` wraps a user's collate_fn and refuses a batch that would be split along another
dimension than the sample's (a sequence-first layout) before it is trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from steadytrain.device.batches import (
    dataclass_fields,
    is_dataclass_instance,
    rebuilt,
    to_device,  # noqa: F401 - the device's; the step's older import of it still works
)
from steadytrain.engine.collate import PerSample
from steadytrain.errors import BadInputError


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
    elif is_dataclass_instance(batch):
        values = list(dataclass_fields(batch).values())
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
    return isinstance(value, torch.Tensor | Mapping | tuple | list) or is_dataclass_instance(value)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a collated batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() else batch
    if isinstance(batch, PerSample):
        return batch.like(batch[start:stop])
    if isinstance(batch, Mapping):
        return rebuilt(batch, {k: slice_batch(v, start, stop) for k, v in batch.items()})
    if is_dataclass_instance(batch):
        return rebuilt(
            batch, {k: slice_batch(v, start, stop) for k, v in dataclass_fields(batch).items()}
        )
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


class SampleFirst:
    """A user's collate_fn whose batches are checked before they are trained on: everything a
    split slices (tensors by their first dimension, lists of per-sample items) must hold one
    entry per sample given to it. A batch laid out sequence-first, `(seq, batch)` as
    pytorch/examples' word_language_model batchifies, or holding a value of the whole batch
    in such a place (class weights as a tensor), would be split along the wrong dimension once
    the micro-batch is smaller than the batch: it is refused at the first batch (exit 2),
    naming the place, its size against the sample count and the fix.

    A tuple or list of one item per sample whose items are tensors or containers
    (torchvision's detection references collate with `tuple(zip(*batch))`: a tuple of images
    and a tuple of target dicts) is read as such, a `PerSample` list, where reading it as
    fields would not hold one entry per sample."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], field: str):
        self.collate_fn, self.field = collate_fn, field

    def __call__(self, samples: list[Any]) -> Any:
        count = len(samples)
        batch = _per_sample_lists(self.collate_fn(samples), count)
        for where, size, what in _sliced(batch, None):
            if size != count:
                raise NotSampleFirstError(_not_sample_first(self, where, size, what, count))
        return batch


def _per_sample_lists(batch: Any, count: int) -> Any:
    """`batch` with each tuple or list of `count` containers that does not split as fields
    (some part of it is not `count` long, once its own parts are read so) made a `PerSample`
    list of its items: from the leaves up, so an (images, targets) pair of such lists stays
    a pair at any count."""
    if isinstance(batch, Mapping):
        return rebuilt(batch, {k: _per_sample_lists(v, count) for k, v in batch.items()})
    if is_dataclass_instance(batch):
        return rebuilt(
            batch, {k: _per_sample_lists(v, count) for k, v in dataclass_fields(batch).items()}
        )
    if not isinstance(batch, tuple | list) or isinstance(batch, PerSample):
        return batch
    if not batch or not any(_is_container(v) for v in batch):
        return batch
    items = [_per_sample_lists(v, count) for v in batch]
    batch = type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    as_fields = all(size == count for _, size, _ in _sliced(batch, None))
    if len(batch) == count and not hasattr(batch, "_fields") and not as_fields:
        return PerSample(batch)
    return batch


class NotSampleFirstError(BadInputError):
    """`SampleFirst`'s refusal. Raised in a DataLoader worker, it comes back to the training
    process as the one line it had (as every steadytrain error does, errors.py)."""


def _not_sample_first(collate: SampleFirst, where: str | None, size: int, what: str, n: int) -> str:
    name = getattr(collate.collate_fn, "__name__", type(collate.collate_fn).__name__)
    place = f"whose {where} is" if where is not None else "that is"
    return (
        f"{collate.field}: collate_fn {name} made a batch of {n} samples {place} {what}: "
        f"{size} along its first dimension, where steadytrain splits a batch into micro-batches "
        f"and expects the {n} samples. Return every tensor and list sample-first (a "
        "sequence-first (seq, batch) layout as (batch, seq), transposed back in loss_fn with "
        "x.t()), and keep values of the whole batch (class weights, a vocabulary) out of the "
        "batch, in loss_fn or the model; see docs/porting.md, 'Data'"
    )


def _sliced(batch: Any, where: str | None) -> Iterator[tuple[str | None, int, str]]:
    """(place, length, description) of each part of `batch` that `slice_batch` slices."""

    if isinstance(batch, torch.Tensor):
        if batch.dim():
            yield where, batch.shape[0], f"a tensor of shape {tuple(batch.shape)}"
    elif isinstance(batch, PerSample):
        yield where, len(batch), f"a list of {len(batch)} items"
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _sliced(value, _place(where, repr(key)))
    elif is_dataclass_instance(batch):
        for key, value in dataclass_fields(batch).items():
            yield from _sliced(value, _place(where, key, attribute=True))
    elif isinstance(batch, tuple | list):
        if batch and any(_is_container(v) for v in batch):
            fields = getattr(batch, "_fields", None)
            for i, value in enumerate(batch):
                part = fields[i] if fields else f"[{i}]"
                yield from _sliced(value, _place(where, part, attribute=bool(fields)))
        elif batch:
            yield where, len(batch), f"a {type(batch).__name__} of {len(batch)} items"


def _place(where: str | None, part: str, attribute: bool = False) -> str:
    """Where a part sits in the batch: 'input_ids', item 0, 'image'[1], .x (an attribute)."""
    if attribute:
        return f".{part}" if where is None else f"{where}.{part}"
    if where is None:
        return f"item {part[1:-1]}" if part.startswith("[") else part
    return f"{where}{part}" if part.startswith("[") else f"{where}[{part}]"
