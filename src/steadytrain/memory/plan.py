"""Choose the micro-batch, the accumulation, activation checkpointing (on CUDA also with its kept
inputs offloaded to host memory; and, where the loss offers one, a chunked loss) that give the
most samples per second within the memory budget.

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
3. Otherwise each mode (plain; checkpointed where the model can; on CUDA checkpointed with
   offloaded inputs, unless plain checkpointing already fits the largest allowed size; chunked
   loss where the loss has a chunked mode for the model, and the savers together; not a mode the
   analytic estimate puts over the limit at one sample while a mode with more savers is
   estimated lower, `_Job.outdone`) is probed at 1, 2 and 4 samples (`probe.py`), and every allowed size of every mode whose predicted peak
   is within the limit is a candidate. The winner has the most samples per second: on CPU and
   MPS as predicted by the time line, size / seconds(size) (the fixed time of a pass is paid
   once per micro-batch, so larger micro-batches run faster until memory stops them); on CUDA
   as measured at each mode's own largest fitting size (`finalists.py`: the small probed sizes
   are bound by kernel launches there, and their time line says little about large sizes). A
   checkpointed
   larger micro-batch beats a plain smaller one exactly when the measured times say so.
4. Allowed sizes divide the effective batch (every step splits into equal micro-batches, the
   rule `micro_batch_size` has in the config) and, by default, are powers of two (kernels are
   tuned for them); the effective batch itself is always allowed.

The analytic estimate (`estimate.py`) is used where the model is a known Hugging Face family:
as a cross-check beside the measurement, and on MPS as a floor under the measured figure, which
is only a lower bound there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.device import Device, call_or_oom
from steadytrain.memory.analytic import Analytic, analytic_for, first_step_bytes
from steadytrain.memory.choice import SAVER_GAIN, Candidate, Mode, allowed_sizes, choose
from steadytrain.memory.compiled import COMPILED_GROWTH, compiled_growth
from steadytrain.memory.finalists import measured_speed, time_finalists
from steadytrain.memory.offload import OFFLOAD, offload_not_needed
from steadytrain.memory.plan_record import Plan, Room, accumulation_reason
from steadytrain.memory.probe import Fit, ProbeResult, RunPass, in_use, measure, one_point, probe
from steadytrain.memory.settings import SIZE_POLICIES

__all__ = [  # the names the trainer, the command line and users import from here
    "COMPILED_GROWTH",
    "MARGINS",
    "SAVER_GAIN",
    "SIZE_POLICIES",
    "Analytic",
    "Candidate",
    "Mode",
    "Plan",
    "Room",
    "allowed_sizes",
    "analytic_for",
    "choose",
    "compiled_growth",
    "first_step_bytes",
    "plan",
]

MARGINS = {"cuda": 0.9, "mps": 0.75, "cpu": 0.75}
"""Share of the room above what is in use that the predicted peak may take, per device type."""
QUICK_SHARE = 0.5
"""The one-pass bound (rule 2) must stay within this share of the allowed growth."""
PROBE_SIZES = (1, 2, 4)


@dataclass
class _Job:
    """One planning: the passes, the device, the config's choices and the room."""

    run: RunPass
    chunked_run: RunPass | None
    device: Device
    room: Room
    activation_checkpointing: str | bool
    can_checkpoint: bool
    micro_batch_sizes: str
    cap: int
    sizes: list[int]
    reps: int = 1
    """Passes per probed size (CUDA times its finalists instead, so one there)."""
    analytic: Analytic | None = None
    compiled: float = 0.0
    """The run compiles its layers (`compile`): the share a sample's growth is counted at
    (`COMPILED_GROWTH`); 0 when it does not compile."""
    eager_passes: Callable[[], AbstractContextManager] | None = None
    """The layers are compiled already: the probe's passes run eager in this context, and the
    CUDA finalists run compiled (see `plan`)."""
    can_offload: bool = False  # the model's layers take the offloaded checkpoint
    notes: list[str] = field(default_factory=list)  # why a mode was not probed
    tile: Callable[[bool], bool] | None = None
    """Switches the tiled MLP (`memory.tiled_mlp`) for every pass that follows; None where the
    model has no MLP to tile or the config decided already."""
    tiled: bool = False
    """The passes run with the MLP tiled (`tiling`): every mode has it on."""

    def eager(self) -> AbstractContextManager:
        return self.eager_passes() if self.eager_passes else contextlib.nullcontext()

    @classmethod
    def bound(
        cls,
        run: RunPass,
        chunked_run: RunPass | None,
        device: Device,
        effective_batch_size: int,
        cap: int | None,
        pending: int,
        can_checkpoint: bool,
        *,
        activation_checkpointing: str | bool,
        plan_margin: float | None,
        micro_batch_sizes: str,
    ) -> _Job:
        """The job with its room: the budget, what is in use, and the margin of the room."""
        margin = plan_margin if plan_margin is not None else MARGINS[device.type]
        budget, base = device.budget, in_use(device)
        room = Room(effective_batch_size, budget, base, margin, device.type, pending)
        cap = min(cap or effective_batch_size, effective_batch_size)
        sizes = allowed_sizes(effective_batch_size, micro_batch_sizes, cap)
        return cls(
            run,
            chunked_run,
            device,
            room,
            activation_checkpointing,
            can_checkpoint,
            micro_batch_sizes,
            cap,
            sizes,
        )

    @property
    def start(self) -> Mode:
        if self.activation_checkpointing == OFFLOAD:
            return Mode(True, offload=self.offload_here, tiled_mlp=self.tiled)
        return Mode(self.activation_checkpointing is True, tiled_mlp=self.tiled)

    @property
    def may_checkpoint(self) -> bool:
        return self.activation_checkpointing == "auto" and self.can_checkpoint

    @property
    def offload_here(self) -> bool:
        """Offload is possible: a model that takes it, on a device with memory of its own."""
        return self.can_offload and self.device.discrete_memory

    def modes(self) -> list[Mode]:
        modes = [self.start]
        if self.may_checkpoint:
            modes += [Mode(True)] + ([Mode(True, offload=True)] if self.offload_here else [])
        if self.chunked_run is not None:
            modes += [m._replace(chunked_loss=True) for m in modes]
        return [m._replace(tiled_mlp=self.tiled) for m in modes]

    def tiling(self) -> str | None:
        """Turn the tiled MLP on for every pass when the analytic estimate puts one sample with
        every other saver the run may use over the limit and the tiled MLP lowers it (a long
        sequence: the recomputed layer's MLP holds every token's inside); the reason, or None
        where it stays off. It is decided before any pass: a pass that is over the limit only
        runs out of memory, at long sequences after seconds."""
        if self.tile is None or self.analytic is None or self.room.limit is None:
            return None
        most = max(self.modes(), key=lambda m: m.savers)
        own = self.analytic.total(1, most)
        tiled = self.analytic.total(1, most._replace(tiled_mlp=True))
        if own is None or tiled is None or own <= self.room.limit or tiled >= own:
            return None
        if not self.tile(True):
            return None
        self.tiled = True
        return (
            f"tiled MLP: on (one sample {most.describe()} is estimated at "
            f"{format_bytes(own)}, over the limit {format_bytes(self.room.limit)}; with each "
            f"layer's MLP over a piece of the tokens at a time, {format_bytes(tiled)})"
        )

    def outdone(self, mode: Mode) -> str | None:
        """Why `mode` is not worth a pass, or None: the analytic estimate puts one sample of it
        over the limit while a mode with more savers is estimated lower. Its pass would only
        run out of memory; at long sequences each such failure costs seconds, and the runs it
        precedes were measured to fail where the same savers set by hand fit (the 1B Llama at
        65,536 tokens under a 16 GiB cap: plain, checkpointed and offloaded passes, each
        without the chunked loss, ran out of memory first, and then so did the start with every
        saver, which trains at 11.4 GiB in a fresh process)."""
        if self.analytic is None or self.room.limit is None:
            return None
        own = self.analytic.total(1, mode)
        if own is None or own <= self.room.limit:
            return None
        for other in self.modes():
            if other != mode and mode.within(other):
                theirs = self.analytic.total(1, other)
                if theirs is not None and theirs < own:
                    return (
                        f"{mode.describe()}: not probed; one sample is estimated at "
                        f"{format_bytes(own)}, over the limit, and {other.describe()} at "
                        f"{format_bytes(theirs)}"
                    )
        return None


