"""The tiled MLP: each decoder layer's MLP run over a piece of the tokens at a time, each piece
under its own checkpoint, so that no more than one piece's intermediate activations exist.

Where it pays: at long sequences under activation checkpointing, the recomputed layer of the
backward holds its MLP's inside for every token. In the Llama-3.2-1B shape that is the gate,
the up projection and their product, 3 × 8,192 values a token in bf16 (48 KiB), 6 GiB at
131,072 tokens, more than the kept layer inputs of all 16 layers. Tiled by 8,192 tokens the
backward holds one piece's, 384 MiB, and the layer keeps the MLP's input (4 KiB a token)
instead: 131,072 tokens train in 14.26 GiB under a 16 GiB cap where 65,536 was the longest
(bench/long_context_lever.py on an H200).

The MLP of these families is token-wise (each token's output depends on that token's input
alone), so a piece's result is that piece's rows of the whole's: the values are the untiled
MLP's up to the matmul's blocking of fewer rows, the gradients the same sums over the same
tokens. Dropout inside the MLP (a LoRA adapter's) draws its masks piece by piece, the same
distribution in another order; with `lora_dropout: 0` nothing differs. Each piece's checkpoint
keeps the RNG state, so its recomputation draws what its forward drew.

A token-wise MLP is found by what it holds: a down projection (`down_proj`) fed by a gate and
an up projection (`gate_proj` and `up_proj`, or Phi-3's fused `gate_up_proj`), and no experts
(a mixture of experts routes tokens, and its router's losses are not token-wise). Llama,
Mistral, Qwen2/3, Gemma, OLMo 2 and Phi-3 have such an `mlp`. The forward is replaced on the
instance (the class's own forward, or a wrapper another library put there, runs inside each
piece) and put back when tiling is turned off. In a compiled layer the tiled MLP runs eager
(`torch.compiler.disable`: the layer's graph breaks around it), as the lever was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from steadytrain.memory.settings import DEFAULT_TILE_TOKENS

_UNTILED = "_steadytrain_untiled_forward"
"""The attribute of a tiled MLP that holds its forward as it was (the instance's own, or None
where the class's ran)."""


def token_wise_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MLPs whose forward is token-wise (see the module docstring), in module order."""
    return [m for m in model.modules() if _token_wise(m)]


def _token_wise(module: torch.nn.Module) -> bool:
    children = dict(module.named_children())
    gated = ("gate_proj" in children and "up_proj" in children) or "gate_up_proj" in children
    return "down_proj" in children and gated and "experts" not in children


def tiled_tokens(model: torch.nn.Module) -> int | None:
    """Tokens per piece of the model's tiled MLPs, None when they are not tiled."""
    for mlp in token_wise_mlps(model):
        if hasattr(mlp, _UNTILED):
            return mlp.forward.tile_tokens
    return None


def set_tiling(model: torch.nn.Module, tokens: int | None) -> int:
    """Run each token-wise MLP of `model` over `tokens` tokens at a time (None: the whole input
    at once, as it was); returns how many MLPs were switched."""
    mlps = token_wise_mlps(model)
    for mlp in mlps:
        if hasattr(mlp, _UNTILED):  # untile first: a new size wraps the original forward
            before = getattr(mlp, _UNTILED)
            del mlp.forward
            if before is not None:
                mlp.forward = before
            delattr(mlp, _UNTILED)
        if tokens is not None:
            setattr(mlp, _UNTILED, mlp.__dict__.get("forward"))
            mlp.forward = _tiled(mlp.forward, tokens)
    return len(mlps)


def _tiled(forward: Callable[..., torch.Tensor], tokens: int) -> Callable[..., torch.Tensor]:
    """`forward` over the rows of its input (every dimension but the last flattened: batch ×
    sequence) `tokens` at a time, each piece under a non-reentrant checkpoint. Without
    gradients, or where the input has no more rows than one piece, `forward` as it is."""

    def tiled(*args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0] if len(args) == 1 and not kwargs else None
        rows = (
            x.numel() // max(x.shape[-1], 1) if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0
        )
        if rows <= tokens or not torch.is_grad_enabled():  # one piece, or another call
            return forward(*args, **kwargs)
        pieces = x.reshape(rows, x.shape[-1]).split(tokens)
        out = torch.cat([checkpoint(forward, piece, use_reentrant=False) for piece in pieces])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    tiled = torch.compiler.disable(tiled)  # in a compiled layer: eager, as measured
    tiled.tile_tokens = tokens
    return tiled


__all__ = ["DEFAULT_TILE_TOKENS", "set_tiling", "tiled_tokens", "token_wise_mlps"]
