"""Manifests for checkpoints another library wrote: a hash of every file, written after the save.

A library's save (Hugging Face's ``checkpoint-N/`` folder, Lightning's ``.ckpt`` file, the Keras
callback's files) is not known to be whole until steadytrain has hashed it: the manifest is written
last (temporary file, fsync, rename, fsync of the folder), so a checkpoint without one, or whose
files no longer match it, is one a kill cut short or something changed, and it is never resumed
from. A folder's manifest is ``FOLDER/steadytrain-manifest.json``; a file's is the sidecar
``FILE.steadytrain-manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from steadytrain import __version__, run_files
from steadytrain._durable import sync, write_atomic


def _sha256_file(path: Path) -> str:
    """The file's SHA-256, read in chunks, never through a link. Here and not from the checkpoint
    store, which imports torch: a Keras run on TensorFlow hashes its checkpoints without it."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb", buffering=0) as handle:
        while chunk := handle.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


MANIFEST_NAME = "steadytrain-manifest.json"
SIDECAR_SUFFIX = "." + MANIFEST_NAME


def manifest_path(target: Path) -> Path:
    target = Path(target)
    return (
        target / MANIFEST_NAME
        if target.is_dir()
        else target.with_name(target.name + SIDECAR_SUFFIX)
    )


def _files(target: Path) -> list[tuple[str, Path]]:
    if target.is_file():
        return [(target.name, target)]
    return sorted(
        (str(path.relative_to(target)), path)
        for path in target.rglob("*")
        if path.is_file()
        and path.name != MANIFEST_NAME
        and not path.name.startswith(".")  # a save in progress, or the OS's (.DS_Store, ._NAME)
        and not run_files.is_os_clutter(path.name)  # Explorer's Thumbs.db, desktop.ini
    )


def write_manifest(target: Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Hash every file of `target` (a folder or one file) and commit the manifest beside them."""
    target = Path(target)
    for _, path in _files(target):  # the library may not have flushed its files to the disk
        fd = os.open(path, os.O_RDONLY)
        try:
            sync(fd)
        finally:
            os.close(fd)
    manifest = {
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "steadytrain": __version__,
        "files": {
            name: {"bytes": path.stat().st_size, "sha256": _sha256_file(path)}
            for name, path in _files(target)
        },
        **(extra or {}),
    }
    final = manifest_path(target)
    write_atomic(final, json.dumps(manifest, indent=1), root=target.parent)
    return final


def read_manifest(target: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads(manifest_path(target).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def problems(target: Path) -> list[str]:
    """What is wrong with `target` against its manifest ([]: it verifies)."""
    target = Path(target)
    if not target.exists():
        return [f"{target}: missing"]
    manifest = read_manifest(target)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return [f"{manifest_path(target).name}: missing or unreadable (the save did not finish)"]
    listed = manifest["files"]
    present = dict(_files(target))
    found = []
    if set(listed) != set(present):
        missing, extra = sorted(set(listed) - set(present)), sorted(set(present) - set(listed))
        found.append(f"files differ from the manifest: missing {missing}, extra {extra}")
    for name in sorted(set(listed) & set(present)):
        path, entry = present[name], listed[name]
        if path.stat().st_size != entry.get("bytes"):
            found.append(f"{name}: size {path.stat().st_size}, manifest says {entry.get('bytes')}")
        elif _sha256_file(path) != entry.get("sha256"):
            found.append(f"{name}: sha256 differs from the manifest (content changed)")
    return found


def newest_verified(
    candidates: Iterable[tuple[int, Path]], record: Callable[[str, dict], None]
) -> tuple[int, Path] | None:
    """The newest (step, checkpoint) that verifies; each newer one that does not is recorded as
    a ``checkpoint_skipped`` event with its reasons."""
    for step, path in sorted(candidates, key=lambda c: (c[0], str(c[1])), reverse=True):
        found = problems(path)
        if not found:
            return step, path
        record("checkpoint_skipped", {"step": step, "checkpoint": str(path), "problems": found})
    return None


def remove_manifest(target: Path) -> None:
    """Forget a checkpoint the library deleted (its sidecar would otherwise outlive it)."""
    path = manifest_path(target)
    if path.name.endswith(SIDECAR_SUFFIX):
        path.unlink(missing_ok=True)
