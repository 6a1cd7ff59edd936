"""Moving a batch to a device: `to_device` moves every tensor of a nested batch (mappings,
dataclass instances, namedtuples, lists, tuples, a per-sample list) and keeps each container's
type, so a collate_fn's own batch class or Hugging Face's BatchEncoding arrive as they left.

The engine moves its micro-batches with it and the checkpoint its loaded optimizer state; the
container helpers (`is_dataclass_instance`, `dataclass_fields`, `rebuilt`) are shared with the
engine's splitting of a batch, which keeps the same types."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`batch` with every tensor on `device`; other leaves as they are. A list whose class has
    `like(items)` (the engine's `PerSample`: one item per sample, with the dataset indices it
    came from) is remade through it, so what it knows about its samples travels too."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return rebuilt(batch, {k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if is_dataclass_instance(batch):
        moved = {k: to_device(v, device, non_blocking) for k, v in dataclass_fields(batch).items()}
        return rebuilt(batch, moved)
    if isinstance(batch, list) and callable(getattr(type(batch), "like", None)):
        return batch.like(to_device(v, device, non_blocking) for v in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def dataclass_fields(batch: Any) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def rebuilt(batch: Any, items: dict[str, Any]) -> Any:
    """A mapping or dataclass of `batch`'s type holding `items` (a collate_fn's own batch class,
    Hugging Face's BatchEncoding, an OrderedDict): a copy with its entries replaced; a plain
    dict where the type cannot be copied."""
    if type(batch) is dict:
        return items
    try:
        made = copy.copy(batch)
    except (TypeError, copy.Error):  # a type copy cannot make: rebuilt, or its entries as a dict
        return dict(items) if isinstance(batch, Mapping) else dataclasses.replace(batch, **items)
    if is_dataclass_instance(batch):
        for name, value in items.items():
            object.__setattr__(made, name, value)  # frozen dataclasses too
        return made
    if not isinstance(made, MutableMapping):
        return dict(items)
    for key, value in items.items():
        made[key] = value
    return made
