"""The loss-continuity guard: a resumed run proves it restored everything.

When a checkpoint is written, the loss of the next optimizer batch is computed with the saved
parameters and random state (forward only, everything put back). The first step after a resume
computes that same loss for real; if it differs, something was not restored (data position, RNG,
parameters, optimizer) and the run stops instead of silently becoming another run. On the CPU
the two are equal bit for bit; accelerators may pick other kernels with and without autograd,
so there the tolerance is 1e-3 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from steadytrain.errors import StateNotRestoredError
from steadytrain.events import Callback, Control, TrainState

ACCELERATOR_RTOL = 1e-3


class ContinuityCheck(Callback):
    def __init__(
        self,
        expected: float,
        micro_batch_size: int,
        device_type: str,
        record: Callable[[str, dict], None],
    ):
        self.expected, self.micro, self.device_type, self.record = (
            expected,
            micro_batch_size,
            device_type,
            record,
        )
        self.done = False

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        if self.done:
            return
        self.done = True
        metrics = info["metrics"]
        if metrics["micro_batch_size"] != self.micro:
            self.record(
                "continuity",
                {
                    "step": state.step,
                    "checked": False,
                    "reason": "the micro-batch changed in the first step",
                },
            )
            return
        got = metrics["loss"]
        rtol = 0.0 if self.device_type == "cpu" else ACCELERATOR_RTOL
        same = got == self.expected or math.isclose(got, self.expected, rel_tol=rtol, abs_tol=0.0)
        self.record(
            "continuity",
            {
                "step": state.step,
                "checked": True,
                "loss": got,
                "expected": self.expected,
                "equal": same,
            },
        )
        if not same:
            raise StateNotRestoredError(
                f"state not fully restored: the first step after resuming (step {state.step}) "
                f"has loss {got!r}, but the checkpoint recorded {self.expected!r} for it. The "
                "data, the model or its random state differ from the run that wrote the "
                "checkpoint. Resume with the same data and code, or start a new run_dir."
            )
