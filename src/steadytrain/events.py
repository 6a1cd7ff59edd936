"""The events the training loop emits, the callback protocol, and the control object.

The loop, with each event where it fires::

    fit_start
    for epoch in epochs:
        for batch in sampler:                     # one optimizer batch: effective_batch_size samples
            step_start
            for micro_batch in split(batch, micro_batch_size):
                forward, loss × share, backward
                micro_step_end                    # heartbeat: one per micro-batch
            # out of memory anywhere above or in the optimizer step:
            #     oom; drop partial grads, free cache; shrink (halve micro_batch_size)
            #     or memory_saver (activation checkpointing); redo this same batch
            unscale, clip, optimizer step, scheduler step, zero grads
            step_end                              # info["metrics"]: one row of metrics.jsonl
        epoch_end
    fit_end                                       # info["reason"]: "finished" | "stopped"

A callback is an object with an ``on_<event>`` method for the events it cares about; every method
has the signature ``(state, control, info)``: ``state`` is the loop's `TrainState` (read it, do not
change it), ``control`` is how a callback asks the loop for something, ``info`` is a dict with what
is particular to that event (documented on `Event`). Callbacks keep their own state.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Event(str, enum.Enum):
    """Every point of the loop a callback can hook. ``info`` keys are listed per event."""

    FIT_START = "fit_start"  # config, device, budget, micro_batch_size
    STEP_START = "step_start"  # (none)
    MICRO_STEP_END = "micro_step_end"  # index, count, size
    OOM = "oom"  # phase, micro_batch_size, error, memory
    SHRINK = "shrink"  # old, new, reason, memory
    MEMORY_SAVER = "memory_saver"  # saver, reason, memory
    STEP_END = "step_end"  # metrics
    EPOCH_END = "epoch_end"  # epoch, memory
    FIT_END = "fit_end"  # reason, exit_code

    @property
    def method(self) -> str:
        return f"on_{self.value}"


class Callback:
    """Base class: override the ``on_<event>`` methods you need; the rest do nothing."""

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_step_start(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_micro_step_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_oom(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None: ...


@dataclass
class TrainState:
    """Where the run is. Everything here is plain data, so it can be saved and restored as JSON."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch, from 0
    batch_in_epoch: int = 0  # optimizer batches of this epoch already consumed
    steps_per_epoch: int = 0
    max_steps: int = 0  # total optimizer steps this run will take
    effective_batch_size: int = 0
    micro_batch_size: int = 0  # micro size in force
    samples_seen: int = 0
    tokens_seen: int = 0
    oom_count: int = 0
    shrink_count: int = 0
    skipped_steps: int = 0  # steps the fp16 grad scaler skipped for inf/NaN gradients
    activation_checkpointing: bool = False
    chunked_loss: int | None = None  # tokens per chunk of a chunked loss in force, None: plain
    last_loss: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Control:
    """What callbacks may ask of the loop. The loop reads it after every event dispatch."""

    stop_requested: bool = False
    stop_exit_code: int = 0
    stop_reason: str = ""
    save_requested: bool = False
    shrink_reason: str | None = None
    _notes: list[str] = field(default_factory=list, repr=False)

    def request_stop(self, exit_code: int = 0, reason: str = "") -> None:
        """Stop after the current optimizer step; `fit()` reports `exit_code`."""
        self.stop_requested, self.stop_exit_code, self.stop_reason = True, exit_code, reason

    def request_save(self) -> None:
        """Ask for a checkpoint at the end of the current optimizer step."""
        self.save_requested = True

    def request_shrink(self, reason: str) -> None:
        """Halve the micro-batch before the next optimizer step (same effective batch)."""
        self.shrink_reason = reason


class Dispatcher:
    """Calls ``on_<event>`` on every callback that has it, in order: ``emit(event, info)``."""

    def __init__(self, callbacks: list[Callback], state: TrainState, control: Control):
        self.callbacks, self.state, self.control = callbacks, state, control

    def __call__(self, event: Event, info: dict | None = None) -> None:
        info = {} if info is None else info
        for callback in self.callbacks:
            method = getattr(callback, event.method, None)
            if method is not None:
                method(self.state, self.control, info)
