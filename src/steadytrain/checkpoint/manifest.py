"""What a committed checkpoint is, and the check of one before anything in it is read: the one
manifest of hashes, for the checkpoints steadytrain's store writes and those another library
writes under an integration. Imports no torch: a Keras run on TensorFlow hashes and verifies its
checkpoints with it.

    checkpoints/step-00000250/   the payload's files + MANIFEST.json (size and sha256 of each)
    checkpoints/latest           names the newest committed folder (a hint, verified)

`verify` reads MANIFEST.json (bounded, never through a link) and checks the folder against it:
the step, the files every checkpoint of the run holds, no file missing or added, each file's
size and sha256. Nothing that is a link, or whose real path leaves the checkpoints folder, is
read (`check_path`). `read_pointer` reads `latest` back the same way.

A library's save (Hugging Face's ``checkpoint-N/`` folder, Lightning's ``.ckpt`` file, the Keras
callback's files, a file a `RunGuard` loop saved) is not known to be whole until steadytrain has
hashed it: `write_library_manifest` writes the same table of files (``file_entry``) last
(temporary file, fsync, rename, fsync of the folder), so a checkpoint without one, or whose files
no longer match it (`library_problems`, the same comparison as `verify`'s: `file_problems`), is
one a kill cut short or something changed, and it is never resumed from. A folder's is
``FOLDER/steadytrain-manifest.json``; a file's is the sidecar ``FILE.steadytrain-manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from steadytrain._units import format_bytes
from steadytrain._version import __version__
from steadytrain.errors import CheckpointError
from steadytrain.run import files as run_files
from steadytrain.run.durable import sync, write_atomic
from steadytrain.run.records import Record

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
POINTER = run_files.LATEST
NAME = re.compile(r"^step-(\d{8,12})$")
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHARD_FILE = re.compile(r"^(\.metadata|__\d{1,6}_\d{1,6}\.distcp)$")
"""The names torch.distributed.checkpoint's file writer gives its files (sharded checkpoints)."""
OS_CLUTTER = run_files.OS_CLUTTER
is_os_clutter = run_files.is_os_clutter  # no checkpoint file is named so (`FILE_NAME`)


MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """The file's SHA-256, read in chunks, never through a link."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A file's line of a manifest: its size and sha256, read back from the disk."""
    return {"sha256": sha256_file(path), "bytes": os.lstat(path).st_size}


def file_problems(
    listed: dict[str, Any],
    present: dict[str, Path],
    check: Callable[[Path], None] | None = None,
) -> list[str]:
    """What differs between a manifest's files (`listed`: name -> its entry) and those found
    (`present`: name -> path): a file missing or added, a size, a sha256 ([]: they match).
    `check(path)` may refuse a file before it is read (raises `Refused`)."""
    problems = []
    missing = sorted(set(listed) - set(present))
    extra = sorted(set(present) - set(listed))
    if missing or extra:
        problems.append(
            f"files differ from the manifest: missing {missing or 'none'}, extra {extra or 'none'}"
        )
    for name in sorted(set(listed) & set(present)):
        file, expected = present[name], listed[name]
        try:
            if check is not None:
                check(file)
            size = os.lstat(file).st_size
            if not isinstance(expected, dict) or size != expected.get("bytes"):
                said = expected.get("bytes") if isinstance(expected, dict) else None
                problems.append(
                    f"{name}: size {size} bytes, manifest says {said} (truncated or overwritten)"
                )
            elif sha256_file(file) != expected.get("sha256"):
                problems.append(f"{name}: sha256 differs from the manifest (content changed)")
        except Refused as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"{name}: cannot be read ({exc})")
    return problems


def dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a canonical checkpoint folder name, else None (`step-250`, `../x`: None)."""
    match = NAME.match(name)
    if match is None or dir_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def file_kind(name: str) -> str:
    """What a file of a checkpoint holds, by its name."""
    if SHARD_FILE.match(name):
        return "sharded"
    if name.endswith(".safetensors"):
        return "tensors"
    if name.endswith(".json"):
        return "json"
    return "objects"


class Refused(Exception):
    """A path that must not be touched (symlink, outside the checkpoints folder)."""


def verify(
    folder: Path, root: Path, required: tuple[str | tuple[str, ...], ...]
) -> tuple[dict[str, Any], list[str]]:
    """The manifest and what is wrong with the folder ([] = it verifies). Raises
    CheckpointError for a checkpoint of a newer steadytrain: falling back past it would
    throw work away."""
    try:
        check_path(folder, root, directory=True)
        manifest = read_manifest(folder, root)
    except Refused as exc:
        return {}, [str(exc)]
    except (OSError, ValueError) as exc:
        return {}, [f"{MANIFEST}: {exc}"]
    problems = []
    if manifest["step"] != step_of(folder.name):
        problems.append(f"{MANIFEST}: says step {manifest['step']}, folder is {folder.name}")
    listed = manifest["files"]
    needed = sorted(
        " or ".join(need) if isinstance(need, tuple) else need
        for need in required
        if listed and not set((need,) if isinstance(need, str) else need) & set(listed)
    )
    if not listed:
        problems.append(f"{MANIFEST}: lists no files; a checkpoint holds its state files")
    elif needed:
        problems.append(f"{MANIFEST}: does not list {needed}, which a checkpoint of this run holds")
    present = {n: folder / n for n in os.listdir(folder) if n != MANIFEST and not is_os_clutter(n)}
    problems += file_problems(listed, present, lambda f: check_path(f, root, directory=False))
    return manifest, problems


def check_path(path: Path, root: Path, directory: bool) -> None:
    """Refuse symlinks and anything whose real path leaves the checkpoints folder, before
    reading it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise Refused(f"{path.name}: missing") from None
    if stat.S_ISLNK(mode):
        raise Refused(f"{path.name} is a symlink; checkpoints hold plain files, refused")
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise Refused(f"{path.name}: not a {'folder' if directory else 'regular file'}")
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise Refused(f"{path.name}: resolves outside {root}; refused")


