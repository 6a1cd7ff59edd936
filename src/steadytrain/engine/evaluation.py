"""Evaluation during training: the model in eval mode over the evaluation data, at a cadence of
optimizer steps and/or epochs, before the step's `step_end` (so the checkpoint of that step holds
what the evaluation changed: a plateau scheduler's state, the best metric).

The metrics come from the user's ``eval_fn(model, batches) -> {name: number}`` or, without one,
from `loss_fn`: ``eval_loss``, the mean over samples (or over the tokens of ``(loss_sum, count)``
losses). ``batches`` yields micro-batches on the device; each one is a heartbeat for the hang
watchdog (`eval_step_end`). Out of memory halves the evaluation's own micro-batch and runs the
evaluation again; the training's micro-batch is not touched. A scheduler whose ``step()`` takes a
metric (ReduceLROnPlateau) is stepped after each evaluation with the chosen metric. State users
carry across steps (`steadytrain.user_state`) is reset for the evaluation and put back after it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from steadytrain.device import Device, OutOfMemory, retry_on_oom
from steadytrain.device.batches import to_device
from steadytrain.engine.batching import batch_len, split_batch
from steadytrain.engine.side_pass import side_pass
from steadytrain.engine.step import StepRunner
from steadytrain.errors import BadInputError, DoesNotFitError, UserCodeError
from steadytrain.events import HALVING, Event, Metric, TrainState
from steadytrain.user_state import reset, select

EvalFn = Callable[[torch.nn.Module, Iterable[Any]], dict[str, float]]


def takes_metric(scheduler: Any) -> bool:
    """Whether `scheduler.step()` needs a metric (ReduceLROnPlateau and its kind)."""
    if scheduler is None or not hasattr(scheduler, "step"):
        return False
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    )


def loss_metrics(loss_fn: Callable[[torch.nn.Module, Any], Any]) -> EvalFn:
    """The default evaluation: `loss_fn`'s mean over every evaluation sample (or token)."""

    def evaluate(model: torch.nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        total, weight = 0.0, 0
        for piece in batches:
            out = loss_fn(model, piece)
            if isinstance(out, tuple | list):
                loss_sum, count = out
                total += float(loss_sum)
                weight += int(count)
            else:
                size = batch_len(piece)
                total += float(out) * size
                weight += size
        return {Metric.EVAL_LOSS: total / max(weight, 1)}

    return evaluate


@dataclass
class Batching:
    """The size of an evaluation's batches, kept across passes: once memory forced it down, a
    later pass (the adapter's after the base's) starts from the smaller size instead of failing
    again. `shrinks`: (from, to) of each out-of-memory halving."""

    size: int
    shrinks: list[tuple[int, int]] = field(default_factory=list)


def loss_sums(
    model: Any,
    samples: Sequence[Any],
    lengths: Sequence[int],
    collate: Callable[[list[Any]], Any],
    device: Device,
    batching: Batching,
    loss_fn: Callable[[Any, Any], tuple[Any, Any]],
    *,
    too_big: Callable[[int], str],
    on_shrink: Callable[[int, int], None] | None = None,
    advance: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """(sum of the losses, their count) of `model` in eval mode over `samples`, whose
    `loss_fn(model, batch)` returns ``(loss_sum, count)`` (target tokens): the evaluation of
    `steadytrain evaluate` and of a fine-tune's end.

    Samples go longest first (`lengths`), so the batch most likely to run out of memory runs
    first. An out-of-memory halves ``batching.size`` (`HALVING`) and redoes the same samples,
    as the step does; at one sample per batch it raises `DoesNotFitError` (exit 3) with
    ``too_big(length of that sample)``. Any other error propagates."""
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])
    total_loss, total_count, start = 0.0, 0, 0

    def score(indices: list[int]) -> tuple[float, int]:
        with torch.no_grad():
            batch = to_device(collate([samples[i] for i in indices]), device.torch_device)
            loss_sum, count = loss_fn(model, batch)
            return float(loss_sum), int(count)

    def halve(oom: OutOfMemory) -> None:
        old = batching.size
        new = HALVING.next(old)
        if new is None:
            raise DoesNotFitError(too_big(lengths[order[start]]))
        batching.size = new
        batching.shrinks.append((old, new))
        if on_shrink is not None:
            on_shrink(old, new)

    with side_pass(model=model, eval_mode=True):
        while start < len(order):
            loss, count = retry_on_oom(
                lambda at=start: score(order[at : at + batching.size]), device.empty_cache, halve
            )
            done = min(batching.size, len(order) - start)  # the size that fitted
            total_loss, total_count, start = total_loss + loss, total_count + count, start + done
            if advance is not None:
                advance(done)
    return total_loss, total_count