def plan(
    run: RunPass,
    device: Device,
    *,
    effective_batch_size: int,
    activation_checkpointing: str | bool = "auto",
    can_checkpoint: bool = False,
    can_offload: bool = False,
    chunked_run: RunPass | None = None,
    plan_margin: float | None = None,
    micro_batch_sizes: str = "powers_of_two",
    cap: int | None = None,
    analytic: Analytic | None = None,
    reps: int | None = None,
    pending: int = 0,
    compiled: bool | float = False,
    eager_passes: Callable[[], AbstractContextManager] | None = None,
    tile: Callable[[bool], bool] | None = None,
) -> Plan:
    """Probe with `run(size, checkpointing)` and choose (the module docstring has the rule):
    bound, one pass, probe, choose, explain.

    `activation_checkpointing`: the config's ('auto' lets the plan decide, where
    `can_checkpoint`; with `can_offload` too, on a device with memory of its own, between plain
    and offloaded checkpointing; 'offload' probes that mode alone). `chunked_run`: the same
    pass with the loss computed in chunks, when the caller's loss has such a variant; the plan
    then decides `chunked_loss` too. `cap`: no size above it (the supervisor's cap after an OS
    kill). `reps`: passes per probed size (the fastest counts: the first pass of a size also
    pays for kernel selection and allocation).
    `pending`: bytes the first optimizer step adds that no probed pass holds (the optimizer's
    state, `first_step_bytes`); added to every prediction. `compiled`: the run
    compiles its layers after the plan, whose passes are eager: sizes are predicted with a
    sample's growth times this share (`compiled_growth(model)`; True: 1.0, no credit), timed
    eagerly at the largest size that fits eager. `eager_passes`: the layers are compiled
    before the plan, and this context (torch.compiler.set_stance("force_eager")) runs them
    eagerly: the probe's passes run in it, and on CUDA each mode's finalist runs compiled at the
    size the compiled prediction allows, so its speed is the compiled run's own (a compiled
    layer's fixed cost per pass favours larger micro-batches more than eager timing shows) and
    a finalist whose compiled peak passes the limit is no contender. `tile(on)`: switches the
    tiled MLP for the passes that follow (True where it could); the plan turns it on before
    any pass where the analytic estimate says one sample does not fit otherwise
    (`_Job.tiling`), and every mode has it then."""
    given = {
        "activation_checkpointing": activation_checkpointing,
        "plan_margin": plan_margin,
        "micro_batch_sizes": micro_batch_sizes,
    }
    job = _Job.bound(
        run, chunked_run, device, effective_batch_size, cap, pending, can_checkpoint, **given
    )
    job.reps, job.analytic = reps or (1 if device.type == "cuda" else 2), analytic
    job.compiled = 0.0 if compiled is False else 1.0 if compiled is True else float(compiled)
    job.eager_passes = eager_passes if job.compiled else None
    job.can_offload, job.tile = can_offload, tile
    if job.room.limit is None:
        reasons = [
            "the budget of this device is unknown: starting at the largest allowed size; the "
            "out-of-memory ladder shrinks it if needed (set memory_budget to plan)"
        ]
        return job.room.plan(job.sizes[-1], job.start, None, reasons, analytic=analytic)
    tiling = job.tiling()
    if tiling is not None:
        job.notes.append(tiling)
    if job.outdone(job.start):  # said among the probe's reasons
        result = ProbeResult(baseline=job.room.in_use)
    else:
        with job.eager():
            result = _first_pass(job)
    return _without_probing(job, result) or _probe_and_choose(job, result)


