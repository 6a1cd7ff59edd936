# long-module: one store: save, verify and load share the folder format and `_write` (tests patch)
"""Checkpoint storage: atomic commit, verification on load, keep-last-K, background writes.

Knows files, not models: a `Payload` is a set of named files (safetensors tensors, pickled
objects read back with weights_only=True, JSON) and `CheckpointStore` commits, finds, verifies,
loads and prunes them under RUN_DIR/checkpoints:

    step-00000250/            one committed checkpoint: the payload's files + MANIFEST.json
    latest                    text file naming the newest committed folder (a hint, verified)
    .staging-step-...-PID-X   a save in progress (or left by a killed one): never read
    .deleting-step-...-PID-X  an old checkpoint being removed: never read

A checkpoint is committed when its folder has the final name; it gets that name only after every
file and MANIFEST.json (size and sha256 of each file, written last) are fsynced. See
docs/checkpoints.md for the sequence, the reasons, and what each error means.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import stat
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import psutil
import torch
from safetensors.torch import load_file

from steadytrain import run_files
from steadytrain._durable import make_folder, sync_dir
from steadytrain._durable import sync as sync_fd
from steadytrain._units import format_bytes
from steadytrain._version import __version__
from steadytrain.errors import CheckpointError, DiskFullError

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
POINTER = run_files.LATEST
FAULT_ENV = "STEADYTRAIN_FAULT_INJECT"
FAULT_PHASES = (
    "mid-write",
    "before-manifest",
    "after-manifest",
    "after-publish",
    "during-retention",
)

_NAME = re.compile(r"^step-(\d{8,12})$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHARD_FILE = re.compile(r"^(\.metadata|__\d{1,6}_\d{1,6}\.distcp)$")
"""The names torch.distributed.checkpoint's file writer gives its files (sharded checkpoints)."""
_LEFTOVER = re.compile(r"^\.(staging|deleting|latest)-(?:.*-)?(\d+)-[0-9a-f]+(?:\.tmp)?$")
_OS_CLUTTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})  # Finder/Explorer droppings
_MAX_STEP = 10**12 - 1
_MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

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


@dataclass
class Payload:
    """What one checkpoint holds, by file name.

    `tensors` files end in .safetensors, `json` files in .json; `objects` files (anything else,
    e.g. optimizer.pt) must hold only what torch.load(weights_only=True) accepts: tensors,
    numbers, strings and plain containers.
    """

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    json: dict[str, Any] = field(default_factory=dict)
    shards: Callable[[Path | None], None] | None = None
    """Saving: writes the files other writers put into the staging folder (every rank's
    shards, through torch.distributed.checkpoint), called with the folder after the payload's
    own files and before the manifest, which then lists every file in the folder; called with
    None when the step is committed already (nothing to write). Saved synchronously only."""
    sharded: list[str] = field(default_factory=list)
    """Loading: the verified files that torch.distributed.checkpoint reads from the folder."""

    def names(self) -> list[str]:
        return [*self.tensors, *self.objects, *self.json]


# --------------------------------------------------------------------------------------------
# Low-level writing. Every byte of every checkpoint file goes through `_write` (tests replace it
# to inject ENOSPC or slow writes).


def _write(handle: BinaryIO, data: memoryview) -> None:
    while data:
        data = data[handle.write(data) :]


class _FileSink:
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


