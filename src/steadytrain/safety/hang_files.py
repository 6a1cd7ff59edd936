"""What a hang leaves on disk, and what the supervisor reads back: the reports in
``RUN_DIR/hangs/`` (a new ``<time>.txt`` each, made by the run's one writer, never through a
link), the GIL backstop's stack dumps (``hangs/backstop-<pid>.txt``) turned into reports, and
``RUN_DIR/heartbeat``. Reading the heartbeat, making a new report file and turning backstop dumps
into reports are in `steadytrain.run.hangs`, which the supervisor uses too (named here as well).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError, SteadytrainError
from steadytrain.run import files as run_files
from steadytrain.run.durable import write_atomic
from steadytrain.run.hangs import new_hang_file
from steadytrain.safety.backstop import DUMP_SIGNAL
from steadytrain.safety.hang_limits import heartbeat_every, margin_s, report_budget_s

EVENTS_TAIL = 20
"""Lines of events.jsonl copied into a hang report: what the run did just before."""
EVENTS_TAIL_BYTES = 64 * 1024


def write_heartbeat(
    run_dir: Path,
    *,
    step: int | None,
    phase: str,
    stalled: float,
    limit: float,
    poll: float,
    action: str,
    dump_signal: bool,
    strict: bool = False,
) -> None:
    """RUN_DIR/heartbeat for the supervisor, replaced atomically. `stale_after_s`: how long the
    file may stay unchanged before the supervisor may kill (the limit and the watcher's own
    backstops); `dump_signal`: whether DUMP_SIGNAL dumps the stacks. A full disk must not end
    the watching; a link planted there is refused, not followed, and raised (exit 2) when
    `strict` (a watchdog's first heartbeat)."""
    record = {
        "pid": os.getpid(),
        "step": step,
        "phase": phase,
        "stalled_s": round(stalled, 3),
        "limit_s": limit,
        "stale_after_s": limit
        + margin_s(poll)
        + report_budget_s(limit)
        + 2 * heartbeat_every(poll),
        "action": action,
        "dump_signal": DUMP_SIGNAL.name if dump_signal else None,
        "dump_file": f"{run_files.HANGS}/backstop-{os.getpid()}.txt",
        "written": time.time(),
    }
    try:
        write_atomic(
            run_dir / run_files.HEARTBEAT,
            json.dumps(record),
            durable=False,
            root=run_files.top(run_dir),
        )
    except BadInputError:
        if strict:
            raise
    except (OSError, SteadytrainError):
        pass


def write_report(run_dir: Path, header: str, device: Any, budget: float) -> tuple[Path | None, Any]:
    """hangs/<time>.txt: `header`, then the stacks (they matter most and cannot block), then the
    events, then the memory reading of `device` (which can block on a stuck device, so it is
    last and bounded by `budget`). Returns (the file or None when it could not be written, the
    reading or None)."""
    memory = None
    path = None
    try:
        path, fd = new_hang_file(run_dir / run_files.HANGS, run_files.top(run_dir))
        with os.fdopen(fd, "w") as out:
            out.write(header)
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
            out.write("\nLast events (events.jsonl):\n")
            out.writelines(tail_lines(run_dir / run_files.EVENTS, EVENTS_TAIL))
            out.flush()
            memory, note = (
                read_with_timeout(device.memory, min(5.0, budget / 2))
                if device is not None
                else (None, "(none: the device is chosen in set-up)")
            )
            out.write("\nMemory reading:\n")
            out.write(json.dumps(memory.to_dict(), indent=1) if memory is not None else note)
            out.write("\n")
    except (OSError, SteadytrainError) as exc:  # a full disk, a planted link (refused)
        if path is not None:  # cut short: no report, rather than one that lacks its end
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"steadytrain: could not write the hang report {path or run_dir / run_files.HANGS}"
                f" ({exc}); the stacks are lost, the event and this line remain\n"
            )
        return None, memory
    return path, memory


def stacks_in(path: Path | None) -> str:
    """Where the console's last line of a hang says the stacks are."""
    return f"stacks in {path}" if path is not None else "no hang report (it could not be written)"


def tail_lines(path: Path, count: int) -> list[str]:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - EVENTS_TAIL_BYTES))
            lines = handle.read().decode(errors="replace").splitlines(keepends=True)
    except OSError as exc:
        return [f"(cannot read {path}: {exc})\n"]
    if len(lines) > count or size > EVENTS_TAIL_BYTES:
        lines = lines[1:][-count:]  # the first may be a partial line
    return [line if line.endswith("\n") else line + "\n" for line in lines] or ["(none)\n"]


def read_with_timeout(read: Callable[[], Any], seconds: float) -> tuple[Any, str]:
    """Call `read` in a helper thread and wait at most `seconds`: on a stuck device a memory
    reading can block like the step did, and the report must still be finished."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(read())
        except Exception as exc:  # noqa: BLE001 - a failed reading is a line in the report
            box.append(exc)

    helper = threading.Thread(target=target, name="steadytrain-hang-memory", daemon=True)
    helper.start()
    helper.join(seconds)
    if not box:
        return None, f"(the memory reading did not return within {seconds:.1f} s)"
    if isinstance(box[0], Exception):
        return None, f"(the memory reading failed: {type(box[0]).__name__}: {box[0]})"
    return box[0], ""