def _first_pass(job: _Job) -> ProbeResult:
    """One pass at micro-batch 1 (none recorded when it runs out of memory)."""
    result = ProbeResult(baseline=job.room.in_use)
    first, oom = call_or_oom(
        lambda: measure(job.run, job.device, 1, job.start.activation_checkpointing, reps=1),
        job.device.empty_cache,
    )
    if oom is not None:
        return result
    result.samples.append(first)
    result.kind = job.device.peak_reading().kind
    return result


def _without_probing(job: _Job, result: ProbeResult) -> Plan | None:
    """The plan the first pass settles (rule 2), or None when a probe must decide: no peak
    reading starts at the largest allowed size; a bound within half the room takes it."""
    if not result.samples:
        return None
    room, top, first = job.room, job.sizes[-1], result.samples[0]
    if first.peak is None:
        reasons = [
            room.describe(),
            f"{room.device_type} gives no peak reading here: starting at the largest allowed "
            f"size {top}; the out-of-memory ladder shrinks it if needed",
        ]
        return room.plan(top, job.start, None, reasons, probe=result)
    growth = max(first.peak - room.in_use, 0)
    bound = room.in_use + growth * top + room.pending
    floor = (
        job.analytic.total(top, job.start) if job.analytic and room.device_type == "mps" else None
    )
    if bound > room.within(QUICK_SHARE) or (floor is not None and floor > room.limit):
        return None
    reasons = [
        room.describe(),
        f"one sample adds at most {format_bytes(growth)}; {top} times that, "
        f"{format_bytes(bound)}, is within half the room: micro {top} without further probing",
        accumulation_reason(top, room.effective_batch_size),
    ]
    return room.plan(
        top, job.start, bound, reasons, probe=result, analytic=job.analytic, quick=True
    )