def _safetensors_parts(tensors: dict[str, torch.Tensor]) -> tuple[list[memoryview], int]:
    """The safetensors file as a list of buffers (header, then each tensor's data), and its size.

    Streaming the tensors' own memory avoids the whole-file copy `safetensors.torch.save` makes,
    which on a memory-constrained machine is the size of the model. Same layout as the
    safetensors writer: 8-byte header length, JSON header padded with spaces to 8 bytes, data
    ordered by decreasing alignment then name.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
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


# --------------------------------------------------------------------------------------------
# Fault injection (tests): STEADYTRAIN_FAULT_INJECT=phase or phase:N SIGKILLs this process the
# N-th time (default 1st) the phase is reached while the variable names it.

_fault_counts: dict[str, int] = {}
_fault_lock = threading.Lock()


def _fault(phase: str) -> None:
    spec = os.environ.get(FAULT_ENV)
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


# --------------------------------------------------------------------------------------------
# Names in flight in this process (staging, deleting, pointer temp): leftover cleaning skips them.

_active: set[str] = set()
_active_lock = threading.Lock()
_stores_with_saves: weakref.WeakSet[CheckpointStore] = weakref.WeakSet()


def _wait_at_exit() -> None:
    """Interpreter exit: a background save has finished by now (its thread is not a daemon);
    report an error nobody collected."""
    for store in list(_stores_with_saves):
        try:
            store.wait()
        except BaseException as exc:  # noqa: BLE001 - reported, nothing can be raised at exit
            print(f"steadytrain: the last checkpoint save failed: {exc}", file=sys.stderr)


atexit.register(_wait_at_exit)


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One safetensors file written and fsynced as the store writes its own (for a file another
    rank puts into a staging folder); returns its size and sha256."""
    parts, _ = _safetensors_parts(tensors)
    return _write_parts(path, parts)


def _write_parts(
    path: Path, parts: Iterable[Any], fault_at: tuple[int, Callable[[], None]] | None = None
) -> dict[str, Any]:
    """Write `parts` to `path` and fsync it (a failed write leaves no half file in the manifest:
    the caller's staging folder is discarded); returns its size and sha256."""
    sink = _FileSink(path, fault_at)
    try:
        for part in parts:
            sink.write(part)
    except BaseException:
        sink.close(sync=False)
        raise
    sink.close()
    return {"sha256": sink.hash.hexdigest(), "bytes": sink.bytes}


def _dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(name: str) -> int | None:
    """The step of a canonical checkpoint folder name, else None (`step-250`, `../x`: None)."""
    match = _NAME.match(name)
    if match is None or _dir_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def _kind(name: str) -> str:
    if SHARD_FILE.match(name):
        return "sharded"
    if name.endswith(".safetensors"):
        return "tensors"
    if name.endswith(".json"):
        return "json"
    return "objects"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _payload_bytes(payload: Payload) -> int:
    """About how many bytes the payload's files take on disk."""
    total = 4096  # manifest
    for tensors in payload.tensors.values():
        total += 64 + sum(128 + t.nelement() * t.element_size() for t in tensors.values())
    total += sum(_object_bytes(obj) for obj in payload.objects.values())
    total += sum(len(_json_bytes(value)) for value in payload.json.values())
    return total


