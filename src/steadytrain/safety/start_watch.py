"""The watching of a process under `steadytrain run` from its import of steadytrain until a
fit's watchdog takes over (`StartWatch`, started by `watch_from_start` from the package's
``__init__`` when ``STEADYTRAIN_START_WATCH`` is set): a hang in model set-up or data loading
before `fit()` gets a report and exit 75 too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from steadytrain.errors import SteadytrainError
from steadytrain.run import env as run_env
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder
from steadytrain.run.files import ENV_START_WATCH  # set by `steadytrain run` for its child
from steadytrain.run.hangs import adopt_backstop_dumps, new_hang_file, read_heartbeat
from steadytrain.run.records import Record
from steadytrain.safety.backstop import HANG_EXIT, Backstop, end_process
from steadytrain.safety.hang_files import stacks_in, write_heartbeat
from steadytrain.safety.hang_limits import MAX_POLL_S, margin_s, report_budget_s, small_stacks

BEFORE_FIT = "before fit() (imports, model and data set-up)"


class StartWatch:
    """The watching of a process from its import of steadytrain until a fit's watchdog takes
    over (`HangWatchdog` start): a hang in model set-up or data loading before `fit()` is
    caught too. The same three layers as the fit's watchdog, with the supervisor's
    --first-heartbeat-timeout as the limit: a thread that writes the heartbeat and, past the
    limit, a hang report with every thread's stack, a ``hang`` event (detected_by "watchdog",
    phase `BEFORE_FIT`) and exit 75; faulthandler's timer a margin later for a process that
    holds the GIL; the heartbeat for the supervisor when the process cannot run at all."""

    def __init__(self, run_dir: Path, limit: float, rank: int = 0):
        self.run_dir, self.limit, self.rank = Path(run_dir), float(limit), rank
        self.poll = max(0.05, min(self.limit / 8, MAX_POLL_S))
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop = Backstop(self.run_dir / run_files.HANGS)

    def start(self) -> None:
        root = run_files.top(self.run_dir)
        make_folder(self.run_dir / run_files.HANGS, root=root)
        self._backstop.open(root)
        self._backstop.arm(self.limit + margin_s(self.poll), exit=True)
        self._write_heartbeat()
        self._thread = threading.Thread(
            target=self._watch, name="steadytrain-start-watch", daemon=True
        )
        with small_stacks():
            self._thread.start()

    def stop(self) -> None:
        """Hand over to a fit's watchdog: the thread ends, the timer and the dump signal are
        disarmed, the backstop file goes (a dump in it becomes a report first)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 5.0)
        was_open = self._backstop.release()
        beat = read_heartbeat(self.run_dir)  # ours goes: a fit's watchdog writes its own
        if beat is not None and beat.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                (self.run_dir / run_files.HEARTBEAT).unlink()
        if was_open:
            with contextlib.suppress(Exception):
                adopt_backstop_dumps(
                    self.run_dir, _record_event(self.run_dir), only_pid=os.getpid()
                )

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            stalled = time.monotonic() - self.started
            if stalled >= self.limit:
                self._fire(stalled)
                return
            self._write_heartbeat()

    def _write_heartbeat(self) -> None:
        write_heartbeat(  # a link is refused, not followed
            self.run_dir,
            step=None,
            phase=BEFORE_FIT,
            stalled=time.monotonic() - self.started,
            limit=self.limit,
            poll=self.poll,
            action="exit",
            dump_signal=self._backstop.signal_registered,
        )

    def _fire(self, stalled: float) -> None:
        if self._stop.is_set():
            return
        budget = report_budget_s(self.limit)
        faulthandler.cancel_dump_traceback_later()
        if self._backstop.file is not None:  # the report itself may not block forever
            self._backstop.arm(budget, exit=True)
        path = None
        with contextlib.suppress(OSError, SteadytrainError):
            path, fd = new_hang_file(self.run_dir / run_files.HANGS, run_files.top(self.run_dir))
            with os.fdopen(fd, "w") as out:
                out.write(
                    "steadytrain hang report\n"
                    f"time: {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n"
                    f"pid: {os.getpid()}\n"
                    + (f"rank: {self.rank}\n" if self.rank else "")
                    + f"phase: {BEFORE_FIT}: fit() has not started watching yet\n"
                    f"no progress for {stalled:.1f} s since the process imported steadytrain "
                    f"(limit {self.limit:.1f} s: steadytrain run --first-heartbeat-timeout)\n"
                    f"action: exit ({HANG_EXIT})\n\n"
                    "Every thread's stack, most recent call first:\n"
                )
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
        info = {
            "step": None,
            "phase": BEFORE_FIT,
            **({"rank": self.rank} if self.rank else {}),
            "stalled_s": round(stalled, 2),
            "limit_s": self.limit,
            "action": "exit",
            "file": str(path.relative_to(self.run_dir)) if path is not None else None,
            "detected_by": "watchdog",
            "exit_code": HANG_EXIT,
        }
        with contextlib.suppress(Exception):
            _record_event(self.run_dir)(Record.HANG, info)
        end_process(
            f"steadytrain: hang {BEFORE_FIT}: no progress for {stalled:.0f} s since the "
            f"process imported steadytrain (limit {self.limit:.0f} s, steadytrain run "
            f"--first-heartbeat-timeout); {stacks_in(path)}; exiting {HANG_EXIT} "
            "(steadytrain run restarts it)\n",
            self._backstop,
        )


def _record_event(run_dir: Path) -> Callable[[str, dict], None]:
    def record(name: str, info: dict) -> None:
        from steadytrain.run.events import append_event

        append_event(run_dir, {"time": time.time(), "event": name, **info})

    return record


_start_watch: StartWatch | None = None


def watch_from_start(environ: Any = os.environ) -> StartWatch | None:
    """Called when steadytrain is imported: under `steadytrain run` (ENV_START_WATCH set), start
    watching this process before `fit()` (`StartWatch`); the variable is taken out of the
    environment, so that processes this one starts (data workers, tools) do not watch
    themselves. Nothing in a multiprocessing child or when the variable is not there."""
    global _start_watch
    spec = run_env.start_watch(environ)
    environ.pop(ENV_START_WATCH, None)
    if spec is None or _start_watch is not None or multiprocessing.parent_process() is not None:
        return None
    run_dir, limit = spec
    try:
        rank = int(environ.get("RANK", "0") or 0)
    except ValueError:
        return None
    own = run_dir if rank == 0 else run_dir / run_files.RANKS / f"rank-{rank}"
    watch = StartWatch(own, limit, rank)
    try:
        watch.start()
    except (OSError, SteadytrainError) as exc:  # a full disk, a planted link: said, not fatal
        with contextlib.suppress(Exception):
            sys.stderr.write(f"steadytrain: cannot watch this process before fit(): {exc}\n")
        watch.stop()
        return None
    _start_watch = watch
    return watch


def stop_start_watch() -> None:
    """A fit's watchdog takes over (or the process no longer needs the start-up watch)."""
    global _start_watch
    watch, _start_watch = _start_watch, None
    if watch is not None:
        watch.stop()
