"""The public `Trainer`: puts the device, precision, data, step runner, loop and the default
callbacks together from the config, and runs them."""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from steadytrain import run_files
from steadytrain.config import TrainConfig
from steadytrain.device import get_rng_state, resolve_device, seed_everything, set_rng_state
from steadytrain.engine import Loop, OptimizerBatchSampler, StepRunner, resolve_precision
from steadytrain.engine.compiling import check_compiler, compile_blocks
from steadytrain.engine.sampler import SeededFetch
from steadytrain.errors import BadInputError, SteadytrainError
from steadytrain.events import Callback, Control, Dispatcher, TrainState
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.plan import analytic_for, first_step_bytes, plan
from steadytrain.run_files import ENV_MAX_MICRO_BATCH
from steadytrain.safety.checkpoint import CheckpointStore, Payload
from steadytrain.safety.continuity import ContinuityCheck
from steadytrain.safety.lock import RunLock
from steadytrain.safety.memory_watch import MemoryWatch
from steadytrain.safety.saving import CheckpointSaver
from steadytrain.safety.signals import SignalStop
from steadytrain.safety.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    HostBuffers,
    capture_payload,
    data_fingerprint,
    differences,
    frozen_fingerprint,
    load_model_tensors,
    model_shape,
    optimizer_identity,
    rng_from_files,
    schedule_identity,
)
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
        device = resolve_device(cfg.device, cfg.budget_bytes_or_fraction())
        precision = resolve_precision(cfg.precision, device)
        seed_everything(cfg.seed)
        model = self.model.to(device.torch_device)
        model.train()
        optimizer = self._build_optimizer(model)
        scheduler = self.scheduler
        if callable(scheduler) and not hasattr(scheduler, "state_dict"):
            scheduler = scheduler(optimizer)  # a factory: optimizer -> scheduler

        sampler = OptimizerBatchSampler(
            len(self.dataset), cfg.effective_batch_size, cfg.seed, cfg.shuffle, cfg.drop_last
        )
        if sampler.steps_per_epoch == 0:
            raise BadInputError(
                f"train_data: {len(self.dataset)} sample(s), fewer than one optimizer batch of "
                f"effective_batch_size {cfg.effective_batch_size}; lower effective_batch_size "
                "or set drop_last: false"
            )
        _warn_if_batch_dependent(model, cfg)
        state = TrainState(
            steps_per_epoch=sampler.steps_per_epoch,
            max_steps=cfg.max_steps or cfg.epochs * sampler.steps_per_epoch,
            effective_batch_size=cfg.effective_batch_size,
            micro_batch_size=(
                cfg.effective_batch_size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
            ),
        )
        identity = self._identity(model, optimizer, scheduler)

        tensorboard = TensorBoardLog.from_config(cfg, run_dir)  # refused before anything is written
        if cfg.compile:
            check_compiler(device.type)
        files = RunFiles(run_dir)
        try:
            store = CheckpointStore(run_dir, cfg.keep_last, log=files.record)
            expected_loss = None
            found = store.latest()
            if found is not None:
                expected_loss = self._restore(
                    store, found, identity, state, model, optimizer, scheduler, precision, files
                )
            cap = _micro_cap_from_supervisor()
            if cap is not None and cap < state.micro_batch_size:
                files.record(
                    "micro_batch_cap",
                    {
                        "old": state.micro_batch_size,
                        "new": cap,
                        "reason": f"{ENV_MAX_MICRO_BATCH}={cap} (supervisor)",
                    },
                )
                state.micro_batch_size = cap
            cfg.dump(run_dir / run_files.CONFIG)

            control = Control()
            callbacks: list[Callback] = []
            emit = Dispatcher(callbacks, state, control)
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
                checkpointing=cfg.activation_checkpointing,
            )
            if state.activation_checkpointing:  # it was on when the checkpoint was written
                state.activation_checkpointing = False
                runner.enable_activation_checkpointing(reason="restored from the checkpoint")
            chunk = getattr(self.loss_fn, "chunk_tokens", None)
            if found is None:
                state.chunked_loss = chunk
            elif state.chunked_loss != chunk and not runner.set_chunked_loss(state.chunked_loss):
                # the loss arithmetic of the run before the stop cannot be restored
                raise BadInputError(
                    f"resume: the checkpoint's run computed its loss in chunks of "
                    f"{state.chunked_loss} tokens, and this loss_fn has no chunked mode for "
                    "this model; use the loss of that run (memory.chunked_loss."
                    "CausalLMLoss) or start a new run_dir"
                )

            host = HostBuffers()

            def capture(state: TrainState) -> Payload:
                next_loss = self._probe_next_loss(runner, sampler, state)
                return capture_payload(
                    state, model, optimizer, scheduler, precision.scaler, identity, next_loss, host
                )

            async_save = cfg.async_save if cfg.async_save != "auto" else cfg.keep_last >= 2
            console = console_callback(cfg)

            def record(name: str, info: dict) -> None:
                """An event from outside the loop's dispatch: into events.jsonl and onto the console."""
                files.record(name, info)
                console.note(name, info)

            planned = RecordAtStart(record)
            if found is None and cfg.micro_batch_size == "auto":
                planned.events = self._plan(runner, optimizer, sampler, state, device, precision)
            if cfg.compile:  # after the plan: its probe measures eager passes (compiling.py)
                planned.events.append(("compile", compile_blocks(model, device.type)))

            callbacks += [
                HangWatchdog.from_config(cfg, run_dir, device, record),
                MemoryWatch.from_config(cfg, device, record),
                CheckpointSaver(store, capture, cfg.save_every_steps, async_save, record),
                SignalStop(record),
                ContinuityCheck(expected_loss, state.micro_batch_size, device.type, record)
                if expected_loss is not None
                else None,
                console,
                tensorboard,
                files,  # a late record after its fit_end reopens the file
                planned,
                *self.user_callbacks,
            ]
            callbacks[:] = [c for c in callbacks if c is not None]
            loop = Loop(
                runner=runner,
                emit=emit,
                batches=lambda epoch, start: self._batches(sampler, epoch, start, device),
                time_every=cfg.log_every_steps,
                fit_info={
                    "device": str(device.torch_device),
                    "device_skipped": list(device.skipped),
                    "precision": precision.name,
                    "budget": device.budget,
                    "micro_batch_size": state.micro_batch_size,
                    "resumed_from": state.step if found is not None else None,
                    "config": cfg.model_dump(mode="json"),
                },
            )
            reason, code = loop.run()
            committed = store.committed()
            return FitResult(
                steps=state.step,
                final_loss=state.last_loss,
                micro_batch_size=state.micro_batch_size,
                reason=reason,
                exit_code=code,
                run_dir=str(run_dir),
                checkpoint=str(committed[-1][1]) if committed else None,
                oom_count=state.oom_count,
            )
        finally:
            files.close()  # closed at fit_end already; this covers a refusal before it

    def _identity(self, model, optimizer, scheduler) -> dict[str, Any]:
        """What defines this run; a checkpoint of a different run must not be resumed into it."""
        cfg = self.config
        return {
            "effective_batch_size": cfg.effective_batch_size,
            "seed": cfg.seed,
            "drop_last": cfg.drop_last,
            "shuffle": cfg.shuffle,
            "model": model_shape(model),
            "frozen_base": frozen_fingerprint(model),
            "optimizer": optimizer_identity(optimizer),
            "schedule": schedule_identity(scheduler),
            "data": data_fingerprint(SeededFetch(self.dataset)),
        }

    def _restore(
        self, store, found, identity, state, model, optimizer, scheduler, precision, files
    ) -> float | None:
        """Load the newest verified checkpoint into the fresh objects. Returns the loss the first
        resumed step must reproduce (None when it cannot be checked)."""
        step, path = found
        payload = store.load(path)
        doc = payload.json[STATE_FILE]
        changed = differences(doc["identity"], identity)
        allowed = set(self.config.resume_overrides)
        overridden = [
            d
            for d in changed
            if _field(d) in allowed or (_field(d) == "frozen_base" and "model" in allowed)
        ]
        refused = [d for d in changed if d not in overridden]
        if refused:
            raise BadInputError(
                f"resume: {path} belongs to a different run; what changed (old -> new):\n  "
                + "\n  ".join(refused)
                + "\nUse the settings, model, optimizer and data of that run, start a new run_dir, "
                "or allow a change explicitly with resume_overrides (e.g. ['seed'])."
            )
        for difference in overridden:
            files.record("resume_override", {"step": step, "change": difference})
        load_model_tensors(model, payload.tensors[MODEL_FILE])
        optimizer.load_state_dict(payload.objects[OPTIMIZER_FILE])
        if scheduler is not None:
            scheduler.load_state_dict(payload.objects[SCHEDULER_FILE])
        if precision.scaler is not None and SCALER_FILE in payload.objects:
            precision.scaler.load_state_dict(payload.objects[SCALER_FILE])
        saved = doc["state"]
        for key in (
            "step",
            "epoch",
            "batch_in_epoch",
            "micro_batch_size",
            "samples_seen",
            "tokens_seen",
            "oom_count",
            "shrink_count",
            "skipped_steps",
            "activation_checkpointing",
            "last_loss",
        ):
            setattr(state, key, saved[key])
        state.chunked_loss = saved.get("chunked_loss")  # absent in checkpoints before it existed
        set_rng_state(rng_from_files(payload.tensors[RNG_FILE], doc["rng"]))
        files.record(
            "resume",
            {"step": step, "checkpoint": path.name, "micro_batch_size": state.micro_batch_size},
        )
        return None if overridden else doc.get("next_loss")

    def _plan(self, runner, optimizer, sampler, state, device, precision) -> list[tuple]:
        """micro_batch_size 'auto': measure passes on the first optimizer batch and set the micro
        size (and activation checkpointing) from `steadytrain.memory.plan`. The probe leaves
        no trace in the run: gradients are dropped, buffers (BatchNorm statistics) and every
        RNG stream are put back, so the run's losses are those of a run started at the chosen
        size. Returns the `plan` and `estimate` events (what was chosen and why)."""
        cfg = self.config
        indices = sampler.batch_at(0, 0)
        batch = self.collate_fn(SeededFetch(self.dataset).__getitems__(indices))
        model = runner.model
        analytic, _ = analytic_for(
            model, batch, precision=precision.name, optimizer=optimizer, device_type=device.type
        )

        was, was_chunked = state.activation_checkpointing, state.chunked_loss

        def passes(chunk: int | None):
            def run(size: int, checkpointing: bool) -> None:
                if checkpointing != state.activation_checkpointing:
                    runner.set_activation_checkpointing(checkpointing)
                if chunk != state.chunked_loss:
                    runner.set_chunked_loss(chunk)
                runner.trial_pass(batch, size)

            return run

        # The chunked loss is a candidate when the loss has a chunked mode for this model and
        # the caller did not choose chunking already.
        offer_chunked = was_chunked is None and runner.can_chunk_loss
        rng = get_rng_state()
        buffers = [b.detach().clone() for b in model.buffers()]
        try:
            chosen = plan(
                passes(was_chunked),
                device,
                effective_batch_size=cfg.effective_batch_size,
                checkpointing=cfg.activation_checkpointing,
                can_checkpoint=runner.can_checkpoint,
                chunked_run=passes(DEFAULT_CHUNK_TOKENS) if offer_chunked else None,
                margin=None if cfg.plan_margin == "auto" else cfg.plan_margin,
                policy=cfg.micro_batch_sizes,
                cap=state.micro_batch_size,
                analytic=analytic,
                pending=first_step_bytes(optimizer),
            )
        finally:
            set_rng_state(rng)
            with torch.no_grad():
                for buffer, saved in zip(model.buffers(), buffers, strict=True):
                    buffer.copy_(saved)
            if state.activation_checkpointing != was:
                runner.set_activation_checkpointing(was)
            if state.chunked_loss != was_chunked:
                runner.set_chunked_loss(was_chunked)
        state.micro_batch_size = chosen.micro_batch_size
        if chosen.checkpointing and not state.activation_checkpointing:
            runner.set_activation_checkpointing(True)
        if chosen.chunked_loss and state.chunked_loss is None:
            runner.set_chunked_loss(DEFAULT_CHUNK_TOKENS)
        estimate = chosen.estimate_event()
        return [("plan", chosen.to_event())] + ([("estimate", estimate)] if estimate else [])

    def _probe_next_loss(self, runner, sampler, state: TrainState) -> float | None:
        """The loss the next step will report, computed now without changing anything, so that a
        resume from this checkpoint can prove it restored everything (see ContinuityCheck)."""
        if state.step >= state.max_steps:
            return None
        epoch, position = state.epoch, state.batch_in_epoch
        if position >= state.steps_per_epoch:
            epoch, position = epoch + 1, 0
        indices = sampler.batch_at(epoch, position)
        batch = self.collate_fn(SeededFetch(self.dataset).__getitems__(indices))
        rng = get_rng_state()
        try:
            return runner.evaluate(batch)
        finally:
            set_rng_state(rng)

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


def _micro_cap_from_supervisor() -> int | None:
    """`steadytrain run` sets this after an OS kill, to start the restarted run smaller."""
    value = os.environ.get(ENV_MAX_MICRO_BATCH)
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise BadInputError(f"{ENV_MAX_MICRO_BATCH}: {value!r} is not a whole number") from None


def _field(difference: str) -> str:
    return difference.split(":", 1)[0]


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
