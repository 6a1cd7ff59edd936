"""The checkpoint writer (a callback): when to write a checkpoint, and the write itself (what
goes in one is `checkpoint.state`'s). "Saver" names the memory savers (activation checkpointing,
chunked loss, offload), never this.

Saves every `save_every_steps` optimizer steps, when a callback asks (`control.request_save()`,
e.g. on a signal), and at the end of a run that finished or was stopped; never after an error,
when the state may be mid-step. With async saves, the state is copied to host memory at the step
boundary and written by the store's background thread while training goes on; the "checkpoint"
event (events.jsonl, the console's "checkpoint at step N") is recorded by that thread as soon as
it has committed, so a step that hangs, or a kill, right after the commit does not take the
record with it; a background save that failed stops the run at the first step end after it.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.checkpoint.store import CheckpointStore, Payload
from steadytrain.device.budget import cpu_headroom
from steadytrain.errors import (
    SIGNAL_EXITS,
    DiskFullError,
    RunDiskFullError,
    RunNotWritableError,
    is_disk_full,
)
from steadytrain.events import Callback, Control, TrainState
from steadytrain.run.records import Metric, Record

STOP_CODES = (0, *SIGNAL_EXITS.values())  # finished, or stopped by a signal


@contextlib.contextmanager
def _disk_full_exits_6() -> Iterator[None]:
    """A save that filled the disk ends the run as a full disk anywhere does (exit 6), with the
    store's message (what it needed, what is free, which checkpoint is kept)."""
    try:
        yield
    except DiskFullError as exc:
        raise RunDiskFullError(exc.path, detail=str(exc)) from exc


@contextlib.contextmanager
def full_disk_ends_the_run(run_dir: str | Path, keep_last: int) -> Iterator[None]:
    """A full disk anywhere in the block (metrics, events, lock, config, a checkpoint) ends the
    run as RunDiskFullError (exit 6): the file, the space left, and the checkpoint kept. A disk
    made read-only meanwhile (EROFS: remounted so after an I/O error, or by hand) ends it as
    RunNotWritableError (exit 2), naming the file and the checkpoint kept."""
    try:
        yield
    except (RunDiskFullError, RunNotWritableError) as exc:
        exc.kept = exc.kept or _kept(run_dir, keep_last)
        raise
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise RunNotWritableError(exc.filename, exc, _kept(run_dir, keep_last)) from exc
        if not is_disk_full(exc):
            raise
        raise RunDiskFullError(exc.filename, exc, _kept(run_dir, keep_last)) from exc


def _kept(run_dir: str | Path, keep_last: int) -> str:
    """The newest committed checkpoint, which a run stopped by a full disk keeps as latest."""
    committed = CheckpointStore(run_dir, keep_last).committed()
    if not committed:
        return "no checkpoint had been committed yet"
    step, path = committed[-1]
    return f"checkpoint {path} (step {step}), the last committed one, stays the latest"


def copy_room(device: Any, need_bytes: Callable[[], int]) -> Callable[[], str | None]:
    """For `CheckpointWriter(room=...)`: on CPU and MPS, where host memory is the training's
    memory, a background save's copy of the state is held while the next step runs, so the copy
    and that step's gradients (`need_bytes`) must fit in what is free; returns why they do not
    (the save is then synchronous, written from the tensors themselves), or None when they fit.
    A copy to host RAM from CUDA memory always goes ahead (pinned buffers, reused)."""

    def why_not() -> str | None:
        if device.type == "cuda":
            return None
        need = need_bytes()
        room = cpu_headroom(device.system)
        memory = device.memory().to_dict()
        used = memory.get("allocated") if device.type == "mps" else memory.get("rss")
        if memory.get("budget") and used is not None:
            room = min(room, memory["budget"] - used)
        if need * 5 // 4 <= room:
            return None
        return (
            f"a background copy of the state beside the next step's gradients needs "
            f"{format_bytes(need)}, {format_bytes(max(room, 0))} is free"
        )

    return why_not