def _probe_and_choose(job: _Job, result: ProbeResult) -> Plan:
    """Probe every mode, predict each allowed size, choose, and say why."""
    with job.eager():
        fits = _probe_modes(job, result)
    reasons = [job.room.describe(), *_probe_reasons(job, result, fits)]
    predict = _predictor(job, fits, compiled=job.compiled)
    compiled_finalists = job.eager_passes is not None and job.device.type == "cuda"
    if job.compiled and any(_compile_credit(mode) for mode in fits):
        reasons.append(_compiled_reason(job.compiled, compiled_finalists))
    for mode in fits:
        share = _recomputed_share(job, mode)
        if share < 1.0:
            reasons.append(
                f"compile: a sample of {mode.describe()} is counted at {share:.0%} of its eager "
                "growth (the analytic estimate's: a compiled layer, its MLP tiled, keeps less "
                "for its recomputation than the eager probe's)"
                + (", and its finalist runs compiled at that size" if compiled_finalists else "")
            )
    speed = None
    if job.device.type == "cuda":  # time the finalists themselves: see `time_finalists`
        runs = {mode: job.chunked_run if mode.chunked_loss else job.run for mode in fits}
        sizes_by = predict if compiled_finalists else _predictor(job, fits)
        timed, notes = time_finalists(
            fits,
            runs,
            job.device,
            job.sizes,
            job.room.limit,
            sizes_by,
            result,
            compiled=compiled_finalists,
        )
        reasons += notes
        if timed:
            speed = measured_speed(fits, timed)
    best, candidates, why = choose(
        fits,
        job.room.effective_batch_size,
        job.room.limit,
        micro_batch_sizes=job.micro_batch_sizes,
        cap=job.cap,
        predict=predict,
        speed=speed,
    )
    found = {"candidates": candidates, "probe": result, "analytic": job.analytic}
    if best is None:
        return _nothing_fits(job, reasons, found)
    reasons += why + _chosen_reasons(job, best, fits)
    largest = max(
        (m for m in range(1, job.cap + 1) if predict(best.mode, m) <= job.room.limit),
        default=None,
    )
    return job.room.plan(
        best.micro_batch_size, best.mode, best.peak, reasons, largest_fitting=largest, **found
    )


