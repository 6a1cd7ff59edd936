"""The output layer and the cross-entropy in one fused pass that never holds the logits (CUDA).

`CausalLMLoss`'s chunked mode (chunked_loss.py) keeps at most N tokens' logits alive and
recomputes each chunk's logits in backward: one more output-layer matmul per chunk. Where Liger
Kernel's `LigerFusedLinearCrossEntropyLoss` can run (a CUDA device with Triton, the package
installed: `pip install steadytrain[cuda]`), the chunked mode uses it instead: it walks the tokens
in chunks of about hidden-size × tokens / vocabulary, computes each chunk's logits, its loss and
its gradient with respect to the hidden states (and the output weight, when that trains) in the
forward, and frees the logits at once. Backward only scales those saved gradients, so no matmul
is recomputed and no logits exist beyond one chunk: with Llama 3's 128,256-entry vocabulary a
micro-batch of 8 × 1,024 tokens holds 64 MiB of logits instead of the plain loss's 10 GiB.

It serves exactly the heads whose arithmetic it reproduces: a plain `nn.Linear` output layer
(its weight tied to the embedding or not, trained or frozen, with or without bias) and at most
Gemma 2/3's `final_logit_softcapping`, which the kernel applies itself. A head adapted by LoRA, a
quantized head and Granite's or Cohere's logit scaling are computed by the checkpointed chunks,
as is everything on CPU and MPS (no Triton there): `fused_loss_sum` answers None, and the caller
falls back. The values equal the plain loss's up to rounding: the kernel takes the matmul in the
dtype autocast would (we cast the operands as autocast does, then run the kernel with autocast
off), and its softmax and loss in fp32, as `F.cross_entropy` on `logits.float()` does.

Where Liger's forward function can be imported, the kernel runs under our own autograd function
(`_FusedLinearCrossEntropy`) rather than Liger's module: Liger's backward asks the host whether
the incoming gradient is exactly 1 (a `torch.tensor(1.0)` copy to the device and a
`torch.equal` read back, two waits for the GPU per micro-batch); ours scales the saved
gradients by the incoming one on the device, with no read. The forward is Liger's own (its one
read of the label count, `.item()`, stays).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

IGNORE_INDEX = -100
UNSUPPORTED_TRANSFORMS = ("logits_scaling", "logit_scale")
"""Config attributes whose logit transform the kernel does not apply (only a softcap)."""


@functools.cache
def _liger_loss_class() -> Any:
    """Liger Kernel's fused linear cross-entropy module class, or None where it cannot be
    imported (not installed, or no Triton: the import of its kernels fails)."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except Exception:  # noqa: BLE001  an optional accelerator: any import failure means "not here"
        return None
    return LigerFusedLinearCrossEntropyLoss


DEVICE_SCALED_BACKWARD = True
"""Off: Liger's module computes the loss, its backward's reads included (the benchmark's switch
for the runs before and after)."""


@functools.cache
def _liger_forward_op() -> Any:
    """Liger Kernel's `fused_linear_cross_entropy_forward` (the loss and the gradients in one
    pass), or None where it cannot be imported; then Liger's module computes the loss."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward
    except Exception:  # noqa: BLE001  an optional accelerator, as in _liger_loss_class
        return None
    return fused_linear_cross_entropy_forward


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss from `forward_op` (Liger's forward function or a stand-in with its
    keywords, returning the loss first and (grad_input, grad_weight, grad_bias) last); backward
    multiplies the saved gradients by the incoming one on the device, never reading it."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, softcap, forward_op):
        out = forward_op(
            _input=hidden,
            weight=weight,
            target=targets,
            bias=bias,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            softcap=softcap,
        )
        grad_input, grad_weight, grad_bias = out[-3:]
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        return out[0]

    @staticmethod
    def backward(ctx, grad_output):
        grads = []
        for grad in ctx.saved_tensors:
            grads.append(None if grad is None else grad * grad_output.to(grad.dtype))
        grad_input, grad_weight, grad_bias = grads
        return grad_input, grad_weight, None, grad_bias, None, None


def fused_available(device: torch.device | str) -> bool:
    """Whether the fused kernel can run on `device`: CUDA, with Liger Kernel importable."""
    return torch.device(device).type == "cuda" and _liger_loss_class() is not None


def supported_head(head: torch.nn.Module, config: Any) -> str | None:
    """Why the fused kernel cannot compute this head's loss exactly, or None when it can."""
    if type(head) is not torch.nn.Linear:
        return f"the output layer is a {type(head).__name__}, not a plain Linear"
    for name in UNSUPPORTED_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"the model scales its logits ({name})"
    return None


def fused_loss_sum(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, config: Any
) -> torch.Tensor | None:
    """Summed next-token cross-entropy of `head(hidden)` against `targets` (both flat: tokens ×
    hidden, and tokens), -100 ignored, computed by the fused kernel; None where it cannot run
    (see the module docstring), so the caller computes it another way."""
    if not fused_available(hidden.device) or supported_head(head, config) is not None:
        return None
    weight, bias = head.weight, head.bias
    dtype = weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    forward_op = _liger_forward_op() if DEVICE_SCALED_BACKWARD else None
    with torch.autocast(hidden.device.type, enabled=False):
        operands = (
            weight.to(dtype),
            hidden.to(dtype).contiguous(),
            targets.contiguous(),
            None if bias is None else bias.to(dtype),
        )
        if forward_op is not None:
            w, h, t, b = operands
            return _FusedLinearCrossEntropy.apply(h, w, t, b, softcap, forward_op)
        loss = _liger_loss_class()(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
        return loss(*operands)
