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

from steadytrain.events import Callback, Control, TrainState
from steadytrain.safety.checkpoint import CheckpointStore, Payload
from steadytrain.safety.watchdog import allowance

STOP_CODES = (0, 130, 143)


class CheckpointSaver(Callback):
    def __init__(
        self,
        store: CheckpointStore,
        capture: Callable[[TrainState], Payload],
        every: int,
        async_save: bool,
        record: Callable[[str, dict], None],
    ):
        self.store, self.capture, self.every = store, capture, every
        self.async_save, self.record = async_save, record
        self.last_saved: int | None = None

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self.last_saved = state.step if state.step else None

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        if state.step % self.every == 0 or control.save_requested:
            metrics = info["metrics"].resolve()  # the step's loss belongs in the checkpoint
            with allowance("checkpoint save"):  # the hang watchdog's limit for saves
                metrics["checkpoint_time"] = self.save(state, final=control.stop_requested)
            control.save_requested = False

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
        payload = self.capture(state)
        if self.async_save and not final:
            self.store.save_async(state.step, payload)
            mode = "async"
        else:
            self.store.save(state.step, payload)
            mode = "sync"
        self.last_saved = state.step
        stall = time.perf_counter() - start
        self.record("checkpoint", {"step": state.step, "mode": mode, "stall_s": round(stall, 4)})
        return stall