def _probe_modes(job: _Job, result: ProbeResult) -> dict[Mode, Fit]:
    """A line peak(b), seconds(b) per mode from passes at `PROBE_SIZES` (each within the safe
    peak), the chunked modes' samples added to `result`."""
    if job.reps > 1:  # size 1 again with repetitions: the first pass also paid for warm-up
        result.samples = []
    room = job.room
    safe = room.limit if job.device.type == "cuda" else room.within(QUICK_SHARE)
    probe_sizes = tuple(s for s in PROBE_SIZES if s <= job.cap)
    fits: dict[Mode, Fit] = {}
    for mode in job.modes():
        top, limit = job.sizes[-1], room.limit - room.pending
        unneeded = (
            mode != job.start and offload_not_needed(fits, mode, top, limit)
        ) or job.outdone(mode)
        if unneeded:
            job.notes.append(unneeded)
            continue
        passes = job.chunked_run if mode.chunked_loss else job.run
        tried = result if not mode.chunked_loss else ProbeResult(baseline=room.in_use)
        probe(
            passes,
            job.device,
            checkpointing=mode.activation_checkpointing,
            sizes=probe_sizes,
            safe_peak=safe,
            reps=job.reps,
            result=tried,
        )
        line = tried.fits.get(mode.activation_checkpointing) or one_point(
            tried, mode.activation_checkpointing, room.in_use
        )
        if line is not None:
            fits[mode] = line
        if mode.chunked_loss:
            result.samples += [dataclasses.replace(s, chunked_loss=True) for s in tried.samples]
            result.failed += tried.failed
            result.skipped += tried.skipped
            result.seconds += tried.seconds
    return fits


def _probe_reasons(job: _Job, result: ProbeResult, fits: dict[Mode, Fit]) -> list[str]:
    """Each mode's measured line, the sizes that ran out of memory, and the savers that were
    not candidates."""
    reasons = [
        f"{mode.describe()}: peak ≈ {format_bytes(line.fixed)} + "
        f"{format_bytes(line.per_sample)} × micro (sizes {', '.join(map(str, line.sizes))}"
        + (f", residual {line.residual:.1%}" if len(line.sizes) > 2 else "")
        + f"), {line.seconds_per_sample * 1000:.3g} ms per sample + "
        f"{line.seconds_fixed * 1000:.3g} ms per pass"
        for mode, line in fits.items()
    ]
    for size, ckpt, _ in result.failed:
        reasons.append(f"{Mode.of(ckpt).describe()} micro {size} ran out of memory in the probe")
    reasons += job.notes
    if job.activation_checkpointing == "auto" and not job.can_checkpoint:
        reasons.append(
            "activation checkpointing: not a candidate (the model has no switch of its own, "
            "like Hugging Face's activation_checkpointing_enable/disable)"
        )
    elif job.activation_checkpointing is False:
        reasons.append("activation checkpointing: off (activation_checkpointing: false)")
    if job.may_checkpoint and not job.device.discrete_memory:
        reasons.append(
            f"activation offload: not a candidate ({job.device.type}: host memory is the same "
            "memory as the device's)"
        )
    if job.chunked_run is None:
        reasons.append("chunked loss: not a candidate (the loss offers no chunked variant)")
    if job.analytic is not None and job.device.type == "mps":
        reasons.append("MPS: each peak is the larger of the measured line and the analytic total")
    return reasons


def _predictor(job: _Job, fits: dict[Mode, Fit], compiled: float = 0.0):
    """peak(mode, size): the measured line (on MPS at least the analytic total), plus the first
    optimizer step's pending bytes; `compiled`: with the compiled growth where it applies."""
    floored = job.analytic is not None and job.device.type == "mps"

    def predict(mode: Mode, size: int) -> float:
        line = fits[mode]
        if not compiled:
            share = 1.0
        elif _compile_credit(mode):
            share = compiled
        else:
            share = _recomputed_share(job, mode)
        measured = line.fixed + line.per_sample * share * size
        floor = job.analytic.total(size, mode) if floored else None
        return (measured if floor is None else max(measured, floor)) + job.room.pending

    return predict


