"""metrics.jsonl and events.jsonl: append-only, one JSON object a line, flushed per line.

After a crash and resume, the steps between the last checkpoint and the crash appear twice in
metrics.jsonl (first run, then the resumed one); readers keep the last line of each step.

How a line is written and read (one write per line, a torn last line ended by the next writer,
torn lines skipped by readers) is `steadytrain.run.jsonl`'s, which the supervisor uses too;
`JsonlFile` and `read_jsonl` are its names here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from steadytrain.errors import RunDiskFullError
from steadytrain.events import Callback, Control, TrainState, oom_step
from steadytrain.run import files as run_files
from steadytrain.run.jsonl import JsonlFile
from steadytrain.run.jsonl import read as read_jsonl
from steadytrain.run.records import EVAL, Metric, Record

__all__ = ["JsonlFile", "RunFiles", "read_jsonl"]


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
        self.event(Record.FIT_START, state, info)

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
        memory = metrics.pop(Metric.MEMORY, {}) or {}
        self.metrics.write({**metrics, **{Metric.of_memory(k): v for k, v in memory.items()}})

    def on_eval_end(self, state: TrainState, control: Control, info: dict) -> None:
        """An evaluation row in metrics.jsonl: ``kind: "eval"``, the step and epoch it followed,
        and the evaluation's metrics (step rows have no ``kind``)."""
        self._write_pending()
        row = {
            Metric.KIND: EVAL,
            Metric.TIME: time.time(),
            Metric.STEP: state.step,
            Metric.EPOCH: info["epoch"],
        }
        self.metrics.write({**row, **info["metrics"]})

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        self.event(Record.OOM, state, {**info, "step": oom_step(state, info)})

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self.event(Record.SHRINK, state, info)

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        self.event(Record.MEMORY_SAVER, state, info)

    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.event(Record.EPOCH_END, state, info)

    def close(self) -> None:
        """Close both files (a later record reopens them)."""
        self.metrics.close()
        self.events.close()

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        try:
            self._write_pending()
            self.event(Record.FIT_END, state, info)
        except RunDiskFullError:
            if not info.get("exit_code"):
                raise
            # the fit is ending on an error already (often this very disk): let it be the one told
        finally:
            self.metrics.close()
            self.events.close()
