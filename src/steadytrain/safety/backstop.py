"""The second layer of the hang watching, and the end of a hung process.

A hang that holds the GIL stops the Python watching thread too. For it `Backstop` keeps
``faulthandler.dump_traceback_later`` (a C thread that needs no GIL) armed beyond the limit, and
registers the dump signal the supervisor sends before it kills a frozen child; both write every
thread's stack to ``RUN_DIR/hangs/backstop-<pid>.txt``, which the next start, or the supervisor,
turns into a hang report (`run_hangs.adopt_backstop_dumps`). `end_process` is how the watchdog
and the start watch end a process they found hung: exit 75, which `steadytrain run` restarts.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn, TextIO

from steadytrain.errors import RESTARTABLE_EXIT
from steadytrain.run.durable import open_in_run
from steadytrain.run.hangs import wait_for_aside
from steadytrain.safety.hang_limits import small_stacks

HANG_EXIT = RESTARTABLE_EXIT
ASIDE_WAIT_S = 1.0
"""How long a hung process about to end waits for the console's line of its hang (a console
blocked on a full pipe gets no longer: the exit must come)."""
DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""What the supervisor sends for a stack dump before it kills a frozen child (no Windows)."""


class Backstop:
    """``hangs/backstop-<pid>.txt`` (this process's pid when made), faulthandler's timer and the
    dump signal writing to it."""

    def __init__(self, hangs: Path):
        self.path = hangs / f"backstop-{os.getpid()}.txt"
        self.file: TextIO | None = None
        self.signal_registered = False

    def open(self, root: Path) -> None:
        """Make the file (never through a link: the run's one writer) and register the dump
        signal on it, unless the program handles that signal itself."""
        self.file = os.fdopen(open_in_run(self.path, "new", root=root), "w")
        if DUMP_SIGNAL is not None and signal.getsignal(DUMP_SIGNAL) == signal.SIG_DFL:
            faulthandler.register(DUMP_SIGNAL, file=self.file, all_threads=True)
            self.signal_registered = True

    def arm(self, seconds: float, exit: bool) -> None:
        """Dump the stacks in `seconds` (and end the process when `exit`), replacing the timer
        armed before. Each arm starts a new timer thread."""
        with small_stacks():
            faulthandler.dump_traceback_later(seconds, exit=exit, file=self.file)

    def release(self) -> bool:
        """Disarm the timer and the dump signal and close the file (a dump in it is left for
        `adopt_backstop_dumps`). Returns whether the file was open."""
        faulthandler.cancel_dump_traceback_later()
        if self.signal_registered:
            faulthandler.unregister(DUMP_SIGNAL)
            self.signal_registered = False
        if self.file is None:
            return False
        self.file.close()
        self.file = None
        return True

    def remove(self) -> None:
        """The report is written: the file goes, so that nothing adopts it later."""
        with contextlib.suppress(OSError):
            self.path.unlink()


def end_process(message: str, backstop: Backstop | None) -> NoReturn:
    """End this hung process with HANG_EXIT: its data workers first (a stuck worker must not
    outlive it), then the console's line for the hang (printed aside, given up to
    `ASIDE_WAIT_S`), then `message` on stderr, then the backstop's file."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    wait_for_aside(ASIDE_WAIT_S)
    with contextlib.suppress(Exception):
        sys.stderr.write(message)
        sys.stderr.flush()
        sys.stdout.flush()
    if backstop is not None:
        backstop.remove()
    os._exit(HANG_EXIT)
