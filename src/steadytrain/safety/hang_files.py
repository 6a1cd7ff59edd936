"""What a hang leaves on disk, and what the supervisor reads back: the reports in
``RUN_DIR/hangs/`` (a new ``<time>.txt`` each, made by the run's one writer, never through a
link), the GIL backstop's stack dumps (``hangs/backstop-<pid>.txt``) turned into reports, and
``RUN_DIR/heartbeat``. No torch here: `steadytrain run` uses this module too.
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

from steadytrain import run_files
from steadytrain._durable import NOFOLLOW, open_in_run, refuse_link, write_atomic
from steadytrain.errors import BadInputError, RunDiskFullError, SteadytrainError
from steadytrain.safety.backstop import DUMP_SIGNAL
from steadytrain.safety.hang_limits import heartbeat_every, margin_s, report_budget_s

EVENTS_TAIL = 20
"""Lines of events.jsonl copied into a hang report: what the run did just before."""
EVENTS_TAIL_BYTES = 64 * 1024


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/heartbeat as a dict, or None when missing or unreadable."""
    path = Path(run_dir) / run_files.HEARTBEAT
    try:  # a link planted there is not read: it could name a FIFO or a device
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            record = json.loads(handle.read(1 << 20))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


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


def adopt_backstop_dumps(
    run_dir: Path,
    record: Callable[[str, dict], None],
    *,
    skip_pid: int | None = None,
    only_pid: int | None = None,
    detected_by: str = "faulthandler",
    extra: dict[str, Any] | None = None,
) -> list[Path]:
    """Turn the stack dumps the GIL backstop (or a supervisor's SIGUSR1) left in
    ``hangs/backstop-<pid>.txt`` into hang reports with a ``hang`` event; empty ones (a process
    that ended without a hang) are removed. `skip_pid`: a file still in use (this process's) is
    left alone; `only_pid`: only that process's file is looked at. Returns the reports made."""
    hangs = Path(run_dir) / run_files.HANGS
    made = []
    if hangs.is_symlink():
        refuse_link(hangs)
    for path in sorted(hangs.glob("backstop-*.txt")):
        pid_text = path.stem.removeprefix("backstop-")
        if pid_text == str(skip_pid) or (only_pid is not None and pid_text != str(only_pid)):
            continue
        refuse_link(path)  # never read (and copied into a report) through a planted link
        try:
            size = path.stat().st_size
            if size == 0:
                path.unlink()
                continue
            target, fd = new_hang_file(
                hangs, run_files.top(run_dir), time.gmtime(path.stat().st_mtime)
            )
            beat = read_heartbeat(Path(run_dir))
            beat = beat if beat is not None and str(beat.get("pid")) == pid_text else {}
            header = (
                f"steadytrain hang report (stack dump of the {detected_by} backstop)\n"
                f"pid: {pid_text}\n"
                f"last heartbeat: steps done {beat.get('step')}, phase {beat.get('phase')}\n"
                "The Python watchdog thread could not write this report: the process held the "
                "GIL or could not run at all.\n\nEvery thread's stack, most recent call first:\n"
            )
            with os.fdopen(fd, "w") as out:
                out.write(header + path.read_text(errors="replace"))
            path.unlink()
        except (OSError, RunDiskFullError):
            continue
        made.append(target)
        info = {
            "step": beat.get("step"),
            "phase": beat.get("phase"),
            "pid": int(pid_text) if pid_text.isdigit() else pid_text,
            "file": str(target.relative_to(run_dir)),
            "detected_by": detected_by,
            **(extra or {}),
        }
        with contextlib.suppress(Exception):
            record("hang", info)
    return made


def write_report(run_dir: Path, header: str, device: Any, budget: float) -> tuple[Path | None, Any]:
    """hangs/<time>.txt: `header`, then the stacks (they matter most and cannot block), then the
    events, then the memory reading of `device` (which can block on a stuck device, so it is
    last and bounded by `budget`). Returns (the file or None when it could not be written, the
    reading or None)."""
    memory = None
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
        with contextlib.suppress(Exception):
            sys.stderr.write(f"steadytrain: could not write the hang report: {exc}\n")
        return None, memory
    return path, memory


def new_hang_file(
    folder: Path, root: Path, when: time.struct_time | None = None
) -> tuple[Path, int]:
    """A new hangs/<time>.txt (hangs/<time>-N.txt when taken) and its write descriptor, made
    by the run's one writer: never through a link (BadInputError)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", when or time.gmtime())
    path, n = folder / f"{stamp}.txt", 1
    while True:
        try:
            return path, open_in_run(path, "exclusive", root=root)
        except FileExistsError:
            n += 1
            path = folder / f"{stamp}-{n}.txt"


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
