"""Every byte of a checkpoint file, written and read back.

Every byte goes through `_write` (tests replace it to inject ENOSPC or slow writes) into a
`FileSink`, which counts and hashes it and fsyncs the file when it closes: the size and sha256
the manifest lists come from the write itself, not from reading the file again. Tensors go into
safetensors files streamed from their own memory (`safetensors_parts`), objects through
torch.save into a sink (`write_object`); `manifest.sha256_file` reads a file back to verify it. The fault
injection of the crash tests is here too: `fault(phase)` fires at the store's save phases.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from steadytrain.run import env as run_env
from steadytrain.run.durable import sync as sync_fd

FAULT_ENV = run_env.ENV_FAULT_INJECT
FAULT_PHASES = (
    "mid-write",
    "before-manifest",
    "after-manifest",
    "after-publish",
    "during-retention",
    "replace-dir",  # _durable.replace_dir: an export's or a merge's swap
)

# safetensors dtype names (safetensors/src/tensor.rs `Dtype`)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def _write(handle: BinaryIO, data: memoryview) -> None:
    """Every byte of every checkpoint file goes through here: tests replace it to inject ENOSPC
    or slow writes."""
    while data:
        data = data[handle.write(data) :]


class FileSink:
    """A new file; counts and hashes what is written. `fault_at` = (offset, hook) calls the hook
    once that many bytes are on their way to the file (the mid-write fault)."""

    def __init__(self, path: Path, fault_at: tuple[int, Callable[[], None]] | None = None):
        self.path = path
        self.handle: BinaryIO = open(path, "xb", buffering=0)  # noqa: SIM115 - closed in close()
        self.bytes = 0
        self.hash = hashlib.sha256()
        self.error: OSError | None = None  # torch.save turns our OSError into RuntimeError
        self._fault_at = fault_at

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self._fault_at is not None and self.bytes + len(view) >= self._fault_at[0]:
            offset, hook = self._fault_at
            self._fault_at = None
            split = offset - self.bytes
            self._put(view[:split])
            hook()
            view = view[split:]
        self._put(view)
        return size

    def _put(self, view: memoryview) -> None:
        try:
            _write(self.handle, view)
        except OSError as exc:
            self.error = exc
            raise
        self.hash.update(view)
        self.bytes += len(view)

    def flush(self) -> None:
        pass

    def close(self, sync: bool = True) -> None:
        try:
            if sync:
                sync_fd(self.handle.fileno())
        finally:
            self.handle.close()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's data as little-endian bytes, without a copy when it is already dense on CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def safetensors_parts(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[list[memoryview], int]:
    """The safetensors file as a list of buffers (header, then each tensor's data), and its size;
    `metadata`: more entries of the header's ``__metadata__`` (the checkpoint's tie, tie.py).

    Streaming the tensors' own memory avoids the whole-file copy `safetensors.torch.save` makes,
    which on a memory-constrained machine is the size of the model. Same layout as the
    safetensors writer: 8-byte header length, JSON header padded with spaces to 8 bytes, data
    ordered by decreasing alignment then name.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    datas = []
    offset = 0
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot go in safetensors")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r}: {tensor.layout} tensors are not supported")
        data = _tensor_bytes(tensor)
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        datas.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = memoryview(struct.pack("<Q", len(text)) + text)
    return [head, *datas], len(head) + offset


# Fault injection (tests): STEADYTRAIN_FAULT_INJECT=phase or phase:N SIGKILLs this process the
# N-th time (default 1st) the phase is reached while the variable names it.

_fault_counts: dict[str, int] = {}
_fault_lock = threading.Lock()


def fault(phase: str) -> None:
    spec = run_env.fault_inject()
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name not in FAULT_PHASES:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: the phase must be one of {', '.join(FAULT_PHASES)}"
        )
    if name != phase:
        return
    with _fault_lock:
        _fault_counts[phase] = _fault_counts.get(phase, 0) + 1
        hit = _fault_counts[phase] == int(nth or 1)
    if hit:
        sys.stdout.flush()
        sys.stderr.flush()
        if hasattr(signal, "SIGKILL"):
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)


def write_tensor_file(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """One safetensors file written and fsynced as the store writes its own (for a file another
    rank puts into a staging folder, with the checkpoint's tie in `metadata`); returns its size
    and sha256."""
    parts, _ = safetensors_parts(tensors, metadata)
    return write_parts(path, parts)


def write_parts(
    path: Path, parts: Iterable[Any], fault_at: tuple[int, Callable[[], None]] | None = None
) -> dict[str, Any]:
    """Write `parts` to `path` and fsync it (a failed write leaves no half file in the manifest:
    the caller's staging folder is discarded); returns its size and sha256."""
    sink = FileSink(path, fault_at)
    try:
        for part in parts:
            sink.write(part)
    except BaseException:
        sink.close(sync=False)
        raise
    sink.close()
    return {"sha256": sink.hash.hexdigest(), "bytes": sink.bytes}


def write_object(path: Path, obj: Any) -> dict[str, Any]:
    """torch.save of `obj` into a new file through a sink; returns its size and sha256."""
    sink = FileSink(path)
    try:
        torch.save(obj, sink)
    except BaseException as exc:
        sink.close(sync=False)
        if isinstance(exc, RuntimeError) and sink.error is not None:
            raise sink.error from None  # our write failed inside torch's C++ writer
        raise
    sink.close()
    return {"sha256": sink.hash.hexdigest(), "bytes": sink.bytes}


def json_bytes(value: Any) -> memoryview:
    return memoryview(json.dumps(value, indent=1).encode())
