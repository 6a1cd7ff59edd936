"""Memory watch: leaks, swap and pressure, cache policy. A callback; docs/memory-watch.md.

Three questions, answered from readings the loop already takes (the step's `memory` and
`step_time`, host values that cost no device synchronisation) plus the machine's swap-in counter,
sampled at most once a second:

* **Leak**: does memory measured at the same point of the step (every `leak_check_every_steps`
  and at each epoch end) rise steadily? Then a `leak` event says the rate in MiB per epoch, when
  the budget is crossed at that rate, the usual causes, and the largest live tensors.
* **Thrash**: on unified memory a job that outgrows memory slides into swap instead of raising;
  by the time the OS kills it there is no exception to catch. When the step time inflates *and*
  the memory readings say why (swap-ins rising, macOS pressure at warning or critical, CUDA
  allocator retries climbing), a `swap` event is recorded and the engine's shrink path halves the
  micro-batch (same effective batch), then the watch waits for the new size to show its effect.
* **Cache**: hand the allocator's cache back (`empty_cache`) only when the readings say it holds
  far more than the tensors use, never every step unless asked: it costs speed (bench/empty_cache.py).

The leak detector is in `steadytrain.safety.leaks`, the thrash detector in
`steadytrain.safety.thrash`; this module is the callback that feeds them and acts on their verdicts.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from steadytrain._units import format_bytes
from steadytrain.events import Callback, Control, TrainState
from steadytrain.run.records import Metric, Record
from steadytrain.safety.leaks import (
    LEAK_CAUSES,
    Leak,
    LeakDetector,
    MiB,
    describe_tensors,
    largest_tensors,
    leak_counters,
)
from steadytrain.safety.thrash import Thrash, ThrashDetector


class MemoryWatch(Callback):
    """Leak and thrash detection and the cache policy, on the loop's events.

    `record(name, info)` writes an event (RUN_DIR/events.jsonl, the console); every event this
    watch records carries a `message`, the warning the user reads.
    """

    cache_ratio = 2.0
    """'auto' empties the cache when reserved (driver) memory is above this multiple of what the
    steps use: the step's peak where the device counts one (CUDA; the engine resets it every step),
    else what is allocated. Measured after a step, the cache always holds that step's freed
    activations, which the next step reuses: emptying those only costs re-allocating them."""
    cache_min_bytes = 256 * MiB
    """... and the gap is at least this large: a small cache is not worth a synchronising call."""
    swap_sample_s = 1.0
    """The swap-in counter is read at most this often: reading it costs about as much as a whole
    memory reading, and swapping that matters lasts seconds."""
    cooldown_steps = 10
    """Steps after a shrink before the watch may shrink again: the smaller micro-batch needs a
    few steps to show its step time, and swap-ins lag behind the memory freed."""

    def __init__(
        self,
        device,
        record: Callable[[str, dict], None],
        *,
        empty_cache: str = "auto",
        leak_check_every_steps: int | str = "auto",
        leak_threshold_mib: float = 32.0,
        thrash_slowdown: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        detector: ThrashDetector | None = None,
    ):
        if empty_cache not in ("auto", "never", "every_step"):
            raise ValueError(f"empty_cache {empty_cache!r}; use auto, never or every_step")
        self.device, self.record, self.clock = device, record, clock
        self.empty_cache = empty_cache
        self.leak_every_spec = leak_check_every_steps
        self.leak_threshold = leak_threshold_mib * MiB
        self.thrash = detector or ThrashDetector(thrash_slowdown)
        self.leak_every = 1
        self.leaks: dict[str, LeakDetector] = {}
        self.reported_leaks: set[str] = set()
        self._last_swap_sample: float | None = None
        self._last_shrink_step: int | None = None
        self._warned_at_one = False
        self._step_times: deque[float] = deque(maxlen=50)

    @classmethod
    def from_config(cls, cfg, device, record: Callable[[str, dict], None]) -> MemoryWatch | None:
        if not cfg.memory_watch:
            return None
        return cls(
            device,
            record,
            empty_cache=cfg.empty_cache,
            leak_check_every_steps=cfg.leak_check_every_steps,
            leak_threshold_mib=cfg.leak_threshold_mib,
            thrash_slowdown=cfg.thrash_slowdown,
        )

    # -- events ------------------------------------------------------------------------------

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        spec = self.leak_every_spec
        self.leak_every = (
            max(1, min(state.steps_per_epoch // 4, 500)) if spec == "auto" else int(spec)
        )
        self.leaks = {
            name: LeakDetector(name, state.steps_per_epoch, self.leak_threshold)
            for name in leak_counters(self.device.type)
        }

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        metrics = info["metrics"]
        memory = metrics.get(Metric.MEMORY) or {}
        step_time = metrics.get(Metric.STEP_TIME)
        if step_time is not None:
            self._step_times.append(step_time)
        if self.empty_cache == "every_step":
            self.device.empty_cache()

        swap_in, now = None, self.clock()
        if self._last_swap_sample is None or now - self._last_swap_sample >= self.swap_sample_s:
            swap_in, self._last_swap_sample = self.device.swap_in(), now
        if step_time is not None:
            verdict = self.thrash.observe(step_time, memory, swap_in, now)
            if verdict is not None:
                self._on_thrash(state, control, verdict, memory)

        if state.step % self.leak_every == 0:
            self._leak_reading(state, memory)

    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None:
        memory = info.get("memory") or {}
        self._leak_reading(state, memory)
        if self.empty_cache == "auto":
            self._maybe_empty_cache(state, memory, "epoch end")

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self._last_shrink_step = state.step
        self.thrash.restart_window()

    # -- leak --------------------------------------------------------------------------------

    def _leak_reading(self, state: TrainState, memory: dict) -> None:
        for name, detector in self.leaks.items():
            leak = detector.add(state.step, memory.get(name))
            if leak is not None and name not in self.reported_leaks:
                self.reported_leaks.add(name)
                self._report_leak(state, leak, memory)

    def _report_leak(self, state: TrainState, leak: Leak, memory: dict) -> None:
        budget = memory.get("budget")
        eta_epochs = eta_steps = eta_seconds = None
        if budget:
            left = budget - leak.current
            eta_epochs = max(left, 0) / leak.rate_per_epoch
            eta_steps = round(eta_epochs * max(state.steps_per_epoch, 1))
            if self._step_times:
                eta_seconds = eta_steps * statistics.median(self._step_times)
        kinds = largest_tensors()
        first_step, first = leak.readings[0]
        text = (
            f"memory leak suspected: {leak.counter} rose {leak.rate_per_epoch / MiB:.1f} MiB per "
            f"epoch over steps {first_step}–{state.step} ({format_bytes(first)} → "
            f"{format_bytes(leak.current)})"
        )
        if eta_epochs is None:
            text += "; no budget is known to project against"
        elif eta_epochs == 0:
            text += f"; it is already above the budget of {format_bytes(budget)}"
        else:
            text += (
                f"; at this rate it reaches the budget of {format_bytes(budget)} in "
                f"{eta_epochs:.1f} epochs (step {state.step + eta_steps}"
                + (f", about {_duration(eta_seconds)}" if eta_seconds is not None else "")
                + ")"
            )
        text += f". Usual causes: {LEAK_CAUSES}."
        if kinds:
            text += f" Largest live tensors: {describe_tensors(kinds)}."
        self.record(
            Record.LEAK,
            {
                "counter": leak.counter,
                "step": state.step,
                "rate_mib_per_epoch": leak.rate_per_epoch / MiB,
                "readings": [{"step": s, "bytes": v} for s, v in leak.readings],
                "budget": budget,
                "eta_epochs": eta_epochs,
                "eta_step": state.step + eta_steps if eta_steps is not None else None,
                "largest_tensors": kinds,
                "message": text,
            },
        )
        if self.empty_cache == "auto":
            self._maybe_empty_cache(state, memory, "leak suspected")

    # -- thrash ------------------------------------------------------------------------------

    def _on_thrash(self, state: TrainState, control: Control, verdict: Thrash, memory: dict):
        if self._last_shrink_step is not None and (
            state.step - self._last_shrink_step < self.cooldown_steps
        ):
            return
        old = state.micro_batch_size
        info = {
            "reason": verdict.reason,
            "slowdown": verdict.slowdown,
            "signal": verdict.signal,
            "micro_batch_size": old,
            "memory": memory,
            **verdict.evidence,
        }
        if old > 1:
            control.request_shrink(verdict.reason)
            self._last_shrink_step = state.step
            self.thrash.restart_window()
            info["action"] = "shrink"
            info["message"] = (
                f"{verdict.reason}: halving the micro-batch {old} → {max(1, old // 2)} to get "
                "out of swap before the OS kills the process; the effective batch stays "
                f"{state.effective_batch_size}"
            )
            self.record(Record.SWAP, info)
        elif not self._warned_at_one:
            self._warned_at_one = True
            info["action"] = "none"
            info["message"] = (
                f"{verdict.reason}, at micro-batch 1: nothing left to shrink. Free memory "
                "(close other programs), shorten sequences, lower precision or use a smaller "
                "model; the OS may kill this run (a checkpoint resumes it)"
            )
            self.record(Record.SWAP, info)
        if self.empty_cache == "auto":
            self._maybe_empty_cache(state, memory, "thrashing")

    # -- cache -------------------------------------------------------------------------------

    def _maybe_empty_cache(self, state: TrainState, memory: dict, why: str) -> None:
        allocated, reserved = memory.get("allocated"), memory.get("reserved")
        if allocated is None or reserved is None:
            return
        used = max(allocated, memory.get("peak") or 0)
        if reserved < self.cache_ratio * used or reserved - used < self.cache_min_bytes:
            return
        self.device.empty_cache()
        after = self.device.memory().reserved
        freed = reserved - after if after is not None else None
        self.record(
            Record.CACHE,
            {
                "why": why,
                "step": state.step,
                "allocated": allocated,
                "peak": memory.get("peak"),
                "reserved_before": reserved,
                "reserved_after": after,
                "freed": freed,
                "message": (
                    f"emptied the allocator cache at step {state.step} ({why}): reserved "
                    f"{format_bytes(reserved)} for {format_bytes(allocated)} of tensors, "
                    f"{format_bytes(after)} after"
                ),
            },
        )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
