"""What the run directory says about an attempt's progress, as the supervisor reads it (standard
library only): the step of the newest checkpoint (the Trainer's checkpoints/latest pointer, or the
integrations' "checkpoint" events), the micro-batch size in force at the last step, and the memory
savers the attempt recorded at its start."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from steadytrain import run_files, run_jsonl
from steadytrain.run_events import SAVERS_EVENT

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
        for event in _events(run_dir, b'"checkpoint"'):
            step = event.get("step")
            if (
                event.get("event") == "checkpoint"
                and isinstance(step, int)
                and not isinstance(step, bool)
            ):
                steps.append(step)
    found = [s for s in steps if s is not None]
    return max(found) if found else None


def last_micro_batch_size(
    run_dir: Path | None, file: str = run_files.METRICS, event: str | None = None
) -> int | None:
    """micro_batch_size of the last complete line of RUN_DIR/metrics.jsonl, read from its tail
    (the file grows by a line per step). A torn last line (the child was killed mid-write) is
    skipped. With `file` events.jsonl and `event` "oom": that of the last out-of-memory event
    (a child that exits 76 records one before it has written any metrics line)."""
    if run_dir is None:
        return None
    for record in reversed(run_jsonl.tail(run_dir / file, METRICS_TAIL_BYTES)):
        if event is not None and record.get("event") != event:
            continue
        value = record.get("micro_batch_size")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _events(run_dir: Path, containing: bytes) -> list[dict[str, Any]]:
    """The records of RUN_DIR/events.jsonl whose line holds `containing`, whole file ([] when
    it cannot be read)."""
    try:
        return run_jsonl.read(run_dir / run_files.EVENTS, containing)
    except OSError:
        return []


def savers_record(run_dir: Path | None, since: float) -> dict[str, Any] | None:
    """The newest `memory_savers` record in RUN_DIR/events.jsonl written at or after `since`
    (the attempt started then): None when that attempt wrote none (it was killed before its
    start-up ended, or it does not train through the Trainer). Reads the whole file: a long
    attempt writes many events after its start."""
    if run_dir is None:
        return None
    found = None
    for event in _events(run_dir, SAVERS_EVENT.encode()):
        stamp = event.get("time")
        if (
            event.get("event") == SAVERS_EVENT
            and isinstance(stamp, (int, float))
            and stamp >= since
            and isinstance(event.get("in_force"), list)
            and isinstance(event.get("left"), list)
        ):
            found = event
    return found
