"""RUN_DIR/training.log: what the console showed during a fine-tune, kept after the terminal
closes (the seed's ``tail -100 logs/training.log``). Everything written to stderr while the run
is in the block (our lines, the progress lines, warnings, the error that ended it) goes to the
file as well, each write flushed, so a SIGKILL loses nothing already shown. Until `start` names
the run directory the lines are held in memory; the fine-tune calls it once the run directory is
locked and its checkpoint, if any, is known to be this run's, so a start refused before that (a
bad config, a run directory in use, another run's checkpoint) writes nothing."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from steadytrain.errors import RunDiskFullError, SteadytrainError, is_disk_full
from steadytrain.run import files as run_files
from steadytrain.run.durable import open_in_run

TRAINING_LOG = run_files.TRAINING_LOG


class TrainingLog:
    """A text stream writing to the console stream and to the log file (held until `start`)."""

    def __init__(self, console: TextIO):
        self._console = console
        self._held: list[str] = []
        self._file: TextIO | None = None
        self._path: Path | None = None

    def start(self, run_dir: Path) -> Path:
        """Open RUN_DIR/training.log (appended: a resumed run continues it) and write what the
        console showed so far."""
        path = run_dir / TRAINING_LOG
        fd = open_in_run(path, "append", root=run_files.top(run_dir))  # never through a link
        self._file, self._path = os.fdopen(fd, "a", encoding="utf-8"), path
        self._to_file("".join(self._held))
        self._held = []
        return path

    def write(self, text: str) -> int:
        if self._file is None:
            self._held.append(text)
        else:
            self._to_file(text)
        return self._console.write(text)

    def _to_file(self, text: str) -> None:
        """Append and flush; a full disk is RunDiskFullError naming the log (exit 6), after
        which only the console is written (the error message itself goes there)."""
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.close()
            raise RunDiskFullError(self._path, exc) from None

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        self._console.flush()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # a full disk: the unwritten tail is dropped
                file.close()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the console's
        return getattr(self._console, name)


@contextlib.contextmanager
def training_log() -> Iterator[TrainingLog]:
    """Copy stderr into the log for the duration of the block."""
    console = sys.stderr
    log = TrainingLog(console)
    sys.stderr = log  # type: ignore[assignment]
    try:
        yield log
    except SteadytrainError as exc:  # the console shows it after we return: keep it too
        if log._file is not None:
            with contextlib.suppress(OSError):
                log._file.write(f"error: {exc}\n")
        raise
    finally:
        sys.stderr = console
        log.close()


__all__ = ["TRAINING_LOG", "TrainingLog", "training_log"]
