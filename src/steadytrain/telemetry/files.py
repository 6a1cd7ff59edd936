"""metrics.jsonl and events.jsonl: append-only, one JSON object a line, flushed per line.

After a crash and resume, the steps between the last checkpoint and the crash appear twice in
metrics.jsonl (first run, then the resumed one); readers keep the last line of each step.

A process killed mid-write can leave a torn last line; `read_jsonl` skips a line that does not
parse only when it is the last one (anything else is real corruption and is reported).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from steadytrain.events import Callback, Control, TrainState

EVENT_NAMES = ("oom", "shrink", "memory_saver", "fit_start", "fit_end", "epoch_end")


class JsonlFile:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle = open(path, "a", buffering=1)  # noqa: SIM115 - held open for the run
        if self._handle.tell() > 0:
            self._repair_torn_tail()

    def _repair_torn_tail(self) -> None:
        with open(self.path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                self._handle.write("\n")  # end the torn line so the next record starts clean

    def write(self, record: dict[str, Any]) -> None:
        if self._handle.closed:  # a late record (a store log line after fit_end)
            self._handle = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._handle.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        self._handle.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL file; a torn line (a kill mid-write) is skipped."""
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
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
        self.metrics = JsonlFile(run_dir / "metrics.jsonl")
        self.events = JsonlFile(run_dir / "events.jsonl")
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
        # the host wait for the device (see steadytrain.engine.metrics).
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

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("oom", state, info)

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("shrink", state, info)

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("memory_saver", state, info)

    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.event("epoch_end", state, info)

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._write_pending()
        self.event("fit_end", state, info)
        self.metrics.close()
        self.events.close()
