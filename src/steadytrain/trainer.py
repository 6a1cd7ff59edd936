"""The public `Trainer`: puts the device, precision, data, step runner, loop and the default
callbacks together from the config, and runs them."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from steadytrain import run_files
from steadytrain.config import TrainConfig
from steadytrain.device import Device, get_rng_state, resolve_device, seed_everything, set_rng_state
from steadytrain.engine import Loop, OptimizerBatchSampler, Precision, StepRunner, resolve_precision
from steadytrain.engine.batching import split_batch, to_device
from steadytrain.engine.compiling import check_compiler, compile_blocks, compile_wanted
from steadytrain.engine.sampler import SeededFetch
from steadytrain.errors import BadInputError, SteadytrainError
from steadytrain.events import Callback, Control, Dispatcher, TrainState
from steadytrain.memory.analytic import analytic_for
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.plan import first_step_bytes, plan
from steadytrain.memory.savers import MemorySavers, Savers, trial_pass
from steadytrain.safety.checkpoint import CheckpointStore, Payload
from steadytrain.safety.continuity import ContinuityCheck
from steadytrain.safety.lock import RunLock
from steadytrain.safety.memory_watch import MemoryWatch
from steadytrain.safety.saving import CheckpointSaver
from steadytrain.safety.signals import SignalStop
from steadytrain.safety.state import HostBuffers, RunState, run_identity
from steadytrain.safety.watchdog import HangWatchdog
from steadytrain.telemetry.console import console_callback
from steadytrain.telemetry.files import RunFiles
from steadytrain.telemetry.tensorboard import TensorBoardLog

OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class FitResult:
    """What `fit()` did. `exit_code` follows DESIGN.md (0 finished, 130/143 stopped by a signal)."""

    steps: int
    final_loss: float | None
    micro_batch_size: int
    reason: str
    exit_code: int
    run_dir: str
    checkpoint: str | None = None
    oom_count: int = 0


class Trainer:
    """Train `model` on `train_data` with `loss_fn(model, micro_batch)` so that the run finishes.

    `loss_fn` returns a mean loss tensor, or ``(loss_sum, count)`` for token-weighted losses.
    `optimizer` is an optimizer or a factory ``params -> optimizer`` (params: those that require
    grad); `scheduler` likewise a scheduler or a factory ``optimizer -> scheduler``, stepped once
    per optimizer step. `train_data` is a map-style dataset or a DataLoader over one (its dataset, collate_fn
    and workers are used; batching is steadytrain's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerLike,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        train_data: Dataset | DataLoader,
        config: TrainConfig | dict,
        scheduler: Any = None,
        callbacks: Iterable[Callback] = (),
        collate_fn: Callable | None = None,
    ):
        self.config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
        self.model, self.loss_fn, self.scheduler = model, loss_fn, scheduler
        self._optimizer = optimizer
        self.user_callbacks = list(callbacks)
        self.dataset, self.collate_fn, self.workers, self.worker_init_fn = _data_source(
            train_data, collate_fn, self.config.num_workers
        )

    def fit(self) -> FitResult:
        """Train to the end (or a stop request) and return what happened."""
        try:
            return self._fit()
        except (SteadytrainError, KeyboardInterrupt):
            raise
        except Exception:
            _keep_traceback(Path(self.config.run_dir))
            raise

    def _fit(self) -> FitResult:
        run_dir = Path(self.config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with RunLock(run_dir):
            return self._fit_locked(run_dir)

    def _fit_locked(self, run_dir: Path) -> FitResult:
        cfg = self.config
        run = self._set_up()
        tensorboard = TensorBoardLog.from_config(cfg, run_dir)  # refused before anything is written
        compiled = compile_wanted(cfg.compile, run.device.type)
        if compiled:
            check_compiler(run.device.type)
        files = RunFiles(run_dir)
        try:
            store = CheckpointStore(run_dir, cfg.keep_last, log=files.record)
            expected_loss = self._resume_or_start(run, store, files)
            cfg.dump(run_dir / run_files.CONFIG)
            console = console_callback(cfg)
            record = _recorder(files, console)
            planned = RecordAtStart(record)
            if not run.resumed and cfg.micro_batch_size == "auto":
                planned.events = self._plan(run, compiled)
            if compiled:  # after the plan: its probe measures eager passes (compiling.py)
                planned.events.append(("compile", compile_blocks(run.model, run.device.type)))
            run.emit.callbacks[:] = self._callbacks(
                run, store, record, expected_loss, [console, tensorboard, files, planned]
            )
            reason, code = self._loop(run).run()
            committed = store.committed()
            return FitResult(
                steps=run.state.step,
                final_loss=run.state.last_loss,
                micro_batch_size=run.state.micro_batch_size,
                reason=reason,
                exit_code=code,
                run_dir=str(run_dir),
                checkpoint=str(committed[-1][1]) if committed else None,
                oom_count=run.state.oom_count,
            )
        finally:
            files.close()  # closed at fit_end already; this covers a refusal before it

    def _set_up(self) -> _Run:
        """Device, precision, model, optimizer, scheduler, sampler, the fresh state, the memory
        savers and the step runner: everything before a checkpoint is looked for."""
        cfg = self.config
        device = resolve_device(cfg.device, cfg.budget_bytes_or_fraction())
        precision = resolve_precision(cfg.precision, device)
        seed_everything(cfg.seed)
        model = self.model.to(device.torch_device)
        model.train()
        optimizer = self._build_optimizer(model)
        scheduler = self.scheduler
        if callable(scheduler) and not hasattr(scheduler, "state_dict"):
            scheduler = scheduler(optimizer)  # a factory: optimizer -> scheduler
        sampler = self._sampler()
        _warn_if_batch_dependent(model, cfg)
        state = TrainState(
            steps_per_epoch=sampler.steps_per_epoch,
            max_steps=cfg.max_steps or cfg.epochs * sampler.steps_per_epoch,
            effective_batch_size=cfg.effective_batch_size,
            micro_batch_size=(
                cfg.effective_batch_size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
            ),
        )
        settings = {
            k: getattr(cfg, k) for k in ("effective_batch_size", "seed", "drop_last", "shuffle")
        }
        identity = run_identity(model, optimizer, scheduler, SeededFetch(self.dataset), settings)
        savers = MemorySavers(model, self.loss_fn, state, cfg.activation_checkpointing)
        emit = Dispatcher([], state, Control())
        runner = StepRunner(
            model=model,
            optimizer=optimizer,
            loss_fn=self.loss_fn,
            device=device,
            precision=precision,
            state=state,
            emit=emit,
            scheduler=scheduler,
            max_grad_norm=cfg.max_grad_norm,
            savers=savers,
        )
        checkpoint = RunState(state, model, optimizer, scheduler, precision.scaler, identity)
        return _Run(
            device, precision, model, optimizer, sampler, state, checkpoint, savers, runner, emit
        )

    def _sampler(self) -> OptimizerBatchSampler:
        cfg = self.config
        sampler = OptimizerBatchSampler(
            len(self.dataset), cfg.effective_batch_size, cfg.seed, cfg.shuffle, cfg.drop_last
        )
        if sampler.steps_per_epoch == 0:
            raise BadInputError(
                f"train_data: {len(self.dataset)} sample(s), fewer than one optimizer batch of "
                f"effective_batch_size {cfg.effective_batch_size}; lower effective_batch_size "
                "or set drop_last: false"
            )
        return sampler

    def _resume_or_start(self, run: _Run, store: CheckpointStore, files: RunFiles) -> float | None:
        """Load the newest verified checkpoint into the fresh objects, if there is one; put the
        memory savers in force; apply the supervisor's micro-batch cap. Returns the loss the
        first resumed step must reproduce (None when there is nothing to check)."""
        expected_loss = None
        found = store.latest()
        if found is not None:
            step, path = found
            overridden, expected_loss = run.checkpoint.load(
                store.load(path), path, self.config.resume_overrides
            )
            for difference in overridden:
                files.record("resume_override", {"step": step, "change": difference})
            files.record(
                "resume",
                {
                    "step": step,
                    "checkpoint": path.name,
                    "micro_batch_size": run.state.micro_batch_size,
                },
            )
        run.resumed = found is not None
        run.savers.start(resumed=run.resumed)
        cap = _micro_cap_from_supervisor()
        if cap is not None and cap < run.state.micro_batch_size:
            reason = f"{run_files.ENV_MAX_MICRO_BATCH}={cap} (supervisor)"
            files.record(
                "micro_batch_cap", {"old": run.state.micro_batch_size, "new": cap, "reason": reason}
            )
            run.state.micro_batch_size = cap
        return expected_loss

    def _callbacks(
        self, run: _Run, store: CheckpointStore, record, expected_loss, telemetry: list
    ) -> list[Callback]:
        """The default callbacks, in dispatch order, then the user's."""
        cfg, state = self.config, run.state
        host = HostBuffers()

        def capture(state: TrainState) -> Payload:
            return run.checkpoint.capture(self._probe_next_loss(run, state), host)

        async_save = cfg.async_save if cfg.async_save != "auto" else cfg.keep_last >= 2
        continuity = None
        if expected_loss is not None:
            continuity = ContinuityCheck(
                expected_loss, state.micro_batch_size, run.device.type, record
            )
        callbacks = [
            HangWatchdog.from_config(cfg, Path(cfg.run_dir), run.device, record),
            MemoryWatch.from_config(cfg, run.device, record),
            CheckpointSaver(store, capture, cfg.save_every_steps, async_save, record),
            SignalStop(record),
            continuity,
            *telemetry,  # console, tensorboard, files (a late record after its fit_end
            # reopens the file), the events decided before the start
            *self.user_callbacks,
        ]
        return [c for c in callbacks if c is not None]

    def _loop(self, run: _Run) -> Loop:
        cfg = self.config
        return Loop(
            runner=run.runner,
            emit=run.emit,
            batches=lambda epoch, start: self._batches(run.sampler, epoch, start, run.device),
            time_every=cfg.log_every_steps,
            fit_info={
                "device": str(run.device.torch_device),
                "device_skipped": list(run.device.skipped),
                "precision": run.precision.name,
                "budget": run.device.budget,
                "micro_batch_size": run.state.micro_batch_size,
                "resumed_from": run.state.step if run.resumed else None,
                "config": cfg.model_dump(mode="json"),
            },
        )

    def _plan(self, run: _Run, compiled: bool = False) -> list[tuple]:
        """micro_batch_size 'auto': measure passes on the first optimizer batch and set the micro
        size (and the memory savers) from `steadytrain.memory.plan`. The probe leaves no trace
        in the run: gradients are dropped, buffers (BatchNorm statistics) and every RNG stream
        are put back, so the run's losses are those of a run started at the chosen size.
        Returns the `plan` and `estimate` events (what was chosen and why)."""
        cfg, state, savers, model = self.config, run.state, run.savers, run.model
        batch = self._batch_at(run.sampler, 0, 0)
        analytic, _ = analytic_for(
            model,
            batch,
            precision=run.precision.name,
            optimizer=run.optimizer,
            device_type=run.device.type,
        )

        def one_pass(size: int) -> None:
            piece = to_device(
                split_batch(batch, size)[0], run.device.torch_device, run.runner.non_blocking
            )
            trial_pass(model, self.loss_fn, piece, run.precision.autocast)

        before = savers.snapshot()
        # The chunked loss is a candidate when the loss has a chunked mode for this model and
        # the caller did not choose chunking already.
        offer_chunked = before.chunked_loss is None and savers.can_chunk_loss
        with _left_as_found(model, savers):
            chosen = plan(
                savers.trial_run(one_pass, before.chunked_loss),
                run.device,
                effective_batch_size=cfg.effective_batch_size,
                activation_checkpointing=cfg.activation_checkpointing,
                can_checkpoint=savers.can_checkpoint,
                chunked_run=savers.trial_run(one_pass, DEFAULT_CHUNK_TOKENS)
                if offer_chunked
                else None,
                plan_margin=None if cfg.plan_margin == "auto" else cfg.plan_margin,
                micro_batch_sizes=cfg.micro_batch_sizes,
                cap=state.micro_batch_size,
                analytic=analytic,
                pending=first_step_bytes(run.optimizer),
                compiled=compiled,
            )
        state.micro_batch_size = chosen.micro_batch_size
        savers.restore(
            Savers(
                before.checkpointing or chosen.checkpointing,
                before.chunked_loss or (DEFAULT_CHUNK_TOKENS if chosen.chunked_loss else None),
            )
        )
        estimate = chosen.estimate_event()
        return [("plan", chosen.to_event())] + ([("estimate", estimate)] if estimate else [])

    def _probe_next_loss(self, run: _Run, state: TrainState) -> float | None:
        """The loss the next step will report, computed now without changing anything, so that a
        resume from this checkpoint can prove it restored everything (see ContinuityCheck)."""
        if state.step >= state.max_steps:
            return None
        epoch, position = state.epoch, state.batch_in_epoch
        if position >= state.steps_per_epoch:
            epoch, position = epoch + 1, 0
        batch = self._batch_at(run.sampler, epoch, position)
        rng = get_rng_state()
        try:
            return run.runner.evaluate(batch)
        finally:
            set_rng_state(rng)

    def _batch_at(self, sampler: OptimizerBatchSampler, epoch: int, position: int) -> Any:
        """The collated optimizer batch at (`epoch`, `position`), as the loop will load it."""
        indices = sampler.batch_at(epoch, position)
        return self.collate_fn(SeededFetch(self.dataset).__getitems__(indices))

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if isinstance(self._optimizer, torch.optim.Optimizer):
            return self._optimizer
        if callable(self._optimizer):
            optimizer = self._optimizer([p for p in model.parameters() if p.requires_grad])
            if isinstance(optimizer, torch.optim.Optimizer):
                return optimizer
        raise BadInputError(
            "optimizer: expected a torch.optim.Optimizer or a function params -> optimizer"
        )

    def _batches(
        self, sampler: OptimizerBatchSampler, epoch: int, start: int, device
    ) -> DataLoader:
        sampler.set_position(epoch, start)
        return DataLoader(
            SeededFetch(self.dataset),
            batch_sampler=sampler,
            collate_fn=self.collate_fn,
            num_workers=self.workers,
            worker_init_fn=self.worker_init_fn,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(self.config.seed * 7919 + epoch),
        )


class RecordAtStart(Callback):
    """Events decided before the loop starts (the plan), recorded at fit_start: events.jsonl and
    the console open with the run's start, and the plan follows it."""

    def __init__(self, record: Callable[[str, dict], None]):
        self.record = record
        self.events: list[tuple[str, dict]] = []

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        for name, data in self.events:
            self.record(name, data)
        self.events = []


@contextlib.contextmanager
def _left_as_found(model: torch.nn.Module, savers: MemorySavers) -> Iterator[None]:
    """Every RNG stream, the model's buffers (BatchNorm statistics) and the memory savers put
    back afterwards: the planner's passes leave no trace in the run."""
    rng = get_rng_state()
    buffers = [b.detach().clone() for b in model.buffers()]
    before = savers.snapshot()
    try:
        yield
    finally:
        set_rng_state(rng)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        savers.restore(before)


@dataclass
class _Run:
    """The parts of one `fit()`, built by `Trainer._set_up` and wired by the phases after it."""

    device: Device
    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: OptimizerBatchSampler
    state: TrainState
    checkpoint: RunState
    savers: MemorySavers
    runner: StepRunner
    emit: Dispatcher
    resumed: bool = False


def _recorder(files: RunFiles, console: Any) -> Callable[[str, dict], None]:
    def record(name: str, info: dict) -> None:
        """An event from outside the loop's dispatch: into events.jsonl and onto the console."""
        files.record(name, info)
        console.note(name, info)

    return record


def _micro_cap_from_supervisor() -> int | None:
    """`steadytrain run` sets this after an OS kill, to start the restarted run smaller."""
    value = os.environ.get(run_files.ENV_MAX_MICRO_BATCH)
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise BadInputError(
            f"{run_files.ENV_MAX_MICRO_BATCH}: {value!r} is not a whole number"
        ) from None


def _data_source(train_data: Any, collate_fn: Callable | None, workers: int):
    """(dataset, collate_fn, num_workers, worker_init_fn) from a dataset or a DataLoader."""
    worker_init_fn = None
    if isinstance(train_data, DataLoader):
        loader = train_data
        train_data = loader.dataset
        collate_fn = collate_fn or loader.collate_fn
        workers = max(workers, loader.num_workers)
        worker_init_fn = loader.worker_init_fn
    if isinstance(train_data, IterableDataset) or not hasattr(train_data, "__getitem__"):
        raise BadInputError(
            "train_data: steadytrain needs a map-style dataset (len() and indexing) so that it can "
            "choose, split and resume batches exactly; an iterable dataset cannot be resumed "
            "mid-epoch. Wrap the data in a list or a torch.utils.data.Dataset."
        )
    try:
        size = len(train_data)
    except TypeError:
        raise BadInputError("train_data: has no len(); give a map-style dataset") from None
    if size == 0:
        raise BadInputError("train_data: the dataset is empty")
    return train_data, collate_fn or default_collate, workers, worker_init_fn


class BatchDependentModelWarning(UserWarning):
    """The model's forward depends on the batch, so splitting a batch changes the result."""


def _warn_if_batch_dependent(model: torch.nn.Module, cfg: TrainConfig) -> None:
    norms = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    if norms and cfg.micro_batch_size != cfg.effective_batch_size:
        warnings.warn(
            f"model: {len(norms)} BatchNorm layer(s) (first: {norms[0]}) compute statistics per "
            "micro-batch, so accumulation over micro-batches is not exactly the full batch. Set "
            "micro_batch_size equal to effective_batch_size if it fits, or use GroupNorm/LayerNorm.",
            BatchDependentModelWarning,
            stacklevel=3,
        )


def _keep_traceback(run_dir: Path) -> None:
    """An unexpected error is a bug: keep its traceback in the run directory for the report."""
    try:
        folder = run_dir / "errors"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        (folder / f"{stamp}-{os.getpid()}.txt").write_text(traceback.format_exc())
    except OSError:
        pass
