"""The LoRA products of a layer's projections that read the same input, as one product each.

A Llama-style layer with LoRA on its projections runs q, k and v on the same input, and gate and
up on the same input. Each projection is a frozen product and a rank-r LoRA path (x times A, then
times B): q, k and v make three skinny products of the same x with their A matrices in forward,
three more for A's gradients and three for x's gradient through A in backward, each re-reading x
or writing a full-width result to add. With dropout 0 the same x goes into each A, so a group's
A matrices stacked make one product: x times [A_q; A_k; A_v] in forward (3r columns instead of
three of r), one product for the stacked A's gradient and one for x's gradient through them in
backward; each member's B then works on its own r columns of the result. The frozen products
stay one per member: fusing them too (one buffer, the weights views of it) made backward copy
the members' output gradients into one tensor, which cost more than the fused product saved
(docs/benchmarks.md, "Fused LoRA projections").

Nothing a checkpoint or an adapter holds changes: the member modules stay where they are with
their own parameters and names (peft's adapter keys, `merge_and_unload`, `generate`), the A
matrices stay the trainable leaves they were (the stacked A is a concatenation of r × width
matrices in each forward, its gradient split back by autograd), nothing is copied. A member
called with an input that is not its group's, merged, with adapters off or another adapter
active runs peft's own forward.

The group computes when its first member is called and hands each other member its output when
that member is called with the same tensor, as the model's code calls them in turn (q, k, v;
gate, up); inside a compiled layer this traces as one graph (engine/compiling.py fuses the
groups of CUDA runs before it compiles their layers).

Every member, in a group or alone (o and down; any other plain LoRA linear), also adds its LoRA
term inside its frozen product (`EPILOGUE_ADD`, engine/lora_product.py): one product whose
epilogue reads the LoRA term as it writes the output, instead of peft's separate sum. The output
is the same to float rounding.
"""

from __future__ import annotations

import importlib.util
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from steadytrain.engine import lora_product

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of the projections that read the same input in one module (Llama, Mistral, Qwen,
Gemma, OLMo and their like); models that fuse them themselves (Phi-3, GPT-NeoX) have none.
Every other fusable LoRA linear is a group of its own."""
EPILOGUE_ADD = True
"""Whether each member's LoRA term is added inside its frozen product (engine/lora_product.py)
instead of after it: on an H200 the 1B LoRA's kernels took 3-5 % less time a step and its peak
fell by 0.25 GiB (docs/benchmarks.md, "The LoRA term inside the frozen product")."""


class Group:
    """The LoRA linears of one group and the outputs not yet handed to their members."""

    def __init__(self, members: list[nn.Module], adapter: str):
        self.members = members
        self.adapter = adapter
        self.input: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def applies(self) -> bool:
        """Whether the fused path computes what each member's own forward would."""
        return all(
            not m.merged and not m.disable_adapters and m.active_adapters == [self.adapter]
            for m in self.members
        )

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`: handed out if the group computed it for this `x`,
        else the group computes every member's and keeps the others' for their calls."""
        if self.input is x and index in self.outputs:
            out = self.outputs.pop(index)
            if not self.outputs:
                self.input = None
            return out
        outs = self.compute(x)
        self.outputs = {i: o for i, o in enumerate(outs) if i != index}
        self.input = x if self.outputs else None
        return outs[index]

    def compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's output for `x`, as peft's `lora.Linear.forward` computes it, with one
        product of x and the members' A matrices stacked."""
        adapter = self.adapter
        a_weights = [m.lora_A[adapter].weight for m in self.members]
        dtype = a_weights[0].dtype
        if x.dtype != dtype and getattr(self.members[0], "cast_input_dtype_enabled", True):
            lora_x = x.to(dtype)
        else:
            lora_x = x
        ranks = [a.shape[0] for a in a_weights]
        stacked = a_weights[0] if len(a_weights) == 1 else torch.cat(a_weights)
        lows = F.linear(lora_x, stacked).split(ranks, dim=-1)
        outs = []
        for m, low in zip(self.members, lows, strict=True):
            b, scale = m.lora_B[adapter], m.scaling[adapter]
            if EPILOGUE_ADD and lora_product.applies(m.base_layer, x, low):
                outs.append(lora_product.frozen_plus_lora(m.base_layer, x, low, b.weight, scale))
            else:
                base = m.base_layer(x)
                outs.append((base + b(low) * scale).to(base.dtype))
        return outs


def fusable(members: list[nn.Module]) -> str | None:
    """The adapter a group of peft LoRA linears can be fused for, or None: each a plain
    `lora.Linear` with one active adapter, the same one, plain LoRA (no DoRA or other variant,
    no bias on B), no dropout, A matrices of one dtype that are plain tensors (not sharded), and
    the same input width."""
    from peft.tuners.lora import Linear

    if not all(type(m) is Linear for m in members):
        return None
    adapters = {tuple(m.active_adapters) for m in members}
    if len(adapters) != 1 or len(next(iter(adapters))) != 1:
        return None
    adapter = next(iter(adapters))[0]
    if not all(
        adapter in m.lora_A
        and adapter not in getattr(m, "lora_variant", {})
        and not m.use_dora.get(adapter, False)
        and m.lora_B[adapter].bias is None
        and isinstance(m.lora_dropout[adapter], nn.Identity)
        and not m.merged
        for m in members
    ):
        return None
    a_weights = [m.lora_A[adapter].weight for m in members]
    if not all(type(a.data) is torch.Tensor for a in a_weights):
        return None  # sharded (DTensor): its shards are gathered per module, not per group
    return adapter if len({(a.shape[1], a.dtype, a.device) for a in a_weights}) == 1 else None


def fuse_projections(model: nn.Module) -> dict[str, Any]:
    """Fuse every group of `GROUPS` that `model` has as peft LoRA linears (`fusable`), in
    place. Returns what was fused: the number of groups and their members' names (none where
    peft is not installed: then there are no LoRA linears)."""
    fused: list[tuple[str, ...]] = []
    if importlib.util.find_spec("peft") is None:
        return {"groups": 0, "fused": []}
    for module in model.modules():
        for names in GROUPS:
            members = [getattr(module, n, None) for n in names]
            if any(m is None or hasattr(m, "fused_group") for m in members):
                continue
            if _fuse(members):
                fused.append(names)
    from peft.tuners.lora import Linear

    for name, module in model.named_modules():
        if type(module) is Linear and not hasattr(module, "fused_group") and _fuse([module]):
            fused.append((name.rsplit(".", 1)[-1],))
    return {"groups": len(fused), "fused": sorted({"+".join(n) for n in fused})}


def _fuse(members: list[nn.Module]) -> bool:
    """Make `members` one group if they are `fusable`; whether they were."""
    adapter = fusable(members)
    if adapter is None:
        return False
    group = Group(members, adapter)
    for index, member in enumerate(members):
        member.fused_group, member.fused_index = group, index
        member.forward = types.MethodType(_fused_forward, member)
    return True


def _fused_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a fused member (bound to it, so that a deep copy of the model binds it to
    the copy): its group's output for `x` where the fused path applies, peft's own otherwise."""
    group = self.fused_group
    if args or kwargs or not group.applies():
        return type(self).forward(self, x, *args, **kwargs)
    return group.output(self.fused_index, x)
