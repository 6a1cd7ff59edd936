"""The training loop: read it top to bottom. Everything cross-cutting is an event."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from steadytrain.device import is_oom
from steadytrain.engine.evaluation import Evaluation
from steadytrain.engine.open_files import open_files_limit_error
from steadytrain.engine.step import StepRunner
from steadytrain.engine.workers import owned_batches
from steadytrain.errors import BadInputError, user_code_error
from steadytrain.events import Dispatcher, Event, Metric, StepMetrics


class Loop:
    """`batches(epoch, start)` yields the collated optimizer batches of an epoch from `start`.

    Every `time_every`-th step (and the last) is timed: its forward+backward and optimizer
    phases are also measured on the device's clock (`StepRunner.run(timed=True)`). Those are
    the steps the progress lines show (``log_every_steps``); the others stay free of any extra
    device work.
    """

    def __init__(
        self,
        *,
        runner: StepRunner,
        batches: Callable[[int, int], Iterable[Any]],
        emit: Dispatcher,
        fit_info: dict[str, Any],
        time_every: int,
        evaluation: Evaluation | None = None,
    ):
        self.runner, self.batches, self.emit, self.fit_info = runner, batches, emit, fit_info
        self.evaluation = evaluation
        self.time_every = time_every
        self.state, self.control = emit.state, emit.control
        self.last_metrics: StepMetrics | None = None
        self.step_in_progress: int | None = None  # the step an error is reported at
        self._last_loss_step = 0

    def _account(self, metrics: StepMetrics) -> None:
        """Counters that need the device's values, updated when a step's metrics resolve."""
        loss, step = metrics[Metric.LOSS], metrics[Metric.STEP]
        if not math.isfinite(loss):
            error = BadInputError(
                f"loss is {loss} at step {step} (epoch {metrics[Metric.EPOCH]}): "
                "look for NaN or Inf in that batch's inputs or targets, or lower the learning rate"
                + (" (fp16: try bf16)" if metrics.get(Metric.SKIPPED) else "")
            )
            # the step whose loss it is: read while the next one runs, it is reported as its own
            error.steadytrain_step = step  # type: ignore[attr-defined]
            raise error
        self.state.tokens_seen += metrics[Metric.TOKENS]
        self.state.skipped_steps += bool(metrics[Metric.SKIPPED])
        if step >= self._last_loss_step:
            self._last_loss_step = step
            self.state.last_loss = loss

    def _row(self, values: dict[str, Any], data_time: float) -> StepMetrics:
        """The step's metrics row (`StepMetrics` lists its columns): the step's values, and
        where and when it ran."""
        step_time = data_time + values[Metric.COMPUTE_TIME] + values[Metric.OPTIMIZER_TIME]
        values |= {
            Metric.TIME: time.time(),
            Metric.STEP: self.state.step,
            Metric.EPOCH: self.state.epoch,
            Metric.DATA_TIME: data_time,
            Metric.STEP_TIME: step_time,
            Metric.MEMORY: self.runner.device.memory().to_dict(),
        }
        previous = self.last_metrics

        def account(metrics: StepMetrics) -> None:
            # Steps resolve in order, so the counters a checkpoint of this step saves include
            # the steps before it that no reader had resolved yet.
            if previous is not None:
                previous.resolve()
            self._account(metrics)

        return StepMetrics(values, account)

    def run(self) -> tuple[str, int]:
        """Train until max_steps or a stop request. Returns (reason, exit_code)."""
        try:
            # Inside the try: a callback that fails at fit_start still gets fit_end, so the
            # callbacks that did start (a watchdog thread, a live display) stop.
            self.emit(Event.FIT_START, self.fit_info)
            self._train()
            if self.last_metrics is not None:
                self.last_metrics.resolve()
        except BaseException as exc:
            # An error raised in the user's code (loss_fn, model, dataset, callback) is theirs:
            # reported with the step, their frames and exit 5 (3 when it ran out of memory
            # outside the step's redo), not as a bug of ours.
            step = getattr(exc, "steadytrain_step", None) or self.step_in_progress
            workers = (self.fit_info.get("config") or {}).get("num_workers") or 0
            limit = open_files_limit_error(exc, workers)  # the environment's, not their code's
            theirs = None if limit else user_code_error(exc, step, out_of_memory=is_oom(exc))
            shown = limit or theirs or exc
            code = 130 if isinstance(shown, KeyboardInterrupt) else getattr(shown, "exit_code", 1)
            first_line = (str(shown).strip().splitlines() or [""])[0]
            reason = f"{type(shown).__name__}: {first_line}"
            kind = type(shown).__name__
            if theirs is not None:
                kind = "an error in your code" + (f" ({theirs.where})" if theirs.where else "")
                reason = f"stopped by {kind}: {theirs.error}"
            info = {"reason": reason, "exit_code": code, "error": kind, "error_step": step}
            # a collective broken by a peer that died: said here too, since torchrun may stop
            # this rank before its exit record, and `steadytrain run` must not blame it
            collective = getattr(exc, "steadytrain_collective", None)
            if collective is not None:
                info["collective"] = collective
            self.emit(Event.FIT_END, info)
            if theirs is not None and theirs is not exc:
                raise theirs from exc
            if limit is not None:
                raise limit from exc
            with contextlib.suppress(AttributeError, TypeError):  # for the "error" event
                exc.steadytrain_step = step  # type: ignore[attr-defined]
            raise
        if self.control.stop_requested:
            reason, code = self.control.stop_reason or "stopped", self.control.stop_exit_code
        else:
            reason, code = "finished", 0
        self.emit(Event.FIT_END, {"reason": reason, "exit_code": code})
        return reason, code

    def _train(self) -> None:
        state, control = self.state, self.control
        while state.step < state.max_steps and not control.stop_requested:
            data_start = time.perf_counter()
            self.step_in_progress = state.step + 1  # its batch is read next
            # the workers outlive a stop signal until the step is saved (engine/workers.py)
            for batch in owned_batches(self.batches(state.epoch, state.batch_in_epoch), control):
                data_time = time.perf_counter() - data_start
                self.emit(Event.STEP_START)
                coming = state.step + 1
                timed = coming % self.time_every == 0 or coming == state.max_steps
                values = self.runner.run(batch, timed=timed)
                state.step += 1
                state.batch_in_epoch += 1
                state.samples_seen += values[Metric.SAMPLES]
                self.last_metrics = self._row(values, data_time)
                ends_epoch = state.batch_in_epoch >= state.steps_per_epoch
                if self.evaluation is not None and self.evaluation.due(state, ends_epoch):
                    self.evaluation.run(state)
                self.emit(Event.STEP_END, {"metrics": self.last_metrics})
                if control.shrink_reason:
                    self.runner.shrink(control.shrink_reason)
                    control.shrink_reason = None
                if state.step >= state.max_steps or control.stop_requested:
                    break
                data_start = time.perf_counter()
                self.step_in_progress = state.step + 1
            if state.batch_in_epoch >= state.steps_per_epoch:
                self.emit(
                    Event.EPOCH_END,
                    {"epoch": state.epoch, "memory": self.runner.device.memory().to_dict()},
                )
                state.epoch += 1
                state.batch_in_epoch = 0