def read_manifest(folder: Path, root: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not os.path.lexists(path):
        raise ValueError("missing (the save did not finish)")
    check_path(path, root, directory=False)
    if os.lstat(path).st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"larger than {format_bytes(MAX_MANIFEST_BYTES)}; not a manifest")
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
        if not (FILE_NAME.match(name) or SHARD_FILE.match(name)) or name == MANIFEST:
            raise ValueError(f"lists a file named {name!r}; refused")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise ValueError(f"entry of {name} lacks 'bytes' or 'sha256'")
    return manifest


def read_pointer(root: Path, ignored: Callable[[str, str | None], None]) -> str | None:
    """The folder name in checkpoints/latest, if it is a plain file naming a checkpoint; else
    None, and `ignored(reason, what it holds or None)` says why (a missing pointer says
    nothing)."""
    path = root / POINTER
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        ignored("checkpoints/latest is a symlink; refused without reading it", None)
        return None
    if not stat.S_ISREG(mode):
        ignored("checkpoints/latest is not a regular file", None)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(64)
        text = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        ignored(f"cannot be read ({exc})", None)
        return None
    if step_of(text) is None:
        ignored("not a checkpoint folder name (step-NNNNNNNN)", raw.decode("ascii", "replace"))
        return None
    return text


# -- a checkpoint another library wrote (an integration's) -----------------------------------

LIBRARY_MANIFEST = "steadytrain-manifest.json"
SIDECAR_SUFFIX = "." + LIBRARY_MANIFEST


def library_manifest_path(target: Path) -> Path:
    """Where the manifest of a library's checkpoint `target` is: inside a folder, beside a file."""
    target = Path(target)
    if target.is_dir():
        return target / LIBRARY_MANIFEST
    return target.with_name(target.name + SIDECAR_SUFFIX)


def _library_files(target: Path) -> dict[str, Path]:
    if target.is_file():
        return {target.name: target}
    return {
        str(path.relative_to(target)): path
        for path in sorted(target.rglob("*"))
        if path.is_file()
        and path.name != LIBRARY_MANIFEST
        and not path.name.startswith(".")  # a save in progress, or the OS's (.DS_Store, ._NAME)
        and not is_os_clutter(path.name)  # Explorer's Thumbs.db, desktop.ini
    }


def write_library_manifest(target: Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Hash every file of `target` (a folder or one file) and commit the manifest beside them."""
    target = Path(target)
    files = _library_files(target)
    for path in files.values():  # the library may not have flushed its files to the disk
        fd = os.open(path, os.O_RDONLY)
        try:
            sync(fd)
        finally:
            os.close(fd)
    manifest = {
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "steadytrain": __version__,
        "files": {name: file_entry(path) for name, path in files.items()},
        **(extra or {}),
    }
    final = library_manifest_path(target)
    write_atomic(final, json.dumps(manifest, indent=1), root=target.parent)
    return final


def read_library_manifest(target: Path) -> dict[str, Any] | None:
    """The manifest of a library's checkpoint, or None where it is missing or unreadable."""
    try:
        manifest = json.loads(library_manifest_path(target).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def library_problems(target: Path) -> list[str]:
    """What is wrong with a library's checkpoint `target` against its manifest ([]: verifies)."""
    target = Path(target)
    if not target.exists():
        return [f"{target}: missing"]
    manifest = read_library_manifest(target)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        name = library_manifest_path(target).name
        return [f"{name}: missing or unreadable (the save did not finish)"]
    return file_problems(manifest["files"], _library_files(target))


def newest_verified(
    candidates: Iterable[tuple[int, Path]], record: Callable[[str, dict], None]
) -> tuple[int, Path] | None:
    """The newest (step, library checkpoint) that verifies; each newer one that does not is
    recorded as a ``checkpoint_skipped`` event with its reasons."""
    for step, path in sorted(candidates, key=lambda c: (c[0], str(c[1])), reverse=True):
        found = library_problems(path)
        if not found:
            return step, path
        record(
            Record.CHECKPOINT_SKIPPED, {"step": step, "checkpoint": str(path), "problems": found}
        )
    return None


def remove_library_manifest(target: Path) -> None:
    """Forget a checkpoint the library deleted (its sidecar would otherwise outlive it)."""
    path = library_manifest_path(target)
    if path.name.endswith(SIDECAR_SUFFIX):
        path.unlink(missing_ok=True)
