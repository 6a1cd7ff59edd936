"""steadytrain for Lightning: one line, ``Trainer(..., callbacks=[SteadytrainCallback()])``.

Works with ``lightning`` and ``pytorch_lightning`` (the callback takes the base class of whichever
is installed, ``lightning`` first). What it does to the trainer:

* ``fit()`` resumes by itself from the newest checkpoint under ``default_root_dir`` whose manifest
  verifies (a ``ckpt_path`` given by the user wins): every ``.ckpt`` Lightning writes gets the
  sidecar manifest after the write returns, through the trainer's own `CheckpointIO`, and one
  without it (a kill mid-save) is skipped. The callback's state in each checkpoint carries every
  RNG stream, so a resumed run draws what the uninterrupted one drew.
* SIGINT / SIGTERM: at the end of the batch, a checkpoint through ``trainer.save_checkpoint``, then
  ``fit`` is left at once (as Lightning leaves it on its own SIGTERM: no epoch-end hooks, so no
  epoch-end checkpoint of an epoch that did not end) and the process exits 130 / 143.
* Mid-epoch resume: the training DataLoader is made one Lightning resumes in the middle of an
  epoch (`_ResumableLoader`), so a run resumed from a checkpoint of the middle of an epoch draws
  that epoch's order again and trains on the batches it had not reached, as the uninterrupted run.
* Out of memory: exit 76 after recording it; `steadytrain run` restarts with
  ``STEADYTRAIN_MAX_MICRO_BATCH`` at half the batch, and the callback then serves the same samples
  in that many per batch, raising ``accumulate_grad_batches`` to match, so every optimizer step
  still sees the batch asked for. Lightning cannot change the batch of a running fit.
* The watchdog (exit 75), memory watch and run files of `RunGuard`, in ``default_root_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from steadytrain.checkpoint.manifest import (
    newest_verified,
    read_library_manifest,
    remove_library_manifest,
    write_library_manifest,
)
from steadytrain.device import get_rng_state, is_oom, set_rng_state
from steadytrain.integrations.core import Options, capped_micro, restart_smaller
from steadytrain.integrations.guard import RunGuard, library_frame, module_sizes
from steadytrain.run import files as run_files
from steadytrain.safety.signals import stop_exit

try:
    from lightning.pytorch import Callback as _Base
except ImportError:
    try:
        from pytorch_lightning import Callback as _Base
    except ImportError:  # neither installed: importable, unusable
        _Base = object

LIBRARY_MODULES = ("lightning", "pytorch_lightning")


class SteadytrainCallback(_Base):
    """Pass to ``Trainer(..., callbacks=[SteadytrainCallback()])``; `hang_timeout`,
    `hang_action`, `memory_watch`, `memory_budget` as in `RunGuard`."""

    def __init__(
        self,
        hang_timeout: float | str = Options.hang_timeout,
        hang_action: str = Options.hang_action,
        memory_watch: bool = Options.memory_watch,
        auto_resume: bool = Options.auto_resume,
        memory_budget: str | float = Options.memory_budget,
    ):
        if _Base is object:
            raise ImportError("SteadytrainCallback for Lightning needs lightning installed")
        self.options = Options(hang_timeout, hang_action, memory_watch, memory_budget, auto_resume)
        self.guard: RunGuard | None = None
        self.asked_micro = self.micro = 0
        self.asked_accumulation = 1
        self._step_loss: Any = None

    # -- before the fit: resume, checkpoint manifests, the batch ----------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.guard is not None:
            return
        run_dir = Path(trainer.default_root_dir)
        self.guard = RunGuard(
            run_dir, **self.options.watch(), device=trainer.strategy.root_device.type
        )
        connector = trainer._checkpoint_connector
        resume_start = connector.resume_start

        def resume_from_verified(checkpoint_path=None, *args, **kwargs):
            if checkpoint_path is None and self.options.auto_resume:
                found = newest_verified(_checkpoints(run_dir), self.guard.record)
                if found is not None:
                    checkpoint_path = str(found[1])
                    # the global step of the save, which its manifest was written for
                    self.guard.record("resume", {"checkpoint": checkpoint_path, "step": found[0]})
            return resume_start(checkpoint_path, *args, **kwargs)

        connector.resume_start = resume_from_verified
        io = trainer.strategy.checkpoint_io
        save, remove = io.save_checkpoint, io.remove_checkpoint

        def save_with_manifest(checkpoint, path, *args, **kwargs):
            save(checkpoint, path, *args, **kwargs)
            if Path(path).is_file():
                step = int(checkpoint.get("global_step", trainer.global_step))
                write_library_manifest(Path(path), step, {"epoch": checkpoint.get("epoch")})
                self.guard.record("checkpoint", {"step": step, "checkpoint": str(path)})

        def remove_with_manifest(path, *args, **kwargs):
            remove(path, *args, **kwargs)
            remove_library_manifest(Path(path))

        io.save_checkpoint, io.remove_checkpoint = save_with_manifest, remove_with_manifest
        self.asked_accumulation = trainer.accumulate_grad_batches
        source = trainer.fit_loop._data_source
        request = source.dataloader
        source.dataloader = lambda: _resumable(self._rebatch(trainer, request()))

    def _rebatch(self, trainer, loader):
        """Serve the same samples `core.max_micro_batch()` at a time (at most), with the
        accumulation raised so the optimizer still sees the batch asked for."""
        size = getattr(loader, "batch_size", None)
        if not isinstance(loader, DataLoader) or size is None:
            return loader  # a batch sampler or iterable of the user's: left as it is
        self.asked_micro = size
        effective = size * self.asked_accumulation
        self.micro = capped_micro(size)
        if self.micro == size:
            return loader
        trainer.accumulate_grad_batches = effective // self.micro
        self.guard.record(
            "micro_batch_cap",
            {
                "old": size,
                "new": self.micro,
                "accumulation": trainer.accumulate_grad_batches,
                "reason": "STEADYTRAIN_MAX_MICRO_BATCH (supervisor)",
            },
        )
        return DataLoader(
            loader.dataset,
            batch_size=self.micro,
            sampler=loader.sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )

    # -- the fit -----------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        combined = trainer.fit_loop._combined_loader
        for loader in combined.flattened if combined is not None else ():
            if isinstance(loader, _ResumableLoader):  # an epoch may be cut short by a limit
                loader.epoch_batches = trainer.num_training_batches
        guard = self.guard
        guard.state.step = trainer.global_step
        planned = trainer.estimated_stepping_batches
        guard.state.max_steps = int(planned) if planned != float("inf") else 0
        guard.state.micro_batch_size = self.micro or self.asked_micro
        config = {"library": "lightning", "trainer": _trainer_config(trainer)}
        frame = library_frame(LIBRARY_MODULES, ("fit",))
        guard.start(config, fit_frame=frame, micro_batch_size=guard.state.micro_batch_size)
        micro, accumulation = guard.state.micro_batch_size, trainer.accumulate_grad_batches
        guard.preflight(
            *module_sizes(pl_module),
            optimizer=type(trainer.optimizers[0]).__name__ if trainer.optimizers else "none",
            batch=f"micro-batch {micro} × {accumulation} = effective batch {micro * accumulation}",
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.guard.state.epoch = trainer.current_epoch  # a resumed run's first row included
        if self._step_loss is None:
            self.guard.start_step()
            self._step_loss = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        guard = self.guard
        guard.beat()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._step_loss += float(loss.detach())
        if trainer.global_step == guard.state.step:
            return  # accumulating: the optimizer step is not over
        accumulation = trainer.accumulate_grad_batches
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        guard.end_step(
            trainer.global_step,
            loss=self._step_loss,  # Lightning hands each batch's loss already divided
            lr=optimizer.param_groups[0]["lr"] if optimizer is not None else None,
            micro_batch_size=self.micro or self.asked_micro,
            accumulation=accumulation,
            samples=(self.micro or self.asked_micro) * accumulation,
        )
        self._step_loss = None
        if guard.stop_requested:
            path = Path(trainer.default_root_dir) / run_files.CHECKPOINTS / "on-signal.ckpt"
            with guard.allowance("checkpoint save"):
                trainer.save_checkpoint(path)
            # Leave the fit now, as Lightning's own SIGTERM does: `should_stop` would end the
            # epoch, running its epoch-end hooks (an epoch-interval scheduler's step) and
            # ModelCheckpoint's save, whose checkpoint resumes after an epoch never finished.
            code = guard.exit_code
            guard.finish(guard.control.stop_reason or "stopped", code)
            raise stop_exit(code)

    def on_validation_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        if self.guard is not None:
            self.guard.beat()  # each validation batch is progress, not a hang

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.guard.end_epoch(trainer.current_epoch)

    def on_fit_end(self, trainer, pl_module) -> None:
        guard = self.guard
        code = guard.exit_code
        guard.finish(guard.control.stop_reason or "finished", code)
        if code:
            raise stop_exit(code)  # steadytrain.Stopped for 130 / 143

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        guard = self.guard
        if guard is None or not guard.started:
            return  # not started, or a stop already finished where it was raised
        if is_oom(exception):
            guard.out_of_memory(exception)
            restart_smaller(guard, exception)  # exit 76: Lightning cannot change a fit's batch
        first = (str(exception).strip().splitlines() or [""])[0]
        guard.finish(f"{type(exception).__name__}: {first}", 1)

    # -- what the callback keeps in each checkpoint ------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        rng = get_rng_state()
        name, keys, *rest = rng["numpy"]
        return {"rng": {**rng, "numpy": (name, keys.tolist(), *rest)}}  # loads weights_only

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        if rng is not None:
            name, keys, *rest = rng["numpy"]
            set_rng_state({**rng, "numpy": (name, np.asarray(keys, dtype=np.uint32), *rest)})


def _resumable(loader):
    """`loader` made a `_ResumableLoader` in place (its class, whichever DataLoader subclass it
    is, gets the resume added), when it is a DataLoader with a sampler. Left as it is: a loader
    of an IterableDataset (no order to draw again) and one Lightning can resume already (its own
    ``state_dict``, torchdata's `StatefulDataLoader`)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    cls = type(loader)
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return loader  # ours already, or the user's own
    if cls is DataLoader:
        loader.__class__ = _ResumableLoader
    else:
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Resumable{cls.__name__}", (_ResumableLoader, cls), {})
        loader.__class__ = _SUBCLASSES[cls]
    return loader


class _ResumableLoader(DataLoader):
    """A DataLoader Lightning resumes mid-epoch: it has Lightning's ``state_dict`` /
    ``load_state_dict`` interface of a loader, whose state Lightning keeps in each checkpoint's
    fit-loop state and loads before the loader's next iterator is made.

    A shuffling loader draws each epoch's order from torch's random generators when the epoch
    starts; a plain DataLoader restarted mid-epoch draws a new order from its first batch, so
    the resumed epoch trains on other batches than the uninterrupted one (Lightning warns so).
    The state keeps the generators' states each epoch's order was drawn from and the batches
    handed out of it; a loaded state makes the next iterator draw the same order from them,
    skip the batches already trained on (as indices, none loaded), and put the generators back
    where the checkpoint left them, so what follows draws what the uninterrupted run drew.
    Samplers whose order comes from elsewhere (numpy, a seed and `set_epoch`) still skip the
    right number of batches."""

    _served = 0  # batches handed out of the epoch in progress
    epoch_batches: float | None = None  # an epoch's batches (`limit_train_batches`); else all
    _iter_rng: list | None = None  # the generators' states when the epoch's iterator was made
    _order_rng: list | None = None  # ... when its sampler began drawing the order
    _resume: dict | None = None  # a loaded state, for the next iterator
    _skip: dict | None = None  # the same, while that iterator is being made

    def state_dict(self) -> dict[str, Any]:
        over = self._served >= min(len(self), self.epoch_batches or float("inf"))
        batches = 0 if over else self._served  # 0: the next epoch draws a new order
        return {"batches": batches, "iter_rng": self._iter_rng, "order_rng": self._order_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("batches") and state.get("order_rng") is not None:
            self._resume = state  # an epoch to go on with, at its next batch

    def __iter__(self):
        resume, self._resume = self._resume, None
        now = _rng_states(self)
        if resume is not None and resume.get("iter_rng") is not None:
            _set_rng_states(self, resume["iter_rng"])  # the workers' base seed drawn again
        self._iter_rng = _rng_states(self)
        self._skip = resume
        try:
            iterator = super().__iter__()
        finally:
            self._skip = None
        if resume is None:
            self._served = 0
        else:
            _set_rng_states(self, now)  # the draws of the replayed start undone
            self._served = resume["batches"]
        return _Counted(self, iterator)

    @property
    def _index_sampler(self):
        return _Order(self, super()._index_sampler, self._skip)


_SUBCLASSES: dict[type, type] = {}


class _Order:
    """A loader's index sampler (its batch sampler) that notes the generators' states its order
    is drawn from and, resuming, draws it from the saved ones and skips the batches done."""

    def __init__(self, loader, sampler, resume: dict | None):
        self.loader, self.sampler, self.resume = loader, sampler, resume

    def __len__(self) -> int:
        return len(self.sampler)  # the whole epoch: Lightning counts the batches done itself

    def __iter__(self):
        loader, resume = self.loader, self.resume
        self.resume = None  # once: a persistent workers' iterator iterates this again each epoch
        now = _rng_states(loader)
        if resume is not None:
            _set_rng_states(loader, resume["order_rng"])
        loader._order_rng = _rng_states(loader)
        indices = iter(self.sampler)
        if resume is not None:
            for _ in range(resume["batches"]):
                next(indices, None)
            _set_rng_states(loader, now)
        yield from indices


class _Counted:
    """A loader's iterator that counts the batches it hands out."""

    def __init__(self, loader, iterator):
        self.loader, self.iterator = loader, iterator

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        self.loader._served += 1
        return batch

    def __len__(self) -> int:
        return len(self.iterator)


def _generators(loader) -> list:
    """The torch generators a loader's order and workers' seeds may be drawn from."""
    found = [torch.default_generator, loader.generator, getattr(loader.sampler, "generator", None)]
    batch_sampler = loader.batch_sampler
    found.append(getattr(getattr(batch_sampler, "sampler", None), "generator", None))
    unique = []
    for generator in found:
        if isinstance(generator, torch.Generator) and all(generator is not g for g in unique):
            unique.append(generator)
    return unique


def _rng_states(loader) -> list:
    return [generator.get_state() for generator in _generators(loader)]


def _set_rng_states(loader, states: list) -> None:
    for generator, state in zip(_generators(loader), states, strict=False):
        generator.set_state(state)


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in run_dir.rglob("*.ckpt"):
        manifest = read_library_manifest(path)
        step = manifest.get("step") if manifest else None
        found.append((step if isinstance(step, int) else -1, path))
    return found


def _trainer_config(trainer) -> dict[str, Any]:
    names = (
        "max_epochs",
        "max_steps",
        "accumulate_grad_batches",
        "gradient_clip_val",
        "precision",
        "default_root_dir",
    )
    config = {name: getattr(trainer, name, None) for name in names}
    config["precision"] = str(getattr(trainer.precision_plugin, "precision", None))
    return config
