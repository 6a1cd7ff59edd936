"""Real small filesystems for the disk-full tests: a tmpfs mounted (CI runs as root; where
mounting is not allowed the test is skipped with the reason), and a file that fills it."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest


def mount(point: Path, options: str) -> None:
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def fill(path: Path) -> None:
    """Write `path` until its filesystem is full."""
    with open(path, "ab", buffering=0) as handle:
        for block in (b"\0" * 4096, b"\0"):
            try:
                while True:
                    handle.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
