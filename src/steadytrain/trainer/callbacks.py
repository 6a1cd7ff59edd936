"""The default callbacks: those every fit gets, whoever runs its loop, put together once: steadytrain's `Trainer`
and `RunGuard` (another library's loop, or a program's own) build them here from the run's
settings and run directory, and dispatch every event through one `Dispatcher` over
`DefaultCallbacks.in_order()`.

The dispatch order, the same for both, and why (every event calls them in this order):

1. the hang watchdog: first, so a step's time and beats are the step's own, taken before a
   save runs. It starts watching before ``fit_start`` (the Trainer's from its set-up, RunGuard's
   from the library's fit), so the stack dumps an earlier process left are reported (``hang``
   events, that attempt's) before this attempt's ``fit_start``.
2. the memory watch: reads the step's memory before a save adds its copy; a leak found at an
   epoch's end is recorded before that ``epoch_end`` line.
3. the CPU contention watch (`cpu`): the Trainer's alone, built by it; it counts torch's
   threads, and a loop under RunGuard may run without torch (Keras on TensorFlow or JAX).
4. the callbacks whose state a checkpoint holds (`before_save`: the program's `user_state`
   objects that are callbacks, the user's callbacks with ``state_dict()``): just before the
   writer, so a save holds their state after the step it saves.
5. the checkpoint writer (the Trainer's; a library saves its own checkpoints).
6. the signal handling: the signals received during a step are recorded at its end, after its
   save (the handler only set the flags the writer and the loop act on).
7. the resume's continuity check (the Trainer's): the first resumed step's loss, after its save.
8. the displays (`display`: the Trainer's console and TensorBoard log), then the run files:
   after the writer, whose ``checkpoint_time`` belongs in the step's row of metrics.jsonl; at
   ``fit_end`` the files close last (a record after that reopens them).
9. the events decided before the start (`at_start`, the Trainer's plan): after ``fit_start``,
   in events.jsonl and on the console.
10. the user's other callbacks (`user`): last, when the step's save is committed and its row
    written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from steadytrain.config import TrainConfig
from steadytrain.errors import SIGNAL_EXITS
from steadytrain.events import Callback, Control, TrainState
from steadytrain.safety.memory_watch import MemoryWatch
from steadytrain.safety.signals import SignalStop
from steadytrain.safety.watchdog import HangWatchdog
from steadytrain.telemetry.files import RunFiles

Record = Callable[[str, dict], None]

WATCH_SETTINGS = (
    "hang_timeout",
    "hang_action",
    "memory_watch",
    "empty_cache",
    "leak_check_every_steps",
    "leak_threshold_mib",
    "thrash_slowdown",
)
"""The `TrainConfig` fields the default callbacks read."""


def watch_settings(**given: Any) -> SimpleNamespace:
    """The settings `DefaultCallbacks` reads, for a loop without a `TrainConfig` (RunGuard):
    those `given`, the others `TrainConfig`'s defaults."""
    defaults = {name: TrainConfig.model_fields[name].default for name in WATCH_SETTINGS}
    return SimpleNamespace(**(defaults | given))


class DefaultCallbacks:
    """The run files, the hang watchdog, the signal handling and (once the device is known,
    `watch_memory`) the memory watch of one run directory, from `settings` (a `TrainConfig`, or
    `watch_settings`). `recorder(files)` makes the run's ``record(name, info)``, the events
    recorded outside the dispatch (from any thread) that the callbacks are given.
    `signals=False`: the program keeps its own SIGINT / SIGTERM handlers."""

    def __init__(
        self,
        settings: Any,
        run_dir: str | os.PathLike,
        recorder: Callable[[RunFiles], Record],
        *,
        rank: int = 0,
        world_size: int = 1,
        signals: bool = True,
    ):
        self.settings = settings
        self.files = RunFiles(run_dir)
        self.record = recorder(self.files)
        self.watchdog = HangWatchdog.from_config(
            settings, Path(run_dir), None, self.record, rank, world_size
        )
        self.signals = SignalStop(self.record) if signals else None
        self.memory_watch: MemoryWatch | None = None

    def watch_memory(self, device: Any) -> None:
        """The memory watch on `device` (none when the memory_watch setting is off)."""
        self.memory_watch = MemoryWatch.from_config(self.settings, device, self.record)

    def watch_from(self, state: TrainState, control: Control, frame: Any) -> None:
        """Start the watchdog for a loop that is another library's, before ``fit_start``:
        `frame` is the frame whose return ends the fit (the library's ``fit``). The Trainer's
        starts before its set-up instead (`HangWatchdog.start`)."""
        self.watchdog.on_fit_start(state, control, {"fit_frame": frame})

    def stopped_by(self, code: int) -> str | None:
        """The signal ("SIGTERM") whose stop ended the loop with that signal's exit code, or
        None."""
        stopping = self.signals.stopping if self.signals is not None else None
        return stopping if stopping is not None and code == SIGNAL_EXITS[stopping] else None

    def in_order(
        self,
        *,
        cpu: Callback | None = None,
        before_save: Iterable[Any] = (),
        writer: Callback | None = None,
        continuity: Callback | None = None,
        display: Iterable[Any] = (),
        at_start: Callback | None = None,
        user: Iterable[Any] = (),
    ) -> list[Any]:
        """These callbacks and those given, in the dispatch order the module docstring gives."""
        ordered = [
            self.watchdog,
            self.memory_watch,
            cpu,
            *before_save,
            writer,
            self.signals,
            continuity,
            *display,
            self.files,
            at_start,
            *user,
        ]
        return [c for c in ordered if c is not None]


class RecordAtStart(Callback):
    """Events decided before the loop starts (the plan), recorded at fit_start: events.jsonl and
    the console open with the run's start, and the plan follows it."""

    def __init__(self, record: Callable[[str, dict], None]):
        self.record = record
        self.events: list[tuple[str, dict]] = []

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        for name, data in self.events:
            self.record(name, data)
        self.events = []


def record_and_show(files: RunFiles, console: Any) -> Callable[[str, dict], None]:
    def record(name: str, info: dict) -> None:
        """An event from outside the loop's dispatch: into events.jsonl and onto the console."""
        files.record(name, info)
        console.note(name, info)

    return record
