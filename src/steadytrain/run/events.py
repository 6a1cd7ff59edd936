"""The events both sides of `steadytrain run` agree on: the child (the Trainer, the watchdog, the
integrations) appends them to RUN_DIR/events.jsonl, the supervisor appends its own beside them and
reads the child's back. The one writer of an event line for a process that does not hold the file
open; the records' names are `steadytrain.run.records.Record`'s. Standard library only: the
supervisor imports it, and nothing of torch; below the trainer, safety and the supervisor, so
none of them imports another for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain.run import files as run_files
from steadytrain.run import jsonl as run_jsonl


def append_event(run_dir: Path, record: dict[str, Any]) -> None:
    """One line appended to RUN_DIR/events.jsonl with a single write in O_APPEND mode, so it
    cannot interleave with another process's lines. A torn last line (a writer was killed while
    writing it) is ended first, inside the same write (`steadytrain.run.jsonl.append`)."""
    run_jsonl.append(Path(run_dir) / run_files.EVENTS, record, root=run_files.top(run_dir))
