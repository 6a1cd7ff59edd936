"""One optimizer step that survives out-of-memory.

The collated batch is split into micro-batches of the size in force; each is moved to the device,
run forward under autocast, its loss weighted by its share of the batch, and backpropagated. On
out-of-memory anywhere in the step the partial gradients are dropped, the cache is freed, the
micro size is halved (or, once the size is 1, the next memory saver is turned on) and the same
batch is redone from the same RNG state. The optimizer always sees the whole batch.

Weighting makes accumulation exact (`steadytrain.engine.accumulation`): a `loss_fn` returning a
mean is weighted by sample share; one returning ``(loss_sum, count)`` (token-level losses)
contributes its sum, and the summed gradient is divided by the batch's total count, so padding
and uneven splits do not bias it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from steadytrain._units import format_bytes
from steadytrain.device import (
    Device,
    OutOfMemory,
    call_or_oom,
    retry_on_oom,
)
from steadytrain.engine.accumulation import BatchLoss, backward, divide_and_clip
from steadytrain.engine.accumulation import check_loss_output as check_loss_output  # re-export
from steadytrain.engine.agreement import Agreement, Phase
from steadytrain.engine.batching import batch_len, split_batch, to_device
from steadytrain.engine.distributed import Group
from steadytrain.engine.one_sample import (
    ONE_SAMPLE_NORM,
    one_sample_batch,
    one_sample_norm_does_not_fit,
)
from steadytrain.engine.precision import Precision
from steadytrain.engine.side_pass import Saved, side_pass
from steadytrain.errors import (
    BadInputError,
    DoesNotFitError,
    FreshProcessOutOfMemory,
    OptimizerStateTouched,
)
from steadytrain.events import HALVING, DeviceSpan, Event, TrainState
from steadytrain.run import env as run_env
from steadytrain.run.records import Metric
from steadytrain.user_state import select

LossFn = Callable[[torch.nn.Module, Any], Any]
Emit = Callable[[Event, dict], None]

_SCHEDULER_ORDER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class SaverLadder(Protocol):
    """The memory savers as the out-of-memory ladder sees them (`memory.savers.MemorySavers`,
    injected by the trainer)."""

    def next_rung(self, reason: str) -> dict[str, Any] | None: ...
    def describe(self) -> str: ...


class StepRunner:
    """Runs optimizer steps on collated batches; owns the micro size and the OOM ladder."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        device: Device,
        precision: Precision,
        state: TrainState,
        emit: Emit,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        savers: SaverLadder | None = None,
        user_state: dict[str, Any] | None = None,
        group: Group | None = None,
    ):
        """`savers`: what the ladder turns on at micro-batch 1 before giving up (None: none).
        `group`: the ranks that share each batch (engine/distributed.py; None: this process)."""
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.device, self.precision, self.state, self.emit = device, precision, state, emit
        self.scheduler, self.max_grad_norm, self.savers = scheduler, max_grad_norm, savers
        self.group = group or Group()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.user_state = user_state or {}  # state the program carries (steadytrain.user_state)
        # BatchNorm's running statistics: a forward that runs out of memory may already have
        # updated them, so a redo puts them back first (a few numbers per channel).
        self.norm_statistics = [
            b
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]
        self.non_blocking = device.type == "cuda"
        self.phase = Phase()
        self.ranks = Agreement.for_group(
            self.group,
            model=model,
            params=self.params,
            free=device.empty_cache,
            phase=self.phase,
            record_oom=self._record_oom,
        )
        self._versions_before_optimizer: dict | None = None
        self._shrinks_before_step = 0
        # The micro size this process first shrank from (None: it has not shrunk). Not
        # `state.shrink_count`: that also counts the shrinks of the attempts before a resume,
        # which left nothing behind in this process's memory.
        self._shrunk_from: int | None = None

    # -- the step -------------------------------------------------------------------------

    def run(self, batch: Any, timed: bool = False) -> dict[str, Any]:
        """One optimizer step on `batch`, redone at smaller micro sizes until it fits.

        `timed`: also measure the forward+backward and optimizer phases on the device's clock
        (`device_compute_time`, `device_optimizer_time`); see `_PhaseMarks`. The step trains
        in training mode with autograd on, as fit() starts and a resume starts: a callback's
        `model.eval()` or `torch.set_grad_enabled(False)` left on does not carry into it."""
        if not self.model.training:  # one flag, not a walk of every module each step
            self.model.train()
        saved = Saved(rng=True, buffers=self.norm_statistics, user_state=self.user_state)
        self._shrinks_before_step = self.state.shrink_count

        def recover(oom: OutOfMemory) -> None:
            self._recover(oom)
            saved.put_back()  # the redo draws and starts from what the failed attempt did

        with torch.enable_grad():
            return retry_on_oom(lambda: self._attempt(batch, timed), self._drop_partial, recover)

    def _attempt(self, batch: Any, timed: bool) -> dict[str, Any]:
        """One try at the step, top to bottom; an out-of-memory anywhere in it ends the try,
        and `run` redoes it smaller."""
        n = self.group.total(batch_len(batch))  # the global batch: each rank holds a share
        micro = self.state.micro_batch_size
        pieces = split_batch(batch, micro)
        self.device.reset_peak()
        marks = _PhaseMarks(self.device, timed)

        def passes() -> BatchLoss:  # this rank's micro-batches; the gradients sum in place
            loss = BatchLoss(n)
            for i, piece in enumerate(pieces):
                self.phase.now = "forward"
                size = batch_len(piece)
                select(self.user_state, i * micro, i * micro + size, n)
                piece = to_device(piece, self.device.torch_device, self.non_blocking)
                self.ranks.micro_batch(last=i == len(pieces) - 1)
                with self.precision.autocast():
                    out = self.loss_fn(self.model, piece)
                scaled = self.precision.scale(loss.add(out, size))  # weighted by its share
                self.phase.now = "backward"
                backward(scaled)
                del out, scaled
                self.emit(Event.MICRO_STEP_END, {"index": i, "count": len(pieces), "size": size})
            return loss

        with self._one_sample_norms(micro, n):
            loss = self.ranks.passes(passes)  # and the ranks' agreement (engine/agreement.py)
        marks.mark()
        divisor = loss.divisor()
        self.phase.now = "optimizer"
        self._versions_before_optimizer = None
        self.precision.unscale(self.optimizer)
        grad_norm = divide_and_clip(self.params, divisor, self.max_grad_norm)
        self._versions_before_optimizer = self._versions()  # what a failed step must not touch
        skipped = self.precision.step(self.optimizer)  # fp16's scaler may skip it
        self._versions_before_optimizer = None
        _schedule(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        self.phase.now = "idle"
        marks.mark()
        # Nothing here waits for the device: the values it computed stay tensors (StepMetrics).
        return {
            Metric.LOSS: loss.mean(),
            Metric.LR: self.optimizer.param_groups[0]["lr"],
            Metric.GRAD_NORM: grad_norm,
            Metric.MICRO_BATCH_SIZE: micro,
            Metric.MICRO_STEPS: len(pieces),
            Metric.SAMPLES: n,
            Metric.TOKENS: divisor if divisor is not None else 0,
            **marks.times(),
            Metric.SKIPPED: skipped,
        }

    @contextlib.contextmanager
    def _one_sample_norms(self, micro: int, n: int) -> Iterator[None]:
        """BatchNorm refusing one sample per channel, said in the run's terms
        (engine/one_sample.py): at micro-batch 1 after a shrink, or on a batch of one sample."""
        try:
            yield
        except ValueError as exc:
            if micro == 1 and self.state.shrink_count and ONE_SAMPLE_NORM in str(exc):
                raise DoesNotFitError(one_sample_norm_does_not_fit(exc)) from exc
            if n == 1 and ONE_SAMPLE_NORM in str(exc):
                raise BadInputError(one_sample_batch(exc, self.state.step + 1)) from exc
            raise

    def evaluate(self, batch: Any, autograd: bool = False) -> float | None:
        """The loss `run(batch)` would report, without a backward or an update: the same split,
        autocast and weighting. Random draws (dropout) are the caller's to save and restore.
        None when it runs out of memory (the caller's check is then skipped, not the step).
        `autograd`: the forward records its graph as the step's does (dropped after each
        micro-batch), so kernels that differ with and without autograd (nn.LSTM on the CPU)
        give the step's very numbers; the resume check needs that, the evaluation does not."""

        micro, size = self.state.micro_batch_size, batch_len(batch)
        n = self.group.total(size)  # several ranks: `batch` is this rank's share

        def forward_only() -> BatchLoss:
            loss = BatchLoss(n)
            with torch.enable_grad() if autograd else torch.no_grad():
                for i, piece in enumerate(split_batch(batch, micro)):
                    select(self.user_state, i * micro, min((i + 1) * micro, size), n)
                    piece = to_device(piece, self.device.torch_device, self.non_blocking)
                    with self.precision.autocast():
                        loss.add(self.loss_fn(self.model, piece), batch_len(piece))
                return loss

        with side_pass(user_state=self.user_state):  # the probe never advances the state
            try:
                loss, oom = call_or_oom(forward_only, self.device.empty_cache)
            except ValueError as exc:  # the step itself says why (`one_sample_batch`)
                if n == 1 and ONE_SAMPLE_NORM in str(exc):
                    return None
                raise
        return self.ranks.loss(loss, oom)  # the same agreement as the step's

    # -- out-of-memory ladder -------------------------------------------------------------

    def _drop_partial(self) -> None:
        """After an out-of-memory: drop the partial gradients (and undo a started optimizer
        step where that is exact), then free the cache."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.phase.now == "optimizer":
            self._undo_optimizer_start(self._versions_before_optimizer)
        if self.precision.scaler is not None:
            # unscale_ may have run; the scaler must forget it before the redo.
            self.precision.scaler._per_optimizer_states.clear()
        self.device.empty_cache()

    def _recover(self, oom: OutOfMemory) -> None:
        """Announce the out-of-memory, then take the next rung: halve the micro size, or at 1
        turn on the next memory saver, or give up.

        Giving up at micro-batch 1 with every saver tried is `DoesNotFitError` (exit 3) only in
        a process that has not shrunk. One that ran larger micro-batches first may still hold
        what they freed (oneDNN's kernels and caches, glibc's arenas: under an address-space
        limit that counts), so its failure is no proof: under `steadytrain run` it exits 76
        (`FreshProcessOutOfMemory`) and a fresh process starts at micro-batch 1, which trains
        or, not having shrunk, says exit 3 (the supervisor's cap stays 1: no loop)."""
        record = self._record_oom(oom)
        self.phase.now = "idle"
        if self.state.shrink_count > self._shrinks_before_step and _freed_memory_stays_held(
            self.device
        ):
            raise FreshProcessOutOfMemory(self._shrink_did_not_help(record))
        if self.shrink(f"out of memory in {record['phase']}", record["memory"]):
            return
        rung = self.savers.next_rung("out of memory at micro-batch 1") if self.savers else None
        if rung is None and self._shrunk_from is not None and run_env.supervised():
            raise FreshProcessOutOfMemory(self._fresh_process_at_one(record))
        if rung is None:
            raise DoesNotFitError(self._does_not_fit(record))
        self.emit(Event.MEMORY_SAVER, {**rung, "memory": record["memory"]})

    def _record_oom(self, oom: OutOfMemory, **where: Any) -> dict[str, Any]:
        """Count the out-of-memory and announce it (the `oom` event: the phase the step was in,
        the error, the micro size, the memory reading, and `where`, e.g. a sharded rank's
        number); returns the record."""
        record = {
            "phase": self.phase.now,
            "error": oom.error,
            "requested": oom.requested,
            "micro_batch_size": self.state.micro_batch_size,
            "memory": self.device.memory().to_dict(),
            **where,
        }
        self.state.oom_count += 1
        self.emit(Event.OOM, dict(record))  # a callback's changes stay in its copy
        return record

    def shrink(self, reason: str, memory: dict | None = None) -> bool:
        """Halve the micro size (same effective batch). False when it is already 1."""
        old = self.state.micro_batch_size
        new = HALVING.next(old)
        if new is None:
            return False
        self.state.micro_batch_size = new
        self.state.shrink_count += 1
        self._shrunk_from = self._shrunk_from or old
        memory = memory or self.device.memory().to_dict()
        self.emit(Event.SHRINK, HALVING.record(old, new, reason, memory))
        return True

    def _versions(self) -> dict[int, int]:
        """In-place version counters of every parameter and optimizer state tensor."""
        tensors = list(self.params)
        for slot in self.optimizer.state.values():
            tensors.extend(v for v in slot.values() if isinstance(v, torch.Tensor))
        return {id(t): t._version for t in tensors}

    def _undo_optimizer_start(self, before: dict | None) -> None:
        """Allow a redo only when optimizer.step changed nothing that existed before it.
        State it created lazily (first step) is discarded; anything it modified in place is
        not undoable."""
        if before is None:
            return  # failed before optimizer.step (unscale, clipping): nothing changed
        touched = [p for p in self.params if p._version != before.get(id(p))]
        for slot in self.optimizer.state.values():
            touched += [
                v
                for v in slot.values()
                if isinstance(v, torch.Tensor) and id(v) in before and v._version != before[id(v)]
            ]
        if touched:
            raise OptimizerStateTouched(
                f"out of memory inside optimizer.step at step {self.state.step + 1}, after it had "
                f"updated {len(touched)} tensor(s) in place; the step cannot be redone exactly. "
                "Resume from the last checkpoint (`steadytrain run` restarts it), or lower "
                "memory_budget so the optimizer state is allocated with room to spare."
            )
        for param in list(self.optimizer.state):
            if not any(
                id(v) in before
                for v in self.optimizer.state[param].values()
                if isinstance(v, torch.Tensor)
            ):
                del self.optimizer.state[param]

    def _shrink_did_not_help(self, failure: dict) -> str:
        micro = self.state.micro_batch_size
        return (
            f"out of memory again at micro-batch {micro} in {failure['phase']} (step "
            f"{self.state.step + 1}), after a smaller micro-batch in this same process: under an "
            "address-space limit (ulimit -v), glibc's malloc keeps the memory the failed attempts "
            "freed, so this process cannot tell what a smaller size needs. Exiting 76: "
            f"`steadytrain run` restarts the run at micro-batch {HALVING.next(micro) or 1} in a fresh "
            "process from its last checkpoint. To keep shrinking in one process, start it with "
            "MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=65536 (glibc then returns freed memory)."
        )

    def _fresh_process_at_one(self, failure: dict) -> str:
        return (
            f"out of memory at micro-batch 1 in {failure['phase']} (step {self.state.step + 1}) "
            f"with every memory saver tried, in a process that shrank from micro-batch "
            f"{self._shrunk_from}: what the larger attempts freed may still be held here "
            "(oneDNN's kernels and caches, malloc's arenas), so this is no proof the run does "
            "not fit. Exiting 76: `steadytrain run` restarts it at micro-batch 1 in a fresh "
            "process from its last checkpoint; if that one runs out too, it says what helps "
            "(exit 3)."
        )

    def _does_not_fit(self, failure: dict) -> str:
        memory = failure["memory"]
        in_use = memory.get("peak") or memory.get("allocated") or memory.get("rss")
        requested = failure.get("requested")
        budget = memory.get("budget")
        need = f"{format_bytes(in_use)} in use"
        if requested:
            need += f", and the failed allocation asked for {format_bytes(requested)} more"
        savers = self.savers.describe() if self.savers else "no memory savers"
        text = (
            f"does not fit: one sample per micro-batch ({savers}) runs out of memory in "
            f"{failure['phase']} on {self.device.torch_device}.\n"
            f"  at the failure: {need}; memory budget {format_bytes(budget)}.\n"
            f"  the error: {failure['error']}\n"
            f"  what helps: {what_helps(self.model, self.precision.name, self.device.type)}."
        )
        if self._shrunk_from is not None:  # unsupervised: no fresh process follows by itself
            text += (
                f"\n  this process shrank from micro-batch {self._shrunk_from}, and what the "
                "larger attempts freed may still be held in it: a fresh process at micro-batch 1 "
                "may fit. Start it again with micro_batch_size 1, or under `steadytrain run`, "
                "which restarts a fresh process at micro-batch 1 before calling it does not fit."
            )
        return text


class _PhaseMarks:
    """The phase boundaries of one step: its start, the end of the passes and agreement, the
    end of the optimizer step; `times()` gives the spans between them.

    The host's clock always. On timed steps the device's clock too: on CUDA and MPS the host
    only queues work, so its clock measures launches (a step whose kernels take 40 ms can show
    2 ms of compute_time). A timing event recorded into the queue at each boundary is stamped
    when the device gets there; the spans are read lazily (`DeviceSpan`) after the wait the run
    already does to read the loss, so a timed step waits no more than any other. Where the
    backend has no timing events, each boundary synchronizes instead (only on timed steps); on
    CPU that is free and the host clock is the device clock.
    """

    def __init__(self, device: Device, timed: bool):
        self.device, self.timed = device, timed
        self.events: list[Any] | None = None
        self.host: list[float] = []
        if timed and device.type != "cpu":
            try:
                self.events = [
                    torch.Event(device.torch_device, enable_timing=True) for _ in range(3)
                ]
            except (RuntimeError, TypeError, ValueError):
                self.events = None
        self.mark()

    def mark(self) -> None:
        """The next boundary."""
        if self.timed:
            self._mark_device()
        self.host.append(time.perf_counter())

    def _mark_device(self) -> None:
        index = len(self.host)
        if self.events is not None:
            try:
                self.events[index].record()
            except RuntimeError:  # a backend whose events cannot time: synchronize instead
                if index:
                    raise
                self.events = None
        if self.events is None:
            self.device.synchronize()

    def times(self) -> dict[str, Any]:
        """`compute_time` and `optimizer_time` on the host's clock; on a timed step also
        `device_compute_time` and `device_optimizer_time`."""
        start, middle, end = self.host
        times: dict[str, Any] = {
            Metric.COMPUTE_TIME: middle - start,
            Metric.OPTIMIZER_TIME: end - middle,
        }
        if not self.timed:
            return times
        if self.events is None:
            return times | {
                Metric.DEVICE_COMPUTE_TIME: times[Metric.COMPUTE_TIME],
                Metric.DEVICE_OPTIMIZER_TIME: times[Metric.OPTIMIZER_TIME],
            }
        start, middle, end = self.events
        return times | {
            Metric.DEVICE_COMPUTE_TIME: DeviceSpan(start, middle),
            Metric.DEVICE_OPTIMIZER_TIME: DeviceSpan(middle, end),
        }


def what_helps(model: torch.nn.Module, precision: str, device_type: str) -> str:
    """The knobs that lower the memory of `model`'s run, in the words of the model it is: a
    convolutional (vision) model's input size, a language model's sequence length, LoRA rank
    and 4-bit base (CUDA), and for any model a smaller one, a lower precision where the run is
    not already in one, and more memory."""
    modules = list(model.modules())
    knobs = []
    if any(isinstance(m, torch.nn.Conv2d | torch.nn.Conv3d) for m in modules):
        knobs.append("smaller images (a smaller resize or crop: the input size)")
    else:
        knobs.append("shorter sequences (max_seq_length) or smaller inputs")
    if any("lora_" in name for name, _ in model.named_modules()):
        knobs.append("a lower LoRA rank")
    if device_type == "cuda" and any(isinstance(m, torch.nn.Embedding) for m in modules):
        knobs.append("a 4-bit base model")
    if precision == "fp32":
        knobs.append("precision 'bf16' or 'fp16'")
    knobs.append("a smaller model")
    return ", ".join(knobs) + ", or closing other programs to give the run more memory"


def _schedule(scheduler: Any) -> None:
    """The scheduler's step, after every optimizer step. One fp16's scaler skipped did not call
    optimizer.step(), so PyTorch thinks the order is wrong; it is not (the skip is counted in
    skipped_steps instead)."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCHEDULER_ORDER, category=UserWarning)
        scheduler.step()


def _freed_memory_stays_held(device: Device) -> bool:
    """Whether memory a failed attempt freed may stay in this process's address space and count
    against its limit: CPU on Linux under RLIMIT_AS (`ulimit -v`), with glibc's default malloc
    (per-thread arenas, a moving mmap threshold). `malloc_trim` does not help (it returns pages,
    not address space); MALLOC_ARENA_MAX and MALLOC_MMAP_THRESHOLD_ set together do."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if os.environ.get("MALLOC_ARENA_MAX") and os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
