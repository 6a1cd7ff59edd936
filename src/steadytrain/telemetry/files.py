"""metrics.jsonl and events.jsonl: append-only, one JSON object a line, flushed per line.

After a crash and resume, the steps between the last checkpoint and the crash appear twice in
metrics.jsonl (first run, then the resumed one); readers keep the last line of each step.

A process killed mid-write (SIGKILL, the OS out-of-memory killer) can leave a torn last line:
the kernel stops copying a large write at a page boundary when a fatal signal is pending. The
next `JsonlFile` on that path ends the torn line before appending, so every record it writes
starts on a line of its own. A torn line therefore ends in a newline and may sit mid-file after
a resume; `read_jsonl` skips exactly the lines that do not parse as JSON and keeps the rest.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from steadytrain import run_files
from steadytrain._durable import open_in_run, write_all
from steadytrain.errors import RunDiskFullError
from steadytrain.events import Callback, Control, TrainState


class JsonlFile:
    """One JSONL file held open for appending; each record is one ``write`` system call of one
    line, unbuffered, so a failed write leaves nothing queued to fail again at close.

    The file is opened at the first record, so a run refused before it records anything (a bad
    config found while the callbacks are built) leaves no open file behind. It is never opened
    through a symbolic link (BadInputError names it); a full disk is RunDiskFullError."""

    def __init__(self, path: Path, root: str | os.PathLike | None = None):
        self.path = Path(path)
        self.root = Path(root) if root is not None else self.path.parent
        self._fd: int | None = None

    def _open(self) -> None:
        self._fd = open_in_run(self.path, "append", root=self.root)
        size = os.fstat(self._fd).st_size
        if size > 0 and os.pread(self._fd, 1, size - 1) != b"\n":
            write_all(self._fd, b"\n", self.path)  # the next record starts clean

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:  # first, or late (after fit_end)
            self._open()
        write_all(self._fd, (json.dumps(record, default=str) + "\n").encode(), self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL file; a torn line (a kill mid-write) is skipped."""
    records = []
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn by a kill mid-line; the line after it was started afresh
    return records


class RunFiles(Callback):
    """Writes one metrics line per optimizer step and one events line per notable event."""

    def __init__(self, run_dir: str | os.PathLike):
        run_dir = Path(run_dir)
        root = run_files.top(run_dir)
        self.metrics = JsonlFile(run_dir / run_files.METRICS, root)
        self.events = JsonlFile(run_dir / run_files.EVENTS, root)
        self._pending = None

    def event(self, name: str, state: TrainState, info: dict) -> None:
        self.events.write({"time": time.time(), "event": name, "step": state.step, **info})

    def record(self, name: str, info: dict) -> None:
        """An event from outside the loop's dispatch (checkpoint store, signal handler, resume)."""
        self.events.write({"time": time.time(), "event": name, **info})

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("fit_start", state, info)

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        # Step k's line is written once step k+1 is queued, so reading its loss does not make
        # the host wait for the device (see steadytrain.events.StepMetrics).
        self._write_pending()
        self._pending = info["metrics"]
        if self._pending.resolved:  # already read (a checkpoint step): write it now
            self._write_pending()

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        metrics = dict(self._pending.resolve())
        self._pending = None
        memory = metrics.pop("memory", {}) or {}
        self.metrics.write({**metrics, **{f"mem_{k}": v for k, v in memory.items()}})

    def on_evaluation_end(self, state: TrainState, control: Control, info: dict) -> None:
        """An evaluation row in metrics.jsonl: ``kind: "eval"``, the step and epoch it followed,
        and the evaluation's metrics (step rows have no ``kind``)."""
        self._write_pending()
        row = {"kind": "eval", "time": time.time(), "step": state.step, "epoch": info["epoch"]}
        self.metrics.write({**row, **info["metrics"]})

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("oom", state, info)

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("shrink", state, info)

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("memory_saver", state, info)

    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("epoch_end", state, info)

    def close(self) -> None:
        """Close both files (a later record reopens them)."""
        self.metrics.close()
        self.events.close()

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        try:
            self._write_pending()
            self.event("fit_end", state, info)
        except RunDiskFullError:
            if not info.get("exit_code"):
                raise
            # the fit is ending on an error already (often this very disk): let it be the one told
        finally:
            self.metrics.close()
            self.events.close()
