"""A LoRA linear's output as one matrix product: x Wᵀ + s · (x A) Bᵀ with the sum in the frozen
product's epilogue.

peft computes the frozen product and the LoRA term as two full-width results and adds them in a
third pass. A compiled layer fuses that add into the next elementwise kernel (SwiGLU's, the
rotary embedding's), which then reads two full-width tensors per projection where one would do
and writes the sum again to keep it for backward. Here the LoRA term is made first (a rank-r
product, written once) and the frozen product accumulates onto it in place: cuBLAS reads it in
the epilogue of x Wᵀ, as that product writes its output (`addmm_` with beta = s), so no pass
adds it and the output is the one tensor the layer keeps.

It is an op of its own, opaque to the compiler: traced as plain torch, inductor would turn the
in-place product into an out-of-place `addmm` whose output is first a copy of the LoRA term (a
full-width copy per projection, which cost more than the add it saved). Its backward is written
out below in plain torch, so the compiler sees and schedules those products: x's gradient
through W, and the rank-r gradients of the LoRA term's two factors. It keeps the rank-r `low`
for backward, and no full-width tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_LIBRARY = torch.library.Library("steadytrain", "DEF")
_LIBRARY.define(
    "lora_product(Tensor x, Tensor weight, Tensor low, Tensor b, float scale) -> Tensor"
)


def _product(x, weight, low, b, scale):
    """x Wᵀ + scale · low Bᵀ for 2-D `x` (tokens × in) and `low` (tokens × r)."""
    return torch.mm(low, b.t()).addmm_(x, weight.t(), beta=scale)


_LIBRARY.impl("lora_product", _product, "CompositeExplicitAutograd")


@torch.library.register_fake("steadytrain::lora_product", lib=_LIBRARY)
def _(x, weight, low, b, scale):
    return x.new_empty((x.shape[0], weight.shape[0]))


class LoraProduct(torch.autograd.Function):
    """The op with its backward, W frozen. (An autograd.Function rather than the op's own
    autograd registration: that one is a Python kernel run at every call, which costs the host
    about as much again as the op.)"""

    @staticmethod
    def forward(ctx: Any, x, weight, low, b, scale: float):
        ctx.save_for_backward(weight, low, b)
        ctx.scale = scale
        return torch.ops.steadytrain.lora_product(x, weight, low, b, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        weight, low, b = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_low = (grad @ b) * ctx.scale if ctx.needs_input_grad[2] else None
        grad_b = (grad.t() @ low) * ctx.scale if ctx.needs_input_grad[3] else None
        return grad_x, None, grad_low, grad_b, None


def applies(base: nn.Module, x: torch.Tensor, low: torch.Tensor) -> bool:
    """Whether `lora_product` computes `base(x)` plus a LoRA term made from `low`: `base` a plain
    `nn.Linear` (not a quantized or sharded one) without a bias and with its weight frozen, and
    autocast on or the operands of one dtype (peft adds a float32 term to a bf16 product in
    float32, which one product in bf16 would not)."""
    if type(base) is not nn.Linear or base.bias is not None or base.weight.requires_grad:
        return False
    return torch.is_autocast_enabled(x.device.type) or x.dtype == base.weight.dtype == low.dtype


def frozen_plus_lora(
    base: nn.Linear, x: torch.Tensor, low: torch.Tensor, b: torch.Tensor, scale: float
) -> torch.Tensor:
    """`base(x) + scale · low Bᵀ` as one product, in the dtype F.linear would compute in here
    (autocast's, where it is on: a custom op is not cast by autocast itself)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    weight = base.weight.to(dtype)
    out = LoraProduct.apply(
        x.reshape(-1, x.shape[-1]).to(dtype),
        weight,
        low.reshape(-1, low.shape[-1]).to(dtype),
        b.to(dtype),
        scale,
    )
    return out.view(*x.shape[:-1], weight.shape[0])
