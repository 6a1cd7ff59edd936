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
            if evaluation is due (eval_every_steps, or eval_every_epochs at an epoch's last step):
                for micro_batch in eval_data:
                    forward under no_grad
                    eval_step_end                 # heartbeat: one per evaluation micro-batch
                eval_end                          # info["metrics"]; a plateau scheduler steps
            step_end                              # info["metrics"]: one row of metrics.jsonl
        epoch_end
    fit_end                                       # info["reason"]: "finished" | "stopped"

A callback is an object with an ``on_<event>`` method for the events it cares about; every method
has the signature ``(state, control, info)``: ``state`` is the loop's `TrainState` (read it, do not
change it), ``control`` is how a callback asks the loop for something, ``info`` is a dict with what
is particular to that event (documented on `Event`). Callbacks keep their own state.

`StepMetrics` is the row every ``on_step_end`` receives (``info["metrics"]``), one line of
metrics.jsonl, keyed by `Metric`. `Record` and `Metric` (from `steadytrain.run.records`) name
every record of events.jsonl and every key of a metrics.jsonl line.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from steadytrain.errors import UserCodeError
from steadytrain.run.records import Metric as Metric  # the metrics keys' registry, likewise
from steadytrain.run.records import Record as Record  # the record registry, in the events layer


class Event(str, enum.Enum):
    """Every point of the loop a callback can hook. ``info`` keys are listed per event."""

    FIT_START = "fit_start"  # config, device, budget, micro_batch_size
    STEP_START = "step_start"  # (none)
    MICRO_STEP_END = "micro_step_end"  # index, count, size
    OOM = "oom"  # phase, micro_batch_size, error, memory; its step is `oom_step`'s
    SHRINK = "shrink"  # old, new, reason, memory
    MEMORY_SAVER = "memory_saver"  # saver, reason, memory
    EVAL_STEP_END = "eval_step_end"  # index
    EVAL_END = "eval_end"  # metrics, epoch, best (eval_metric improved)
    STEP_END = "step_end"  # metrics
    EPOCH_END = "epoch_end"  # epoch, memory
    FIT_END = "fit_end"  # reason, exit_code
    EVALUATION_END = "eval_end"  # the earlier name of EVAL_END (an alias: the same member)

    @property
    def method(self) -> str:
        return f"on_{self.value}"


def oom_step(state: TrainState, info: dict) -> int:
    """The step an out-of-memory (the `oom` event's `info`) happened in, as the console and
    events.jsonl name it: in a training step, the step in progress (`state.step` + 1, as
    fit_end's `error_step` names the step an error stopped); in an evaluation, the step it
    follows (`state.step`, as "evaluation at step k" does)."""
    return state.step if info.get("phase") == "evaluation" else state.step + 1


