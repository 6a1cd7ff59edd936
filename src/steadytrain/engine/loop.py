"""The training loop: read it top to bottom. Everything cross-cutting is an event."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from steadytrain.engine.step import StepRunner
from steadytrain.events import Dispatcher, Event


class Loop:
    """`batches(epoch, start)` yields the collated optimizer batches of an epoch from `start`."""

    def __init__(
        self,
        *,
        runner: StepRunner,
        batches: Callable[[int, int], Iterable[Any]],
        emit: Dispatcher,
        fit_info: dict[str, Any],
    ):
        self.runner, self.batches, self.emit, self.fit_info = runner, batches, emit, fit_info
        self.state, self.control = emit.state, emit.control

    def run(self) -> tuple[str, int]:
        """Train until max_steps or a stop request. Returns (reason, exit_code)."""
        self.emit(Event.FIT_START, self.fit_info)
        try:
            self._train()
        except BaseException as exc:
            code = 130 if isinstance(exc, KeyboardInterrupt) else getattr(exc, "exit_code", 1)
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.emit(
                Event.FIT_END, {"reason": f"{type(exc).__name__}: {first_line}", "exit_code": code}
            )
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
            for batch in self.batches(state.epoch, state.batch_in_epoch):
                data_time = time.perf_counter() - data_start
                self.emit(Event.STEP_START)
                metrics = self.runner.run(batch)
                state.step += 1
                state.batch_in_epoch += 1
                state.samples_seen += metrics["samples"]
                state.tokens_seen += metrics["tokens"]
                state.last_loss = metrics["loss"]
                metrics.update(
                    step=state.step,
                    epoch=state.epoch,
                    data_time=data_time,
                    step_time=data_time + metrics["compute_time"] + metrics["optimizer_time"],
                    memory=self.runner.device.memory().to_dict(),
                )
                self.emit(Event.STEP_END, {"metrics": metrics})
                if control.shrink_reason:
                    self.runner.shrink(control.shrink_reason)
                    control.shrink_reason = None
                if state.step >= state.max_steps or control.stop_requested:
                    break
                data_start = time.perf_counter()
            if state.batch_in_epoch >= state.steps_per_epoch:
                self.emit(
                    Event.EPOCH_END,
                    {"epoch": state.epoch, "memory": self.runner.device.memory().to_dict()},
                )
                state.epoch += 1
                state.batch_in_epoch = 0
