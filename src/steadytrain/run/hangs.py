"""The run directory's hang files that both sides of `steadytrain run` use: RUN_DIR/heartbeat
read back (the watchdog writes it, `safety.hang_files`; the supervisor watches it), a new
``hangs/<time>.txt`` made by the run's one writer, and the stack dumps the GIL backstop or a
supervisor's SIGUSR1 left in ``hangs/backstop-<pid>.txt`` turned into hang reports (by the
watchdog of the next attempt, or by the supervisor that killed a frozen child), and the console lines a watching thread prints aside
(`print_aside`), which a hung process gives a moment before it ends. Standard library
and the run's safe writer only: the supervisor imports it, and nothing of torch; below the
watchdog and the supervisor, so neither imports the other for it."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain.errors import RunDiskFullError
from steadytrain.run import files as run_files
from steadytrain.run.durable import NOFOLLOW, open_in_run, refuse_link
from steadytrain.run.records import Record


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
            record(Record.HANG, info)
    return made


_ASIDE: list[threading.Thread] = []
"""The lines being printed aside (`print_aside`) that may not have been printed yet."""


def print_aside(print_line: Callable[[], Any]) -> None:
    """Run `print_line` on a daemon thread of its own: a watching thread's line for the console,
    where the loop's thread may hold the console (a blocked stderr) and the watcher must not
    wait for it. `wait_for_aside` gives such lines their moment before a process ends."""
    _ASIDE[:] = [t for t in _ASIDE if t.is_alive()]
    thread = threading.Thread(target=print_line, name="steadytrain-aside", daemon=True)
    _ASIDE.append(thread)
    thread.start()


def wait_for_aside(timeout: float) -> None:
    """Wait up to `timeout` seconds in all for the lines `print_aside` is printing (a hung
    process ends right after the watchdog records its hang, whose console line would otherwise
    be lost or cut off)."""
    deadline = time.monotonic() + timeout
    for thread in list(_ASIDE):
        thread.join(max(0.0, deadline - time.monotonic()))
