"""What a start refused for bad input (exit 2) puts back before the loop has started."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from steadytrain.run import files as run_files
from steadytrain.safety.lock import RunLock


class AsFound:
    """What a start refused for bad input (exit 2) puts back before the loop has started: the
    lock file and the folders the start made (the run directory, those on the way to it,
    hangs/) while they are empty, so a fresh run directory is not left behind and one with an
    earlier run is as it was."""

    def __init__(self, run_dir: Path):
        self.lock_path = run_dir / run_files.LOCK
        self.had_lock = os.path.lexists(self.lock_path)
        on_the_way = [run_dir / run_files.HANGS, run_dir, *run_dir.parents]
        self.made = [f for f in on_the_way if not os.path.lexists(f)]  # the deepest first
        self.started = False  # the loop has started: what the run did is its record

    def unlock(self, lock: RunLock) -> None:
        """The lock file this start made, removed while it is still held (POSIX: released
        after; elsewhere the release removes it)."""
        if not self.started and not self.had_lock and os.name == "posix":
            with contextlib.suppress(OSError):
                os.unlink(lock.path)

    def put_back(self) -> None:
        for folder in [] if self.started else self.made:
            with contextlib.suppress(OSError):  # not empty: left as it is
                os.rmdir(folder)