class Evaluation:
    """Runs evaluations for the loop; `batches(index)` yields the collated evaluation batches of
    the `index`-th evaluation (the same ones again when an out-of-memory repeats it)."""

    def __init__(
        self,
        *,
        runner: StepRunner,
        batches: Callable[[int], Iterable[Any]],
        eval_fn: EvalFn,
        every_steps: int | None,
        every_epochs: int | None,
        scheduler: Any = None,
        metric: str = Metric.EVAL_LOSS,
        mode: str = "min",
        needs_metric: bool = False,
        at_end: bool = False,
    ):
        self.runner, self.batches, self.eval_fn = runner, batches, eval_fn
        self.every_steps, self.every_epochs = every_steps, every_epochs
        self.scheduler, self.metric, self.mode = scheduler, metric, mode
        self.needs_metric = needs_metric or scheduler is not None
        self.at_end = at_end  # also after the run's last step (one max_steps ends mid-epoch)
        self.micro: int | None = None  # None: whole evaluation batches
        self.count = 0

    def due(self, state: TrainState, ends_epoch: bool) -> bool:
        if self.every_steps and state.step % self.every_steps == 0:
            return True
        if self.at_end and state.step >= state.max_steps:
            return True
        return bool(ends_epoch and self.every_epochs and (state.epoch + 1) % self.every_epochs == 0)

    def run(self, state: TrainState) -> dict[str, float]:
        """One evaluation; emits `eval_end` and steps a metric-driven scheduler."""
        runner = self.runner
        with side_pass(model=runner.model, eval_mode=True, user_state=runner.user_state) as saved:

            def recover(oom: OutOfMemory) -> None:
                saved.put_back()
                self._shrink(oom.error)

            metrics = retry_on_oom(
                lambda: self._once(self.count), runner.device.empty_cache, recover
            )
        self.count += 1
        metrics = _as_numbers(metrics)
        best = False
        if self.needs_metric or self.metric in metrics:
            value = self.value(metrics)
            best = state.best_metric is None or (
                value < state.best_metric if self.mode == "min" else value > state.best_metric
            )
            if best:
                state.best_metric, state.best_step = value, state.step
            if self.scheduler is not None:
                self.scheduler.step(value)
        runner.emit(Event.EVAL_END, {"metrics": metrics, "epoch": state.epoch, "best": best})
        return metrics

    def value(self, metrics: dict[str, float]) -> float:
        """The chosen metric (eval_metric), refused with the names there are when absent."""
        if self.metric not in metrics:
            raise BadInputError(
                f"eval_metric: {self.metric!r} is not among the evaluation's metrics "
                f"{sorted(metrics)}; set eval_metric to one of them"
            )
        value = metrics[self.metric]
        if not math.isfinite(value):
            raise BadInputError(f"eval_metric: {self.metric} is {value}; look for NaN in eval_data")
        return value

    def _once(self, index: int) -> dict[str, float]:
        runner = self.runner
        reset(runner.user_state)
        with torch.no_grad(), runner.precision.autocast():
            return self.eval_fn(runner.model, self._micro_batches(index))

    def _micro_batches(self, index: int) -> Iterator[Any]:
        runner, count = self.runner, 0
        for batch in self.batches(index):
            n = batch_len(batch)
            micro = min(self.micro or n, n)
            for i, piece in enumerate(split_batch(batch, micro)):
                select(runner.user_state, i * micro, min((i + 1) * micro, n), n)
                yield to_device(piece, runner.device.torch_device, runner.non_blocking)
                count += 1
                runner.emit(Event.EVAL_STEP_END, {"index": count})

    def _shrink(self, error: str) -> None:
        runner = self.runner
        memory = runner.device.memory().to_dict()
        old = self.micro or max((batch_len(b) for b in self.batches(self.count)), default=1)
        runner.emit(
            Event.OOM,
            {"phase": "evaluation", "error": error, "micro_batch_size": old, "memory": memory},
        )
        new = HALVING.next(old)
        if new is None:
            raise DoesNotFitError(
                f"does not fit: evaluation at one sample per micro-batch runs out of memory on "
                f"{runner.device.torch_device} ({error}); use shorter evaluation samples or a "
                "smaller model"
            )
        self.micro = new


def _as_numbers(metrics: Any) -> dict[str, float]:
    """eval_fn's {name: number}; anything else is the user's mistake, said as such (exit 5)."""
    if not isinstance(metrics, dict):
        problem = f"returned {type(metrics).__name__}, not a dict"
    else:
        numbers: dict[str, float] = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                problem = f"{name!r} is a tensor of shape {tuple(value.shape)}, not one number"
                break
            try:
                numbers[str(name)] = float(value)
            except (TypeError, ValueError):
                problem = f"{name!r} is {type(value).__name__}, not a number"
                break
        else:
            return numbers
    raise UserCodeError(
        f"eval_fn {problem}: it must return {{name: number}}, e.g. {{'accuracy': correct / total}}",
        where="eval_fn",
    )
