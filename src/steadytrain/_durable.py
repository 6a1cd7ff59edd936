"""Flushing to stable storage: what makes a write or a rename survive a power cut. No torch here,
so the light commands (config) can use it."""

from __future__ import annotations

import contextlib
import os
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
