"""Leaks: readings of a memory counter taken at the same point of the step, and the steady rise
that says something is kept alive by every step (`LeakDetector`); which counter shows a leak on
each device; the largest live tensors, named in the `leak` event of `MemoryWatch`.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from steadytrain._units import format_bytes

MiB = 2**20

LEAK_CAUSES = (
    "a model or optimizer rebuilt inside the loop; tensors kept in a Python list (keep "
    "loss.item(), not loss); caches that grow with every new input shape"
)


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
