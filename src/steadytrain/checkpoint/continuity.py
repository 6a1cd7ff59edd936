"""The loss-continuity guard: a resumed run shows whether it restored everything.

When a checkpoint is written, the loss of the next optimizer batch is computed with the saved
parameters and random state, as the step will compute it (the next epoch's first batch after the
epoch-end hooks, autograd on; everything put back). The first step after a resume computes that
same loss for real. If it differs, something was not restored as it was (data position, RNG,
parameters, optimizer, the program's code): the difference is recorded as a `continuity` event
(both losses), shown on the console and in the report, and the run goes on; with
`continuity_strict` it stops instead (exit 2). On the CPU the two are equal bit for bit;
accelerators may pick other kernels between a probe and a step, so there the tolerance is 1e-3
relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from steadytrain.errors import StateNotRestoredError
from steadytrain.events import Callback, Control, TrainState
from steadytrain.run.records import Metric, Record

ACCELERATOR_RTOL = 1e-3


class ContinuityCheck(Callback):
    def __init__(
        self,
        expected: float,
        micro_batch_size: int,
        device_type: str,
        record: Callable[[str, dict], None],
        strict: bool = False,
    ):
        self.expected, self.micro, self.device_type, self.record = (
            expected,
            micro_batch_size,
            device_type,
            record,
        )
        self.strict = strict
        self.done = False

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        if self.done:
            return
        self.done = True
        metrics = info["metrics"]
        if metrics[Metric.MICRO_BATCH_SIZE] != self.micro:
            self.record(
                Record.CONTINUITY,
                {
                    "step": state.step,
                    "checked": False,
                    "reason": "the micro-batch changed in the first step",
                },
            )
            return
        got = metrics[Metric.LOSS]
        rtol = 0.0 if self.device_type == "cpu" else ACCELERATOR_RTOL
        same = got == self.expected or math.isclose(got, self.expected, rel_tol=rtol, abs_tol=0.0)
        found = (
            f"the first step after resuming (step {state.step}) has loss {got!r}, but the "
            f"checkpoint recorded {self.expected!r} for it"
        )
        event = {"step": state.step, "checked": True, "loss": got, "expected": self.expected}
        event["equal"] = same
        if not same:
            event["strict"] = self.strict
            event["message"] = (
                f"{found}: the data, the code or its random state differ from the run that wrote "
                "the checkpoint, so from here on this run may not be the one an uninterrupted run "
                + (
                    "would have been; stopping (continuity_strict: true)"
                    if self.strict
                    else "would have been; going on (continuity_strict: true stops here instead)"
                )
            )
        self.record(Record.CONTINUITY, event)
        if not same and self.strict:
            raise StateNotRestoredError(
                f"state not fully restored: {found}. The data, the model or its random state "
                "differ from the run that wrote the checkpoint. Resume with the same data and "
                "code, start a new run_dir, or set continuity_strict: false to go on."
            )
