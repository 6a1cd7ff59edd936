"""Optional TensorBoard scalars in RUN_DIR/tensorboard (``tensorboard: true``).

The same values as metrics.jsonl, written at the same moment: step k when step k+1 ends, once
the run files have read its loss, so TensorBoard adds no wait for the device. `SummaryWriter`
queues records for its own writer thread, so a step costs a few small appends, no file I/O.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError
from steadytrain.events import Callback, Control, Metric, StepMetrics, TrainState

GIB = 1024**3


class TensorBoardLog(Callback):
    """Writes one set of scalars per optimizer step; flushes and closes at the end of the run."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self._previous: StepMetrics | None = None

    @classmethod
    def from_config(cls, cfg, run_dir: Path) -> TensorBoardLog | None:
        """None unless ``tensorboard: true``; refuses, before training, when the package is
        missing (torch's SummaryWriter needs it and would fail only when first used)."""
        if not cfg.tensorboard:
            return None
        if importlib.util.find_spec("tensorboard") is None:
            raise BadInputError(
                "tensorboard: true needs the tensorboard package, which is not installed in this "
                "environment; run `pip install tensorboard`, or set tensorboard: false"
            )
        return cls(Path(run_dir) / "tensorboard")

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run redoes the steps after its checkpoint: purge_step makes TensorBoard drop
        # the first attempt's records of those steps, as readers of metrics.jsonl keep the last.
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=state.step + 1 if state.step else None
        )

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        metrics = info["metrics"]
        if self._previous is not None:  # the run files resolve it in this same dispatch
            self._write(self._previous.resolve())
        self._previous = None
        if metrics.resolved:
            self._write(metrics)
        else:
            self._previous = metrics

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        if self._previous is not None and self._previous.resolved:
            self._write(self._previous)
        self._previous = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None

    def _write(self, m: StepMetrics) -> None:
        for tag, value in scalars(m).items():
            self.writer.add_scalar(tag, value, m[Metric.STEP], walltime=m.get(Metric.TIME))


def scalars(m: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard tags of one resolved metrics row (absent values are left out)."""
    mem = m.get(Metric.MEMORY) or {}
    used = mem.get("allocated") if mem.get("allocated") is not None else mem.get("rss")
    step_time = m.get(Metric.STEP_TIME) or 0.0
    values = {
        "train/loss": m.get(Metric.LOSS),
        "train/lr": m.get(Metric.LR),
        "train/grad_norm": m.get(Metric.GRAD_NORM),
        "train/micro_batch_size": m.get(Metric.MICRO_BATCH_SIZE),
        "time/step": step_time,
        "time/data": m.get(Metric.DATA_TIME),
        "time/forward_backward": m.get(Metric.COMPUTE_TIME),
        "time/optimizer": m.get(Metric.OPTIMIZER_TIME),
        "time/forward_backward_device": m.get(Metric.DEVICE_COMPUTE_TIME),
        "time/optimizer_device": m.get(Metric.DEVICE_OPTIMIZER_TIME),
        "time/checkpoint": m.get(Metric.CHECKPOINT_TIME),
        "throughput/samples_per_s": m[Metric.SAMPLES] / step_time if step_time else None,
        "throughput/tokens_per_s": m[Metric.TOKENS] / step_time
        if step_time and m.get(Metric.TOKENS)
        else None,
        "memory/used_gib": used / GIB if used is not None else None,
        "memory/peak_gib": mem["peak"] / GIB if mem.get("peak") is not None else None,
        "memory/budget_pct": 100 * used / mem["budget"] if used and mem.get("budget") else None,
    }
    return {tag: float(v) for tag, v in values.items() if v is not None}
