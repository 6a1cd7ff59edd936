"""What the run directory says about an attempt's progress, as the supervisor reads it (standard
library only): the step of the newest checkpoint (the Trainer's checkpoints/latest pointer, or the
integrations' "checkpoint" events), the micro-batch size in force at the last step, and the memory
savers the attempt recorded at its start."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain.run import files as run_files
from steadytrain.run import jsonl as run_jsonl
from steadytrain.run.records import Metric, Record

METRICS_TAIL_BYTES = run_jsonl.TAIL_BYTES  # the last few metrics lines, however long the run
_STEP_NAME = re.compile(r"step-(\d+)")


def checkpoint_step(run_dir: Path | None) -> int | None:
    """The step of the newest committed checkpoint (RUN_DIR/checkpoints/latest holds its folder
    name, e.g. step-00000250); None when there is none or the pointer cannot be read."""
    if run_dir is None:
        return None
    try:
        with run_jsonl.open_regular(run_dir / run_files.CHECKPOINTS / run_files.LATEST) as file:
            name = file.read(64).decode().strip()  # a pipe planted there: OSError, not a wait
    except (OSError, UnicodeDecodeError):
        return None
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def progress_step(run_dir: Path | None) -> int | None:
    """The step of the newest checkpoint the run says it committed and verified: the Trainer's
    `checkpoints/latest` pointer, or the newest `checkpoint` event in RUN_DIR/events.jsonl,
    which the Trainer and every integration (Hugging Face, Lightning, Keras, `RunGuard`'s
    `checkpoint_saved`) append after each save is committed and hashed. None when neither says
    one. Reads the whole file (a line per event, not per step)."""
    steps = [checkpoint_step(run_dir)]
    if run_dir is not None:
        for event in _events(run_dir, f'"{Record.CHECKPOINT}"'.encode()):
            step = event.get("step")
            if (
                event.get("event") == Record.CHECKPOINT
                and isinstance(step, int)
                and not isinstance(step, bool)
            ):
                steps.append(step)
    found = [s for s in steps if s is not None]
    return max(found) if found else None


def last_micro_batch_size(
    run_dir: Path | None, file: str = run_files.METRICS, event: Record | None = None
) -> int | None:
    """micro_batch_size of the last complete line of RUN_DIR/metrics.jsonl, read from its tail
    (the file grows by a line per step). A torn last line (the child was killed mid-write) is
    skipped. With `file` events.jsonl and `event` `Record.OOM`: that of the last out-of-memory
    event (a child that exits 76 records one before it has written any metrics line)."""
    if run_dir is None:
        return None
    for record in reversed(run_jsonl.tail(run_dir / file, METRICS_TAIL_BYTES)):
        if event is not None and record.get("event") != event:
            continue
        value = record.get(Metric.MICRO_BATCH_SIZE)  # an oom record's key is the same
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _events(run_dir: Path, containing: bytes, start: int = 0) -> list[dict[str, Any]]:
    """The records of RUN_DIR/events.jsonl whose line holds `containing`, whole file or from the
    size `start` on ([] when it cannot be read)."""
    try:
        return run_jsonl.read(run_dir / run_files.EVENTS, containing, start)
    except OSError:
        return []


@dataclass(frozen=True)
class AttemptStart:
    """Where an attempt began in the run directory's events files (RUN_DIR/events.jsonl and each
    rank's under ranks/): their sizes when it started. They only grow, so what the attempt wrote
    lies past them: its records are told apart by place, not by their wall-clock times, which an
    NTP step or a laptop waking can set back mid-attempt below the time it started."""

    sizes: dict[Path, int]

    @classmethod
    def now(cls, run_dir: Path | None) -> AttemptStart:
        if run_dir is None:
            return cls({})
        files = [Path(run_dir) / run_files.EVENTS]
        files += (Path(run_dir) / run_files.RANKS).glob(f"rank-*/{run_files.EVENTS}")
        sizes = {}
        for path in files:
            try:
                sizes[path] = os.stat(path).st_size
            except (OSError, ValueError):
                continue  # none yet: all of it will be the attempt's
        return cls(sizes)

    def offset(self, path: Path) -> int:
        """The size `path` had when the attempt started (0: it had none)."""
        return self.sizes.get(Path(path), 0)


Since = float | AttemptStart
"""An attempt's start: its place in the events files, or (older callers, tests) a wall-clock
time its records are at or after."""


def attempt_records(path: Path, since: Since) -> list[dict[str, Any]]:
    """The records the attempt started at `since` wrote in the JSON-lines file `path`, among
    those of its tail; oldest first."""
    if isinstance(since, AttemptStart):
        return run_jsonl.tail(path, since=since.offset(path))
    return [r for r in run_jsonl.tail(path) if at_or_after(r, since)]


def at_or_after(record: dict[str, Any], since: float) -> bool:
    stamp = record.get("time")
    return isinstance(stamp, (int, float)) and stamp >= since


def savers_record(run_dir: Path | None, since: Since) -> dict[str, Any] | None:
    """The newest `memory_savers` record in RUN_DIR/events.jsonl written by the attempt started
    at `since`: None when that attempt wrote none (it was killed before its start-up ended, or
    it does not train through the Trainer). Reads the whole file: a long attempt writes many
    events after its start."""
    if run_dir is None:
        return None
    start = since.offset(run_dir / run_files.EVENTS) if isinstance(since, AttemptStart) else 0
    found = None
    for event in _events(run_dir, Record.MEMORY_SAVERS.encode(), start):
        if (
            event.get("event") == Record.MEMORY_SAVERS
            and (isinstance(since, AttemptStart) or at_or_after(event, since))
            and isinstance(event.get("in_force"), list)
            and isinstance(event.get("left"), list)
        ):
            found = event
    return found
