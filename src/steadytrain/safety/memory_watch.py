# long-module: the leak, swap and cache watchers read the same samples at each step
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
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from steadytrain._units import format_bytes
from steadytrain.events import Callback, Control, TrainState

MiB = 2**20

LEAK_CAUSES = (
    "a model or optimizer rebuilt inside the loop; tensors kept in a Python list (keep "
    "loss.item(), not loss); caches that grow with every new input shape"
)


# -- leaks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leak:
    """A steady rise of one counter, as measured over `readings` (step, bytes)."""

    counter: str
    rate_per_epoch: float  # bytes per epoch, from a least-squares fit
    readings: tuple[tuple[int, int], ...]

    @property
    def current(self) -> int:
        return self.readings[-1][1]


class LeakDetector:
    """Readings of one counter taken at the same point of the step; reports a steady rise.

    Steady means: each of the last `window` readings is above the one before by more than
    `noise` bytes (a single jump, such as the optimizer's state appearing at the first step or a
    checkpoint's buffers, is not a trend), the least-squares slope over them is at least
    `threshold` bytes per epoch, and their whole rise is more than `FALLS` times the largest
    fall the counter has shown between two readings. A leak never makes memory fall; a counter
    that has fallen by 20 MiB between readings moves that much by itself (allocator caching,
    variable-length batches), and four readings that happen to rise by 10 MiB each are no trend
    there. Only the last `window` readings are fitted, so warm-up does not bend the rate of a
    leak found later.
    """

    FALLS = 3

    def __init__(
        self,
        counter: str,
        steps_per_epoch: int,
        threshold: float,
        window: int = 4,
        noise: int = MiB // 4,
    ):
        if window < 3:
            raise ValueError("a steady rise needs at least 3 readings")
        self.counter, self.steps_per_epoch = counter, max(steps_per_epoch, 1)
        self.threshold, self.noise = threshold, noise
        self.readings: deque[tuple[int, int]] = deque(maxlen=window)
        self.largest_fall = 0

    def add(self, step: int, value: int | None) -> Leak | None:
        if value is None or (self.readings and self.readings[-1][0] >= step):
            return None
        if self.readings:
            self.largest_fall = max(self.largest_fall, self.readings[-1][1] - value)
        self.readings.append((step, value))
        if len(self.readings) < (self.readings.maxlen or 0):
            return None
        values = [v for _, v in self.readings]
        if any(b - a <= self.noise for a, b in itertools.pairwise(values)):
            return None
        if values[-1] - values[0] <= self.FALLS * self.largest_fall:
            return None
        rate = _slope(list(self.readings)) * self.steps_per_epoch
        if rate < self.threshold:
            return None
        return Leak(self.counter, rate, tuple(self.readings))


