"""What the run directory says about how an attempt ended, read by the supervisor (standard
library only, like the supervisor): the memory reading of the last step before a kill, and the
error the trainer recorded before it exited.

A SIGKILL whose cause the kernel's counter does not show (systemd-oomd, earlyoom, a `kill -9`)
is judged by the last metrics line: when the machine had little memory left at that step, the
kill is taken for a memory kill, so the next attempt starts with a smaller micro-batch. A smaller
start costs some speed if the guess is wrong; a wrong "no" costs the next attempt being killed
the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain import run_files

TAIL_BYTES = 64 * 1024  # enough for the last few lines of a JSON-lines file, however long
LOW_AVAILABLE = 0.20
"""Memory counts as high when less than this share of the machine's memory was available at the
last step. earlyoom kills below 10 %; the last line is up to a step old and a step's peak comes
after its reading, so twice that margin."""
PRESSURE_WARNING = 2  # macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical
GIB = 1024**3


def tail_lines(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete JSON lines at the end of a JSON-lines file, oldest first; a torn line (the
    writer was killed mid-write) and the partial first line of the tail are skipped."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - tail_bytes))
            tail = handle.read()
    except OSError:
        return []
    records = []
    for line in tail.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def physical_memory() -> int | None:
    """The machine's memory in bytes (Linux and macOS), None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class MemoryAtKill:
    """The memory reading of the last step before a kill: whether it was high, and in words."""

    high: bool
    text: str


def memory_at_kill(run_dir: Path | None, total: int | None = None) -> MemoryAtKill | None:
    """Judge the last metrics line of RUN_DIR/metrics.jsonl (None: no line with a memory
    reading). `total` is the machine's memory (default: read here, where the child ran)."""
    if run_dir is None:
        return None
    lines = [r for r in tail_lines(Path(run_dir) / run_files.METRICS) if "step" in r]
    if not lines:
        return None
    line = lines[-1]
    total = physical_memory() if total is None else total
    available, pressure = _number(line.get("mem_system_available")), line.get("mem_pressure")
    rss = _number(line.get("mem_rss"))
    if available is None and pressure is None:
        return None
    parts = []
    if available is not None:
        parts.append(
            f"{available / GIB:.1f} GiB of {total / GIB:.1f} GiB available"
            if total
            else f"{available / GIB:.1f} GiB available"
        )
    if rss is not None:
        parts.append(f"{rss / GIB:.1f} GiB used by the trainer")
    if isinstance(pressure, int) and pressure >= PRESSURE_WARNING:
        parts.append("memory pressure " + ("critical" if pressure >= 4 else "warning"))
    high = (isinstance(pressure, int) and pressure >= PRESSURE_WARNING) or (
        available is not None and bool(total) and available < LOW_AVAILABLE * total
    )
    return MemoryAtKill(high, f"step {line.get('step')}: {', '.join(parts)}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ---- the error a trainer recorded before it exited -----------------------------------------

ERROR_EVENT = "error"


def last_error(run_dir: Path | None, since: float) -> dict[str, Any] | None:
    """The newest "error" event in RUN_DIR/events.jsonl written at or after `since` (seconds
    since the epoch): the one the attempt started then recorded; None when it recorded none."""
    if run_dir is None:
        return None
    for record in reversed(tail_lines(Path(run_dir) / run_files.EVENTS)):
        if record.get("event") != ERROR_EVENT:
            continue
        stamp = record.get("time")
        if isinstance(stamp, (int, float)) and stamp >= since:
            return record
        return None
    return None


def same_failure(error: dict[str, Any] | None, before: dict[str, Any] | None) -> bool:
    """Two attempts failed identically: the same error (type, message, where) at the same step.
    A restart would fail the same way again."""
    if not error or not before or not error.get("signature"):
        return False
    return error.get("signature") == before.get("signature") and error.get("step") == before.get(
        "step"
    )
