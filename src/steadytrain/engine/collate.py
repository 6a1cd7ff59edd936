"""Collation of whatever samples a map-style dataset returns.

`collate` gives PyTorch's `default_collate` result wherever that succeeds (so a ported program
sees the batches its own DataLoader made), and goes on where it fails: per field of dicts that
share their keys, per position of tuples and lists of one length, and as a `PerSample` list for
any other leaf (None, custom objects, strings mixed with numbers, tensors of different shapes,
dicts with different keys). `PerSample` tells the batching code that the list holds one item per
sample, so a micro-batch split slices it like a tensor's first dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data._utils.collate import default_collate

_FAILURES = (TypeError, RuntimeError, KeyError, ValueError, IndexError)


class PerSample(list):
    """A batch leaf with one item per sample (what could not be stacked into a tensor)."""


def collate(samples: list[Any]) -> Any:
    """A batch of `samples`: `default_collate`'s where it succeeds, else structure by
    structure, with `PerSample` lists for the leaves it cannot stack."""
    try:
        return default_collate(samples)
    except _FAILURES:
        pass
    first = samples[0]
    if all(isinstance(s, Mapping) for s in samples) and all(
        s.keys() == first.keys() for s in samples
    ):
        return {key: collate([s[key] for s in samples]) for key in first}
    if _same_length_sequences(samples):
        fields = [collate(list(column)) for column in zip(*samples, strict=True)]
        namedtuple = isinstance(first, tuple) and hasattr(first, "_fields")
        if namedtuple and all(type(s) is type(first) for s in samples):
            return type(first)(*fields)
        return fields
    return PerSample(samples)


def _same_length_sequences(samples: list[Any]) -> bool:
    if not all(isinstance(s, Sequence) and not isinstance(s, str | bytes) for s in samples):
        return False
    size = len(samples[0])
    return size > 0 and all(len(s) == size for s in samples)
