"""Out-of-memory classification: exception type first, then the known messages of each backend.

MPS and CPU raise plain `RuntimeError`; CUDA raises `torch.OutOfMemoryError` from the caching
allocator and `torch.AcceleratorError` ("CUDA error: out of memory") from the driver. The whole
`__cause__` / `__context__` chain is searched, because wrappers (DataParallel, user code) re-raise.
"""

from __future__ import annotations

import re

import torch

OOM_MESSAGES = (
    "CUDA out of memory",  # caching allocator (also the OutOfMemoryError type)
    "CUDA error: out of memory",  # driver, raised as AcceleratorError
    "MPS backend out of memory",  # MPS allocator, plain RuntimeError
    "Invalid buffer size",  # MPS buffer over Metal's maximum size
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator (Linux, macOS)
    "DefaultCPUAllocator: not enough memory",  # CPU allocator (Windows, Android)
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",  # cuDNN workspace
)
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None),
                getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
    if isinstance(t, type)
)
_TRIED = re.compile(r"(?:Tried to allocate|tried to allocate)\s+([0-9.]+)\s*([KMGT]i?B|bytes)")
_SCALE = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_oom(exc: BaseException) -> bool:
    """True when `exc` (or anything in its cause chain) is an out-of-memory error."""
    for err in _chain(exc):
        if _OOM_TYPES and isinstance(err, _OOM_TYPES):
            return True
        if isinstance(err, (RuntimeError, MemoryError)):
            if isinstance(err, MemoryError):
                return True
            text = str(err)
            if any(m in text for m in OOM_MESSAGES):
                return True
    return False


def oom_request_bytes(exc: BaseException) -> int | None:
    """The size the failed allocation asked for, when the message says ("Tried to allocate 2.00 GiB")."""
    for err in _chain(exc):
        match = _TRIED.search(str(err))
        if match:
            return int(float(match.group(1)) * _SCALE[match.group(2)])
    return None
