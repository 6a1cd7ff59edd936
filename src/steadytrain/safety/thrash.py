"""Thrashing: a run that outgrew memory and slid into swap, told from one reading per optimizer
step (`ThrashDetector`): the step time inflates and the memory readings say why (swap-ins rising,
macOS pressure, CUDA allocator retries climbing).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass, field

from steadytrain.safety.leaks import MiB


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
