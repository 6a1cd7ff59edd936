"""Flushing to stable storage: what makes a write or a rename survive a power cut, and the two
ways steadytrain replaces something a reader may be looking at: one file (`write_atomic`) or a
whole folder (`sync_tree` then `replace_dir`). No torch here, so the light commands (config,
report) and the supervisor can use it."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path


def sync(fd: int) -> None:
    """Flush a file or directory to stable storage. macOS fsync stops at the drive's cache;
    F_FULLFSYNC goes through it."""
    if sys.platform == "darwin":
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
    os.fsync(fd)


def sync_dir(path: Path) -> None:
    """Make a create, rename or delete in the folder `path` durable (POSIX). A no-op on Windows,
    where folders cannot be opened and NTFS journals renames itself."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `data`: write a temporary file in the same folder, flush it, rename
    it over `path`, flush the folder. A reader (a resume, a browser refreshing, the supervisor)
    sees the old file or the new one, never a part; a failure leaves the old file and no
    temporary. `durable=False` skips the flushes, for files rewritten every second whose loss
    in a power cut costs nothing (the heartbeat)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(payload)
            if durable:
                handle.flush()
                sync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        with contextlib.suppress(OSError):  # the file is in place; the folder flush is best effort
            sync_dir(path.parent)


def sync_tree(folder: Path) -> None:
    """Flush every file directly in `folder`, then the folder itself: a staging folder is
    complete on disk before `replace_dir` publishes it."""
    for item in folder.iterdir():
        if item.is_file():
            with open(item, "rb") as handle:
                sync(handle.fileno())
    sync_dir(folder)


def replace_dir(staging: Path, target: Path) -> None:
    """Put the complete folder `staging` at `target`. An old `target` is moved aside first and
    deleted only after the new one is in place; if the rename fails the old one comes back."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)
        raise
    with contextlib.suppress(OSError):  # the folder is in place; the flush is best effort
        sync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
