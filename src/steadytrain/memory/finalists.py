"""On CUDA, each mode's speed is measured at its own finalist size instead of extrapolated from
the small probed sizes (`time_finalists` says why)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from steadytrain._units import format_bytes
from steadytrain.device import Device, call_or_oom
from steadytrain.memory.choice import Mode, Predict
from steadytrain.memory.probe import Fit, ProbeResult, RunPass, measure

TIME_PASS = 0.5
"""Seconds a finalist's timed pass may take on CUDA (`time_finalists`)."""
TIMED_PASSES = 2
"""Passes a finalist is timed over, its rate the fastest's: one sub-second pass on a GPU is
noisy (the 4-bit 1B's micro-8 pass on an H200 took 0.116 s in one call and 0.135 s in the
next, which made the plan take checkpointed micro 32 over a plain micro 8 that trains 12 %
faster), and the slower readings are the ones disturbed."""


@dataclass(frozen=True)
class Timed:
    """A mode's finalist: the largest allowed size predicted to fit, and the size and speed
    of the pass that was timed for it."""

    largest: int
    size: int
    samples_per_second: float


def time_finalists(
    fits: dict[Mode, Fit],
    runs: dict[Mode, RunPass],
    device: Device,
    sizes: list[int],
    limit: float,
    predict: Predict,
    result: ProbeResult,
    compiled: bool = False,
) -> tuple[dict[Mode, Timed], list[str]]:
    """On CUDA, time each mode at its own finalist size instead of extrapolating its time line.

    Small probed sizes say little about the speed of large ones on a GPU: at one or two
    samples a pass is bound by kernel launches, not arithmetic (1B Llama on an H100: 96 ms at
    micro 1 and 97 ms at micro 2), so a line through them predicts almost free samples. Memory
    is linear and exact there; time is not. So each mode runs one pass at the largest size it
    may use (after one at that size that pays for allocation, unless the probe ran that size
    just before; the fastest of `TIMED_PASSES`), capped where a pass would take
    longer than `TIME_PASS` (bounded with the largest probed size's time per sample, which
    overstates it): beyond that size the GPU is busy and the measured rate is taken as the rate
    of the larger sizes too. A mode is not timed when a mode with a subset of its memory savers
    was timed at a size at least as large: the same size with more recomputation (or with
    copies to host memory) is slower. A finalist that runs out of memory, or whose measured
    peak passes `limit` (a prediction that was wrong), is not a contender.

    `compiled`: the finalists run compiled layers (`plan`). Each then runs at its largest
    fitting size, once more than it is timed (the first pass at a new size compiles; the eager
    probe's passes warm nothing): a compiled layer's fixed cost per pass makes a smaller size's rate say little
    about a larger one's (Qwen3-0.6B on an H200: micro 4 at half the rate of micro 8)."""
    order = sorted(fits, key=lambda m: (m.savers, m.checkpointing))
    timed: dict[Mode, Timed] = {}
    notes: list[str] = []
    for mode in order:
        fitting = [m for m in sizes if predict(mode, m) <= limit]
        if not fitting:
            continue
        size = fitting[-1] if compiled else _finalist_size(fits[mode], fitting)
        cheaper = [other for other, t in timed.items() if other.within(mode) and t.size >= size]
        if cheaper:
            notes.append(
                f"{mode.describe()}: not timed; {cheaper[0].describe()} runs micro "
                f"{timed[cheaper[0]].size} with less recomputation"
            )
            continue
        rate, missed = _time_one(runs[mode], device, mode, size, result, limit, compiled)
        if rate is None:
            notes.append(f"{mode.describe()} micro {size} {missed} when timed: not a contender")
            continue
        timed[mode] = Timed(fitting[-1], size, rate)
        notes.append(
            f"{mode.describe()}: measured {rate:.3g} samples/s at micro {size}"
            + (f" (fits up to {fitting[-1]})" if fitting[-1] > size else "")
        )
    return timed, notes


def _finalist_size(line: Fit, fitting: list[int]) -> int:
    """The largest fitting size whose pass stays within `TIME_PASS` (any size up to the largest
    probed one is allowed)."""
    probed = max(line.sizes)
    per_sample = max(line.seconds(probed), 1e-9) / probed
    return max(
        (m for m in fitting if m <= probed or m * per_sample <= TIME_PASS), default=fitting[0]
    )


def _time_one(
    run: RunPass,
    device: Device,
    mode: Mode,
    size: int,
    result: ProbeResult,
    limit: float,
    compiled: bool,
) -> tuple[float | None, str]:
    """samples/s at `size`, the fastest of `TIMED_PASSES` passes (recorded in `result`), or None and why it does not
    count: it ran out of memory, or its peak passed `limit`."""
    warm = not compiled and any(  # this mode ran this size eagerly: kernels chosen, blocks cached
        (s.size, s.checkpointing, s.chunked_loss)
        == (size, mode.activation_checkpointing, mode.chunked_loss)
        for s in result.samples
    )
    sample, oom = call_or_oom(
        lambda: measure(
            run, device, size, mode.activation_checkpointing, TIMED_PASSES + (not warm), warm
        ),
        device.empty_cache,
    )
    if oom is not None:
        result.failed.append((size, mode.activation_checkpointing, oom.error[:300]))
        return None, "ran out of memory"
    result.samples.append(dataclasses.replace(sample, chunked_loss=mode.chunked_loss))
    if sample.peak is not None and sample.peak > limit:
        over = f"peak {format_bytes(sample.peak)} above the limit {format_bytes(limit)}"
        result.failed.append((size, mode.activation_checkpointing, over))
        return None, f"measured a {over}"
    return size / max(sample.seconds, 1e-9), ""


def measured_speed(
    fits: dict[Mode, Fit], timed: dict[Mode, Timed]
) -> Callable[[Mode, int], float | None]:
    """samples/s per (mode, size) from the timed finalists: the measured rate at and above the
    timed size; below it the line's rate scaled to meet the measurement; None for a mode that
    was not timed."""

    def speed(mode: Mode, size: int) -> float | None:
        t = timed.get(mode)
        if t is None:
            return None
        if size >= t.size:
            return t.samples_per_second
        line = fits[mode]
        return (
            t.samples_per_second
            * line.samples_per_second(size)
            / max(line.samples_per_second(t.size), 1e-9)
        )

    return speed
