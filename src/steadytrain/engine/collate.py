"""Collation of whatever samples a map-style dataset returns.

`collate` gives PyTorch's `default_collate` result wherever that succeeds (so a ported program
sees the batches its own DataLoader made), and goes on where it fails: per field of dicts that
share their keys, per position of tuples and lists of one length, and as a `PerSample` list for
any other leaf (None, custom objects, strings mixed with numbers, tensors of different shapes,
dicts with different keys). `PerSample` tells the batching code that the list holds one item per
sample, so a micro-batch split slices it like a tensor's first dimension.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data._utils.collate import default_collate

from steadytrain.errors import UnstackedSamplesError

_FAILURES = (TypeError, RuntimeError, KeyError, ValueError, IndexError)


class PerSample(list):
    """A batch leaf with one item per sample (what could not be stacked into a tensor).

    `indices` are the samples' dataset indices where the loader knew them (`SeededFetch`),
    `field` the key or position the leaf came from. Used as a tensor (an attribute of a tensor,
    or a torch function given it) where its items are tensors of different shapes, it raises
    `UnstackedSamplesError` (exit 5) naming two of the samples and their shapes, the mistake of a
    program that gives samples of different lengths without a collate_fn that pads them."""

    indices: Sequence[int] | None = None
    field: str | None = None
    whole: PerSample | None = None  # the optimizer batch's leaf this one was sliced from

    def like(self, items: Iterable[Any]) -> PerSample:
        """`items` as a PerSample of the same leaf (a micro-batch's part, moved to a device)."""
        made = PerSample(items)
        made.indices, made.field = self.indices, self.field
        made.whole = self.whole if self.whole is not None else self
        return made

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and hasattr(torch.Tensor, name):
            self._refuse_as_tensor()
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __getitem__(self, index: Any) -> Any:
        # A tensor's indexing (`x[:, :3]`, `x[..., 0]`, `x[None]`, `x[mask]`) on samples that were
        # not stacked: the same refusal as `.shape`, not list's "indices must be integers".
        one = isinstance(index, int | slice) or hasattr(index, "__index__")
        if isinstance(index, torch.Tensor):  # a mask or a list of positions: a tensor's indexing
            one = index.numel() == 1 and not index.is_floating_point() and index.dtype != torch.bool
        if not one:
            self._refuse_as_tensor()
        return super().__getitem__(index)

    def _refuse_as_tensor(self) -> None:
        problem = unstacked(self)
        if problem is not None:
            raise UnstackedSamplesError(problem, where="data")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> Any:
        def plain(value: Any) -> Any:
            return list(value) if isinstance(value, PerSample) else value

        try:
            return func(
                *(plain(a) for a in args), **{k: plain(v) for k, v in (kwargs or {}).items()}
            )
        except TypeError:
            for value in (*args, *(kwargs or {}).values()):
                problem = unstacked(value) if isinstance(value, PerSample) else None
                if problem is not None:
                    raise UnstackedSamplesError(problem, where="data") from None
            raise


def unstacked(leaf: PerSample) -> str | None:
    """Why the samples of `leaf` were not stacked into one tensor, naming two of them and their
    shapes, and the fix; None when its items are not all tensors (or lists of numbers)."""
    leaf = leaf.whole if leaf.whole is not None else leaf  # a micro-batch's: its whole batch
    shapes = [_shape(item) for item in leaf]
    if not shapes or any(shape is None for shape in shapes):
        return None
    names = list(leaf.indices) if leaf.indices is not None else None
    if names is None or len(names) != len(shapes):
        names, whose = list(range(len(shapes))), " of the batch"  # positions, not indices
    else:
        whose = ""
    field = f"{leaf.field} of each sample: " if leaf.field else ""
    counts: dict[tuple, int] = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    if len(counts) == 1:
        return None  # one shape: not stacked for another reason (dtypes, say)
    tokens = all(len(shape) == 1 for shape in shapes) and all(_integers(item) for item in leaf)

    def size(shape: tuple) -> str:
        return f"{shape[0]} tokens" if tokens else f"shape {shape}"

    common, most = max(counts.items(), key=lambda kv: kv[1])
    if most == len(shapes) - 1 and len(shapes) > 2:  # one sample unlike the others
        odd = next(i for i, shape in enumerate(shapes) if shape != common)
        found = (
            f"sample {names[odd]}{whose} has {size(shapes[odd])} where the {most} other "
            f"samples of its batch have {size(common)}"
        )
    else:
        first = shapes[0]
        other = next(i for i, shape in enumerate(shapes) if shape != first)
        if tokens:
            lengths = sorted(shape[0] for shape in shapes)
            also = f" (this batch: {lengths[0]} to {lengths[-1]} tokens)"
            found = f"samples {names[0]} and {names[other]}{whose} have {first[0]} and "
            found += f"{shapes[other][0]} tokens{also}"
        else:
            also = f" (this batch: {len(counts)} different shapes)" if len(counts) > 2 else ""
            found = f"samples {names[0]} and {names[other]}{whose} have shapes {first} and "
            found += f"{shapes[other]}{also}"
    if tokens:
        fix = (
            "samples of different lengths cannot be stacked into one tensor: pad them in a "
            "collate_fn (`Trainer(..., collate_fn=Collator(pad_id))`, from "
            "steadytrain.recipes.data, pads token samples and masks the padding), or give every "
            "sample the same length"
        )
    else:
        fix = (
            "samples of different shapes cannot be stacked into one tensor: give every sample "
            "one shape (resize, crop or pad it in the dataset), or pad them in a collate_fn=..."
        )
    return f"{field}{found}; {fix}"


def _shape(item: Any) -> tuple | None:
    if isinstance(item, torch.Tensor) or type(item).__module__ == "numpy":
        return tuple(getattr(item, "shape", ())) or None
    numbers = isinstance(item, Sequence) and not isinstance(item, str | bytes) and item
    if numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in item):
        return (len(item),)
    return None


