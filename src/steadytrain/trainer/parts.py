"""The parts of one `fit()`, built in one go before a checkpoint is looked for: this rank's device
and precision, the model placed (replicated or sharded), the optimizer and scheduler, the
sampler, the fresh training state, the memory savers and the step runner."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain.checkpoint.state import STATE_FILE
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.config import TrainConfig, fsdp_offload_problem, offload_problem
from steadytrain.device import Device, resolve_device, seed_everything
from steadytrain.engine import OptimizerBatchSampler, Precision, StepRunner, resolve_precision
from steadytrain.engine.batching import batch_len
from steadytrain.engine.compiling import compile_wanted
from steadytrain.engine.distributed import Group
from steadytrain.engine.evaluation import takes_metric
from steadytrain.engine.sharding import choose, shard
from steadytrain.engine.side_pass import side_pass
from steadytrain.errors import CheckpointError, ConfigError
from steadytrain.events import Control, Dispatcher, TrainState
from steadytrain.memory.analytic import (
    OffloadChoice,
    Sharding,
    analytic_for,
    fsdp_offload_choice,
    unknown_model,
)
from steadytrain.memory.choice import Mode
from steadytrain.memory.savers import MemorySavers
from steadytrain.run import env as run_env
from steadytrain.trainer.data import batch_at, check_order_fits, make_sampler
from steadytrain.trainer.evaluation import check_evaluation
from steadytrain.trainer.notes import warn_if_batch_dependent
from steadytrain.trainer.optimizers import build_optimizer, make_scheduler
from steadytrain.trainer.program import Program


@dataclass(frozen=True)
class RunParts:
    """The parts of one `fit()` (`build_parts`), handed to the components that use them."""

    device: Device
    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: OptimizerBatchSampler
    state: TrainState
    savers: MemorySavers
    runner: StepRunner
    emit: Dispatcher
    group: Group
    distributed: dict[str, Any]
    """The mode the `distributed` field chose (engine/sharding.py), for fit_start."""


def build_parts(cfg: TrainConfig, program: Program, group: Group) -> RunParts:
    """Device, precision, model, optimizer, scheduler, sampler, the fresh state, the memory
    savers and the step runner: everything before a checkpoint is looked for."""
    device = _resolve_device(cfg, group)
    group = group.on(device.torch_device)
    precision = resolve_precision(cfg.precision, device)
    if cfg.seed is not None:  # null: the RNG streams as the program left them
        seed_everything(cfg.seed + group.rank)  # each rank its own dropout masks
    model = program.model.to(device.torch_device)
    sampler = make_sampler(program.data, cfg)
    group, distributed = _place(cfg, model, group, device, _Estimating(program, precision, sampler))
    model.train()
    optimizer = build_optimizer(program.optimizer, model)
    scheduler = make_scheduler(program.scheduler, optimizer)
    check_evaluation(cfg, scheduler, program.eval_data, program.eval_fn)
    check_order_fits(program.data, sampler, device.budget, cfg.max_steps)
    group.check_batches(sampler)
    warn_if_batch_dependent(model, cfg)
    state = TrainState(
        steps_per_epoch=sampler.steps_per_epoch,
        max_steps=cfg.max_steps or cfg.epochs * sampler.steps_per_epoch,
        effective_batch_size=cfg.effective_batch_size,
        micro_batch_size=(
            cfg.effective_batch_size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
        ),
        fsdp_offload=bool(distributed.get("offload")),
    )
    savers = MemorySavers(
        model,
        program.loss_fn,
        state,
        cfg.activation_checkpointing,
        device.discrete_memory,
        tiled_mlp=cfg.tiled_mlp,
    )
    emit = Dispatcher([], state, Control())
    runner = StepRunner(
        model=model,
        optimizer=optimizer,
        loss_fn=program.loss_fn,
        device=device,
        precision=precision,
        state=state,
        emit=emit,
        scheduler=None if takes_metric(scheduler) else scheduler,  # evaluation steps it
        max_grad_norm=cfg.max_grad_norm,
        savers=savers,
        user_state=program.user_state,
        group=group,
    )
    return RunParts(
        device=device,
        precision=precision,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        state=state,
        savers=savers,
        runner=runner,
        emit=emit,
        group=group,
        distributed=distributed,
    )


def _resolve_device(cfg: TrainConfig, group: Group) -> Device:
    """This rank's device, refusing what the config asks that it cannot do: offloaded
    checkpointing where host memory is the device's memory."""
    device = resolve_device(group.device_name(cfg.device), cfg.budget_bytes_or_fraction())
    if cfg.activation_checkpointing == "offload" and not device.discrete_memory:
        raise ConfigError([offload_problem(device.type)])
    if cfg.fsdp_offload and not device.discrete_memory:
        raise ConfigError([fsdp_offload_problem(device.type)])
    return device


