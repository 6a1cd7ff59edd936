"""Out-of-memory classification: exception type first, then the known messages of each backend.

MPS and CPU raise plain `RuntimeError`; CUDA raises `torch.OutOfMemoryError` from the caching
allocator and `torch.AcceleratorError` ("CUDA error: out of memory") from the driver (mps.md §3).
The whole `__cause__` / `__context__` chain is searched, because wrappers (DataParallel, user code)
re-raise. Failures that end the process (Metal command-buffer OOM, jetsam SIGKILL) never reach
Python: the supervisor handles those.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

OOM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("CUDA out of memory", "CUDA caching allocator (also the torch.OutOfMemoryError type)"),
    ("CUDA error: out of memory", "CUDA driver, raised as torch.AcceleratorError"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS could not allocate its workspace"),
    ("CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "cuDNN could not allocate its workspace"),
    ("MPS backend out of memory", "MPS allocator, plain RuntimeError, with or without a watermark"),
    ("Invalid buffer size", "MPS buffer larger than Metal's maximum buffer size"),
    (
        "DefaultCPUAllocator: ",
        "CPU allocator: can't allocate memory (Linux, macOS) / not enough "
        "memory (Windows, Android)",
    ),
    (
        "could not create a primitive",
        "oneDNN (CPU kernels) failing to allocate a primitive's scratchpad: seen under a memory "
        "cap (RLIMIT_AS) where the allocator itself still had room",
    ),
)
"""(text to find in the message, where it comes from). The CPU prefix is matched from
"DefaultCPUAllocator: " because the `alloc_cpu.cpp:<line>` before it varies between releases."""

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        getattr(torch, "OutOfMemoryError", None),
        getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
    )
    if isinstance(t, type)
)
_TRIED = re.compile(
    r"tried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*(bytes|[KMGT]i?B)\b", re.IGNORECASE
)
# MPS prints "KB", "MB", "GB" but divides by powers of 1024 (MPSAllocator `format_size`), and
# CUDA prints KiB/MiB/GiB: in an OOM message every unit is binary.
_SCALE = {"bytes": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during, without looping on cycles."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def oom_kind(exc: BaseException) -> str | None:
    """Where the out-of-memory error in `exc`'s chain came from, or None when there is none."""
    for err in exception_chain(exc):
        if _OOM_TYPES and isinstance(err, _OOM_TYPES):
            return "torch.OutOfMemoryError"
        if isinstance(err, MemoryError):
            return "MemoryError"  # Python or numpy (collate, data loading) ran out
        if isinstance(err, RuntimeError):
            text = str(err)
            for needle, source in OOM_MESSAGES:
                if needle in text:
                    return source
    return None


def is_oom(exc: BaseException) -> bool:
    """True when `exc` (or anything in its cause chain) is an out-of-memory error."""
    return oom_kind(exc) is not None


def oom_request_bytes(exc: BaseException) -> int | None:
    """The size the failed allocation asked for, when the message says ("Tried to allocate
    2.00 GiB", MPS "Tried to allocate 256 bytes on private pool", CPU "you tried to allocate
    123 bytes")."""
    for err in exception_chain(exc):
        match = _TRIED.search(str(err))
        if match:
            unit = match.group(2)
            scale = _SCALE["bytes"] if unit.lower() == "bytes" else _SCALE[unit[0].upper()]
            return int(float(match.group(1)) * scale)
    return None
