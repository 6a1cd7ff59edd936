"""Says why steps slow down on a shared CPU: when a step takes much longer than the run's typical
step and the CPU is oversubscribed (torch's threads plus other processes' work outnumber the
cores), one `cpu_contention` event names the threads, the cores, the others' load and the thread
count that would fit. The memory watch's thrash check covers slow steps with memory pressure;
this one covers slow steps without it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from steadytrain.device.cpu_load import CpuLoad, CpuMeter
from steadytrain.events import Callback, Control, TrainState
from steadytrain.run.records import Metric, Record

SLOW = 1.5  # a step this many times the typical step time is a slow one
WARMUP = 5  # the first steps (allocation, planning, caches) are no baseline
WINDOW = 50  # steps whose median is the typical step time
REPEAT_S = 300.0  # said again at most this often while it lasts


class CpuContention(Callback):
    """`record(name, info)` writes the event (events.jsonl and the console). `meter` reads the
    CPU (injectable for tests); `clock` is monotonic seconds."""

    def __init__(
        self,
        record: Callable[[str, dict], None],
        meter: Callable[[], CpuLoad] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.record = record
        self._meter = meter
        self.clock = clock
        self.times: deque[float] = deque(maxlen=WINDOW)
        self._seen = 0
        self._said_at: float | None = None

    @classmethod
    def from_config(cls, cfg, device, record: Callable[[str, dict], None]) -> CpuContention | None:
        """Where the step runs on the CPU; elsewhere the CPU's threads are not the step's."""
        return cls(record) if device.type == "cpu" else None

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        if self._meter is None:
            self._meter = CpuMeter().read

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        step_time = info["metrics"].get(Metric.STEP_TIME)
        if not isinstance(step_time, (int, float)):
            return
        self._seen += 1
        if self._seen <= WARMUP:
            return
        typical = statistics.median(self.times) if len(self.times) >= WARMUP else None
        load = self._meter() if self._meter is not None else None  # every step: an interval
        self.times.append(step_time)
        if typical is None or load is None or step_time < SLOW * typical:
            return
        if not load.oversubscribed:
            return
        now = self.clock()
        if self._said_at is not None and now - self._said_at < REPEAT_S:
            return
        self._said_at = now
        self.record(Record.CPU_CONTENTION, self._info(state.step, step_time, typical, load))

    def _info(self, step: int, step_time: float, typical: float, load: CpuLoad) -> dict:
        advice = load.advised_threads
        message = (
            f"step {step} took {step_time:.2f} s, {step_time / typical:.1f}× the typical "
            f"{typical:.2f} s: the CPU is oversubscribed: {load.describe()}. "
            + (
                f"Use {advice} thread{'s' if advice != 1 else ''} (torch.set_num_threads({advice}) "
                f"or OMP_NUM_THREADS={advice}) or stop the other work; "
                if advice < load.threads
                else "Stop the other work or give the run more cores; "
            )
            + "`steadytrain doctor` shows the thread count that fits"
        )
        return {
            "step": step,
            "step_time": step_time,
            "typical_step_time": typical,
            "threads": load.threads,
            "cores": load.cores,
            "others_busy_cores": load.others_busy,
            "load_average": load.load_average,
            "advised_threads": advice,
            "message": message,
        }
