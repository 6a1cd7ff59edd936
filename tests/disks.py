"""Real small filesystems for the disk-full tests: a tmpfs mounted (CI runs as root; where
mounting is not allowed the test is skipped with the reason), and a file that fills it."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def mount(point: Path, options: str) -> None:
    """A tmpfs with `options` ("size=2m") mounted at `point`."""
    mount_or_skip("-t", "tmpfs", "-o", options, "tmpfs", str(point))


def mount_or_skip(*argv: str) -> None:
    """`mount ARGV`, or the test skipped with the reason where mounting is not allowed."""
    try:
        done = subprocess.run(["mount", *argv], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@contextlib.contextmanager
def tmpfs(point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` ("2m") mounted at `point` (made here) for the block; unmounted
    lazily after, so that a process still holding a file there does not keep it mounted."""
    point.mkdir(exist_ok=True)
    mount(point, f"size={size}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, timeout=20)


def fill(path: Path) -> None:
    """Write `path` until its filesystem is full."""
    with open(path, "ab", buffering=0) as handle:
        for block in (b"\0" * 4096, b"\0"):
            try:
                while True:
                    handle.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
