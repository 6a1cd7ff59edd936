"""`distributed: fsdp`: the model sharded over the ranks with FSDP2 (`fully_shard`).

Each repeated block (a Hugging Face model's decoder layers, from its `_no_split_modules`; else
the parameterised children of a `ModuleList` whose class repeats) is sharded on its own, then
the root: a block's parameters are gathered for its forward and backward only, so a rank holds
one block whole at a time. With LoRA (peft) the frozen base is sharded as well and only the
adapters have gradients and optimizer state.

Gradients are reduce-scattered once per optimizer step, in the last micro-batch's backward
(`set_gradient_sync(model, False)` before the others). The reduction sums (divide factor 1):
each rank's loss is already weighted by its share of the global batch (engine/step.py).

`choose` resolves the config's `distributed` field: 'auto' replicates when the model's
parameters, gradients and optimizer state fit one rank's memory budget, and shards otherwise.
"""

from __future__ import annotations

import atexit
import time
from collections import Counter
from typing import Any

import torch

from steadytrain.engine.distributed import Group
from steadytrain.errors import ConfigError

MODES = {"replicate": "replicate", "ddp": "replicate", "fsdp": "fsdp"}
"""The config's `distributed` values and the mode each means ('ddp' names replicate)."""

ADAM_STATES = 2
"""Optimizer state per trainable parameter assumed by 'auto' (AdamW's two moments)."""


def state_bytes(model: torch.nn.Module) -> int:
    """Parameters, plus a gradient and the optimizer's two moments per trainable parameter."""
    total = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        total += size * (2 + ADAM_STATES) if param.requires_grad else size
    return total


def choose(setting: str, model: torch.nn.Module, group: Group, budget: int | None) -> dict:
    """The mode this run takes, and why: {"mode", "reason", "state_bytes", "budget"}."""
    need = state_bytes(model)
    info: dict[str, Any] = {"state_bytes": need, "budget": budget}
    if not group.active:
        return info | {"mode": "replicate", "reason": "one process: nothing to shard"}
    if setting != "auto":
        return info | {"mode": MODES[setting], "reason": f"distributed: {setting}"}
    if budget is None or need <= budget:
        why = "no memory budget" if budget is None else "the whole state fits one rank's budget"
        return info | {"mode": "replicate", "reason": f"distributed: auto; {why}"}
    return info | {
        "mode": "fsdp",
        "reason": "distributed: auto; parameters, gradients and optimizer state exceed one "
        "rank's memory budget",
    }


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: the classes named in `_no_split_modules` (Hugging Face),
    else the parameterised members of a `ModuleList` whose class occurs more than once."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    found = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            kinds = Counter(type(m) for m in module)
            found += [m for m in module if kinds[type(m)] > 1 and any(True for _ in m.parameters())]
    return found


def _let_workers_release() -> None:
    """At exit, before the interpreter is torn down: FSDP keeps the process group alive past
    `destroy_process_group`, and a gloo worker thread frees each finished collective's tensors
    a moment after its caller moved on; freed once teardown has begun, they need the
    interpreter and the process aborts (SIGABRT instead of its exit code). A short pause lets
    the workers finish first."""
    time.sleep(_RELEASE_S)


_RELEASE_S = 0.2


def shard(model: torch.nn.Module, group: Group, offload: bool = False) -> dict[str, Any]:
    """Shard `model` in place over the group's ranks (every rank must hold the same values:
    `Group.broadcast_module` first). `offload` (the config's `fsdp_offload`): every unit with
    FSDP2's `CPUOffloadPolicy`, its shards of parameters, gradients and (the optimizer being
    built on them) optimizer state in pinned host memory. Returns what was sharded, for the
    `sharding` event."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(group.device)
    device_type = device.type
    gloo = device_type == "cpu"
    FSDPModule, fully_shard = _fsdp2(gloo)
    if device_type == "cuda":
        # The mesh names a device type only; it and fully_shard take "the current device" for
        # every all-gather and reduce-scatter, which is cuda:0 unless this rank's GPU is made
        # current: rank 1 then holds memory on GPU 0 and its NCCL communicator waits forever.
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device_type, (group.world_size,))
    atexit.unregister(_let_workers_release)  # once, however many fits
    atexit.register(_let_workers_release)
    blocks = repeated_blocks(model)
    kinds = ", ".join(sorted({type(b).__name__ for b in blocks})) or "none"  # before: FSDP<cls>
    policy = {}
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = {"offload_policy": CPUOffloadPolicy()}
    for block in blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the losses carry the global weights
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # required on gloo: above
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return {
        "mode": "fsdp",
        "blocks": len(blocks),
        "kinds": kinds,
        "world_size": group.world_size,
        "offload": offload,
    }


def _fsdp2(gloo: bool) -> tuple[type, Any]:
    """FSDP2's public names, or a ConfigError naming the field when this torch lacks what the run
    needs: a gradient divide factor, and on gloo (CPU) sums without a pre-multiplied reduction."""
    needs = ["set_gradient_divide_factor"] + (["set_force_sum_reduction_for_comms"] if gloo else [])
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        pass
    else:
        if all(hasattr(FSDPModule, name) for name in needs):
            return FSDPModule, fully_shard
    raise ConfigError(
        [
            f"distributed: fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard with "
            f"{' and '.join(needs)}), which torch {torch.__version__} lacks; install a newer "
            "torch, or set distributed: replicate"
        ]
    )


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def set_gradient_sync(model: torch.nn.Module, on: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (only the step's last one)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)
