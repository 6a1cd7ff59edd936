"""The data fingerprint: length and the contents of a few samples, so that a resume into a
changed or reordered dataset shows without reading all of it.

Whatever a map-style dataset returns is digested: tensors of every dtype and shape (0-dim
included), NumPy arrays and scalars, Python numbers, strings, bytes, None, nested dicts, lists,
tuples and sets, dataclasses and plain objects (by their attributes). What cannot be digested to
the same bytes in another process (an object that shows only its memory address, a tensor
without host storage, a structure nested too deep) is digested by its type alone: the weaker
check. Each such case adds one line to `notes`, and the resume loss check (ContinuityCheck) still
compares the first resumed step's loss with the one saved beside the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

MAX_DEPTH = 32


def data_fingerprint(dataset: Any, notes: list[str] | None = None) -> str:
    """Length and the contents of samples first, middle and last of `dataset` (16 hex digits).
    Samples or parts of them that only the weaker check covers are described in `notes`."""
    digest = hashlib.sha256(f"len={len(dataset)}".encode())
    n = len(dataset)
    indices = sorted({0, n // 2, n - 1})
    getitems = getattr(dataset, "__getitems__", None)
    try:
        if getitems is not None:  # SeededFetch: random draws while loading are seeded
            samples = getitems(_SeededIndices(indices))
        else:
            samples = [dataset[i] for i in indices]
    except (LookupError, TypeError) as exc:  # keyed otherwise (a sampler of its own keys)
        if notes is not None:
            said = getattr(exc, "problem", None) or f"{type(exc).__name__}: {exc}"  # ours: its own
            notes.append(
                f"data fingerprint: samples {indices} not readable by those indices "
                f"({(str(said).strip().splitlines() or [''])[0]}); checked by length only (the "
                "resume loss check still compares the first step)"
            )
        return digest.hexdigest()[:16]
    weak: set[str] = set()
    for sample in samples:
        digest_value(digest, sample, weak)
    if weak and notes is not None:
        notes.append(
            "data fingerprint: "
            + ", ".join(sorted(weak))
            + " checked by type only (the resume loss check still compares the first step)"
        )
    return digest.hexdigest()[:16]


class _SeededIndices(list):
    """Indices carrying a loading seed, as the engine's sampler yields them."""

    seed = 0


def digest_value(digest: Any, value: Any, weak: set[str], depth: int = 0) -> None:
    """Feed `value` into `digest` as bytes that another process computes the same way. What can
    only be checked by its type is named in `weak`."""
    kind = type(value)
    digest.update(f"<{kind.__module__}.{kind.__qualname__}>".encode())
    if depth > MAX_DEPTH:
        weak.add(f"a structure nested deeper than {MAX_DEPTH}")
    elif isinstance(value, torch.Tensor):
        _digest_tensor(digest, value, weak)
    elif isinstance(value, np.ndarray | np.generic):
        _digest_array(digest, np.asarray(value), weak, depth)
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes):
        digest.update(repr(value).encode())
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        for key, item in items:
            digest_value(digest, key, weak, depth + 1)
            digest_value(digest, item, weak, depth + 1)
    elif isinstance(value, list | tuple):
        digest.update(f"n={len(value)}".encode())
        for item in value:
            digest_value(digest, item, weak, depth + 1)
    elif isinstance(value, set | frozenset):
        parts = []  # the iteration order of a set of strings differs between processes
        for item in value:
            part = hashlib.sha256()
            digest_value(part, item, weak, depth + 1)
            parts.append(part.digest())
        for part in sorted(parts):
            digest.update(part)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            digest.update(field.name.encode())
            digest_value(digest, getattr(value, field.name), weak, depth + 1)
    else:
        _digest_object(digest, value, weak, depth)


def _digest_tensor(digest: Any, tensor: torch.Tensor, weak: set[str]) -> None:
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    try:
        host = tensor.detach().to("cpu")
        if host.layout != torch.strided:
            host = host.to_dense()
        flat = host.contiguous().reshape(-1)
        if flat.is_quantized:
            flat = flat.int_repr()
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        weak.add(f"a {tensor.dtype} tensor on {tensor.device.type} with layout {tensor.layout}")


def _digest_array(digest: Any, array: np.ndarray, weak: set[str], depth: int) -> None:
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    if array.dtype.hasobject:  # the bytes of an object array are pointers
        for item in array.reshape(-1).tolist():
            digest_value(digest, item, weak, depth + 1)
    else:
        digest.update(np.ascontiguousarray(array).tobytes())


def _digest_object(digest: Any, value: Any, weak: set[str], depth: int) -> None:
    """A plain object by its attributes; one with its own repr by that repr, unless the repr
    shows a memory address (different in every process)."""
    attributes = getattr(value, "__dict__", None)
    own_repr = type(value).__repr__ is not object.__repr__
    if own_repr:
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a user's __repr__ may fail in any way
            text = None
        if text is not None and " at 0x" not in text:
            digest.update(text.encode())
            return
    if isinstance(attributes, dict):
        digest_value(digest, attributes, weak, depth + 1)
        return
    kind = type(value)
    weak.add(f"{kind.__module__}.{kind.__qualname__} objects")