def _object_bytes(obj: Any) -> int:
    """Roughly what torch.save will write for `obj`: its tensors' bytes plus some overhead."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size() + 64
    if isinstance(obj, dict):
        return 64 + sum(_object_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return 64 + sum(_object_bytes(v) for v in obj)
    return 64


def _tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


class _Refused(Exception):
    """A path that must not be touched (symlink, outside the checkpoints folder)."""


class CheckpointStore:
    """Checkpoints of one run under RUN_DIR/checkpoints. One writer per run directory (RunLock).

    `required` names the files a checkpoint must list to verify (the trainer's state files; a
    tuple of names: one of them), so
    a manifest cut down to fewer files is skipped like any failing checkpoint.
    `log(event, info)` receives what the store noticed (skipped checkpoints and why, leftovers
    removed, deletions, failed deletes); it may be called from the background writer thread.
    """

    def __init__(
        self,
        run_dir: str | Path,
        keep_last: int = 2,
        log: Callable[[str, dict], None] | None = None,
        fingerprint: str | None = None,
        required: Iterable[str] = (),
    ):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer of at least 1, got {keep_last!r}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / run_files.CHECKPOINTS
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self.required = tuple(required)  # files every checkpoint must list to verify
        self._log = log or (lambda event, info: None)
        self._commit_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None

    # ---------------------------------------------------------------------------------- saving

    def save(self, step: int, payload: Payload) -> Path:
        """Write and commit the checkpoint of `step`; returns its folder. Waits for (and raises
        the error of) a background save first."""
        self.wait()
        self._check(step, payload)
        return self._commit(step, payload)

    def save_async(self, step: int, payload: Payload) -> None:
        """Commit in a background thread. The payload must be host copies nobody changes until
        the save is done. Waits for a save in flight first and raises its error."""
        self.wait()
        self._check(step, payload)
        if payload.shards is not None:
            raise ValueError("save_async: a payload with shards is written by save() (collective)")
        for name, tensor in self._all_tensors(payload):
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"save_async: {name} is on {tensor.device}; copy the state to host memory "
                    "first (steadytrain.checkpoint.state.to_host), so training can go on meanwhile"
                )
        thread = threading.Thread(
            target=self._run_in_background,
            args=(step, payload),
            name=f"steadytrain-checkpoint-{step}",
            daemon=False,  # interpreter exit waits for the commit
        )
        self._thread = thread
        _stores_with_saves.add(self)
        thread.start()

    def in_flight(self) -> bool:
        """Whether a background save is still writing."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self) -> Path | None:
        """Wait for the background save; return its folder, or raise its error. None when no
        save was in flight."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        result, self._result = self._result, None
        if error is not None:
            raise error
        return result

    def _run_in_background(self, step: int, payload: Payload) -> None:
        try:
            self._result = self._commit(step, payload)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by wait()
            self._error = exc

    @staticmethod
    def _all_tensors(payload: Payload) -> Iterable[tuple[str, torch.Tensor]]:
        for file, tensors in payload.tensors.items():
            for key, tensor in tensors.items():
                yield f"{file}:{key}", tensor
        for file, obj in payload.objects.items():
            for tensor in _tensors_in(obj):
                yield file, tensor

    @staticmethod
    def _check(step: int, payload: Payload) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
            raise ValueError(f"step must be an integer in 0..{_MAX_STEP}, got {step!r}")
        names = payload.names()
        if len(set(names)) != len(names):
            raise ValueError(f"payload file names repeat: {sorted(names)}")
        for name in names:
            if not _FILE_NAME.match(name) or name == MANIFEST:
                raise ValueError(
                    f"payload file name {name!r}: use letters, digits, '.', '_' or '-', "
                    f"not starting with '.', and not {MANIFEST}"
                )
        for kind, files in (("tensors", payload.tensors), ("objects", payload.objects)):
            for name in files:
                if _kind(name) != kind:
                    raise ValueError(
                        f"payload.{kind}[{name!r}]: tensors files end in .safetensors, json files "
                        "in .json, objects files in anything else (e.g. .pt)"
                    )
        for name in payload.json:
            if _kind(name) != "json":
                raise ValueError(f"payload.json[{name!r}]: json file names end in .json")
        for name, tensors in payload.tensors.items():
            for key, tensor in tensors.items():
                if not isinstance(key, str) or key == "__metadata__":
                    raise ValueError(f"{name}: tensor name {key!r} is not allowed")
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"{name}: {key!r} is a {type(tensor).__name__}, not a tensor")

    def _commit(self, step: int, payload: Payload) -> Path:
        with self._commit_lock:
            make_folder(self.root, root=run_files.top(self.run_dir))  # checkpoints/ not a link
            self._clean_leftovers()
            name = _dir_name(step)
            final = self.root / name
            replacing = False
            if os.path.lexists(final):
                problems = self._problems(final)
                if not problems:
                    if payload.shards is not None:
                        payload.shards(None)  # the other ranks learn there is nothing to write
                    self._log("checkpoint_exists", {"step": step, "checkpoint": name})
                    newest = self.committed()[-1][1]
                    if newest == final and self._read_pointer(quiet=True) != name:
                        self._write_pointer(name)
                    return final
                self._log("checkpoint_replaced", {"checkpoint": name, "problems": problems})
                replacing = True
            staging = self._stage(step, name, payload)
            try:
                if replacing:
                    self._remove(final, reason="replaced by a new save of the same step")
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            finally:
                _forget(staging.name)
            sync_dir(self.root)
            _fault("after-publish")
            try:
                self._write_pointer(name)
            except OSError as exc:  # committed anyway; latest() does not need the pointer
                self._log("checkpoint_pointer_failed", {"checkpoint": name, "error": str(exc)})
            self._retain(final)
            return final

    def _stage(self, step: int, name: str, payload: Payload) -> Path:
        """Write every file and the manifest into a new staging folder; fsync it all."""
        staging = self.root / f".staging-{name}-{os.getpid()}-{secrets.token_hex(4)}"
        _remember(staging.name)
        try:
            staging.mkdir()
            files: dict[str, dict[str, Any]] = {}
            first_tensor_file = True
            for file, tensors in payload.tensors.items():
                parts, total = _safetensors_parts(tensors)
                fault_at = (total // 2, lambda: _fault("mid-write")) if first_tensor_file else None
                first_tensor_file = False
                files[file] = self._write_file(staging / file, parts, fault_at)
            for file, obj in payload.objects.items():
                files[file] = self._write_object(staging / file, obj)
            for file, value in payload.json.items():
                files[file] = self._write_file(staging / file, [_json_bytes(value)])
            if payload.shards is not None:
                payload.shards(staging)
                files |= self._others_files(staging, files)
            _fault("before-manifest")
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "fingerprint": self.fingerprint,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "steadytrain": __version__,
                "files": files,
            }
            self._write_file(staging / MANIFEST, [_json_bytes(manifest)])
            sync_dir(staging)
            _fault("after-manifest")
            return staging
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            _forget(staging.name)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(name, payload, exc) from exc
            raise

    @staticmethod
    def _others_files(staging: Path, own: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Size and sha256 of the files other writers put into the staging folder (fsynced by
        them; the folder is synced with the manifest)."""
        found = {}
        for name in sorted(set(os.listdir(staging)) - set(own)):
            if not (_FILE_NAME.match(name) or SHARD_FILE.match(name)):
                raise ValueError(f"a shard writer left {name!r} in {staging}; refused")
            found[name] = {
                "sha256": _sha256_file(staging / name),
                "bytes": (staging / name).stat().st_size,
            }
        return found

    def _write_file(
        self,
        path: Path,
        parts: Iterable[Any],
        fault_at: tuple[int, Callable[[], None]] | None = None,
    ) -> dict[str, Any]:
        return _write_parts(path, parts, fault_at)

    def _write_object(self, path: Path, obj: Any) -> dict[str, Any]:
        sink = _FileSink(path)
        try:
            torch.save(obj, sink)
        except BaseException as exc:
            sink.close(sync=False)
            if isinstance(exc, RuntimeError) and sink.error is not None:
                raise sink.error from None  # our write failed inside torch's C++ writer
            raise
        sink.close()
        return {"sha256": sink.hash.hexdigest(), "bytes": sink.bytes}

    def _disk_full(self, name: str, payload: Payload, exc: OSError) -> DiskFullError:
        needed = _payload_bytes(payload)
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = 0
        newest = self.committed()
        kept = (
            f"the previous checkpoint {newest[-1][1].name} is untouched and still the latest"
            if newest
            else "no earlier checkpoint exists"
        )
        return DiskFullError(
            f"disk full while writing checkpoint {self.root / name} ({exc.strerror or exc}): it "
            f"needs about {format_bytes(needed)} ({needed} bytes) and {format_bytes(free)} "
            f"({free} bytes) is free on that disk; {kept}. Old checkpoints are deleted only "
            f"after a new one is committed, so keep_last={self.keep_last} needs room for "
            f"{self.keep_last + 1} checkpoints. Free some space, lower keep_last, or use a "
            "run_dir on a bigger disk, then run again to resume.",
            path=self.root / name,
            needed=needed,
            free=free,
        )

    def _write_pointer(self, name: str) -> None:
        temp = self.root / f".latest-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        _remember(temp.name)
        try:
            self._write_file(temp, [memoryview(f"{name}\n".encode())])
            os.replace(temp, self.root / POINTER)
            sync_dir(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        finally:
            _forget(temp.name)

    # ------------------------------------------------------------------------------- retention

    def _retain(self, just_saved: Path) -> None:
        """Keep the newest `keep_last` committed checkpoints (and the one just saved)."""
        committed = self.committed()
        keep = {path for _, path in committed[-self.keep_last :]} | {just_saved}
        for _, path in committed:
            if path not in keep:
                self._remove(path, reason=f"keep_last={self.keep_last}")

    def _remove(self, path: Path, reason: str) -> None:
        """Rename to .deleting-* (it stops counting as committed at once), then delete."""
        doomed = self.root / f".deleting-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
        _remember(doomed.name)
        try:
            os.rename(path, doomed)
            _fault("during-retention")
            shutil.rmtree(doomed)
            self._log("checkpoint_deleted", {"checkpoint": path.name, "reason": reason})
        except OSError as exc:
            self._log(
                "checkpoint_delete_failed",
                {"checkpoint": path.name, "path": str(doomed), "error": str(exc)},
            )
        finally:
            _forget(doomed.name)

    # --------------------------------------------------------------------------------- reading

    def committed(self) -> list[tuple[int, Path]]:
        """Published checkpoint folders, oldest first; not verified. Symlinks are not counted."""
        found = []
        for entry in self._entries():
            step = _step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, Path(entry.path)))
        return sorted(found)

    def _entries(self) -> list[os.DirEntry]:
        try:
            with os.scandir(self.root) as entries:
                return list(entries)
        except FileNotFoundError:
            return []

    def latest(self, refused: Mapping[str, list[str]] | None = None) -> tuple[int, Path] | None:
        """The newest committed checkpoint that verifies; None when there is none at all.

        A checkpoint that fails is logged (`checkpoint_skipped`, with the file and what failed)
        and the next older one is tried. `refused`: checkpoints (folder name -> problems) the
        caller found damaged as it loaded them (and logged): passed over as failing. Raises
        CheckpointError when checkpoints exist but none verifies, and when the newest one was
        written by a newer steadytrain.
        """
        self._clean_leftovers()
        pointer = self._read_pointer()
        refused = refused or {}
        failures: list[tuple[str, list[str]]] = []
        for entry in self._entries():  # symlinks and files under a checkpoint name
            if _step_of(entry.name) is not None and not entry.is_dir(follow_symlinks=False):
                what = "a symlink" if entry.is_symlink() else "not a folder"
                problems = [f"{entry.name} is {what}; checkpoints are plain folders, refused"]
                self._log("checkpoint_skipped", {"checkpoint": entry.name, "problems": problems})
                failures.append((entry.name, problems))
        committed = self.committed()
        names = {path.name for _, path in committed}
        if pointer is not None and pointer not in names:
            self._log(
                "checkpoint_pointer_ignored",
                {"pointer": pointer, "reason": "names no committed checkpoint folder"},
            )
        for step, path in reversed(committed):
            if path.name in refused:
                failures.append((path.name, list(refused[path.name])))
                continue
            problems = self._problems(path)
            if not problems:
                if pointer is not None and pointer != path.name and pointer in names:
                    self._log(
                        "checkpoint_pointer_ignored",
                        {
                            "pointer": pointer,
                            "using": path.name,
                            "reason": "the newest checkpoint that verifies is another one",
                        },
                    )
                return step, path
            self._log(
                "checkpoint_skipped",
                {"checkpoint": path.name, "path": str(path), "problems": problems},
            )
            failures.append((path.name, problems))
        if not failures:
            if not os.path.lexists(self.root / POINTER):
                return None
            failures = [(POINTER, [f"names {pointer or 'nothing usable'}; no checkpoint folder"])]
        lines = "\n".join(f"  {name}: {'; '.join(problems)}" for name, problems in failures)
        raise CheckpointError(
            f"no checkpoint in {self.root} verifies; steadytrain does not start over "
            f"silently:\n{lines}\nRestore a checkpoint folder from a backup, or start this run "
            f"from scratch by moving {self.root} away (or by using another run_dir)."
        )

    def load(self, path: str | Path) -> Payload:
        """Verify the checkpoint, then read it. Raises CheckpointError naming the file."""
        path = Path(path)
        if _step_of(path.name) is None:
            raise CheckpointError(f"{path}: not a checkpoint folder name (step-NNNNNNNN)")
        if os.path.realpath(path.parent) != os.path.realpath(self.root):
            raise CheckpointError(f"{path}: not inside {self.root}; refused")
        manifest, problems = self._verify(path)
        if problems:
            raise CheckpointError(
                f"checkpoint {path} does not verify:\n  "
                + "\n  ".join(problems)
                + f"\nMove it out of {self.root} and the run resumes from the one before it."
            )
        payload = Payload()
        for name in manifest["files"]:
            file = path / name
            kind = _kind(name)
            try:
                if kind == "sharded":
                    payload.sharded.append(name)
                elif kind == "tensors":
                    payload.tensors[name] = load_file(file, device="cpu")
                elif kind == "json":
                    payload.json[name] = json.loads(file.read_bytes())
                else:
                    payload.objects[name] = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(_load_failure(file, kind, exc)) from exc
        return payload

    # ---------------------------------------------------------------------------- verification

    def _problems(self, folder: Path) -> list[str]:
        return self._verify(folder)[1]

    def _verify(self, folder: Path) -> tuple[dict[str, Any], list[str]]:
        """The manifest and what is wrong with the folder ([] = it verifies). Raises
        CheckpointError for a checkpoint of a newer steadytrain: falling back past it would
        throw work away."""
        try:
            self._check_path(folder, directory=True)
            manifest = self._read_manifest(folder)
        except _Refused as exc:
            return {}, [str(exc)]
        except (OSError, ValueError) as exc:
            return {}, [f"{MANIFEST}: {exc}"]
        problems = []
        if manifest["step"] != _step_of(folder.name):
            problems.append(f"{MANIFEST}: says step {manifest['step']}, folder is {folder.name}")
        listed = manifest["files"]
        needed = sorted(
            " or ".join(need) if isinstance(need, tuple) else need
            for need in self.required
            if listed and not set((need,) if isinstance(need, str) else need) & set(listed)
        )
        if not listed:
            problems.append(f"{MANIFEST}: lists no files; a checkpoint holds its state files")
        elif needed:
            problems.append(
                f"{MANIFEST}: does not list {needed}, which a checkpoint of this run holds"
            )
        present = {n for n in os.listdir(folder) if n != MANIFEST and n not in _OS_CLUTTER}
        missing = sorted(set(listed) - present)
        extra = sorted(present - set(listed))
        if missing or extra:
            problems.append(
                "files differ from the manifest: "
                f"missing {missing or 'none'}, extra {extra or 'none'}"
            )
        for name in sorted(set(listed) & present):
            file = folder / name
            expected = listed[name]
            try:
                self._check_path(file, directory=False)
                size = os.lstat(file).st_size
                if size != expected["bytes"]:
                    problems.append(
                        f"{name}: size {size} bytes, manifest says {expected['bytes']} "
                        "(truncated or overwritten)"
                    )
                elif _sha256_file(file) != expected["sha256"]:
                    problems.append(f"{name}: sha256 differs from the manifest (content changed)")
            except _Refused as exc:
                problems.append(str(exc))
            except OSError as exc:
                problems.append(f"{name}: cannot be read ({exc})")
        return manifest, problems

    def _check_path(self, path: Path, directory: bool) -> None:
        """Refuse symlinks and anything whose real path leaves the checkpoints folder, before
        reading it."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise _Refused(f"{path.name}: missing") from None
        if stat.S_ISLNK(mode):
            raise _Refused(f"{path.name} is a symlink; checkpoints hold plain files, refused")
        if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
            raise _Refused(f"{path.name}: not a {'folder' if directory else 'regular file'}")
        root = os.path.realpath(self.root)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise _Refused(f"{path.name}: resolves outside {self.root}; refused")

    def _read_manifest(self, folder: Path) -> dict[str, Any]:
        path = folder / MANIFEST
        if not os.path.lexists(path):
            raise ValueError("missing (the save did not finish)")
        self._check_path(path, directory=False)
        if os.lstat(path).st_size > _MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {format_bytes(_MAX_MANIFEST_BYTES)}; not a manifest")
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read()
        try:
            manifest = json.loads(raw)
        except ValueError as exc:  # not JSON, not UTF-8, an integer of thousands of digits
            raise ValueError(f"does not parse ({exc})") from None
        except RecursionError:
            raise ValueError("does not parse (nested thousands of levels deep)") from None
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        version = manifest.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            writer = manifest.get("steadytrain", "an unknown version")
            raise CheckpointError(
                f"checkpoint {folder} was written by steadytrain {writer} in checkpoint format "
                f"{version}; this is steadytrain {__version__}, which reads format "
                f"{FORMAT_VERSION}. Upgrade steadytrain to resume from it, or use another run_dir."
            )
        if version != FORMAT_VERSION:
            raise ValueError(f"format_version {version!r} is not one steadytrain knows")
        files = manifest.get("files")
        if not isinstance(manifest.get("step"), int) or not isinstance(files, dict):
            raise ValueError("'step' or 'files' is missing or of the wrong type")
        for name, entry in files.items():
            if not (_FILE_NAME.match(name) or SHARD_FILE.match(name)) or name == MANIFEST:
                raise ValueError(f"lists a file named {name!r}; refused")
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("bytes"), int)
                or not isinstance(entry.get("sha256"), str)
            ):
                raise ValueError(f"entry of {name} lacks 'bytes' or 'sha256'")
        return manifest

    def _read_pointer(self, quiet: bool = False) -> str | None:
        """The folder name in checkpoints/latest, if it is a plain file naming a checkpoint."""
        path = self.root / POINTER

        def ignored(reason: str, pointer: str | None = None) -> None:
            if not quiet:
                self._log("checkpoint_pointer_ignored", {"pointer": pointer, "reason": reason})

        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            ignored("checkpoints/latest is a symlink; refused without reading it")
            return None
        if not stat.S_ISREG(mode):
            ignored("checkpoints/latest is not a regular file")
            return None
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
            with os.fdopen(fd, "rb") as handle:
                raw = handle.read(64)
            text = raw.decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            ignored(f"cannot be read ({exc})")
            return None
        if _step_of(text) is None:
            ignored("not a checkpoint folder name (step-NNNNNNNN)", raw.decode("ascii", "replace"))
            return None
        return text

    # -------------------------------------------------------------------------------- leftovers

    def _clean_leftovers(self) -> None:
        """Remove staging, deleting and pointer-temp leftovers of killed saves. Never one that
        is in flight in this process, nor one of another live process."""
        for entry in self._entries():
            match = _LEFTOVER.match(entry.name)
            if match is None:
                continue
            kind, pid = match.group(1), int(match.group(2))
            with _active_lock:
                if entry.name in _active:
                    continue
            if pid != os.getpid() and psutil.pid_exists(pid):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue  # removed meanwhile by another cleaner
            except OSError as exc:
                self._log("checkpoint_leftover_failed", {"path": entry.path, "error": str(exc)})
                continue
            self._log(
                "checkpoint_leftover_removed",
                {"path": entry.path, "kind": {"latest": "pointer-temp"}.get(kind, kind)},
            )


def _remember(name: str) -> None:
    with _active_lock:
        _active.add(name)


def _forget(name: str) -> None:
    with _active_lock:
        _active.discard(name)


def _json_bytes(value: Any) -> memoryview:
    return memoryview(json.dumps(value, indent=1).encode())


def _load_failure(file: Path, kind: str, exc: Exception) -> str:
    if kind == "objects" and isinstance(exc, pickle.UnpicklingError):
        return (
            f"{file}: refused to unpickle it with weights_only=True: {str(exc).splitlines()[0]}. "
            "It holds something other than tensors, numbers, strings and plain containers, and "
            "code in it could run. steadytrain never retries with weights_only=False; if you "
            "wrote this file yourself and trust it, convert it to plain state, or start over."
        )
    return f"{file}: cannot be read as {kind} ({type(exc).__name__}: {exc})"
