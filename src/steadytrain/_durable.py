"""Flushing to stable storage: what makes a write or a rename survive a power cut, and the two
ways steadytrain replaces something a reader may be looking at: one file (`write_atomic`) or a
whole folder (`sync_tree` then `replace_dir`). Writes in a run directory never go through a
planted symbolic link, and a full disk is named as such (exit 6). No torch here, so the light
commands (config, report) and the supervisor can use it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path

from steadytrain.errors import BadInputError, RunDiskFullError, is_disk_full


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


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def refuse_link(path: str | os.PathLike) -> None:
    """BadInputError when `path` is a symbolic link: a link planted in a run directory could send
    a write anywhere (steadytrain often runs as root), so no write goes through one."""
    if os.path.islink(path):
        raise BadInputError(
            f"{os.fspath(path)} is a symbolic link (to {os.readlink(path)}); steadytrain never "
            "writes through a link in a run directory; remove the link and run again"
        )


def write_error(path: str | os.PathLike, exc: OSError) -> Exception:
    """The error to raise for a failed write of `path`: a planted link (exit 2), a full disk
    (exit 6), else `exc` itself."""
    if exc.errno == errno.ELOOP or os.path.islink(path):
        try:
            refuse_link(path)
        except BadInputError as refused:
            return refused
    if is_disk_full(exc):
        return RunDiskFullError(path, exc)
    return exc


def open_for_append(path: str | os.PathLike) -> int:
    """A descriptor appending to `path` (created if missing), never through a symbolic link."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o644)
    except OSError as exc:
        raise write_error(path, exc) from None


def write_all(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Write every byte of `data` to `fd` (a short write is continued); a full disk is
    RunDiskFullError naming `path`."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise write_error(path, exc) from None


def write_atomic(path: str | os.PathLike, data: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `data`: a temporary file in the same folder (created afresh, never
    through a link), flushed, renamed over `path`, then the folder flushed. A reader sees the old
    file or the new one; a failure leaves the old file and no temporary. A link at `path` is
    refused; a full disk is RunDiskFullError. `durable=False` skips the flushes."""
    path = Path(path)
    refuse_link(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a killed writer with this PID, or a planted link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
        try:
            write_all(fd, payload, path)
            if durable:
                sync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
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
