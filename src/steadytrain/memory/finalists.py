"""On CUDA, each mode's speed is measured at its own finalist size instead of extrapolated from
the small probed sizes (`time_finalists` says why)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from steadytrain.device import Device, call_or_oom
from steadytrain.memory.choice import Mode, Predict
from steadytrain.memory.probe import Fit, ProbeResult, RunPass, measure

TIME_PASS = 0.5
"""Seconds a finalist's timed pass may take on CUDA (`time_finalists`)."""


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
) -> tuple[dict[Mode, Timed], list[str]]:
    """On CUDA, time each mode at its own finalist size instead of extrapolating its time line.

    Small probed sizes say little about the speed of large ones on a GPU: at one or two
    samples a pass is bound by kernel launches, not arithmetic (1B Llama on an H100: 96 ms at
    micro 1 and 97 ms at micro 2), so a line through them predicts almost free samples. Memory
    is linear and exact there; time is not. So each mode runs one pass at the largest size it
    may use (after one at that size that pays for allocation, unless the probe ran that size
    just before), capped where a pass would take
    longer than `TIME_PASS` (bounded with the largest probed size's time per sample, which
    overstates it): beyond that size the GPU is busy and the measured rate is taken as the rate
    of the larger sizes too. A mode is not timed when a mode with a subset of its memory savers
    was timed at a size at least as large: the same size with more recomputation is slower.
    A finalist that runs out of memory (a prediction that was wrong) is not a contender."""
    order = sorted(fits, key=lambda m: (m.checkpointing + m.chunked_loss, m.checkpointing))
    timed: dict[Mode, Timed] = {}
    notes: list[str] = []
    for mode in order:
        fitting = [m for m in sizes if predict(mode, m) <= limit]
        if not fitting:
            continue
        size = _finalist_size(fits[mode], fitting)
        cheaper = [
            other
            for other, t in timed.items()
            if other.checkpointing <= mode.checkpointing
            and other.chunked_loss <= mode.chunked_loss
            and t.size >= size
        ]
        if cheaper:
            notes.append(
                f"{mode.describe()}: not timed; {cheaper[0].describe()} runs micro "
                f"{timed[cheaper[0]].size} with less recomputation"
            )
            continue
        rate = _time_one(runs[mode], device, mode, size, result)
        if rate is None:
            notes.append(f"{mode.describe()} micro {size} ran out of memory when timed")
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
    run: RunPass, device: Device, mode: Mode, size: int, result: ProbeResult
) -> float | None:
    """samples/s of one pass at `size` (recorded in `result`); None when it ran out of memory."""
    warm = any(  # this mode ran this size in the probe: kernels chosen, blocks cached
        (s.size, s.checkpointing, s.chunked_loss) == (size, *mode) for s in result.samples
    )
    sample, oom = call_or_oom(
        lambda: measure(run, device, size, mode.checkpointing, reps=1 if warm else 2),
        device.empty_cache,
    )
    if oom is None:
        result.samples.append(dataclasses.replace(sample, chunked_loss=mode.chunked_loss))
        return size / max(sample.seconds, 1e-9)
    error = oom.error[:300]
    result.failed.append((size, mode.checkpointing, error))
    return None


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
