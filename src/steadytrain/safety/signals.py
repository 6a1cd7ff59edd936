"""Ctrl-C and SIGTERM: finish the optimizer step, commit a checkpoint, exit 130 / 143.

The exit is `steadytrain.Stopped`, a `SystemExit` that `fit()` (and each integration) raises
once the checkpoint is committed: the process ends with the code unless the program catches it.

The handlers only set flags (nothing else is safe inside a signal handler); the loop acts on them
at the next step boundary, so a signal during a data wait or a long step is not lost. A second
Ctrl-C while the checkpoint is being written is acknowledged and ignored: the save completes, or,
if the process is killed harder, the previous checkpoint stays `latest`.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from steadytrain.errors import SIGNAL_EXITS, Stopped
from steadytrain.events import Callback, Control, TrainState
from steadytrain.records import Record

EXIT_CODES = {signal.SIGINT: SIGNAL_EXITS["SIGINT"], signal.SIGTERM: SIGNAL_EXITS["SIGTERM"]}


def stop_exit(code: int, result: object = None) -> SystemExit:
    """What ends a process that stopped with `code`: `Stopped` for a signal's 130 / 143 (the
    program may catch it), a plain `SystemExit` for any other code."""
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

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self._control = control
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1 and self._control is not None:
            self.stopping = name
            self._control.request_save()
            self._control.request_stop(EXIT_CODES[signum], f"stopped by {name}")
            print(
                f"\nsteadytrain: {name} received; finishing this optimizer step, saving a "
                f"checkpoint, then exiting with {EXIT_CODES[signum]}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"\nsteadytrain: {name} again; already stopping, the checkpoint is being "
                "written (kill -9 now keeps the previous checkpoint as latest)",
                file=sys.stderr,
                flush=True,
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