def _recomputed_share(job: _Job, mode: Mode) -> float:
    """What a sample of a checkpointed mode with the tiled MLP adds once the layers are
    compiled, as a share of what it adds in the eager probe: the analytic estimate's compiled
    growth over its eager growth (memory/estimate.py `RECOMPUTED_TILED_SHARE`); 1.0 (no credit)
    for other modes, where the run does not compile, or where the estimate cannot say."""
    credited = job.compiled and mode.checkpointing and mode.tiled_mlp
    if not credited or job.analytic is None or job.device.type == "mps":
        return 1.0
    return job.analytic.compiled_share(mode) or 1.0


def _compile_credit(mode: Mode) -> bool:
    """Whether compiling shrinks this mode's growth per sample (`COMPILED_GROWTH`)."""
    return mode.chunked_loss and not mode.checkpointing


def _compiled_reason(share: float, compiled_finalists: bool) -> str:
    timing = (
        "each mode's finalist runs compiled at that size"
        if compiled_finalists
        else "timed eagerly at the largest size that fits eager"
    )
    return (
        f"compile: the probe measures eager passes; a sample of a mode without "
        f"checkpointing, with the chunked loss, is counted at {share:.0%} of its eager growth "
        f"(compiled layers recompute their elementwise results), and {timing}"
    )


def _nothing_fits(job: _Job, reasons: list[str], found: dict[str, Any]) -> Plan:
    mode = job.start
    if job.may_checkpoint and not mode.checkpointing:  # the most a mode saves, then the ladder
        mode = Mode(True, offload=job.offload_here)
    if job.chunked_run is not None:  # a long sequence's logits alone can outgrow the budget
        mode = mode._replace(chunked_loss=True)
    if job.tile is not None and not mode.tiled_mlp and job.tile(True):  # and its MLPs' inside
        mode = mode._replace(tiled_mlp=True)
    reasons.append(
        "nothing is predicted to fit, not even one sample"
        + (f" {mode.describe()}" if mode != Mode() else "")
        + ": starting at micro 1 with every saver it may use; the out-of-memory ladder has the "
        "last word"
    )
    return job.room.plan(1, mode, None, reasons, **found)


def _chosen_reasons(job: _Job, best: Candidate, fits: dict[Mode, Fit]) -> list[str]:
    """Accumulation, the checkpointing decision and the analytic cross-check of the choice."""
    reasons = [accumulation_reason(best.micro_batch_size, job.room.effective_batch_size)]
    if best.mode.chunked_loss and getattr(job.chunked_run, "method", None) == "fused":
        reasons.append(
            "the chunked loss is the fused linear cross-entropy here (Liger Kernel on CUDA, "
            "memory/fused_loss.py): no logits held beyond one chunk, nothing recomputed"
        )
    if best.mode.offload and not job.start.offload:
        reasons.append(
            "activation offload: on (checkpointing alone does not fit the size it needs; each "
            "layer's input waits in pinned host memory until the backward)"
        )
    elif best.mode.checkpointing and not job.start.checkpointing:
        reasons.append("activation checkpointing: on (the faster way to the larger micro-batch)")
    elif not best.mode.checkpointing and Mode(True) in fits:
        reasons.append("activation checkpointing: off (plain is predicted faster)")
    if job.analytic is not None:
        at = job.analytic.of(best.micro_batch_size, best.mode)
        if at is not None and at.peak is not None and job.device.type == "cuda":
            off = (best.peak - at.peak) / at.peak
            estimated_eager = not (at.settings.compiled and at.settings.device_type != "mps")
            credited = job.compiled and _compile_credit(best.mode)
            eager = " of eager layers" if credited and estimated_eager else ""
            reasons.append(
                f"cross-check: the analytic estimate of the tensor peak{eager} is "
                f"{format_bytes(at.peak)}, the probe's {format_bytes(best.peak)} ({off:+.0%})"
            )
    return reasons
