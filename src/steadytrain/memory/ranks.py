"""What each rank holds when several GPUs train one model (torchrun): the estimate per rank.

How the ranks hold the model is a run's `distributed` (engine/sharding.py `choose`):

* **replicate** (`ddp` is the same): every rank holds the whole model, its gradients and its
  optimizer state, as one process does. steadytrain sums each gradient in place after the ranks
  agree (engine/distributed.py), with no bucket of its own: a rank's memory is one process's at
  its micro-batch. (torch's `DistributedDataParallel`, in a script that wraps the model itself,
  adds its buckets: a flat copy of the gradients, or with `gradient_as_bucket_view=True` about
  `DDP_BUCKETS_IN_FLIGHT` buckets of `DDP_BUCKET` in flight; said in a note.)
* **fsdp**: FSDP2's `fully_shard` on each decoder layer, then on the root (the embeddings, the
  final norm, the output layer). Each rank keeps its shard of every parameter, gradient and
  optimizer state: a tensor's first dimension padded to a multiple of the ranks, divided
  (`ParamCounts.shard`). On top, while the forward and backward run (read off torch's
  `_fully_shard/_fsdp_param_group.py` and `_fsdp_collectives.py`):
  - the unsharded copy of the unit running and of the next one, all-gathered ahead of its turn
    (`PREFETCHED_UNITS`), and the root's whole parameters, which the root keeps gathered from its
    forward to the end of the backward (FSDP2 does not reshard the root after forward);
  - in the backward, the unit's unsharded gradient and the reduce-scatter's input, a copy of it
    (`foreach_reduce` copies the gradients in, then frees them; one input is kept in flight),
    and the root's unsharded gradient from the output layer's backward to the end;
  - with more than one micro-batch a step (`accumulation`), whole unsharded gradients of every
    unit: the run turns the gradient sync off but in the last micro-batch
    (`set_requires_gradient_sync(False)`, engine/agreement.py), and FSDP2 keeps each unit's
    gradient unsharded until the backward that reduce-scatters it.
  With `fsdp_offload` (FSDP2's `CPUOffloadPolicy`) the shards of parameters, gradients and
  optimizer state live in pinned host memory and the optimizer steps on the CPU: the device
  holds the gathered copies, the backward's gradients and the activations.

Activations are each rank's own micro-batch, as on one process. Collective libraries' own
buffers (NCCL's, outside torch's allocator) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from steadytrain._units import budget_spec, format_bytes
from steadytrain.memory.model_shape import ParamCounts

ONE, REPLICATE, FSDP = "one process", "replicate", "fsdp"
MODES = {"replicate": REPLICATE, "ddp": REPLICATE, "fsdp": FSDP, "none": ONE}
"""The settings' `distributed` values and the mode each means on several ranks."""

PREFETCHED_UNITS = 2
"""Unsharded decoder layers at a time: the one running and the next, all-gathered ahead
(FSDP2's implicit prefetch in forward and backward)."""
GRADIENT_COPIES = 2
"""A unit's unsharded gradient in its backward: autograd's, and the reduce-scatter's input that
`foreach_reduce` copies it into before freeing it."""
DDP_BUCKET = 25 * 2**20
"""torch DistributedDataParallel's `bucket_cap_mb` default."""
DDP_BUCKETS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Ranks:
    """How the ranks hold the model, and what each rank holds of it (bytes)."""

    world_size: int
    mode: str
    """`ONE`, `REPLICATE` or `FSDP`."""
    why: str
    weights: int
    adapters: int
    grads: int
    states: int
    temporaries: int
    gathered: int = 0
    """fsdp: unsharded parameters during forward and backward (the root and two units)."""
    gathered_formula: str = ""
    grad_buffers: int = 0
    """fsdp: the backward's unsharded gradients (the root's, a unit's and its reduce-scatter
    input)."""
    grad_buffers_formula: str = ""
    held_grads: int = 0
    """fsdp with accumulation: whole unsharded gradients between micro-batches."""
    root_reduce: int = 0
    """fsdp: the end of the backward, the root's gradient and its reduce-scatter input."""
    host: int = 0
    """fsdp_offload: the shards in pinned host memory (not in the device's total)."""
    formulas: dict[str, str] | None = None
    """Row name -> formula of the per-rank model state, where it differs from one process's."""

    @property
    def sharded(self) -> bool:
        return self.mode == FSDP


def mode_of(gpus: int, distributed: str, state_bytes: int, budget: int | None) -> tuple[str, str]:
    """(mode, why) as a run resolves its `distributed` (engine/sharding.py `choose`): one
    process always replicates; auto replicates where parameters, gradients and optimizer state
    (`state_bytes`) fit one rank's `budget` (or no budget is known), and shards otherwise."""
    if gpus <= 1:
        said = "" if distributed in ("auto", "none") else f" (distributed: {distributed} is moot)"
        return ONE, f"one process: nothing to shard{said}"
    if distributed != "auto":
        return MODES[distributed], f"--distributed {distributed}"
    if budget is None or state_bytes <= budget:
        why = "no memory budget" if budget is None else "the whole state fits one rank's budget"
        return REPLICATE, f"distributed auto: {why}"
    return FSDP, (
        f"distributed auto: parameters, gradients and optimizer state "
        f"({format_bytes(state_bytes)}) exceed one rank's budget ({format_bytes(budget)})"
    )


