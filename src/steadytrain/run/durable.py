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
import signal
import stat
import sys
from pathlib import Path

from steadytrain.errors import (
    NOT_WRITABLE_ERRNOS,
    BadInputError,
    RunDiskFullError,
    RunNotWritableError,
    is_disk_full,
)
from steadytrain.run import env as run_env


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
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_AT = os.name != "nt" and os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd


def refuse_link(path: str | os.PathLike) -> None:
    """BadInputError when `path` is a symbolic link: a link planted in a run directory could send
    a write anywhere (steadytrain often runs as root), so no write goes through one."""
    if os.path.islink(path):
        raise _link_error(path)


def _link_error(path: str | os.PathLike) -> BadInputError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return BadInputError(
        f"{os.fspath(path)} is a symbolic link{to}; steadytrain never writes through a link in "
        "a run directory; remove the link and run again"
    )


# -- the one writer of the files a run writes ---------------------------------------------------
#
# Every file under a run directory is written through `open_in_run` (a stream: a JSONL file, a
# log, a hang report) or `write_atomic` (a file replaced whole). Both take the run directory as
# `root`: the folders from `root` down to the file are opened one by one without following a
# link (openat with O_NOFOLLOW | O_DIRECTORY, created when missing), and the file itself is
# opened with O_NOFOLLOW relative to its folder's descriptor, so a link planted at the file or
# at any folder on the way (hangs/, errors/, ranks/rank-1/) is refused, not written through,
# with no window between the check and the write. `root` itself may be a link: it is the folder
# the user named. A file replaced whole goes through a fresh temporary and a rename, so a hard
# link planted at its name is replaced, never written into; a stream refuses a hard link.


def _run_root(path: Path, root: str | os.PathLike | None) -> Path:
    root = Path(root) if root is not None else path.parent
    try:
        path.relative_to(root)
    except ValueError:
        raise ValueError(f"{path} is not inside the run directory {root}") from None
    return root


def _open_folder(folder: Path, root: Path, create: bool = True) -> int:
    """A descriptor of `folder` (inside `root`), reached from `root` one folder at a time
    without following a link; missing folders are made when `create`. A link (or a file) on
    the way is BadInputError naming it."""
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(root, exc) from None
    if not _AT:  # Windows: a check per folder (no openat there)
        here = root
        for part in folder.relative_to(root).parts:
            here = here / part
            refuse_link(here)
            if create:
                try:
                    here.mkdir(exist_ok=True)
                except OSError as exc:
                    raise write_error(here, exc) from None
        return -1
    fd = os.open(root, os.O_RDONLY | DIRECTORY)
    here = root
    try:
        for part in folder.relative_to(root).parts:
            here = here / part
            inner = _open_dir_at(part, fd, here, create)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_at(name: str, fd: int, path: Path, create: bool) -> int:
    for _ in range(2):
        try:
            return os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass  # made meanwhile (another rank): open it
            except OSError as exc:
                raise write_error(path, exc) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                if os.path.islink(path):
                    raise _link_error(path) from None
                raise BadInputError(
                    f"{path} is not a folder; steadytrain writes its files in a folder there; "
                    "move it away and run again"
                ) from None
            raise write_error(path, exc) from None
    return os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)


def make_folder(path: str | os.PathLike, *, root: str | os.PathLike) -> Path:
    """Make the folder `path` inside the run directory `root` (and those on the way), never
    through a link."""
    path = Path(path)
    fd = _open_folder(path, _run_root(path, root))
    if fd >= 0:
        os.close(fd)
    return path


def open_in_run(path: str | os.PathLike, how: str = "append", *, root: str | os.PathLike) -> int:
    """A write descriptor of the file `path` inside the run directory `root`, never through a
    link. `how`: "append" (read and append; created if missing; a file with a second name, a
    hard link, is refused), "new" (made afresh: a file at the name is removed first) or
    "exclusive" (the name must be free: FileExistsError otherwise). A link at the file or at a
    folder on the way is BadInputError (exit 2), a full disk RunDiskFullError (exit 6)."""
    path = Path(path)
    flags = os.O_CREAT | NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    flags |= {
        "append": os.O_RDWR | os.O_APPEND,
        "new": os.O_WRONLY | os.O_EXCL,
        "exclusive": os.O_WRONLY | os.O_EXCL,
    }[how]
    folder = _open_folder(path.parent, _run_root(path, root))
    at = {"dir_fd": folder} if folder >= 0 else {}
    name = path.name if folder >= 0 else path
    try:
        if how == "new":
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.stat(name, follow_symlinks=False, **at).st_mode):
                    raise _link_error(path)
                os.unlink(name, **at)
        fd = os.open(name, flags, 0o644, **at)
    except OSError as exc:
        if how == "exclusive" and isinstance(exc, FileExistsError):
            if os.path.islink(path):
                raise _link_error(path) from None
            raise
        raise write_error(path, exc) from None
    finally:
        if folder >= 0:
            os.close(folder)
    found = os.fstat(fd)
    if how == "append" and not stat.S_ISREG(found.st_mode):
        os.close(fd)
        raise BadInputError(
            f"{path} is not a regular file (a named pipe, a device or a socket); steadytrain "
            "appends the run's records to a file there; remove it and run again"
        )
    if how == "append" and found.st_nlink > 1:
        os.close(fd)
        raise BadInputError(
            f"{path} has another name (a hard link); steadytrain never appends to a file "
            "that is also somewhere else; remove it and run again"
        )
    return fd