class Callback:
    """Base class: override the ``on_<event>`` methods you need; the rest do nothing."""

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_step_start(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_micro_step_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_oom(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_eval_step_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_eval_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None: ...
    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None: ...


OTHER_LIBRARIES = {
    "on_train_begin": "on_fit_start",
    "on_train_start": "on_fit_start",
    "on_fit_begin": "on_fit_start",
    "on_train_end": "on_fit_end",
    "on_step_begin": "on_step_start",
    "on_batch_begin": "on_step_start",
    "on_train_batch_start": "on_step_start",
    "on_batch_end": "on_step_end",
    "on_train_batch_end": "on_step_end",
    "on_evaluate": "on_eval_end",
    "on_validation_end": "on_eval_end",
}
"""The names Hugging Face, Lightning and Keras give to the loop's points, and the event each
is here: the suggestion for a callback written for one of them."""

EARLIER_METHODS = {Event.EVAL_END: ("on_evaluation_end",)}
"""Methods called under their earlier names too (eval_end was evaluation_end), so callbacks
written for them keep running."""

_METHODS = {event: (event.method, *EARLIER_METHODS.get(event, ())) for event in Event}
"""The methods each event calls on a callback, its earlier names included."""


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """Refuse a callback with an ``on_*`` method that no event calls (``on_train_end`` would
    never run): `UserCodeError` (exit 5) naming the method, the closest event and the events."""
    methods = [event.method for event in Event]
    earlier = [name for names in EARLIER_METHODS.values() for name in names]
    for i, callback in enumerate(callbacks):
        if isinstance(callback, type):  # its methods would be called without an instance
            raise UserCodeError(
                f"callbacks[{i}] is the class {callback.__name__}, not a callback: pass an "
                f"instance, callbacks=[{callback.__name__}()]",
                where="callbacks",
            )
        if inspect.isfunction(callback) or inspect.ismethod(callback):  # no event calls it
            raise UserCodeError(
                f"callbacks[{i}] is a function ({callback.__name__}), which no event calls: a "
                "callback is an object whose on_* methods are called (subclass "
                "steadytrain.Callback and define on_step_end(self, state, control, info), for "
                "one)",
                where="callbacks",
            )
        for name in dir(callback):
            if not name.startswith("on_") or name in methods or name in earlier:
                continue
            if not callable(inspect.getattr_static(callback, name, None)):
                continue
            close = OTHER_LIBRARIES.get(name) or next(
                iter(difflib.get_close_matches(name, methods, n=1, cutoff=0.0))
            )
            raise UserCodeError(
                f"callback {type(callback).__name__} has a method {name}, which no event calls, "
                f"so it would never run: did you mean {close}? The events a callback can have: "
                f"{', '.join(methods)} (each called with (state, control, info))",
                where="callbacks",
            )


FROM_CONFIG = {"from_config": True}
"""`TrainState` field metadata: the value follows from this run's config and data, so a resume
keeps the fresh value instead of the checkpoint's."""


@dataclass
class TrainState:
    """Where the run is. Everything here is plain data, so it can be saved and restored as JSON
    (`checkpoint.state.load_train_state` reads it back, field by field)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch, from 0
    batch_in_epoch: int = 0  # optimizer batches of this epoch already consumed
    steps_per_epoch: int = field(default=0, metadata=FROM_CONFIG)
    max_steps: int = field(default=0, metadata=FROM_CONFIG)  # total optimizer steps of the run
    effective_batch_size: int = field(default=0, metadata=FROM_CONFIG)
    micro_batch_size: int = 0  # micro size in force
    samples_seen: int = 0
    tokens_seen: int = 0
    oom_count: int = 0
    shrink_count: int = 0
    skipped_steps: int = 0  # steps the fp16 grad scaler skipped for inf/NaN gradients
    activation_checkpointing: bool | str = False  # or "offload": inputs kept in host memory
    chunked_loss: int | None = None  # tokens per chunk of a chunked loss in force, None: plain
    tiled_mlp: int | None = None  # tokens per piece of the tiled MLPs in force, None: whole
    fsdp_offload: bool = False  # sharded with the shards in host memory (a rerun shards so)
    last_loss: float | None = None
    best_metric: float | None = None  # the best evaluation's eval_metric (keep_best)
    best_step: int | None = None

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

    def request_stop(self, exit_code: int = 0, reason: str = "") -> None:
        """Stop after the current optimizer step; `fit()` reports `exit_code`."""
        self.stop_requested, self.stop_exit_code, self.stop_reason = True, exit_code, reason

    def request_save(self) -> None:
        """Ask for a checkpoint at the end of the current optimizer step."""
        self.save_requested = True

    def request_shrink(self, reason: str) -> None:
        """Halve the micro-batch before the next optimizer step (same effective batch)."""
        self.shrink_reason = reason


def divisor_at_most(total: int, limit: int) -> int:
    """The largest micro-batch not above `limit` that splits `total` samples evenly, so the
    optimizer still sees exactly `total` per step."""
    limit = max(1, min(limit, total))
    return next(d for d in range(limit, 0, -1) if total % d == 0)


@dataclass(frozen=True)
class Halving:
    """The out-of-memory policy every caller asks (the step, the evaluation, `steadytrain
    evaluate`, the integrations' callbacks, the supervisor's restart size): after an
    out-of-memory at `size` samples per pass, the next size is half of it; at 1 there is
    none, and the caller gives up (turns on a memory saver, or says it does not fit).
    `record` is what a ``shrink`` event holds."""

    def next(self, size: int, whole: int | None = None) -> int | None:
        """Half of `size`, or None at 1 (give up). `whole`: the next size must split `whole`
        samples evenly (an integration's batch, whose gradients must add up to it): the
        largest divisor of `whole` not above the half."""
        if size <= 1:
            return None
        half = size // 2
        return half if whole is None else divisor_at_most(whole, half)

    def record(self, old: int, new: int, reason: str, memory: dict | None, **more: Any) -> dict:
        """The ``shrink`` event: sizes before and after, why, the memory reading (and `more`)."""
        return {"old": old, "new": new, **more, "reason": reason, "memory": memory}


HALVING = Halving()


class Dispatcher:
    """Calls ``on_<event>`` on every callback that has it, in order: ``emit(event, info)``."""

    def __init__(self, callbacks: list[Callback], state: TrainState, control: Control):
        self.callbacks, self.state, self.control = callbacks, state, control

    def __call__(self, event: Event, info: dict | None = None) -> None:
        info = {} if info is None else info
        for callback in self.callbacks:
            for name in _METHODS[event]:
                method = getattr(callback, name, None)
                if method is not None:
                    method(self.state, self.control, info)


# -- one optimizer step's metrics row ------------------------------------------------------------
#
# Reading a device value (the loss) makes the host wait for the device. Done at the end of every
# step, that wait leaves the device idle while the host prepares and launches the next step
# (about 10 % of a launch-bound step on an H100, docs/benchmarks.md). So the step hands back its
# device values as tensors; the first read of any of them converts them all, in one wait. The run
# files write step k's line when step k+1 has been queued, so by default nothing waits early.
# Phase times measured on the device (`DeviceSpan`, on the steps the progress display shows) are
# pending values too: two device events, read after that same wait, when both have long passed.

_CONVERT: dict[str, Callable[[Any], Any]] = {
    Metric.LOSS: float,
    Metric.GRAD_NORM: float,
    Metric.TOKENS: int,
    Metric.SKIPPED: bool,
}


def _is_tensor(value: Any) -> bool:
    # No torch import here: the light commands import this module. Without torch loaded, nothing
    # is a tensor.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class DeviceSpan:
    """Seconds between two events recorded on the device's queue (CUDA or MPS timing events).

    The events mark where a phase's work begins and ends on the device, so the span is the
    device's time for that phase, not the host's time to queue it. Reading it before the device
    has passed `end` would wait; `StepMetrics` reads it after converting the step's tensors,
    which already waited for work queued after `end`.
    """

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any):
        self.start, self.end = start, end

    def seconds(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


def _pending(value: Any) -> bool:
    return isinstance(value, DeviceSpan) or _is_tensor(value)


class StepMetrics(dict):
    """A dict of one step's metrics whose device values resolve on first read.

    Its keys are `Metric` members (`steadytrain.run.records`). The row: from the step, ``loss``, ``lr``, ``grad_norm``, ``micro_batch_size``,
    ``micro_steps``, ``samples``, ``tokens``, ``compute_time``, ``optimizer_time``, ``skipped``
    (and ``device_compute_time``, ``device_optimizer_time`` on timed steps); from the loop,
    ``time``, ``step``, ``epoch``, ``data_time``, ``step_time``, ``memory``; from the checkpoint
    callback, ``checkpoint_time`` on the steps it saves.

    `metrics["loss"]`, `.get("loss")` and `resolve()` convert every pending tensor (one device
    synchronisation) and call `on_resolve(metrics)` once. Code that hands the dict to something
    that reads it wholesale (`json.dumps`, `dict(...)`) calls `resolve()` first.
    """

    def __init__(
        self, values: dict[str, Any], on_resolve: Callable[[StepMetrics], None] | None = None
    ):
        super().__init__(values)
        self._on_resolve = on_resolve
        self._resolved = not any(_pending(v) for v in values.values())
        if self._resolved and on_resolve is not None:
            self._on_resolve = None
            on_resolve(self)

    @property
    def resolved(self) -> bool:
        return self._resolved

    def resolve(self) -> StepMetrics:
        if not self._resolved:
            self._resolved = True
            items = list(dict.items(self))
            for key, value in items:
                if _is_tensor(value):
                    dict.__setitem__(self, key, _CONVERT.get(key, float)(value))
            for key, value in items:
                if isinstance(value, DeviceSpan):
                    dict.__setitem__(self, key, value.seconds())
            on_resolve, self._on_resolve = self._on_resolve, None  # once; frees what it holds
            if on_resolve is not None:
                on_resolve(self)
        return self

    def __getitem__(self, key: str) -> Any:
        if not self._resolved and _pending(dict.__getitem__(self, key)):
            self.resolve()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default