def budget_of(memory_budget: str | None) -> int | None:
    """The per-rank budget a settings' `memory_budget` states as a size; None for a fraction,
    auto or nothing (the caller resolves those against a device)."""
    spec = None if memory_budget is None else budget_spec(memory_budget)
    return spec if isinstance(spec, int) else None


def share_of(
    counts: ParamCounts,
    *,
    gpus: int,
    mode: str,
    why: str,
    weights: int,
    adapters: int,
    grads: int,
    states: int,
    temporaries: int,
    trainable: int,
    trainable_bytes: int,
    weight_bytes: int,
    lora: bool,
    accumulation: int,
    offload: bool,
) -> Ranks:
    """What one of `gpus` ranks holds under `mode`, from one process's model state (bytes of
    `weights`, `adapters`, `grads`, `states`, optimizer `temporaries`)."""
    if mode != FSDP:
        return Ranks(gpus, mode, why, weights, adapters, grads, states, temporaries)
    n = gpus
    root = [i for i in range(len(counts.tensors)) if i not in _in_layers(counts)]
    units = counts.layer_tensors or [[]]
    unit = max(units, key=lambda found: counts.shard(found, n))
    unit_values = n * counts.shard(unit, n)
    root_values = n * counts.shard(root, n)
    layers = max(len(counts.layer_tensors), 1)
    if lora:  # the frozen base is sharded and gathered too; only the adapters train
        share = -(-trainable // n)
        unit_trainable = -(-trainable // layers)
        root_trainable = 0
        shard_weights = -(-weights // n)
    else:
        share = counts.shard(None, n)
        unit_trainable, root_trainable = unit_values, root_values
        shard_weights = weights * share // max(counts.total, 1)
    ratio = share / max(trainable, 1)
    sharded = {
        "weights": shard_weights,
        "adapters": -(-adapters // n),
        "grads": share * trainable_bytes,
        "states": int(states * ratio),
        "temporaries": int(temporaries * ratio),
    }
    units_gathered = min(PREFETCHED_UNITS, layers)
    adapter_unit = unit_trainable * 4 if lora else 0
    gathered = root_values * weight_bytes + units_gathered * (
        unit_values * weight_bytes + adapter_unit
    )
    gathered_formula = (
        f"the root's {root_values:,} params (embeddings, final norm, output layer: gathered "
        f"from its forward to the end of the backward) + {units_gathered} decoder layers of "
        f"{unit_values:,} (the one running and the next, prefetched) × {weight_bytes} B"
    )
    held = trainable * trainable_bytes if accumulation > 1 else 0
    if held:
        buffers = unit_trainable * trainable_bytes
        buffers_formula = (
            f"the reduce-scatter's input of one layer, {unit_trainable:,} × {trainable_bytes} B "
            "(the unsharded gradients are held whole: next row)"
        )
    else:
        buffers = (root_trainable + GRADIENT_COPIES * unit_trainable) * trainable_bytes
        buffers_formula = (
            f"the root's unsharded gradient ({root_trainable:,}) + {GRADIENT_COPIES} × a "
            f"layer's ({unit_trainable:,}: autograd's and the reduce-scatter's input) × "
            f"{trainable_bytes} B"
        )
    host = sum(sharded.values()) if offload else 0
    formulas = {
        name: f"{format_bytes(value)} of {what} sharded over {n} ranks (FSDP2, padded)"
        for name, value, what in (
            ("weights", sharded["weights"], format_bytes(weights)),
            ("trainable adapters", sharded["adapters"], format_bytes(adapters)),
            ("gradients", sharded["grads"], format_bytes(grads)),
            ("optimizer states", sharded["states"], format_bytes(states)),
            ("optimizer step temporaries", sharded["temporaries"], format_bytes(temporaries)),
        )
    }
    if offload:
        formulas = {
            name: f"in host memory (--fsdp-offload): {text}" for name, text in formulas.items()
        }
        sharded = dict.fromkeys(sharded, 0)
    return Ranks(
        world_size=n,
        mode=mode,
        why=why,
        weights=sharded["weights"],
        adapters=sharded["adapters"],
        grads=sharded["grads"],
        states=sharded["states"],
        temporaries=sharded["temporaries"],
        gathered=gathered,
        gathered_formula=gathered_formula,
        grad_buffers=buffers,
        grad_buffers_formula=buffers_formula,
        held_grads=held,
        root_reduce=2 * root_trainable * trainable_bytes,
        host=host,
        formulas=formulas,
    )


def _in_layers(counts: ParamCounts) -> set[int]:
    return {i for found in counts.layer_tensors for i in found}


def ddp_note(grads: int) -> str:
    """What torch's DistributedDataParallel would add to a replicated rank."""
    return (
        "replicate: steadytrain sums each gradient in place after the ranks agree, with no "
        "buckets of its own; a script that wraps the model in torch's DistributedDataParallel "
        f"itself adds its buckets, a flat copy of the gradients ({format_bytes(grads)} per "
        "rank), or with gradient_as_bucket_view=True about "
        f"{DDP_BUCKETS_IN_FLIGHT} × {format_bytes(DDP_BUCKET)} in flight"
    )
