"""RUN_DIR/training.log: what the console showed during a fine-tune, kept after the terminal
closes (the seed's ``tail -100 logs/training.log``). Everything written to stderr while the run
is in the block (our lines, the progress lines, warnings, the error that ended it) is appended
to the file as well, each write flushed, so a SIGKILL loses nothing already shown."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from steadytrain import run_files
from steadytrain.errors import SteadytrainError

TRAINING_LOG = run_files.TRAINING_LOG


class _Tee:
    """A text stream writing to the console stream and to the log file."""

    def __init__(self, console: TextIO, log: TextIO):
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        self._log.write(text)
        self._log.flush()
        return self._console.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._console.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the console's
        return getattr(self._console, name)


@contextlib.contextmanager
def training_log(run_dir: Path) -> Iterator[Path]:
    """Copy stderr into RUN_DIR/training.log (appended: a resumed run continues the file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TRAINING_LOG
    with open(path, "a", encoding="utf-8") as log:
        console = sys.stderr
        sys.stderr = _Tee(console, log)  # type: ignore[assignment]
        try:
            yield path
        except SteadytrainError as exc:  # the console shows it after we return: keep it too
            log.write(f"error: {exc}\n")
            raise
        finally:
            sys.stderr = console


__all__ = ["TRAINING_LOG", "training_log"]
