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

from steadytrain.config import TrainConfig
from steadytrain.device import resolve_device, seed_everything
from steadytrain.engine import Loop, OptimizerBatchSampler, StepRunner, resolve_precision
from steadytrain.errors import BadInputError, SteadytrainError
from steadytrain.events import Callback, Control, Dispatcher, TrainState
from steadytrain.telemetry.console import ConsoleLog
from steadytrain.telemetry.files import RunFiles

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
    grad). `train_data` is a map-style dataset or a DataLoader over one (its dataset, collate_fn
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
        cfg = self.config
        device = resolve_device(cfg.device, cfg.budget_bytes_or_fraction())
        precision = resolve_precision(cfg.precision, device)
        seed_everything(cfg.seed)
        model = self.model.to(device.torch_device)
        model.train()
        optimizer = self._build_optimizer(model)

        sampler = OptimizerBatchSampler(
            len(self.dataset), cfg.effective_batch_size, cfg.seed, cfg.shuffle, cfg.drop_last
        )
        if sampler.steps_per_epoch == 0:
            raise BadInputError(
                f"train_data: {len(self.dataset)} sample(s), fewer than one optimizer batch of "
                f"effective_batch_size {cfg.effective_batch_size}; lower effective_batch_size "
                "or set drop_last: false"
            )
        micro = cfg.effective_batch_size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
        _warn_if_batch_dependent(model, cfg)
        state = TrainState(
            steps_per_epoch=sampler.steps_per_epoch,
            max_steps=cfg.max_steps or cfg.epochs * sampler.steps_per_epoch,
            effective_batch_size=cfg.effective_batch_size,
            micro_batch_size=micro,
        )
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.dump(run_dir / "config.json")

        callbacks = [RunFiles(run_dir), ConsoleLog(cfg.log_every_steps), *self.user_callbacks]
        emit = Dispatcher(callbacks, state, Control())
        runner = StepRunner(
            model=model,
            optimizer=optimizer,
            loss_fn=self.loss_fn,
            device=device,
            precision=precision,
            state=state,
            emit=emit,
            scheduler=self.scheduler,
            max_grad_norm=cfg.max_grad_norm,
            checkpointing=cfg.activation_checkpointing,
        )
        loop = Loop(
            runner=runner,
            emit=emit,
            batches=lambda epoch, start: self._batches(sampler, epoch, start, device),
            fit_info={
                "device": str(device.torch_device),
                "precision": precision.name,
                "budget": device.budget,
                "micro_batch_size": micro,
                "config": cfg.model_dump(mode="json"),
            },
        )
        reason, code = loop.run()
        return FitResult(
            steps=state.step,
            final_loss=state.last_loss,
            micro_batch_size=state.micro_batch_size,
            reason=reason,
            exit_code=code,
            run_dir=str(run_dir),
            oom_count=state.oom_count,
        )

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
            self.dataset,
            batch_sampler=sampler,
            collate_fn=self.collate_fn,
            num_workers=self.workers,
            worker_init_fn=self.worker_init_fn,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(self.config.seed * 7919 + epoch),
        )


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