def _integers(item: Any) -> bool:
    if isinstance(item, torch.Tensor):
        return not item.is_floating_point() and not item.is_complex() and item.dtype != torch.bool
    if type(item).__module__ == "numpy":
        return getattr(item, "dtype", None) is not None and item.dtype.kind in "iu"
    return all(isinstance(v, int) for v in item)


def collate(samples: list[Any]) -> Any:
    """A batch of `samples`: `default_collate`'s where it succeeds, else structure by
    structure, with `PerSample` lists for the leaves it cannot stack."""
    return _collate(samples, getattr(samples, "indices", None), None)


def _collate(samples: list[Any], indices: Sequence[int] | None, field: str | None) -> Any:
    try:
        return default_collate(samples)
    except _FAILURES:
        pass
    first = samples[0]
    if all(isinstance(s, Mapping) for s in samples) and all(
        s.keys() == first.keys() for s in samples
    ):
        return {
            key: _collate([s[key] for s in samples], indices, _join(field, repr(key)))
            for key in first
        }
    if _same_length_sequences(samples):
        fields = [
            _collate(list(column), indices, _join(field, f"[{i}]"))
            for i, column in enumerate(zip(*samples, strict=True))
        ]
        namedtuple = isinstance(first, tuple) and hasattr(first, "_fields")
        if namedtuple and all(type(s) is type(first) for s in samples):
            return type(first)(*fields)
        return fields
    leaf = PerSample(samples)
    leaf.indices, leaf.field = indices, field
    return leaf


def _join(field: str | None, part: str) -> str:
    """Where a leaf sits in each sample: 'input_ids', item 0, 'image'[1]."""
    if field is None:
        return part if not part.startswith("[") else f"item {part[1:-1]}"
    return f"{field}{part}" if part.startswith("[") else f"{field}[{part}]"


def _same_length_sequences(samples: list[Any]) -> bool:
    if not all(isinstance(s, Sequence) and not isinstance(s, str | bytes) for s in samples):
        return False
    size = len(samples[0])
    return size > 0 and all(len(s) == size for s in samples)