def _slope(points: Sequence[tuple[int, int]]) -> float:
    """Least-squares slope of value over step (bytes per step)."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def leak_counters(device_type: str) -> tuple[str, ...]:
    """Which reading shows a leak on this device: CPU tensors live in the process (rss); CUDA
    tensors in the caching allocator (allocated: reserved would also count the cache); MPS
    memory in the driver (reserved: driver memory, which also holds the graph caches of
    mps.md §5), plus rss, where the growth invisible to the driver counters shows first."""
    return {"cuda": ("allocated",), "mps": ("reserved", "rss")}.get(device_type, ("rss",))


def largest_tensors(limit: int = 5) -> list[dict]:
    """Live tensors grouped by kind (shape, dtype, device), largest total first, each storage
    counted once. Scans every object the garbage collector tracks: tens of milliseconds for a
    large program, so it runs once, when a leak is first suspected, never per step."""
    kinds: dict[tuple, dict] = {}
    seen: set[tuple[str, int]] = set()
    torch = sys.modules.get("torch")  # never imported here: without torch there is no tensor
    if torch is None:
        return []
    with warnings.catch_warnings():
        # `type()`, not `isinstance`: isinstance reads `__class__`, which deprecated module
        # proxies (torch.distributed.reduce_op) answer with a FutureWarning.
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for obj in tensors:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key in seen or storage.data_ptr() == 0:
                continue
            seen.add(key)
            kind = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), str(obj.device))
            entry = kinds.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += storage.nbytes()
        except Exception:  # noqa: BLE001 - a tensor subclass without storage is skipped
            continue
    top = sorted(kinds.items(), key=lambda kv: kv[1]["bytes"], reverse=True)[:limit]
    return [
        {
            "shape": list(k[0]),
            "dtype": k[1],
            "device": k[2],
            "count": v["count"],
            "bytes": v["bytes"],
        }
        for k, v in top
    ]


def describe_tensors(kinds: list[dict]) -> str:
    return "; ".join(
        f"{k['count']} × {k['dtype']}{k['shape']} on {k['device']} ({format_bytes(k['bytes'])})"
        for k in kinds
    )


# -- thrashing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thrash:
    """Why the watch thinks the run is thrashing: the slowdown and the memory signal."""

    slowdown: float | None  # recent median step time / baseline median; None: not measured
    signal: str  # what the memory readings say, in words
    evidence: dict = field(default_factory=dict)

    @property
    def reason(self) -> str:
        if self.slowdown is None:
            return f"thrashing: {self.signal}"
        return f"thrashing: step time {self.slowdown:.1f}× its baseline with {self.signal}"


class ThrashDetector:
    """Decides from one reading per optimizer step whether the run is thrashing.

    Both must say so: the **step time** (median of the last `window` steps at least `slowdown` ×
    the median of the early steps, `warmup` first steps skipped because they include compiling
    and first-touch allocation) and the **memory readings**, one of:

    * swap-ins rising: the machine's cumulative swapped-in bytes rose at each of the last two
      samples, at `swap_in_rate` bytes/s or more. Swap *used* is not a signal: pages swapped out
      long ago and never needed again cost nothing.
    * macOS memory pressure at warning (2) or critical (4) in most of the window.
    * CUDA allocator retries (`num_alloc_retries`) risen at each of the last `retry_steps` steps:
      the allocator is freeing its cache and retrying to satisfy every step.

    Critical pressure (4) held for the whole window is enough alone: it is the level at which
    macOS picks processes to kill (mps.md §6), and on unified memory the compressor can keep
    step times flat until then. After a verdict (or any shrink) the window restarts, so the new
    micro-batch is judged on its own steps.
    """

    def __init__(
        self,
        slowdown: float = 2.0,
        *,
        window: int = 5,
        warmup: int = 3,
        baseline_steps: int = 10,
        swap_in_rate: float = 1 * MiB,
        retry_steps: int = 3,
    ):
        self.slowdown, self.window, self.warmup = slowdown, window, warmup
        self.baseline_steps, self.swap_in_rate, self.retry_steps = (
            baseline_steps,
            swap_in_rate,
            retry_steps,
        )
        self._seen = 0
        self._early: list[float] = []
        self.baseline: float | None = None
        self._times: deque[float] = deque(maxlen=window)
        self._pressure: deque[int | None] = deque(maxlen=window)
        self._retries: deque[int] = deque(maxlen=retry_steps + 1)
        self._swap: deque[tuple[float, int]] = deque(maxlen=3)

    def restart_window(self) -> None:
        """Forget the recent readings (after a shrink): the new size is judged on its own."""
        self._times.clear()
        self._pressure.clear()
        self._retries.clear()
        self._swap.clear()

    def observe(
        self, step_time: float, memory: dict, swap_in: int | None = None, now: float | None = None
    ) -> Thrash | None:
        """One optimizer step's readings. `swap_in` (cumulative bytes, or None when not sampled
        this step) comes with `now`, the monotonic time it was read at."""
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        if self.baseline is None:
            self._early.append(step_time)
            if len(self._early) >= self.baseline_steps:
                self.baseline = statistics.median(self._early)
        self._times.append(step_time)
        self._pressure.append(memory.get("pressure"))
        retries = memory.get("alloc_retries")
        if retries is not None:
            self._retries.append(retries)
        if swap_in is not None and now is not None and (not self._swap or now > self._swap[-1][0]):
            self._swap.append((now, swap_in))

        if len(self._times) < self.window:
            return None
        pressures = [p for p in self._pressure if p is not None]
        if len(pressures) == self.window and min(pressures) >= 4:
            return Thrash(self._slowdown(), "memory pressure critical (4)", self.evidence())
        slowdown = self._slowdown()
        if slowdown is None or slowdown < self.slowdown:
            return None
        signal = self._memory_signal()
        return Thrash(slowdown, signal, self.evidence()) if signal else None

    def _slowdown(self) -> float | None:
        if not self.baseline or len(self._times) < self.window:
            return None
        return statistics.median(self._times) / self.baseline

    def _memory_signal(self) -> str | None:
        if len(self._swap) >= 3:
            (t0, s0), (_, s1), (t2, s2) = self._swap
            if s1 > s0 and s2 > s1 and t2 > t0:
                rate = (s2 - s0) / (t2 - t0)
                if rate >= self.swap_in_rate:
                    return f"swap-in {rate / MiB:.1f} MiB/s"
        pressures = [p for p in self._pressure if p is not None]
        if pressures and sum(p >= 2 for p in pressures) * 2 > self.window:
            return f"memory pressure {'critical (4)' if max(pressures) >= 4 else 'warning (2)'}"
        r = list(self._retries)
        if len(r) == self.retry_steps + 1 and all(b > a for a, b in itertools.pairwise(r)):
            return f"CUDA allocator retries rising ({r[0]} → {r[-1]} in {self.retry_steps} steps)"
        return None

    def evidence(self) -> dict:
        return {
            "baseline_step_time": self.baseline,
            "step_times": list(self._times),
            "pressure": list(self._pressure),
            "alloc_retries": list(self._retries),
            "swap_in": [{"time": t, "bytes": b} for t, b in self._swap],
        }


# -- the callback -----------------------------------------------------------------------------


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
        memory = metrics.get("memory") or {}
        step_time = metrics.get("step_time")
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
            "leak",
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
            self.record("swap", info)
        elif not self._warned_at_one:
            self._warned_at_one = True
            info["action"] = "none"
            info["message"] = (
                f"{verdict.reason}, at micro-batch 1: nothing left to shrink. Free memory "
                "(close other programs), shorten sequences, lower precision or use a smaller "
                "model; the OS may kill this run (a checkpoint resumes it)"
            )
            self.record("swap", info)
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
            "cache",
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
