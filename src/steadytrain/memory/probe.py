"""Measure what a micro-batch costs on this device: run real passes at a few small sizes and fit
peak(b) = fixed + per_sample × b and seconds(b) = seconds_fixed + seconds_per_sample × b.

The memory layer knows no engine: the caller hands over `run(size, checkpointing)`, one forward
and backward of `size` samples that leaves the model as it found it (`engine.side_pass.trial_pass`,
switched per mode by `MemorySavers.trial_run`). The probe resets the device's peak reading, runs
it, reads the peak, and times it between two synchronisations.

Why these sizes: activations grow linearly with the micro-batch and everything else (weights,
gradients, workspaces) does not, so two sizes give the line and a third gives the residual, the
check that the line holds. Small sizes are cheap (a few passes, about a second on a 1B model on
a GPU) and safe: on unified memory (MPS) and on CPU a pass that needs more than there is does not
raise, it swaps (or the OS kills the process), so a size is probed only when the line so far
says it stays well inside the room (`safe_peak`). On CUDA an out-of-memory during the probe is a
real, recoverable error: it is caught and recorded as "does not fit".

Why the time is measured too: activation checkpointing lowers per_sample and raises the time per
sample; only the measured times say whether a larger checkpointed micro-batch beats a smaller
plain one (docs/plan.md).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from steadytrain._units import format_bytes
from steadytrain.device import Device, call_or_oom

RunPass = Callable[[int, "bool | str"], None]
"""run(size, checkpointing): one forward and backward of `size` samples, model unchanged;
`checkpointing` is False, True or "offload" (checkpointing with its kept inputs in host memory,
`memory.offload`), each a mode of its own here."""


@dataclass(frozen=True)
class Sample:
    """One probed size: the peak (max over repetitions) and the fastest time."""

    size: int
    checkpointing: bool | str
    peak: int | None
    seconds: float
    chunked_loss: bool = False


@dataclass(frozen=True)
class Fit:
    """peak(b) and seconds(b) as lines through the probed sizes of one mode."""

    checkpointing: bool | str
    fixed: float
    """Bytes in use at the peak that do not grow with the micro-batch (weights, gradients,
    workspaces, and on CPU the whole process)."""
    per_sample: float
    seconds_fixed: float
    seconds_per_sample: float
    sizes: tuple[int, ...]
    residual: float
    """Largest |measured - line| / measured over the probed sizes; 0 with two sizes (the line
    goes through both)."""
    kind: str
    """The device's peak reading kind ('exact', 'resident', 'lower_bound'), see PeakReading."""

    def peak(self, size: int) -> float:
        return self.fixed + self.per_sample * size

    def seconds(self, size: int) -> float:
        return self.seconds_fixed + self.seconds_per_sample * size

    def samples_per_second(self, size: int) -> float:
        return size / max(self.seconds(size), 1e-9)

    def to_dict(self) -> dict:
        return {**asdict(self), "sizes": list(self.sizes)}


@dataclass
class ProbeResult:
    """What the probe ran and what it fitted, per mode (False: plain, True: checkpointing,
    "offload": checkpointing with offloaded inputs)."""

    baseline: int | None
    """Memory in use before the first pass (the device's main counter)."""
    samples: list[Sample] = field(default_factory=list)
    failed: list[tuple[int, bool | str, str]] = field(default_factory=list)
    """(size, checkpointing, error) of passes that ran out of memory."""
    skipped: list[tuple[int, bool | str, str]] = field(default_factory=list)
    """(size, checkpointing, why) of sizes not probed because they could come near the budget."""
    fits: dict[bool | str, Fit] = field(default_factory=dict)
    kind: str = "none"
    seconds: float = 0.0
    """Wall time the probe took, every pass and synchronisation included."""

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline,
            "samples": [asdict(s) for s in self.samples],
            "failed": [list(f) for f in self.failed],
            "skipped": [list(s) for s in self.skipped],
            "fits": {_FIT_NAMES.get(k, str(k)): f.to_dict() for k, f in self.fits.items()},
            "kind": self.kind,
            "seconds": round(self.seconds, 3),
        }


_FIT_NAMES = {False: "plain", True: "checkpointing", "offload": "offload"}


def in_use(device: Device) -> int | None:
    """Memory held now by the device's main counter: CUDA allocated, MPS driver memory, CPU RSS;
    read after freeing what is free (the allocator's cache, glibc's free pages), as each probed
    pass starts that way too."""
    gc.collect()
    device.empty_cache()
    reading = device.memory()
    if device.type == "cuda":
        return reading.allocated
    if device.type == "mps":
        return reading.reserved
    return reading.rss


