"""Ctrl-C, SIGTERM and SIGHUP: finish the optimizer step, commit a checkpoint, exit 130 / 143 /
129.

The exit is `steadytrain.Stopped`, a `SystemExit` that `fit()` (and each integration) raises
once the checkpoint is committed: the process ends with the code unless the program catches it.

The handlers only set flags (nothing else is safe inside a signal handler); the loop acts on them
at the next step boundary, so a signal during a data wait or a long step is not lost. A second
Ctrl-C while the checkpoint is being written is acknowledged and ignored: the save completes, or,
if the process is killed harder, the previous checkpoint stays `latest`.

A signal to the whole process group (a cluster's preemption, a terminal) reaches the DataLoader
workers too: they ignore it, and a worker that died of it anyway is not an error
(`engine.workers`). SIGHUP is a terminal closing: stdout and stderr found gone are pointed at
the null device before anything is printed (`steadytrain._terminal`), so the lines of the stop
and the interpreter's last flush cannot end the run.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from steadytrain._terminal import detach_gone, say
from steadytrain.engine.workers import defer_worker_deaths
from steadytrain.errors import SIGNAL_EXITS, Stopped
from steadytrain.events import Callback, Control, TrainState
from steadytrain.run.records import Record

EXIT_CODES = {
    getattr(signal, name): code for name, code in SIGNAL_EXITS.items() if hasattr(signal, name)
}
"""The stop signals this platform has (Windows: no SIGHUP), and the code each ends the run with."""


def stop_exit(code: int, result: object = None) -> SystemExit:
    """What ends a process that stopped with `code`: `Stopped` for a signal's 130 / 143 / 129
    (the program may catch it), a plain `SystemExit` for any other code."""
    for name, signal_code in SIGNAL_EXITS.items():
        if code == signal_code:
            return Stopped(name, result)
    return SystemExit(code)


class SignalStop(Callback):
    def __init__(self, record: Callable[[str, dict], None]):
        self.record = record
        self.received: list[int] = []
        self.stopping: str | None = None  # the signal whose stop this run makes ("SIGTERM")
        self._logged = 0
        self._control: Control | None = None
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()  # a process forked from this one does not stop this run
        self._undefer: Callable[[], None] | None = None

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self._control = control
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != self._pid:
            return  # a forked process (a worker started before it ignored the signal)
        detach_gone()  # a closed terminal: nothing printed from here on may fail
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1 and self._control is not None:
            self.stopping = name
            self._undefer = defer_worker_deaths()
            self._control.request_save()
            self._control.request_stop(EXIT_CODES[signum], f"stopped by {name}")
            say(
                f"\nsteadytrain: {name} received; finishing this optimizer step, saving a "
                f"checkpoint, then exiting with {EXIT_CODES[signum]}"
            )
        else:
            say(
                f"\nsteadytrain: {name} again; already stopping, the checkpoint is being "
                "written (kill -9 now keeps the previous checkpoint as latest)"
            )

    def _log_new(self, state: TrainState) -> None:
        for signum in self.received[self._logged :]:
            self.record(Record.SIGNAL, {"signal": signal.Signals(signum).name, "step": state.step})
        self._logged = len(self.received)

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._log_new(state)

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._log_new(state)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._undefer is not None:
            self._undefer()
            self._undefer = None
