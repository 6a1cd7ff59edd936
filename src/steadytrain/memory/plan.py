"""Choose the micro-batch, the accumulation, activation checkpointing (and, where the loss offers
one, a chunked loss) that give the most samples per second within the memory budget.

The rule (docs/plan.md has the reasons):

1. The room is what the budget leaves above what is in use now (weights, data, the process),
   and the plan may use `margin` of it: `limit = in_use + margin × (budget - in_use)`. The margin
   is 0.9 on CUDA (a measured peak, an exact counter, and a real out-of-memory the ladder
   survives) and 0.75 on MPS and CPU (a peak that is read coarsely, and memory that swaps or
   gets the process killed instead of raising).
2. One pass at micro-batch 1 first. Its whole growth times the largest allowed size is an upper
   bound on that size's peak (the fixed part is counted every time); when the bound is within
   half the room, that size is taken without probing further: a model that fits at the whole
   effective batch costs one extra pass.
3. Otherwise each mode (plain; checkpointed where the model can; chunked loss where the loss
   has a chunked mode for the model, and both savers together) is probed at 1, 2 and 4 samples
   (`probe.py`), and every allowed size of every mode whose predicted peak is within the limit
   is a candidate. The winner has the most samples per second: on CPU and MPS as predicted by
   the time line, size / seconds(size) (the fixed time of a pass is paid once per micro-batch,
   so larger micro-batches run faster until memory stops them); on CUDA as measured at each
   mode's own largest fitting size (`_time_finalists`: the small probed sizes are bound by
   kernel launches there, and their time line says little about large sizes). A checkpointed
   larger micro-batch beats a plain smaller one exactly when the measured times say so.
4. Allowed sizes divide the effective batch (every step splits into equal micro-batches, the
   rule `micro_batch_size` has in the config) and, by default, are powers of two (kernels are
   tuned for them); the effective batch itself is always allowed.

The analytic estimate (`estimate.py`) is used where the model is a known Hugging Face family:
as a cross-check beside the measurement, and on MPS as a floor under the measured figure, which
is only a lower bound there.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from steadytrain._units import format_bytes
from steadytrain.device import Device, is_oom
from steadytrain.errors import BadInputError
from steadytrain.memory.probe import Fit, ProbeResult, RunPass, in_use, measure, probe

MARGINS = {"cuda": 0.9, "mps": 0.75, "cpu": 0.75}
"""Share of the room above what is in use that the predicted peak may take, per device type."""
QUICK_SHARE = 0.5
"""The one-pass bound (rule 2) must stay within this share of the allowed growth."""
PROBE_SIZES = (1, 2, 4)
SAVER_GAIN = 1.05
"""A memory saver (checkpointing, chunked loss) must be predicted this much faster than the best
plain candidate to be chosen: its recomputation cost is certain, a few per cent of timing noise
is not."""
SIZE_POLICIES = ("powers_of_two", "divisors")
TIME_PASS = 0.5
"""Seconds a finalist's timed pass may take on CUDA (`_time_finalists`)."""


class Mode(NamedTuple):
    checkpointing: bool = False
    chunked_loss: bool = False

    def describe(self) -> str:
        parts = ["checkpointed" if self.checkpointing else "plain"]
        if self.chunked_loss:
            parts.append("chunked loss")
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    micro: int
    mode: Mode
    peak: float
    samples_per_second: float | None
    fits: bool