class CheckpointWriter(Callback):
    def __init__(
        self,
        store: CheckpointStore,
        capture: Callable[[TrainState, bool], Payload],
        every: int,
        async_save: bool,
        record: Callable[[str, dict], None],
        best: CheckpointStore | None = None,
        room: Callable[[], str | None] | None = None,
        allowance: Callable[[str], contextlib.AbstractContextManager] | None = None,
    ):
        """`capture(state, copy)`: the payload, copied to host memory when `copy`. `best`:
        keep_best's store. `room`: why a background copy does not fit now (`copy_room`).
        `allowance(phase)`: the hang watchdog's longer limit while a save runs (passed in by
        the Trainer: the checkpoint package does not import the watchdog)."""
        self.store, self.capture, self.every = store, capture, every
        self.async_save, self.record = async_save, record
        self.best, self.room = best, room
        self.allowance = allowance or (lambda phase: contextlib.nullcontext())
        self.last_saved: int | None = None
        self._in_flight = False  # a background save whose error is not collected yet

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self.last_saved = state.step if state.step else None

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._settle(block=False)  # a background save that failed stops the run here
        if state.step % self.every == 0 or control.save_requested:
            metrics = info["metrics"].resolve()  # the step's loss belongs in the checkpoint
            with self.allowance("checkpoint save"):  # the hang watchdog's limit for saves
                metrics[Metric.CHECKPOINT_TIME] = self.save(state, final=control.stop_requested)
            control.save_requested = False

    def on_eval_end(self, state: TrainState, control: Control, info: dict) -> None:
        """keep_best: a full checkpoint of the step whose evaluation was the best so far, in
        RUN_DIR/best/checkpoints/ (one kept, replaced only after a better one is committed)."""
        if self.best is None or not info.get("best"):
            return
        start = time.perf_counter()
        with self.allowance("checkpoint save"), _disk_full_exits_6():
            self._settle(block=True)  # the capture reuses host buffers a save may still read
            self.best.save(state.step, self.capture(state, False))
        self.record(
            Record.BEST_CHECKPOINT,
            {
                "step": state.step,
                "metric": state.best_metric,
                "stall_s": round(time.perf_counter() - start, 4),
            },
        )

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        try:
            if info.get("exit_code") in STOP_CODES and self.last_saved != state.step and state.step:
                self.save(state, final=True)
        finally:
            self._settle(block=True)

    def save(self, state: TrainState, final: bool) -> float:
        """Save now; returns the seconds the loop was held (the whole write when synchronous)."""
        start = time.perf_counter()
        self._settle(block=True)  # the capture reuses host buffers the last save may still read
        background = self.async_save and not final
        why = self.room() if background and self.room is not None else None
        with _disk_full_exits_6():
            if why is None and background:
                step, payload = state.step, self.capture(state, True)
                stall = time.perf_counter() - start  # the copy: what the loop waits for

                def committed(folder: Path) -> None:  # in the store's thread, at the commit
                    self._committed(step, "async", stall)

                self.store.save_async(step, payload, on_commit=committed)
                self._in_flight = True
            else:  # written from the training's own host tensors: no second copy of the state
                self.store.save(state.step, self.capture(state, False))
                self._committed(state.step, "sync", time.perf_counter() - start, why)
        self.last_saved = state.step
        return time.perf_counter() - start

    def _settle(self, block: bool) -> None:
        """Raise the error of the background save once it has ended (its commit recorded
        itself). Without `block`, a save still writing is left alone."""
        if not self._in_flight or (not block and self.store.in_flight()):
            return
        self._in_flight = False
        with _disk_full_exits_6():
            self.store.wait()  # raises what the background save raised (a full disk)

    def _committed(self, step: int, mode: str, stall: float, why_sync: str | None = None) -> None:
        """The "checkpoint" event: the checkpoint of `step` is on disk and is the latest. From
        the store's thread for a background save: `record` writes one line in one system call
        and prints from another thread aside (`ConsoleLog.note`), as the watchdog's records do."""
        info = {"step": step, "mode": mode, "stall_s": round(stall, 4)}
        self.record(Record.CHECKPOINT, info | ({"why_sync": why_sync} if why_sync else {}))
