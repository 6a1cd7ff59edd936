"""The parts of one `fit()`, built in one go before a checkpoint is looked for: this rank's device
and precision, the model placed (replicated or sharded), the optimizer and scheduler, the
sampler, the fresh training state, the memory savers and the step runner."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from steadytrain.config import TrainConfig, fsdp_offload_problem, offload_problem
from steadytrain.device import Device, resolve_device, seed_everything
from steadytrain.engine import OptimizerBatchSampler, Precision, StepRunner, resolve_precision
from steadytrain.engine.distributed import Group
from steadytrain.engine.evaluation import takes_metric
from steadytrain.engine.sharding import choose, shard
from steadytrain.errors import ConfigError
from steadytrain.events import Control, Dispatcher, TrainState
from steadytrain.memory.savers import MemorySavers
from steadytrain.run import env as run_env
from steadytrain.trainer.data import check_order_fits, make_sampler
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
    group, distributed = _place(cfg, model, group, device)
    model.train()
    optimizer = build_optimizer(program.optimizer, model)
    scheduler = make_scheduler(program.scheduler, optimizer)
    check_evaluation(cfg, scheduler, program.eval_data, program.eval_fn)
    sampler = make_sampler(program.data, cfg)
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
    cfg: TrainConfig, model: torch.nn.Module, group: Group, device: Device
) -> tuple[Group, dict[str, Any]]:
    """Every rank starts from rank 0's model; then it is replicated or sharded (the
    `distributed` field, engine/sharding.py), before the optimizer takes its parameters;
    sharded with the shards in host memory where the config's `fsdp_offload` or the
    supervisor (ENV_FSDP_OFFLOAD, on a device with memory of its own) asks.
    Returns the group (sharded or not) and the mode chosen."""
    group.broadcast_module(model)
    distributed = choose(cfg.distributed, model, group, device.budget)
    asked = run_env.fsdp_offload() and device.discrete_memory and not cfg.fsdp_offload
    if distributed["mode"] != "fsdp":
        if cfg.fsdp_offload:  # distributed auto chose to replicate, or one process
            distributed["reason"] += "; fsdp_offload: nothing offloaded, the run does not shard"
        return group, distributed
    distributed |= shard(model, group, offload=cfg.fsdp_offload or asked)
    if asked:
        distributed["reason"] += (
            f"; the shards in host memory: {run_env.ENV_FSDP_OFFLOAD}=1 (supervisor: a rank "
            "ran out of memory at micro-batch 1 with every memory saver in force)"
        )
    return dataclasses.replace(group, sharded=True), distributed