@dataclass
class Plan:
    """The choice and why. `reasons` are the sentences the console and docs show."""

    micro_batch_size: int
    effective_batch_size: int
    checkpointing: bool
    chunked_loss: bool
    predicted_peak: float | None
    limit: float | None
    budget: int | None
    margin: float
    in_use: int | None
    reasons: list[str]
    candidates: list[Candidate] = field(default_factory=list)
    probe: ProbeResult | None = None
    analytic: Any = None
    quick: bool = False
    largest_fitting: int | None = None
    device_type: str = "cuda"

    @property
    def accumulation(self) -> int:
        return -(-self.effective_batch_size // self.micro_batch_size)

    def to_event(self) -> dict[str, Any]:
        """The `plan` event of events.jsonl."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulation": self.accumulation,
            "effective_batch_size": self.effective_batch_size,
            "activation_checkpointing": self.checkpointing,
            "chunked_loss": self.chunked_loss,
            "predicted_peak": _int(self.predicted_peak),
            "limit": _int(self.limit),
            "budget": self.budget,
            "margin": self.margin,
            "in_use": self.in_use,
            "quick": self.quick,
            "reasons": self.reasons,
            "candidates": [
                {
                    "micro": c.micro,
                    "mode": c.mode.describe(),
                    "peak": _int(c.peak),
                    "samples_per_second": c.samples_per_second,
                    "fits": c.fits,
                }
                for c in self.candidates
            ],
            "probe": self.probe.to_dict() if self.probe is not None else None,
        }

    def estimate_event(self) -> dict[str, Any] | None:
        """The `estimate` event the report sets against the measured peak: the analytic estimate
        at the chosen settings where the model is a known family, else the probe's prediction.
        `peak` is the tensor peak (CUDA's counter), `total` what the process holds. On CPU the
        report's measurement is the process's resident set, interpreter and libraries included,
        which the analytic total does not model: the probe's prediction is recorded there, with
        the analytic figures beside it."""
        extra = {}
        if self.analytic is not None:
            at = self.analytic.at(self.micro_batch_size, self.checkpointing, self.chunked_loss)
            if at is not None and at.peak is not None and self.device_type != "cpu":
                return {
                    "source": "analytic",
                    "peak": at.peak,
                    "total": at.total,
                    "probe_peak": _int(self.predicted_peak),
                    "micro_batch_size": self.micro_batch_size,
                }
            if at is not None:
                extra = {"analytic_peak": at.peak, "analytic_total": at.total}
        if self.predicted_peak is None:
            return None
        return {
            "source": "probe",
            "peak": _int(self.predicted_peak),
            "total": _int(self.predicted_peak),
            "micro_batch_size": self.micro_batch_size,
            **extra,
        }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def allowed_sizes(
    effective: int, policy: str = "powers_of_two", cap: int | None = None
) -> list[int]:
    """Micro sizes the plan may choose, ascending: divisors of `effective` (powers of two only
    under 'powers_of_two'), always `effective` itself, none above `cap`."""
    if policy not in SIZE_POLICIES:
        raise BadInputError(
            f"micro_batch_sizes: {policy!r} is not one of {', '.join(SIZE_POLICIES)}"
        )
    sizes = {d for d in range(1, effective + 1) if effective % d == 0}
    if policy == "powers_of_two":
        sizes = {d for d in sizes if d & (d - 1) == 0} | {effective}
    top = effective if cap is None else min(cap, effective)
    found = sorted(d for d in sizes if d <= top)
    return found or [1]


def choose(
    fits: dict[Mode, Fit],
    effective: int,
    limit: float,
    *,
    policy: str = "powers_of_two",
    cap: int | None = None,
    predict: Callable[[Mode, int], float] | None = None,
    speed: Callable[[Mode, int], float | None] | None = None,
) -> tuple[Candidate | None, list[Candidate], list[str]]:
    """The best candidate by predicted samples per second among those within `limit`, every
    candidate, and the reasons. `predict(mode, size)` replaces the fitted line's peak (MPS adds
    the analytic floor); `speed(mode, size)` the line's samples per second (CUDA's measured
    finalists; None: not a contender). None when nothing fits, not even one sample."""
    sizes = allowed_sizes(effective, policy, cap)
    predict = predict or (lambda mode, size: fits[mode].peak(size))
    measured, speed = speed, speed or (lambda mode, size: fits[mode].samples_per_second(size))
    candidates = [
        Candidate(m, mode, predict(mode, m), speed(mode, m), predict(mode, m) <= limit)
        for mode in fits
        for m in sizes
    ]
    fitting = [c for c in candidates if c.fits and c.samples_per_second is not None]
    how = "predicted" if measured is None else "measured"
    reasons = []
    if not fitting:
        return None, candidates, reasons
    best = max(
        fitting,
        key=lambda c: (
            c.samples_per_second,
            not c.mode.checkpointing,
            not c.mode.chunked_loss,
            c.micro,
        ),
    )
    plain = [c for c in fitting if c.mode == Mode()]
    if plain and best.mode != Mode():
        fastest_plain = max(plain, key=lambda c: (c.samples_per_second, c.micro))
        if best.samples_per_second < SAVER_GAIN * fastest_plain.samples_per_second:
            best = fastest_plain
            reasons.append(
                f"a memory saver must be predicted at least {SAVER_GAIN - 1:.0%} faster than "
                "plain to be chosen"
            )
    top = {}
    for mode in fits:
        inside = [c for c in fitting if c.mode == mode]
        if inside:
            top[mode] = max(inside, key=lambda c: (c.samples_per_second, c.micro))
    rivals = [c for mode, c in top.items() if mode != best.mode]
    if rivals:
        beaten = ", ".join(
            f"{c.mode.describe()} micro {c.micro} {c.samples_per_second:.3g}" for c in rivals
        )
        reasons.append(
            f"{best.mode.describe()} micro {best.micro}: {how} {best.samples_per_second:.3g} "
            f"samples/s, the most among those that fit (best of the others: {beaten})"
        )
    else:
        reasons.append(
            f"{best.mode.describe()} micro {best.micro}: {how} "
            f"{best.samples_per_second:.3g} samples/s, the largest allowed size that fits"
        )
    top_size = min(effective, cap or effective)
    largest = max(
        (m for m in range(best.micro, top_size + 1) if predict(best.mode, m) <= limit),
        default=best.micro,
    )
    if best.micro < largest:
        bigger = largest
        what = "a power of two dividing" if policy == "powers_of_two" else "a divisor of"
        reasons.append(
            f"up to {bigger} would fit, but the micro-batch must be {what} the effective batch "
            f"{effective} (every step splits into equal micro-batches, as micro_batch_size "
            "requires)"
            + ("; micro_batch_sizes: divisors allows any divisor" if policy != "divisors" else "")
        )
    return best, candidates, reasons


@dataclass
class Analytic:
    """The analytic estimate of a known Hugging Face family, linear in the micro-batch: two
    `estimate` calls per mode (each builds the model on the meta device), cached."""

    config: Any
    settings: Any
    strict: bool = False
    """False in the trainer: the estimate is a cross-check there, and a config it cannot read
    (an odd family, a new transformers) must not stop a run; the error is kept in `problem`."""
    problem: str | None = None
    _cache: dict = field(default_factory=dict)

    def at(self, micro: int, checkpointing: bool, chunked_loss: bool = False):
        """The estimate at these settings, or None when it cannot be made (see `problem`)."""
        from steadytrain.memory.estimate import estimate

        key = (micro, checkpointing, chunked_loss)
        if key not in self._cache:
            changes = {"micro_batch": micro, "checkpointing": checkpointing}
            if any(f.name == "chunked_loss" for f in dataclasses.fields(self.settings)):
                changes["chunked_loss"] = chunked_loss
            try:
                found = estimate(self.config, dataclasses.replace(self.settings, **changes))
            except (BadInputError, AttributeError, KeyError, TypeError, ValueError) as exc:
                if self.strict:
                    raise
                self.problem, found = f"{type(exc).__name__}: {exc}", None
            self._cache[key] = found
        return self._cache[key]

    def total(self, micro: int, mode: Mode) -> float | None:
        one = self.at(1, mode.checkpointing, mode.chunked_loss)
        two = self.at(2, mode.checkpointing, mode.chunked_loss)
        if one is None or two is None or one.total is None or two.total is None:
            return None
        return one.total + (two.total - one.total) * (micro - 1)


def plan(
    run: RunPass,
    device: Device,
    *,
    effective_batch_size: int,
    checkpointing: str | bool = "auto",
    can_checkpoint: bool = False,
    chunked_run: RunPass | None = None,
    margin: float | None = None,
    policy: str = "powers_of_two",
    cap: int | None = None,
    analytic: Analytic | None = None,
    reps: int | None = None,
    pending: int = 0,
) -> Plan:
    """Probe with `run(size, checkpointing)` and choose (the module docstring has the rule).

    `checkpointing`: the config's activation_checkpointing ('auto' lets the plan decide, where
    `can_checkpoint`). `chunked_run`: the same pass with the loss computed in chunks, when the
    caller's loss has such a variant; the plan then decides `chunked_loss` too. `cap`: no size
    above it (the supervisor's cap after an OS kill). `reps`: passes per probed size (the
    fastest counts: the first pass of a size also pays for kernel selection and allocation).
    `pending`: bytes the first optimizer step adds that no probed pass holds (the optimizer's
    state, `first_step_bytes`); added to every prediction."""
    cap = min(cap or effective_batch_size, effective_batch_size)
    margin = margin if margin is not None else MARGINS[device.type]
    reps = reps or (1 if device.type == "cuda" else 2)  # CUDA times its finalists instead
    budget = device.budget
    sizes = allowed_sizes(effective_batch_size, policy, cap)
    start = checkpointing is True
    base = in_use(device)
    common = dict(
        effective_batch_size=effective_batch_size,
        budget=budget,
        margin=margin,
        device_type=device.type,
    )
    if budget is None or base is None:
        return Plan(
            micro_batch_size=sizes[-1],
            checkpointing=start,
            chunked_loss=False,
            predicted_peak=None,
            limit=None,
            in_use=base,
            reasons=[
                "the budget of this device is unknown: starting at the largest allowed size; "
                "the out-of-memory ladder shrinks it if needed (set memory_budget to plan)"
            ],
            analytic=analytic,
            **common,
        )
    limit = base + margin * max(budget - base, 0)
    head = (
        f"budget {format_bytes(budget)}, {format_bytes(base)} in use: the peak may reach "
        f"{format_bytes(limit)} ({margin:.0%} of the room above what is in use)"
        + (
            f"; the first optimizer step adds {format_bytes(pending)} of optimizer state, "
            "counted in every prediction"
            if pending
            else ""
        )
    )

    result = ProbeResult(baseline=base)
    try:
        first = measure(run, device, 1, start, reps=1)
    except Exception as exc:
        if not is_oom(exc):
            raise
        first = None
    if first is not None:
        result.samples.append(first)
        result.kind = device.peak_reading().kind
    if first is not None and first.peak is None:
        return Plan(
            micro_batch_size=sizes[-1],
            checkpointing=start,
            chunked_loss=False,
            predicted_peak=None,
            limit=limit,
            in_use=base,
            reasons=[
                head,
                f"{device.type} gives no peak reading here: starting at the largest allowed "
                f"size {sizes[-1]}; the out-of-memory ladder shrinks it if needed",
            ],
            probe=result,
            **common,
        )
    if first is not None and first.peak is not None:
        growth = max(first.peak - base, 0)
        bound = base + growth * sizes[-1] + pending
        floor = (
            analytic.total(sizes[-1], Mode(start)) if analytic and device.type == "mps" else None
        )
        if bound <= base + QUICK_SHARE * (limit - base) and (floor is None or floor <= limit):
            return Plan(
                micro_batch_size=sizes[-1],
                checkpointing=start,
                chunked_loss=False,
                predicted_peak=bound,
                limit=limit,
                in_use=base,
                reasons=[
                    head,
                    f"one sample adds at most {format_bytes(growth)}; {sizes[-1]} times that, "
                    f"{format_bytes(bound)}, is within half the room: micro "
                    f"{sizes[-1]} without further probing",
                    _accumulation_reason(sizes[-1], effective_batch_size),
                ],
                probe=result,
                analytic=analytic,
                quick=True,
                **common,
            )

    if reps > 1:  # size 1 again with repetitions: the first pass also paid for warm-up
        result.samples = []
    safe = limit if device.type == "cuda" else base + QUICK_SHARE * (limit - base)
    probe_sizes = tuple(s for s in PROBE_SIZES if s <= cap)
    modes = [Mode(start)]
    if checkpointing == "auto" and can_checkpoint:
        modes.append(Mode(True))
    if chunked_run is not None:
        modes += [Mode(m.checkpointing, True) for m in list(modes)]
    fits: dict[Mode, Fit] = {}
    for mode in modes:
        passes = chunked_run if mode.chunked_loss else run
        tried = result if not mode.chunked_loss else ProbeResult(baseline=base)
        probe(
            passes,
            device,
            checkpointing=mode.checkpointing,
            sizes=probe_sizes,
            safe_peak=safe,
            reps=reps,
            result=tried,
        )
        line = tried.fits.get(mode.checkpointing) or _one_point(tried, mode, base)
        if line is not None:
            fits[mode] = line
        if mode.chunked_loss:
            result.samples += [dataclasses.replace(s, chunked_loss=True) for s in tried.samples]
            result.failed += tried.failed
            result.skipped += tried.skipped
            result.seconds += tried.seconds

    reasons = [head]
    for mode, line in fits.items():
        reasons.append(
            f"{mode.describe()}: peak ≈ {format_bytes(line.fixed)} + "
            f"{format_bytes(line.per_sample)} × micro (sizes {', '.join(map(str, line.sizes))}"
            + (f", residual {line.residual:.1%}" if len(line.sizes) > 2 else "")
            + f"), {line.seconds_per_sample * 1000:.3g} ms per sample + "
            f"{line.seconds_fixed * 1000:.3g} ms per pass"
        )
    for size, ckpt, _ in result.failed:
        reasons.append(f"{Mode(ckpt).describe()} micro {size} ran out of memory in the probe")
    if checkpointing == "auto" and not can_checkpoint:
        reasons.append(
            "activation checkpointing: not a candidate (the model has no switch of its own, "
            "like Hugging Face's activation_checkpointing_enable/disable)"
        )
    elif checkpointing is False:
        reasons.append("activation checkpointing: off (activation_checkpointing: false)")
    if chunked_run is None:
        reasons.append("chunked loss: not a candidate (the loss offers no chunked variant)")

    floored = analytic is not None and device.type == "mps"
    if floored:
        reasons.append("MPS: each peak is the larger of the measured line and the analytic total")

    def predict(mode: Mode, size: int) -> float:
        measured = fits[mode].peak(size)
        floor = analytic.total(size, mode) if floored else None
        return (measured if floor is None else max(measured, floor)) + pending

    speed = None
    if device.type == "cuda":  # time the finalists themselves: see `_time_finalists`
        runs = {mode: chunked_run if mode.chunked_loss else run for mode in fits}
        timed, notes = _time_finalists(fits, runs, device, sizes, limit, predict, result)
        reasons += notes
        if timed:
            speed = _measured_speed(fits, timed)

    best, candidates, why = choose(
        fits, effective_batch_size, limit, policy=policy, cap=cap, predict=predict, speed=speed
    )
    if best is None:
        ckpt = start or (checkpointing == "auto" and can_checkpoint)
        reasons.append(
            "nothing is predicted to fit, not even one sample"
            + (" with checkpointing" if ckpt else "")
            + ": starting at micro 1; the out-of-memory ladder has the last word"
        )
        return Plan(
            micro_batch_size=1,
            checkpointing=ckpt,
            chunked_loss=False,
            predicted_peak=None,
            limit=limit,
            in_use=base,
            reasons=reasons,
            candidates=candidates,
            probe=result,
            analytic=analytic,
            **common,
        )
    reasons += why
    reasons.append(_accumulation_reason(best.micro, effective_batch_size))
    if best.mode.checkpointing and not start:
        reasons.append("activation checkpointing: on (the faster way to the larger micro-batch)")
    elif not best.mode.checkpointing and Mode(True) in fits:
        reasons.append("activation checkpointing: off (plain is predicted faster)")
    if analytic is not None:
        at = analytic.at(best.micro, best.mode.checkpointing, best.mode.chunked_loss)
        if at is not None and at.peak is not None and device.type == "cuda":
            off = (best.peak - at.peak) / at.peak
            reasons.append(
                f"cross-check: the analytic estimate of the tensor peak is "
                f"{format_bytes(at.peak)}, the probe's {format_bytes(best.peak)} ({off:+.0%})"
            )
    return Plan(
        micro_batch_size=best.micro,
        checkpointing=best.mode.checkpointing,
        chunked_loss=best.mode.chunked_loss,
        predicted_peak=best.peak,
        limit=limit,
        in_use=base,
        reasons=reasons,
        candidates=candidates,
        probe=result,
        analytic=analytic,
        largest_fitting=max(
            (m for m in range(1, cap + 1) if predict(best.mode, m) <= limit), default=None
        ),
        **common,
    )


@dataclass(frozen=True)
class Timed:
    """A mode's finalist: the largest allowed size predicted to fit, and the size and speed
    of the pass that was timed for it."""

    largest: int
    size: int
    samples_per_second: float


def _time_finalists(
    fits: dict[Mode, Fit],
    runs: dict[Mode, RunPass],
    device: Device,
    sizes: list[int],
    limit: float,
    predict: Callable[[Mode, int], float],
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
        line = fits[mode]
        probed = max(line.sizes)
        per_sample = max(line.seconds(probed), 1e-9) / probed
        size = max(
            (m for m in fitting if m <= probed or m * per_sample <= TIME_PASS), default=fitting[0]
        )
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
        warm = any(  # this mode ran this size in the probe: kernels chosen, blocks cached
            (s.size, s.checkpointing, s.chunked_loss) == (size, *mode) for s in result.samples
        )
        try:
            sample = measure(runs[mode], device, size, mode.checkpointing, reps=1 if warm else 2)
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "out of memory"
        else:
            result.samples.append(dataclasses.replace(sample, chunked_loss=mode.chunked_loss))
            rate = size / max(sample.seconds, 1e-9)
            timed[mode] = Timed(fitting[-1], size, rate)
            notes.append(
                f"{mode.describe()}: measured {rate:.3g} samples/s at micro {size}"
                + (f" (fits up to {fitting[-1]})" if fitting[-1] > size else "")
            )
            continue
        gc.collect()  # out of the except block: its frames held the activations
        device.empty_cache()
        result.failed.append((size, mode.checkpointing, error))
        notes.append(f"{mode.describe()} micro {size} ran out of memory when timed")
    return timed, notes


def _measured_speed(
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


def _one_point(result: ProbeResult, mode: Mode, base: int) -> Fit | None:
    """A line from a single probed size, when a larger one could not be probed safely: all of
    its growth is taken as per-sample (an upper bound beyond that size)."""
    only = [s for s in result.samples if s.checkpointing == mode.checkpointing and s.peak]
    if not only:
        return None
    s = only[0]
    return Fit(
        checkpointing=mode.checkpointing,
        fixed=float(base),
        per_sample=max(s.peak - base, 0) / s.size,
        seconds_fixed=0.0,
        seconds_per_sample=s.seconds / s.size,
        sizes=(s.size,),
        residual=0.0,
        kind=result.kind,
    )


def _accumulation_reason(micro: int, effective: int) -> str:
    steps = -(-effective // micro)
    if steps == 1:
        return f"accumulation 1: the whole effective batch {effective} in one pass"
    return f"accumulation {steps}: {steps} micro-batches of {micro}, the effective batch stays {effective}"


def analytic_for(model, batch, *, precision: str, optimizer, device_type: str):
    """(Analytic, None) for a known Hugging Face family, read off the live model (its config,
    peft adapters, weights dtype, attention), the batch (sequence length) and the optimizer;
    (None, why not) otherwise."""
    from steadytrain.memory.estimate import KNOWN_FAMILIES, Settings, text_config

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return None, "the model has no Hugging Face config"
    family = getattr(text_config(config), "model_type", None)
    if family not in KNOWN_FAMILIES:
        return None, f"family {family!r} is not modelled ({', '.join(KNOWN_FAMILIES)})"
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
        return None, "the batch has no input_ids of shape (batch, seq)"
    names = {
        "torch.float32": "fp32",
        "torch.bfloat16": "bf16",
        "torch.float16": "fp16",
    }
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    weights = names.get(str((frozen or params)[0].dtype), "fp32")
    settings: dict[str, Any] = {"method": "full"}
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        lora = next(iter(peft_config.values()))
        targets = lora.target_modules
        settings = {
            "method": "lora",
            "lora_r": int(lora.r),
            "lora_targets": targets if isinstance(targets, str) else ",".join(sorted(targets)),
            "lora_dropout": float(lora.lora_dropout or 0.0),
        }
    kind = type(optimizer).__name__.lower()
    if kind == "sgd":
        momentum = optimizer.param_groups[0].get("momentum", 0)
        opt = "sgd-momentum" if momentum else "sgd"
    elif "8bit" in kind:
        opt = "adamw8bit"
    else:
        opt = "adamw"
    attention = {"flash_attention_2": "flash", "eager": "eager"}.get(
        getattr(config, "_attn_implementation", None) or "sdpa", "sdpa"
    )
    try:
        chosen = Settings(
            micro_batch=1,
            seq=int(ids.shape[1]),
            precision=precision,
            weights_dtype=weights,
            optimizer=opt,
            attention=attention,
            device_type=device_type,
            load_in_4bit=bool(getattr(model, "is_loaded_in_4bit", False)),
            **settings,
        )
        chosen.check()
    except BadInputError as exc:
        return None, str(exc)
    return Analytic(config, chosen), None


def first_step_bytes(optimizer) -> int:
    """Memory the first optimizer step adds that no probed pass shows: the optimizer's state,
    created lazily at that step (Adam and AdamW: two tensors the size of each parameter, plus
    one parameter-sized temporary in the default foreach step; SGD with momentum: one; plain
    SGD: none; 8-bit Adam: about half a byte per value; any other optimizer is taken as Adam).
    0 when the state exists already."""
    if any(optimizer.state.values()):
        return 0
    groups = optimizer.param_groups
    size = sum(p.numel() * p.element_size() for g in groups for p in g["params"])
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        return size if any(g.get("momentum") for g in groups) else 0
    if "8bit" in name:
        return size // 2
    return 3 * size


# -- the command ------------------------------------------------------------------------------

CHECKPOINTING_CHOICES = ("auto", "on", "off")
ASSUMED_RECOMPUTE = 4 / 3
"""Without a probe the times are unknown; checkpointing is taken to cost one more forward per
sample (a forward is about a third of forward + backward), so plain wins wherever it fits."""
ASSUMED_CHUNKED = 1.1
"""The chunked loss's cost per sample when nothing is measured: 8-10 % on an H100 for Llama 3's
vocabulary (docs/benchmarks.md)."""


def plan_command(
    model: str,
    effective_batch: int,
    seq: int = 1024,
    precision: str = "fp32",
    weights_dtype: str = "fp32",
    method: str = "full",
    lora_r: int = 16,
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj",
    lora_dropout: float = 0.0,
    load_in_4bit: bool = False,
    checkpointing: str = "auto",
    optimizer: str = "adamw",
    attention: str = "sdpa",
    device_type: str | None = None,
    memory: str | None = None,
    probe_device: bool | None = None,
    micro_batch_sizes: str = "powers_of_two",
    margin: float | None = None,
    json_output: bool = False,
    console=None,
) -> int:
    """`steadytrain plan`: the analytic estimate, then (on CUDA by default, elsewhere with
    --probe) a probe of the model built from its config with random weights on this device,
    then the plan. Exit 0 with a plan, 3 when nothing fits, 2 bad input."""
    from steadytrain.memory.estimate import (
        DEVICE_TYPES,
        Settings,
        load_config,
        resolve_target,
    )

    problems = []
    if effective_batch < 1:
        problems.append(f"--effective-batch: {effective_batch} is not positive")
    if checkpointing not in CHECKPOINTING_CHOICES:
        problems.append(
            f"--checkpointing: {checkpointing!r} is not one of {', '.join(CHECKPOINTING_CHOICES)}"
        )
    if device_type is not None and device_type not in DEVICE_TYPES:
        problems.append(f"--device-type: {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    if margin is not None and not 0 < margin <= 1:
        problems.append(f"--margin: {margin} is outside (0, 1]; 0.9 means 90% of the room")
    if micro_batch_sizes not in SIZE_POLICIES:
        problems.append(
            f"--micro-batch-sizes: {micro_batch_sizes!r} is not one of {', '.join(SIZE_POLICIES)}"
        )
    if problems:
        raise BadInputError("plan: " + "; ".join(problems))
    budget, source, resolved_type = resolve_target(memory, device_type)
    settings = Settings(
        micro_batch=1,
        seq=seq,
        precision=precision,
        weights_dtype=weights_dtype,
        method=method,
        lora_r=lora_r,
        lora_targets=lora_targets,
        lora_dropout=lora_dropout,
        load_in_4bit=load_in_4bit,
        optimizer=optimizer,
        attention=attention,
        device_type=resolved_type,
    )
    settings.check()
    config = load_config(model)
    analytic = Analytic(config, settings, strict=True)
    ckpt = {"auto": "auto", "on": True, "off": False}[checkpointing]
    from steadytrain.device import resolve_device

    here = resolve_device("auto").type
    if probe_device is None:
        probe_device = here == "cuda" and resolved_type == "cuda"
    if probe_device and resolved_type != here:
        raise BadInputError(
            f"--probe: this machine trains on {here}, the plan is for {resolved_type} "
            "(--device-type); probe on the machine itself, or leave --probe out for the "
            "analytic plan"
        )
    if probe_device:
        chosen = _probe_plan(
            config, settings, analytic, ckpt, effective_batch, memory, margin, micro_batch_sizes
        )
    else:
        chosen = _analytic_plan(
            analytic, ckpt, effective_batch, budget, resolved_type, margin, micro_batch_sizes
        )
    chosen.reasons.insert(0, f"budget from {source}")
    if json_output:
        import json

        print(json.dumps(chosen.to_event(), indent=2, default=str))
    else:
        render_plan(chosen, seq, console)
    return 3 if chosen.predicted_peak is None else 0


def _analytic_plan(analytic, ckpt, effective, budget, device_type, margin, policy) -> Plan:
    """The plan from the estimate alone: peak(b) is the analytic total (tensors and overhead)
    against the whole budget; times are assumed (`ASSUMED_RECOMPUTE`)."""
    margin = margin if margin is not None else MARGINS[device_type]
    modes = [Mode(ckpt is True)] + ([Mode(True)] if ckpt == "auto" else [])
    modes += [Mode(m.checkpointing, True) for m in modes]
    fits = {}
    for mode in modes:
        one, two = (
            analytic.at(1, mode.checkpointing, mode.chunked_loss).total,
            analytic.at(2, mode.checkpointing, mode.chunked_loss).total,
        )
        if one is None or two is None:
            raise BadInputError(
                "plan: the activations of this model family are not modelled, so only a probe "
                "can tell; run it where the model will train with --probe"
            )
        fits[mode] = Fit(
            checkpointing=mode.checkpointing,
            fixed=float(2 * one - two),
            per_sample=float(two - one),
            seconds_fixed=0.0,
            seconds_per_sample=(ASSUMED_RECOMPUTE if mode.checkpointing else 1.0)
            * (ASSUMED_CHUNKED if mode.chunked_loss else 1.0),
            sizes=(1, 2),
            residual=0.0,
            kind="analytic",
        )
    common = dict(
        effective_batch_size=effective,
        budget=budget,
        margin=margin,
        in_use=0,
        device_type=device_type,
    )
    if budget is None:
        raise BadInputError("plan: this device's budget is unknown; pass --memory 16GiB")
    limit = margin * budget
    reasons = [
        f"no probe: the analytic total (tensors + overhead) against {margin:.0%} of the budget "
        f"{format_bytes(budget)}, {format_bytes(limit)}; times are not measured, so a "
        "checkpointed or chunked-loss size is taken only where no plain one fits (run with "
        "--probe on the training machine to compare measured speeds)"
    ]
    for mode, line in fits.items():
        reasons.append(
            f"{mode.describe()}: total ≈ {format_bytes(line.fixed)} + "
            f"{format_bytes(line.per_sample)} × micro (analytic, micro 1 and 2)"
        )
    best, candidates, why = choose(fits, effective, limit, policy=policy)
    if best is None:
        reasons.append(
            "nothing fits, not even one sample checkpointed: see the knobs of `estimate`"
        )
        return Plan(
            micro_batch_size=1,
            checkpointing=ckpt is not False,
            chunked_loss=True,
            predicted_peak=None,
            limit=limit,
            reasons=reasons,
            candidates=candidates,
            analytic=analytic,
            **common,
        )
    reasons += [r for r in why if "samples/s" not in r]
    reasons.append(_accumulation_reason(best.micro, effective))
    return Plan(
        micro_batch_size=best.micro,
        checkpointing=best.mode.checkpointing,
        chunked_loss=best.mode.chunked_loss,
        predicted_peak=best.peak,
        limit=limit,
        reasons=reasons,
        candidates=candidates,
        analytic=analytic,
        **common,
    )


def _probe_plan(config, settings, analytic, ckpt, effective, memory, margin, policy) -> Plan:
    """Build the model from its config with random weights on this device (LoRA through peft
    when asked), and plan with real passes on random tokens."""
    import torch

    from steadytrain._units import parse_bytes
    from steadytrain.device import resolve_device
    from steadytrain.memory.chunked_loss import CausalLMLoss
    from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
    from steadytrain.memory.probe import checkpointing_switch

    device = resolve_device("auto", parse_bytes(memory) if memory else 0.9)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    model = _random_model(config, settings, dtypes[settings.weights_dtype], device.torch_device)
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.optimizer.startswith("sgd"):
        momentum = 0.9 if settings.optimizer == "sgd-momentum" else 0.0
        pending = first_step_bytes(torch.optim.SGD(params, lr=0.0, momentum=momentum))
    else:
        pending = first_step_bytes(torch.optim.AdamW(params))
        if settings.optimizer == "adamw8bit":
            pending //= 6
    vocab = config.get_text_config().vocab_size if hasattr(config, "get_text_config") else 0
    generator = torch.Generator().manual_seed(0)
    top = min(max(PROBE_SIZES), effective)
    tokens = torch.randint(0, vocab or 2, (top, settings.seq), generator=generator)
    tokens = tokens.to(device.torch_device)
    state = {"checkpointing": False}
    loss_fn = CausalLMLoss()

    def passes(chunk_tokens: int | None):
        def run(size: int, checkpointing: bool) -> None:
            if checkpointing != state["checkpointing"]:
                switch = checkpointing_switch(model, checkpointing)
                if switch is None:
                    raise BadInputError("plan: this model has no activation checkpointing switch")
                switch()
                state["checkpointing"] = checkpointing
            loss_fn.set_chunking(chunk_tokens)
            ids = tokens[:size]
            with torch.autocast(
                device.type, dtype=dtypes[settings.precision], enabled=settings.autocast
            ):
                loss_sum, _ = loss_fn(model, {"input_ids": ids, "labels": ids})
            loss_sum.backward()
            for p in params:
                p.grad = None

        return run

    return plan(
        passes(None),
        device,
        effective_batch_size=effective,
        checkpointing=ckpt,
        can_checkpoint=checkpointing_switch(model, True) is not None,
        chunked_run=passes(DEFAULT_CHUNK_TOKENS) if loss_fn.can_chunk(model) else None,
        margin=margin,
        policy=policy,
        analytic=analytic,
        pending=pending,
    )


def _random_model(config, settings, dtype, torch_device):
    import torch
    from transformers import AutoModelForCausalLM

    attention = {"flash": "flash_attention_2", "eager": "eager"}.get(settings.attention, "sdpa")
    config._attn_implementation = attention
    with torch.device(torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if settings.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = settings.targets
        model = get_peft_model(
            model,
            LoraConfig(
                r=settings.lora_r,
                lora_alpha=2 * settings.lora_r,
                lora_dropout=settings.lora_dropout,
                target_modules="all-linear" if targets == ("all-linear",) else list(targets),
            ),
        )
    model.train()
    return model


def render_plan(chosen: Plan, seq: int | None = None, console=None) -> None:
    """The candidates table and the reasons."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"plan: micro-batch {chosen.micro_batch_size} × {chosen.accumulation} "
        f"(effective batch {chosen.effective_batch_size}), activation checkpointing "
        f"{'on' if chosen.checkpointing else 'off'}"
        + (", chunked loss" if chosen.chunked_loss else ""),
        title_justify="left",
    )
    for name in ("mode", "micro", "accum", "predicted peak", "of limit", "samples/s", "tokens/s"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    table.add_column("")
    # Per mode, the sizes that fit and the first that does not: the rest says nothing new.
    shown, over = [], set()
    for c in chosen.candidates:
        if c.fits or c.mode not in over:
            shown.append(c)
            over |= set() if c.fits else {c.mode}
    hidden = len(chosen.candidates) - len(shown)
    if hidden:
        table.caption = f"{hidden} larger size(s) over the limit not shown (--json lists them)"
    for c in shown:
        picked = c.micro == chosen.micro_batch_size and c.mode == Mode(
            chosen.checkpointing, chosen.chunked_loss
        )
        rate = c.samples_per_second if chosen.probe is not None else None
        table.add_row(
            c.mode.describe().replace("checkpointed", "ckpt"),
            str(c.micro),
            str(-(-chosen.effective_batch_size // c.micro)),
            format_bytes(c.peak),
            f"{c.peak / chosen.limit:.0%}" if chosen.limit else "-",
            f"{rate:.3g}" if rate else "-",
            f"{rate * seq:,.0f}" if rate and seq else "-",
            "◀ chosen" if picked else ("fits" if c.fits else "over"),
        )
    console.print(table)
    for reason in chosen.reasons:
        console.print(f"- {reason}", markup=False, highlight=False)