def write_error(path: str | os.PathLike, exc: OSError) -> Exception:
    """The error to raise for a failed write of `path`: a planted link or a folder where the
    file belongs (exit 2), a full disk (exit 6), a read-only place (exit 2), else `exc`
    itself."""
    if exc.errno == errno.ELOOP or os.path.islink(path):
        return _link_error(path)
    if is_disk_full(exc):
        return RunDiskFullError(path, exc)
    if exc.errno in NOT_WRITABLE_ERRNOS:
        return RunNotWritableError(path, exc)
    if exc.errno == errno.EISDIR:
        return BadInputError(
            f"{os.fspath(path)} is a folder; steadytrain writes a file of the run there; move the "
            "folder away and run again"
        )
    return exc


def open_for_append(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> int:
    """A descriptor appending to `path` (created if missing), never through a symbolic link:
    `open_in_run(path, "append", root=root)`; `root` defaults to the file's folder."""
    return open_in_run(path, "append", root=root if root is not None else Path(path).parent)


def write_all(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Write every byte of `data` to `fd` (a short write is continued); a full disk is
    RunDiskFullError naming `path`."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise write_error(path, exc) from None


def write_atomic(
    path: str | os.PathLike,
    data: str | bytes,
    durable: bool = True,
    *,
    root: str | os.PathLike | None = None,
) -> None:
    """Replace `path` with `data`: a temporary file in the same folder (created afresh, never
    through a link), flushed, renamed over `path`, then the folder flushed. A reader sees the old
    file or the new one; a failure leaves the old file and no temporary. A link at `path`, or at
    a folder between the run directory `root` and it, is refused (exit 2); a full disk is
    RunDiskFullError. `root` defaults to the file's folder (only the file itself checked).
    `durable=False` skips the flushes."""
    path = Path(path)
    refuse_link(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp_name = f".{path.name}.{os.getpid()}.tmp"
    folder = _open_folder(path.parent, _run_root(path, root))
    at = {"dir_fd": folder} if folder >= 0 else {}
    tmp = tmp_name if folder >= 0 else path.with_name(tmp_name)
    name = path.name if folder >= 0 else path
    try:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, **at)  # a leftover of a killed writer with this PID, or a link
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644, **at)
            try:
                write_all(fd, payload, path)
                if durable:
                    sync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, **({"src_dir_fd": folder, "dst_dir_fd": folder} if at else {}))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, **at)
            raise write_error(path, exc) from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, **at)
            raise
        if durable:
            with contextlib.suppress(OSError):  # the file is in place; the flush is best effort
                sync(folder) if folder >= 0 else sync_dir(path.parent)
    finally:
        if folder >= 0:
            os.close(folder)


def sync_tree(folder: Path) -> None:
    """Flush every file directly in `folder`, then the folder itself: a staging folder is
    complete on disk before `replace_dir` publishes it."""
    for item in folder.iterdir():
        if item.is_file():
            with open(item, "rb") as handle:
                sync(handle.fileno())
    sync_dir(folder)


def replace_dir(staging: Path, target: Path) -> None:
    """Put the complete folder `staging` at `target`, so that a reader (or a kill) finds the old
    `target` or the new one, never none. Where `target` is a folder already, the two are swapped
    in one step (Linux `renameat2(RENAME_EXCHANGE)`, macOS `renamex_np(RENAME_SWAP)`) and the old
    one, now at `staging`'s name, is deleted after. Where the system or file system cannot swap,
    the old `target` is moved aside to `.NAME.old-PID` first and deleted only after the new one
    is in place; if the rename fails it comes back, and a process killed between the two renames
    leaves it for the next export to put back (`recipes.finetune`)."""
    if _is_real_dir(target) and _swap(staging, target):
        fault("replace-dir")
        with contextlib.suppress(OSError):  # the folder is in place; the flush is best effort
            sync_dir(target.parent)
        shutil.rmtree(staging, ignore_errors=True)  # the old folder now
        return
    old = None
    if os.path.lexists(target):
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        _remove_entry(old)  # a leftover of a killed export with this PID, or a planted link
        target.rename(old)
        fault("replace-dir")
    try:
        staging.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)
        raise
    with contextlib.suppress(OSError):  # the folder is in place; the flush is best effort
        sync_dir(target.parent)
    if old is not None:
        _remove_entry(old)


def _remove_entry(path: Path) -> None:
    """Remove what is at `path`, if anything: a folder with its files; a link or a file by its
    name only (never what a link points to)."""
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_RENAME_SWAP = 2  # macOS sys/stdio.h
_CANNOT_SWAP = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def _swap(a: Path, b: Path) -> bool:
    """Exchange the entries `a` and `b` in one step; False where this system or file system
    cannot (the caller then moves them one at a time). Any other failure is raised."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return False  # Windows: no such call (and no CDLL(None))
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return False
    paths = (os.fsencode(a), os.fsencode(b))
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        done = libc.renameat2(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        done = libc.renamex_np(paths[0], paths[1], _RENAME_SWAP)
    else:
        return False
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_SWAP:
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


# Fault injection (tests): STEADYTRAIN_FAULT_INJECT=replace-dir SIGKILLs the process inside
# `replace_dir`, right after the old folder was swapped out or moved aside (as
# `checkpoint.file_io.fault` does for a checkpoint's save phases).


def fault(phase: str) -> None:
    if run_env.fault_inject() != phase:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)