def _place(
    cfg: TrainConfig,
    model: torch.nn.Module,
    group: Group,
    device: Device,
    estimating: _Estimating,
) -> tuple[Group, dict[str, Any]]:
    """Every rank starts from rank 0's model; then it is replicated or sharded (the
    `distributed` field, engine/sharding.py), before the optimizer takes its parameters;
    sharded with the shards in host memory where the config's `fsdp_offload` or the
    supervisor (ENV_FSDP_OFFLOAD, on a device with memory of its own) asks, where the
    checkpoint a rerun resumes from was made so, or where the per-rank estimate says nothing
    fits without it (`_offload_by_estimate`). Returns the group (sharded or not) and the mode
    chosen."""
    group.broadcast_module(model)
    distributed = choose(cfg.distributed, model, group, device.budget)
    asked = run_env.fsdp_offload() and device.discrete_memory and not cfg.fsdp_offload
    if distributed["mode"] != "fsdp":
        if cfg.fsdp_offload:  # distributed auto chose to replicate, or one process
            distributed["reason"] += "; fsdp_offload: nothing offloaded, the run does not shard"
        return group, distributed
    kept = chosen = None
    if device.discrete_memory and not (cfg.fsdp_offload or asked):
        # a rerun shards as its checkpoint's run did; rank 0 holds the checkpoints
        kept = group.broadcast_object(_kept_offload(cfg) if group.is_main else None)
        if kept is None and cfg.micro_batch_size == "auto":
            own = _offload_by_estimate(cfg, model, group, device, estimating)
            chosen = _agreed_offload(group, own)
    offload = cfg.fsdp_offload or asked or bool(kept) or bool(chosen and chosen.on)
    distributed |= shard(model, group, offload=offload)
    if asked:
        distributed["reason"] += (
            f"; the shards in host memory: {run_env.ENV_FSDP_OFFLOAD}=1 (supervisor: a rank "
            "ran out of memory at micro-batch 1 with every memory saver in force)"
        )
    if kept:
        distributed["reason"] += (
            "; the shards in host memory as the run that saved the checkpoint had them "
            "(its trainer state's fsdp_offload)"
        )
    if chosen is not None:
        distributed["offload_choice"] = chosen.to_dict()
        distributed["offload_reason"] = chosen.reason()
        if chosen.on:
            distributed["reason"] += "; " + chosen.reason()
    return dataclasses.replace(group, sharded=True), distributed


@dataclass(frozen=True)
class _Estimating:
    """What the per-rank estimate reads before the model is sharded: the program (its data,
    loss and optimizer), the run's precision and its sampler."""

    program: Program
    precision: Precision
    sampler: OptimizerBatchSampler


def _agreed_offload(group: Group, own: OffloadChoice | None) -> OffloadChoice | None:
    """One choice for every rank (FSDP2 shards every rank alike): each rank priced its own
    share of the batch (its padding may differ); the group takes the largest figures against
    the smallest budget, and none where any rank could not price the run."""
    if not group.active:
        return own
    known = own is not None
    on_device, on_host, unknown, least = group.largest(
        [
            own.on_device if known else 0.0,
            own.on_host if known else 0.0,
            0.0 if known else 1.0,
            -own.budget if known else 0.0,
        ]
    )
    if unknown or own is None:
        return None
    return OffloadChoice.of(on_device, on_host, -least, own.mode)


def _kept_offload(cfg: TrainConfig) -> bool | None:
    """`fsdp_offload` as the newest checkpoint of this run directory kept it (its trainer
    state), None where there is none (a fresh start) or it cannot be read: the resume, later,
    verifies it and says why."""
    try:
        committed = CheckpointStore(Path(cfg.run_dir)).committed()
        if not committed:
            return None
        doc = json.loads((committed[-1][1] / STATE_FILE).read_text())
    except (CheckpointError, OSError, ValueError):
        return None
    state = doc.get("state") if isinstance(doc, dict) else None
    return bool(state.get("fsdp_offload")) if isinstance(state, dict) else None


def _offload_by_estimate(
    cfg: TrainConfig, model: torch.nn.Module, group: Group, device: Device, e: _Estimating
) -> OffloadChoice | None:
    """`fsdp_offload` from the per-rank estimate (`memory.analytic.fsdp_offload_choice`), for
    `micro_batch_size: auto` on a device with memory of its own: decided here because FSDP2
    takes its offload policy when it shards, before the optimizer is built and before any pass
    can run. Priced as the plan will price it: this rank's share of the first optimizer batch
    (drawn ahead, the random streams put back), the optimizer the program builds (a factory
    is called once on the unsharded parameters and the result dropped), one sample with every
    saver the plan may turn on. None where the estimate cannot price the run."""
    program = e.program
    if unknown_model(model) is not None:  # before drawing a batch or building an optimizer
        return None
    with side_pass(rng=True):
        batch = batch_at(program.data, e.sampler, 0, 0, group, ahead=True)
    if batch is None:  # a DataLoader whose sampler cannot be copied: not drawn ahead
        return None
    optimizer = program.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        try:
            optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        except Exception:  # noqa: BLE001 - the real build after sharding raises it, named
            return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    savers = MemorySavers(
        model, program.loss_fn, None, cfg.activation_checkpointing, device.discrete_memory
    )
    chunked = getattr(program.loss_fn, "chunked_method", None)
    method = chunked(model, device.torch_device) if callable(chunked) else None
    analytic, _ = analytic_for(
        model,
        batch,
        precision=e.precision.name,
        optimizer=optimizer,
        device_type=device.type,
        compiled=compile_wanted(cfg.compile, device.type),
        fused_loss=method == "fused",
        sharding=Sharding(group.world_size, batch_len(batch)),
    )
    most = Mode(
        checkpointing=savers.can_checkpoint or cfg.activation_checkpointing is True,
        offload=savers.can_offload,
        chunked_loss=savers.can_chunk_loss,
        tiled_mlp=cfg.tiled_mlp not in (False, "auto"),  # the plan tiles only where asked
    )
    return fsdp_offload_choice(analytic, most, device.budget, device.discrete_memory)
