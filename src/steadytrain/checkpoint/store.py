"""Checkpoint storage: atomic commit, verification on load, keep-last-K, background writes.

Knows files, not models: a `Payload` is a set of named files (safetensors tensors, pickled
objects read back with weights_only=True, JSON) and `CheckpointStore` commits, finds, verifies,
loads and prunes them under RUN_DIR/checkpoints:

    step-00000250/            one committed checkpoint: the payload's files + MANIFEST.json
    latest                    text file naming the newest committed folder (a hint, verified)
    .staging-step-...-PID-X   a save in progress (or left by a killed one): never read
    .deleting-step-...-PID-X  an old checkpoint being removed: never read

A checkpoint is committed when its folder has the final name; it gets that name only after every
file and MANIFEST.json (size and sha256 of each file, written last) are fsynced. Every file
carries the checkpoint's tie (its step and an id drawn for the save, tie.py), so a file copied
in from another checkpoint is refused on load even when its manifest line was re-signed. See
docs/checkpoints.md for the sequence, the reasons, and what each error means.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import pickle
import secrets
import shutil
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from steadytrain._units import format_bytes
from steadytrain._version import __version__
from steadytrain.checkpoint.file_io import (
    fault,
    json_bytes,
    safetensors_parts,
    write_object,
    write_parts,
)
from steadytrain.checkpoint.leftovers import clean_leftovers, forget, remember
from steadytrain.checkpoint.manifest import (
    FILE_NAME,
    FORMAT_VERSION,
    MANIFEST,
    POINTER,
    SHARD_FILE,
    dir_name,
    file_entry,
    file_kind,
    read_pointer,
    step_of,
    verify,
)
from steadytrain.checkpoint.payload import Payload, all_tensors, check_payload, payload_bytes
from steadytrain.checkpoint.tie import Tie, header_tie, tie_problems, tied, untied
from steadytrain.errors import CheckpointError, DiskFullError, RunNotWritableError
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, sync_dir
from steadytrain.run.records import Record

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
        check_payload(step, payload)
        return self._commit(step, payload)

    def save_async(
        self,
        step: int,
        payload: Payload,
        on_commit: Callable[[Path], None] | None = None,
    ) -> None:
        """Commit in a background thread. The payload must be host copies nobody changes until
        the save is done. Waits for a save in flight first and raises its error. `on_commit`
        (the folder) runs in that thread once the checkpoint is committed: what says so is said
        then, whatever the training thread is doing (a step that hangs, a kill on its way);
        an error it raises is the save's, raised by `wait()`."""
        self.wait()
        check_payload(step, payload)
        if payload.shards is not None:
            raise ValueError("save_async: a payload with shards is written by save() (collective)")
        for name, tensor in all_tensors(payload):
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"save_async: {name} is on {tensor.device}; copy the state to host memory "
                    "first (steadytrain.checkpoint.state.to_host), so training can go on meanwhile"
                )
        thread = threading.Thread(
            target=self._run_in_background,
            args=(step, payload, on_commit),
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

    def _run_in_background(
        self, step: int, payload: Payload, on_commit: Callable[[Path], None] | None
    ) -> None:
        try:
            self._result = self._commit(step, payload)
            if on_commit is not None:
                on_commit(self._result)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by wait()
            self._error = exc

    def _commit(self, step: int, payload: Payload) -> Path:
        with self._commit_lock:
            make_folder(self.root, root=run_files.top(self.run_dir))  # checkpoints/ not a link
            clean_leftovers(self._entries(), self._log)
            name = dir_name(step)
            final = self.root / name
            replacing = False
            if os.path.lexists(final):
                manifest, problems = self._verify(final)
                problems = problems or self._mixed(final, manifest)
                if not problems:
                    if payload.shards is not None:
                        payload.shards(None, None)  # the other ranks learn: nothing to write
                    self._log(Record.CHECKPOINT_EXISTS, {"step": step, "checkpoint": name})
                    newest = self.committed()[-1][1]
                    if newest == final and self._read_pointer(quiet=True) != name:
                        self._write_pointer(name)
                    return final
                self._log(Record.CHECKPOINT_REPLACED, {"checkpoint": name, "problems": problems})
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
                forget(staging.name)
            sync_dir(self.root)
            fault("after-publish")
            try:
                self._write_pointer(name)
            except OSError as exc:  # committed anyway; latest() does not need the pointer
                self._log(Record.CHECKPOINT_POINTER_FAILED, {"checkpoint": name, "error": str(exc)})
            self._retain(final)
            return final

    def _stage(self, step: int, name: str, payload: Payload) -> Path:
        """Write every file and the manifest into a new staging folder; fsync it all."""
        staging = self.root / f".staging-{name}-{os.getpid()}-{secrets.token_hex(4)}"
        remember(staging.name)
        tie = Tie.new(step)
        try:
            staging.mkdir()
            files: dict[str, dict[str, Any]] = {}
            first_tensor_file = True
            for file, tensors in payload.tensors.items():
                parts, total = safetensors_parts(tensors, tie.metadata())
                fault_at = (total // 2, lambda: fault("mid-write")) if first_tensor_file else None
                first_tensor_file = False
                files[file] = self._write_file(staging / file, parts, fault_at)
            for file, obj in payload.objects.items():
                files[file] = write_object(staging / file, tied(obj, tie))
            for file, value in payload.json.items():
                files[file] = self._write_file(staging / file, [json_bytes(tied(value, tie))])
            if payload.shards is not None:
                payload.shards(staging, tie)
                files |= self._others_files(staging, files)
            fault("before-manifest")
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "checkpoint": tie.id,
                "fingerprint": self.fingerprint,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "steadytrain": __version__,
                "files": files,
            }
            self._write_file(staging / MANIFEST, [json_bytes(manifest)])
            sync_dir(staging)
            fault("after-manifest")
            return staging
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            forget(staging.name)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(name, payload, exc) from exc
            if isinstance(exc, OSError) and exc.errno == errno.EROFS:  # remounted read-only
                raise RunNotWritableError(self.root, exc) from exc
            raise

    @staticmethod
    def _others_files(staging: Path, own: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Size and sha256 of the files other writers put into the staging folder (fsynced by
        them; the folder is synced with the manifest)."""
        found = {}
        for name in sorted(set(os.listdir(staging)) - set(own)):
            if not (FILE_NAME.match(name) or SHARD_FILE.match(name)):
                raise ValueError(f"a shard writer left {name!r} in {staging}; refused")
            found[name] = file_entry(staging / name)
        return found

    def _write_file(
        self,
        path: Path,
        parts: Iterable[Any],
        fault_at: tuple[int, Callable[[], None]] | None = None,
    ) -> dict[str, Any]:
        return write_parts(path, parts, fault_at)

    def _disk_full(self, name: str, payload: Payload, exc: OSError) -> DiskFullError:
        needed = payload_bytes(payload)
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
        remember(temp.name)
        try:
            self._write_file(temp, [memoryview(f"{name}\n".encode())])
            os.replace(temp, self.root / POINTER)
            sync_dir(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        finally:
            forget(temp.name)

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
        remember(doomed.name)
        try:
            os.rename(path, doomed)
            fault("during-retention")
            shutil.rmtree(doomed)
            self._log(Record.CHECKPOINT_DELETED, {"checkpoint": path.name, "reason": reason})
        except OSError as exc:
            self._log(
                Record.CHECKPOINT_DELETE_FAILED,
                {"checkpoint": path.name, "path": str(doomed), "error": str(exc)},
            )
        finally:
            forget(doomed.name)

    # --------------------------------------------------------------------------------- reading

    def committed(self) -> list[tuple[int, Path]]:
        """Published checkpoint folders, oldest first; not verified. Symlinks are not counted."""
        found = []
        for entry in self._entries():
            step = step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, Path(entry.path)))
        return sorted(found)

    def _entries(self) -> list[os.DirEntry]:
        try:
            with os.scandir(self.root) as entries:
                return list(entries)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointError(
                f"{self.root} is not a folder; steadytrain keeps a run's checkpoints in a folder "
                "there; move it away (the run then starts from scratch) or restore the folder"
            ) from None

    def latest(self, refused: Mapping[str, list[str]] | None = None) -> tuple[int, Path] | None:
        """The newest committed checkpoint that verifies; None when there is none at all.

        A checkpoint that fails is logged (`checkpoint_skipped`, with the file and what failed)
        and the next older one is tried. `refused`: checkpoints (folder name -> problems) the
        caller found damaged as it loaded them (and logged): passed over as failing. Raises
        CheckpointError when checkpoints exist but none verifies, and when the newest one was
        written by a newer steadytrain.
        """
        clean_leftovers(self._entries(), self._log)
        pointer = self._read_pointer()
        refused = refused or {}
        failures: list[tuple[str, list[str]]] = []
        for entry in self._entries():  # symlinks and files under a checkpoint name
            if step_of(entry.name) is not None and not entry.is_dir(follow_symlinks=False):
                what = "a symlink" if entry.is_symlink() else "not a folder"
                problems = [f"{entry.name} is {what}; checkpoints are plain folders, refused"]
                self._log(
                    Record.CHECKPOINT_SKIPPED, {"checkpoint": entry.name, "problems": problems}
                )
                failures.append((entry.name, problems))
        committed = self.committed()
        names = {path.name for _, path in committed}
        if pointer is not None and pointer not in names:
            self._log(
                Record.CHECKPOINT_POINTER_IGNORED,
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
                        Record.CHECKPOINT_POINTER_IGNORED,
                        {
                            "pointer": pointer,
                            "using": path.name,
                            "reason": "the newest checkpoint that verifies is another one",
                        },
                    )
                return step, path
            self._log(
                Record.CHECKPOINT_SKIPPED,
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
        if step_of(path.name) is None:
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
        ties: dict[str, Tie | None] = {}
        for name in manifest["files"]:
            file = path / name
            kind = file_kind(name)
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
        for files in (payload.objects, payload.json):
            for name, value in files.items():
                files[name] = _take_tie(path / name, value, ties)
        problems = _tie_problems(path, manifest, ties)
        if problems:
            raise CheckpointError(_mixed_message(path, self.root, problems))
        return payload

    # ---------------------------------------------------------------------------- verification

    def _problems(self, folder: Path) -> list[str]:
        return self._verify(folder)[1]

    def _mixed(self, folder: Path, manifest: dict[str, Any]) -> list[str]:
        """What ties a verified folder's files to other checkpoints ([]: nothing): read without
        loading the tensors (the pickles memory-mapped), for a save of a step already there."""
        ties: dict[str, Tie | None] = {}
        try:
            for name in manifest["files"]:
                kind, file = file_kind(name), folder / name
                if kind == "json":
                    _take_tie(file, json.loads(file.read_bytes()), ties)
                elif kind == "objects":
                    value = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                    _take_tie(file, value, ties)
            return _tie_problems(folder, manifest, ties)
        except CheckpointError as exc:
            return [str(exc)]
        except Exception as exc:  # noqa: BLE001 - unreadable: the new save replaces it
            return [f"{folder.name}: cannot be read ({type(exc).__name__}: {exc})"]

    def _verify(self, folder: Path) -> tuple[dict[str, Any], list[str]]:
        return verify(folder, self.root, self.required)

    def _read_pointer(self, quiet: bool = False) -> str | None:
        """The folder name in checkpoints/latest, if it is a plain file naming a checkpoint;
        why not is logged unless `quiet`."""

        def ignored(reason: str, pointer: str | None) -> None:
            if not quiet:
                self._log(Record.CHECKPOINT_POINTER_IGNORED, {"pointer": pointer, "reason": reason})

        return read_pointer(self.root, ignored)


def _take_tie(file: Path, value: Any, ties: dict[str, Tie | None]) -> Any:
    """`value` (a pickled or JSON file's) without its tie, which goes into `ties` under the
    file's name when the value can carry one (a dict)."""
    if not isinstance(value, dict):
        return value
    try:
        value, ties[file.name] = untied(value)
    except ValueError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return value


def _tie_problems(folder: Path, manifest: dict[str, Any], ties: dict[str, Tie | None]) -> list[str]:
    """What ties the checkpoint in `folder` to others: each safetensors file's header tie (read
    here, the header only) and the `ties` of the other files, against the manifest's."""
    for name in manifest["files"]:
        if file_kind(name) != "tensors":
            continue
        file = folder / name
        try:
            with safe_open(file, framework="pt") as handle:
                ties[name] = header_tie(handle.metadata())
        except ValueError as exc:
            raise CheckpointError(f"{file}: {exc}") from None
    ordered = {name: ties[name] for name in manifest["files"] if name in ties}
    return tie_problems(manifest["step"], manifest.get("checkpoint"), ordered)


def _mixed_message(path: Path, root: Path, problems: list[str]) -> str:
    """The refusal of a checkpoint whose files belong to different checkpoints: the first line
    names each such file (a `checkpoint_skipped` record keeps the first line)."""
    return (
        f"{path}: mixes files of different checkpoints: {'; '.join(problems)}\n"
        f"Move it out of {root} and the run resumes from the one before it."
    )


def _load_failure(file: Path, kind: str, exc: Exception) -> str:
    if kind == "objects" and isinstance(exc, pickle.UnpicklingError):
        return (
            f"{file}: refused to unpickle it with weights_only=True: {str(exc).splitlines()[0]}. "
            "It holds something other than tensors, numbers, strings and plain containers, and "
            "code in it could run. steadytrain never retries with weights_only=False; if you "
            "wrote this file yourself and trust it, convert it to plain state, or start over."
        )
    return f"{file}: cannot be read as {kind} ({type(exc).__name__}: {exc})"
