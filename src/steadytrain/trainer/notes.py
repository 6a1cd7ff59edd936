"""What a run says at its start, before its first step: the notes (dropout masks drawn per
micro-batch, a memory budget below what the process holds, the data fingerprint's), the
`arithmetic` line that lists every setting that changes the arithmetic of training, and the
warning for a model whose forward depends on the batch."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from steadytrain._units import format_bytes
from steadytrain.config import TrainConfig
from steadytrain.device import Device
from steadytrain.engine import OptimizerBatchSampler
from steadytrain.events import TrainState
from steadytrain.run.records import Record
from steadytrain.trainer.data import DataSource

if TYPE_CHECKING:  # the parts are built with this module's warning
    from steadytrain.trainer.parts import RunParts


def start_events(
    cfg: TrainConfig, source: DataSource, parts: RunParts, notes: list[str]
) -> list[tuple[str, dict]]:
    """The `note` events (`notes` given, then dropout's and the budget's) and the `arithmetic`
    event, recorded at the run's start."""
    notes = [*notes, dropout_note(parts.model, cfg), budget_note(parts.device)]
    events = [(Record.NOTE, {"message": n}) for n in notes if n is not None]
    arithmetic = arithmetic_event(
        cfg, source, parts.sampler, parts.state, parts.precision.name, parts.group.world_size
    )
    return [*events, (Record.ARITHMETIC, arithmetic)]


def budget_note(device: Device) -> str | None:
    """A note, at the start, where `memory_budget` was given as a size below what this process
    already holds with the model in place (on CPU its resident memory: the interpreter and torch
    alone are hundreds of MiB; elsewhere the device's allocated memory): no micro-batch or
    memory saver brings the run under it. A note, not a refusal: the fine-tune refuses a budget
    its estimate does not fit before loading anything, and a process that holds more than a
    fresh one (a notebook's data) would otherwise be refused where its dry-run said it fits. A
    fraction of usable memory is left to the plan."""
    budget = device.budget
    if not isinstance(device.budget_spec, int) or budget is None:
        return None
    reading = device.memory()
    held = reading.rss if device.type == "cpu" else reading.allocated
    if held is None or held <= budget:
        return None
    what = "resident memory" if device.type == "cpu" else f"memory allocated on {device.type}"
    return (
        f"memory_budget: {format_bytes(budget)} is less than this process already holds with "
        f"the model in place ({format_bytes(held)} of {what}): the run cannot keep within it "
        "and trains over it. Give a memory_budget above that (steadytrain estimate shows what "
        "training adds), or leave it out (auto: 0.9 of usable memory)"
    )


def arithmetic_event(
    cfg: TrainConfig,
    source: DataSource,
    sampler: OptimizerBatchSampler,
    state: TrainState,
    precision: str,
    world_size: int = 1,
) -> dict[str, Any]:
    """Every setting that changes the arithmetic of training, as one event with one sentence;
    under torchrun each of the `world_size` ranks accumulates its share of the batch."""
    micro, batch = state.micro_batch_size, state.effective_batch_size
    dropped = sampler.num_samples % batch if sampler.drop_last else 0
    if source.loader is not None:
        order = f"the DataLoader's {type(source.loader.sampler).__name__}"
    else:
        order = f"shuffled each epoch (seed {cfg.seed or 0})" if cfg.shuffle else "in order"
    clipping = "off" if cfg.max_grad_norm is None else f"at gradient norm {cfg.max_grad_norm}"
    share = -(-batch // world_size)  # the largest rank's share
    accumulation = f"micro-batch {micro} × {-(-share // micro)} accumulated to {batch}"
    if world_size > 1:
        accumulation = (
            f"micro-batch {micro} × {-(-share // micro)} accumulated on each of {world_size} "
            f"ranks to {batch} (a share of {share} per rank)"
        )
    seeding = (
        "RNG streams as the program left them"
        if cfg.seed is None
        else f"RNG streams reseeded from seed {cfg.seed}"
    )
    parts = [
        f"clipping {clipping}",
        f"order {order}",
        f"{dropped} sample(s) dropped per epoch",
        f"precision {precision}",
        accumulation,
        seeding,
    ]
    if source.loader is not None and source.loader.batch_size != batch:
        parts.append(
            f"the DataLoader's batch_size {source.loader.batch_size} replaced by "
            f"effective_batch_size {batch}"
        )
    return {
        "clipping": cfg.max_grad_norm,
        "order": order,
        "dropped_per_epoch": dropped,
        "precision": precision,
        "micro_batch_size": micro,
        "effective_batch_size": batch,
        "seed": cfg.seed,
        "message": "; ".join(parts),
    }


def dropout_note(model: torch.nn.Module, cfg: TrainConfig) -> str | None:
    """A note naming the modules that draw random masks per forward (dropout), when the batch
    may be split: masks are drawn per micro-batch, so a run split differently (after a shrink)
    is a different sample of the same training, not the same numbers."""
    if cfg.micro_batch_size == cfg.effective_batch_size:
        return None
    names = [
        name
        for name, module in model.named_modules()
        if (isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0)
        or (isinstance(module, torch.nn.RNNBase) and module.dropout > 0)
    ]
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"dropout in {shown} draws its masks per micro-batch: when the batch is split (or "
        "split again after an out-of-memory) the masks differ from those of the whole batch, "
        "so the losses differ from an unsplit run (their expectation does not)"
    )


class BatchDependentModelWarning(UserWarning):
    """The model's forward depends on the batch, so splitting a batch changes the result."""


def warn_if_batch_dependent(model: torch.nn.Module, cfg: TrainConfig) -> None:
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
