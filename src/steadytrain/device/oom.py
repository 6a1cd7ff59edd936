"""Out-of-memory classification: exception type first, then the known messages of each backend.

MPS and CPU raise plain `RuntimeError`; CUDA raises `torch.OutOfMemoryError` from the caching
allocator and `torch.AcceleratorError` ("CUDA error: out of memory") from the driver (mps.md §3).
The whole `__cause__` / `__context__` chain is searched, because wrappers (DataParallel, user code)
re-raise. Failures that end the process (Metal command-buffer OOM, jetsam SIGKILL) never reach
Python: the supervisor handles those.

Keras on TensorFlow raises `tf.errors.ResourceExhaustedError` ("OOM when allocating tensor"), an
`Exception` but no `RuntimeError`; JAX (XLA) raises a `RuntimeError` subclass ("RESOURCE_EXHAUSTED:
Out of memory"). No framework is imported here: a type is checked only when its framework is
already in `sys.modules` (an error of a framework never imported cannot exist), so this module
loads without torch or TensorFlow.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

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
    ("OOM when allocating tensor", "TensorFlow allocator, tf.errors.ResourceExhaustedError"),
    ("RESOURCE_EXHAUSTED: Out of memory", "XLA allocator (JAX; TensorFlow with XLA)"),
    (
        "could not create a primitive",
        "oneDNN (CPU kernels) failing to allocate a primitive's scratchpad: seen under a memory "
        "cap (RLIMIT_AS) where the allocator itself still had room",
    ),
)
"""(text to find in the message, where it comes from). The CPU prefix is matched from
"DefaultCPUAllocator: " because the `alloc_cpu.cpp:<line>` before it varies between releases."""

FOREIGN_OOM_TYPES = ("ResourceExhaustedError",)
"""Names of out-of-memory error types that are no `RuntimeError` (TensorFlow's ``OpError``
family): matched by name and message where the framework's own type is not at hand."""


def _torch_oom_types() -> tuple[type[BaseException], ...]:
    torch = sys.modules.get("torch")  # never imported here: no torch, no torch error
    candidates = (
        getattr(torch, "OutOfMemoryError", None),
        getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
    )
    return tuple(t for t in candidates if isinstance(t, type))


def _tensorflow_oom_types() -> tuple[type[BaseException], ...]:
    tf = sys.modules.get("tensorflow")  # the same: only when the program imported it
    t = getattr(getattr(tf, "errors", None), "ResourceExhaustedError", None)
    return (t,) if isinstance(t, type) else ()


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
    torch_types, tf_types = _torch_oom_types(), _tensorflow_oom_types()
    for err in exception_chain(exc):
        if torch_types and isinstance(err, torch_types):
            return "torch.OutOfMemoryError"
        if tf_types and isinstance(err, tf_types):
            return "tf.errors.ResourceExhaustedError"
        if isinstance(err, MemoryError):
            return "MemoryError"  # Python or numpy (collate, data loading) ran out
        if isinstance(err, RuntimeError) or type(err).__name__ in FOREIGN_OOM_TYPES:
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


T = TypeVar("T")


@dataclass(frozen=True)
class OutOfMemory:
    """What an out-of-memory error said, kept as plain values: holding the exception would keep
    its frames, and with them the tensors that ran out of room, alive."""

    error: str
    """The message's first line (at most 400 characters)."""
    requested: int | None
    """Bytes the failed allocation asked for, when the message says."""

    @classmethod
    def of(cls, exc: BaseException) -> OutOfMemory:
        lines = str(exc).strip().splitlines()
        return cls(lines[0][:400] if lines else "out of memory", oom_request_bytes(exc))


def call_or_oom(
    fn: Callable[[], T], free: Callable[[], None]
) -> tuple[T | None, OutOfMemory | None]:
    """``(fn(), None)``, or ``(None, what ran out)`` when `fn` runs out of memory; any other
    error propagates. After an out-of-memory the except block is left first (its traceback holds
    the failed pass's tensors), then garbage is collected and `free()` runs (drop what the caller
    holds, empty the device's cache), so the caller retries, shrinks or gives up with the memory
    back."""
    oom = None
    try:
        return fn(), None
    except Exception as exc:
        if not is_oom(exc):
            raise
        oom = OutOfMemory.of(exc)
    gc.collect()
    free()
    return None, oom


def retry_on_oom(
    fn: Callable[[], T], free: Callable[[], None], recover: Callable[[OutOfMemory], None]
) -> T:
    """`fn()` until it returns: after each out-of-memory, `free()` as in `call_or_oom`, then
    `recover(oom)`, which makes the next try smaller or raises to give up."""
    while True:
        value, oom = call_or_oom(fn, free)
        if oom is None:
            return value  # type: ignore[return-value]
        recover(oom)