def measure(
    run: RunPass,
    device: Device,
    size: int,
    checkpointing: bool | str,
    reps: int = 1,
    warm: bool = False,
) -> Sample:
    """Run one size `reps` times; the peak is the largest, the time the fastest of the passes
    after the first when there are several (the first pass at a size also pays for kernel
    selection and for allocating its memory, which a training step at that size does once),
    of all of them when `warm` (this size ran just before).

    CUDA's peak counter counts allocated bytes, which neither the allocator's cache nor
    uncollected garbage on the host changes: passes run as training steps do, on cached blocks
    (the allocator frees its cache itself before it reports an out-of-memory), and the garbage
    collector is not run (a full collection takes a quarter of a second with transformers
    loaded, more than a pass). Elsewhere the reading is the process's (or the driver's) memory,
    which both would inflate: garbage is collected and the cache emptied before every pass."""
    peaks: list[int] = []
    times: list[float] = []
    for _ in range(max(reps, 1)):
        if device.type != "cuda":
            gc.collect()
            device.empty_cache()
        device.synchronize()
        device.reset_peak_reading()
        start = time.perf_counter()
        run(size, checkpointing)
        device.synchronize()
        times.append(time.perf_counter() - start)
        reading = device.peak_reading()
        if reading.bytes is not None:
            peaks.append(reading.bytes)
    timed = times if warm else times[1:] or times
    return Sample(size, checkpointing, max(peaks) if peaks else None, min(timed))


def fit(samples: list[Sample], kind: str) -> Fit | None:
    """Least-squares lines through the samples of one mode; None with fewer than two sizes or
    without peak readings. A negative slope (noise on a tiny model) is read as zero: nothing
    measurable grows with the batch."""
    usable = [s for s in samples if s.peak is not None]
    sizes = sorted({s.size for s in usable})
    if len(sizes) < 2:
        return None
    xs = [s.size for s in usable]
    fixed, per_sample = _line(xs, [float(s.peak) for s in usable])
    if per_sample < 0:
        per_sample, fixed = 0.0, max(float(s.peak) for s in usable)
    t_fixed, t_per = _line(xs, [s.seconds for s in usable])
    if t_per <= 0:  # no measurable growth: the pass costs the same at every probed size
        t_fixed, t_per = sum(s.seconds for s in usable) / len(usable), 0.0
    t_fixed = max(t_fixed, 0.0)
    residual = max(abs(s.peak - (fixed + per_sample * s.size)) / s.peak for s in usable)
    return Fit(
        checkpointing=usable[0].checkpointing,
        fixed=fixed,
        per_sample=per_sample,
        seconds_fixed=t_fixed,
        seconds_per_sample=t_per,
        sizes=tuple(sizes),
        residual=residual if len(sizes) > 2 else 0.0,
        kind=kind,
    )


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def probe(
    run: RunPass,
    device: Device,
    *,
    checkpointing: bool | str,
    sizes: tuple[int, ...] = (1, 2, 4),
    safe_peak: float | None = None,
    reps: int = 1,
    result: ProbeResult | None = None,
) -> ProbeResult:
    """Probe one mode at `sizes` (ascending), adding to `result`. A size is skipped when the
    line through the sizes already probed (or, after one size, `size` × that size's whole
    peak above the baseline: an upper bound) puts its peak above `safe_peak`; an out-of-memory
    stops the mode there."""
    started = time.perf_counter()
    if result is None:
        result = ProbeResult(baseline=in_use(device))
    done = [s for s in result.samples if s.checkpointing == checkpointing]
    for size in sizes:
        if any(s.size == size for s in done):
            continue
        bound = _predicted(done, size, result.baseline)
        if safe_peak is not None and bound is not None and bound > safe_peak:
            result.skipped.append(
                (
                    size,
                    checkpointing,
                    f"predicted {format_bytes(bound)} > {format_bytes(safe_peak)}, the most a "
                    "probe may reach here",
                )
            )
            break
        sample, oom = call_or_oom(
            lambda size=size: measure(run, device, size, checkpointing, reps), device.empty_cache
        )
        if oom is not None:
            result.failed.append((size, checkpointing, oom.error[:300]))
            break
        done.append(sample)
        result.samples.append(sample)
        kind = device.peak_reading().kind if sample.peak is not None else "none"
        result.kind = kind
    line = fit(done, result.kind)
    if line is not None:
        result.fits[checkpointing] = line
    result.seconds += time.perf_counter() - started
    return result


def _predicted(done: list[Sample], size: int, baseline: int | None) -> float | None:
    with_peak = [s for s in done if s.peak is not None]
    if not with_peak:
        return None
    line = fit(with_peak, "")
    if line is not None:
        return line.peak(size)
    first = with_peak[0]
    above = max(first.peak - (baseline or 0), 0)
    return (baseline or 0) + above * size / first.size


def one_point(result: ProbeResult, checkpointing: bool | str, base: int) -> Fit | None:
    """A line from a single probed size of one mode, when a larger one could not be probed
    safely: all of its growth is taken as per-sample (an upper bound beyond that size)."""
    only = [s for s in result.samples if s.checkpointing == checkpointing and s.peak]
    if not only:
        return None
    s = only[0]
    return Fit(
        checkpointing=checkpointing,
        fixed=float(base),
        per_sample=max(s.peak - base, 0) / s.size,
        seconds_fixed=0.0,
        seconds_per_sample=s.seconds / s.size,
        sizes=(s.size,),
        residual=0.0,
        kind=result.kind,
    )
