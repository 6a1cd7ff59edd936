"""One process per run directory: RUN_DIR/.lock.

On POSIX the lock is `flock(LOCK_EX | LOCK_NB)` on the file, so the kernel releases it when the
holder dies in any way (kill -9, OOM kill): a stale lock cannot exist and the next run takes over
without asking. The file holds the holder's PID, host and start time, for the error message.
Elsewhere (Windows) the file is created with O_EXCL and a lock whose PID no longer runs is taken
over.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from steadytrain.errors import BadInputError, RunDiskFullError, is_disk_full
from steadytrain.run import files as run_files
from steadytrain.run.durable import NOFOLLOW, make_folder

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


class RunLock:
    """`with RunLock(run_dir): ...` holds the run directory for this process.

    A second holder, in this process or another, gets BadInputError naming the holder.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / run_files.LOCK
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        try:
            make_folder(self.run_dir, root=run_files.top(self.run_dir))  # no link on the way
            self._fd = self._acquire_flock() if fcntl is not None else self._acquire_exclusive()
            if os.fstat(self._fd).st_nlink > 1:  # truncating it would truncate the other name
                os.close(self._fd)  # not release(): that truncates
                self._fd = None
                raise BadInputError(
                    f"{self.path} has another name (a hard link); steadytrain never writes a "
                    "file that is also somewhere else; remove it and run again"
                )
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps(_holder()).encode())
        except OSError as exc:
            self.release()
            raise self._cannot_write(exc) from None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # a reader never sees a finished run's PID as the holder
        finally:
            os.close(fd)  # closing releases the flock
        if fcntl is None:
            os.unlink(self.path)

    def _acquire_flock(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
        try:
            self._flock(fd)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use() from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _flock(self, fd: int) -> None:
        """Take the lock. A process forked by the holder (a DataLoader worker) shares the
        holder's lock and outlives a SIGKILL of it by a few seconds, until it sees its parent
        gone: while the PID the file names has ended, wait for those to let go."""
        deadline = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not _holder_ended(_read_holder(self.path)):
                    raise
                deadline = deadline or time.monotonic() + ORPHANS_WAIT_S
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _acquire_exclusive(self) -> int:
        import psutil

        for _ in range(2):
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
            except FileExistsError:
                pid = _read_holder(self.path).get("pid")
                if isinstance(pid, int) and psutil.pid_exists(pid):
                    raise self._in_use() from None
                os.unlink(self.path)  # its holder is gone
        raise self._in_use()

    def _cannot_write(self, exc: OSError) -> BadInputError | RunDiskFullError:
        if exc.errno == errno.ELOOP or self.path.is_symlink():
            return BadInputError(
                f"{self.path} is a symbolic link; steadytrain never writes through a link in a "
                "run directory; remove the link (it points outside what this run owns)"
            )
        if is_disk_full(exc):
            return RunDiskFullError(self.path, exc, kept="nothing: the run had not started")
        if exc.errno == errno.EISDIR:
            return BadInputError(
                f"{self.path} is a folder; steadytrain writes a file of the run there; move the "
                "folder away and run again"
            )
        file = next((p for p in (self.run_dir, *self.run_dir.parents) if p.is_file()), None)
        if exc.errno in (errno.EEXIST, errno.ENOTDIR) and file is not None:
            return BadInputError(
                f"run_dir {self.run_dir}: {file} is a file, not a folder; give output_dir "
                "(run_dir) a folder, which is made if it does not exist"
            )
        return BadInputError(
            f"run_dir {self.run_dir}: cannot write {self.path.name} there ({exc.strerror}); "
            "choose a folder this user can create and write"
        )

    def _in_use(self) -> BadInputError:
        holder = _read_holder(self.path)
        pid = holder.get("pid", "unknown")
        host = f" on {holder['host']}" if holder.get("host") else ""
        started = f" (started {holder['started']})" if holder.get("started") else ""
        return BadInputError(
            f"run directory {self.run_dir} is in use by PID {pid}{host}{started}; wait for it, "
            "stop it, or use another run_dir (a fine-tune's output_dir)"
        )


def _holder() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


ORPHANS_WAIT_S = 30.0
"""How long a lock whose holder has ended is waited for: a DataLoader worker checks every 5 s
whether its parent is alive."""


def _holder_ended(holder: dict) -> bool:
    """Whether the process the lock file names, on this host, no longer runs (or is a zombie)."""
    import psutil

    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _read_holder(path: Path) -> dict:
    """What the holder wrote; {} while it has not written yet, or when unreadable."""
    try:
        value = json.loads(path.read_bytes() or b"{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
