"""The checkpoint saver (a callback): when to save, and the save itself (state capture is the
trainer's). Not to be confused with activation checkpointing, which recomputes activations.

Saves every `save_every_steps` optimizer steps, when a callback asks (`control.request_save()`,
e.g. on a signal), and at the end of a run that finished or was stopped; never after an error,
when the state may be mid-step. With async saves, the state is copied to host memory at the step
boundary and written by the store's background thread while training goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.device.budget import cpu_headroom
from steadytrain.events import Callback, Control, TrainState
from steadytrain.safety.checkpoint import CheckpointStore, Payload
from steadytrain.safety.watchdog import allowance

STOP_CODES = (0, 130, 143)


def copy_room(device: Any, need_bytes: Callable[[], int]) -> Callable[[], str | None]:
    """For `CheckpointSaver(room=...)`: on CPU and MPS, where host memory is the training's
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


class CheckpointSaver(Callback):
    def __init__(
        self,
        store: CheckpointStore,
        capture: Callable[[TrainState, bool], Payload],
        every: int,
        async_save: bool,
        record: Callable[[str, dict], None],
        best: CheckpointStore | None = None,
        room: Callable[[], str | None] | None = None,
    ):
        """`capture(state, copy)`: the payload, copied to host memory when `copy`. `best`:
        keep_best's store. `room`: why a background copy does not fit now (`copy_room`)."""
        self.store, self.capture, self.every = store, capture, every
        self.async_save, self.record = async_save, record
        self.best, self.room = best, room
        self.last_saved: int | None = None

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self.last_saved = state.step if state.step else None

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        if state.step % self.every == 0 or control.save_requested:
            metrics = info["metrics"].resolve()  # the step's loss belongs in the checkpoint
            with allowance("checkpoint save"):  # the hang watchdog's limit for saves
                metrics["checkpoint_time"] = self.save(state, final=control.stop_requested)
            control.save_requested = False

    def on_evaluation_end(self, state: TrainState, control: Control, info: dict) -> None:
        """keep_best: a full checkpoint of the step whose evaluation was the best so far, in
        RUN_DIR/best/checkpoints/ (one kept, replaced only after a better one is committed)."""
        if self.best is None or not info.get("best"):
            return
        start = time.perf_counter()
        with allowance("checkpoint save"):
            self.store.wait()  # the capture reuses host buffers an async save may still read
            self.best.save(state.step, self.capture(state, False))
        self.record(
            "best_checkpoint",
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
            self.store.wait()

    def save(self, state: TrainState, final: bool) -> float:
        """Save now; returns the seconds the loop was held (the whole write when synchronous)."""
        start = time.perf_counter()
        self.store.wait()  # the capture reuses host buffers the last async save may still read
        background = self.async_save and not final
        why = self.room() if background and self.room is not None else None
        if why is None and background:
            self.store.save_async(state.step, self.capture(state, True))
            mode = "async"
        else:  # written from the training's own host tensors: no second copy of the state
            self.store.save(state.step, self.capture(state, False))
            mode = "sync"
        self.last_saved = state.step
        stall = time.perf_counter() - start
        info = {"step": state.step, "mode": mode, "stall_s": round(stall, 4)}
        self.record("checkpoint", info | ({"why_sync": why} if why else {}))
        return stall
