"""Activations of a family the analytic model does not know, measured by running its own code
on the meta device (shapes, no storage, no arithmetic).

`activations.py` and `families.py` derive, op by op, what the layers of the known families save
for backward. Any other family (OPT, Granite, StableLM, ...) differs in its norms, MLPs, rotary
and biases, so instead of a formula per family this module runs the family's Hugging Face decoder
forward once on the meta device under `torch.autograd.graph.saved_tensors_hooks` and adds up the
bytes of every tensor autograd saves for backward (each storage once, parameters excluded). That
is the activations row by definition, for any architecture transformers can build, at no memory
and in a fraction of a second even for a 70B config.

How the run's settings are reproduced on the meta device:

* compute dtype: the model is built in the dtype its matmuls would run in (autocast's, else the
  weights'); autocast's cached weight copies are counted by `weight_copies`, as for Llama;
* what needs a gradient: a full fine-tune trains every parameter; LoRA is modelled by letting the
  targeted linears' weights require a gradient (autograd then saves their inputs, which is what
  the adapters' `lora_A` saves; the rank-r intermediate is left out: r / hidden of that input);
* attention: a fused kernel (flash or memory-efficient, `attention_kernel`) saves q, k, v, the
  output and a log-sum-exp per row; on the meta device sdpa would take its math path, so the
  fused case is computed by a stand-in that saves exactly that; eager and math attention run the
  family's own code and save its seq × seq probabilities;
* checkpointing: each layer keeps its input (one hidden state per layer) and one layer is
  recomputed at a time: `kept` and `one_layer` come from the same run, split by layer.

The measurement is what autograd saves. Transient working memory (an attention backward's
scratch) is added as for Llama (`SCRATCH_PROBABILITIES`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from steadytrain.memory.activations import (
    DROPOUT_MASK_BYTES,
    SCRATCH_PROBABILITIES,
    Activations,
    attention_kernel,
)
from steadytrain.memory.model_shape import Shape, _matches
from steadytrain.memory.settings import PRECISIONS, Settings

MEASURED_TOKENS_MAX = 1 << 16
"""The meta run uses at most this many tokens (micro-batch 1 at the run's sequence length when
that is more): activations are linear in the micro-batch, so the result is scaled."""


def measured_activations(config: Any, shape: Shape, s: Settings, tokens: int) -> Activations:
    """The activations row for `tokens` tokens (micro-batch × seq) of `config`'s causal LM under
    `s`, measured on the meta device (module docstring)."""
    import torch

    name = s.precision if s.autocast else s.weights_dtype
    compute = PRECISIONS[name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    kernel = attention_kernel(shape, s)
    model = _meta_model(config, dtype, "eager" if s.attention == "eager" else "sdpa")
    if getattr(model.config, "_attn_implementation", None) == "eager":
        kernel = "eager"  # asked for, or the family has no sdpa path (Gemma 2)
    hooks = _require_grads(model, s)
    body = model.get_decoder()
    layers = _layers(body)
    try:
        per_layer, outside = _saved_bytes(body, layers, s.seq, kernel == "fused")
    finally:
        for hook in hooks:
            hook.remove()
    scale = tokens / s.seq  # the run was one sample of s.seq tokens
    hidden_bytes = s.seq * shape.hidden * PRECISIONS[s.weights_dtype]  # the residual stream
    scratch = SCRATCH_PROBABILITIES.get(kernel, 0) * compute * shape.heads * s.seq * s.seq
    one_layer = int(scale * (max(per_layer, default=0) + scratch))
    inputs = int(scale * hidden_bytes * len(layers)) if s.checkpointing else 0
    if s.checkpointing:
        kept = inputs + int(scale * outside)
        total = kept + one_layer
        formula = (
            f"measured on the meta device ({shape.family}'s own forward): {len(layers)} layer "
            f"inputs + outside the layers {outside * scale:,.0f} B + one layer recomputed "
            f"{max(per_layer, default=0) * scale:,.0f} B"
        )
    else:
        kept = 0
        total = int(scale * (sum(per_layer) + outside + scratch))
        formula = (
            f"measured on the meta device ({shape.family}'s own forward): {len(layers)} layers "
            f"× {sum(per_layer) / max(len(layers), 1) * scale:,.0f} B + outside the layers "
            f"{outside * scale:,.0f} B, what autograd saves for backward"
        )
    return Activations(total, kept, one_layer, formula, inputs)


def _meta_model(config: Any, dtype, attention: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attention
            )
        except ValueError:  # a family without sdpa support (Gemma 2): its eager attention
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="eager"
            )


def _require_grads(model, s: Settings) -> list:
    """Gradients where the run has them: every parameter (full fine-tune; with autocast over
    weights of another dtype, each linear gets and saves its own cast of the input), or LoRA
    adapters on the targeted linears, emulated by a hook that saves what peft's adapter saves:
    under autocast its own copy of the input (peft casts the input to the adapter's fp32 and
    autocast casts it back, once per adapter), else the input itself. Returns the hooks."""
    import torch

    full = s.method == "full"
    output = model.get_output_embeddings()
    for p in model.parameters():
        p.requires_grad_(full)
    every = full or s.targets == ("all-linear",)
    mixed = s.autocast and PRECISIONS[s.weights_dtype] != PRECISIONS[s.precision]
    hooks = []
    for name, module in model.named_modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if not linear or module is output:  # Conv1D: GPT-2's linear layers
            continue
        if full and mixed:  # autocast gives each linear its own cast of the input, and saves it
            hooks.append(module.register_forward_pre_hook(_cast_copy))
        elif not full and (every or any(_matches(name, t) for t in s.targets)):
            hooks.append(module.register_forward_pre_hook(_adapter_hook(s)))
    return hooks


def _cast_copy(module, args):
    return (args[0].clone(), *args[1:])


def _adapter_hook(s: Settings):
    import torch

    mask_bytes = DROPOUT_MASK_BYTES.get(s.device_type or "cuda", 1)

    class Adapter(torch.autograd.Function):
        """The adapter's effect on the graph: the output needs a gradient (its A and B train);
        saved: the input of A (autocast's copy, or the dropout's output and its mask) and the
        input of B (rank r)."""

        @staticmethod
        def forward(ctx, x, anchor):
            saved = [x.clone() if s.autocast or s.lora_dropout > 0 else x]
            if s.lora_dropout > 0:
                saved.append(x.new_empty((*x.shape, mask_bytes), dtype=torch.uint8))
            saved.append(x.new_empty((*x.shape[:-1], s.lora_r)))
            ctx.save_for_backward(*saved)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # never called: the meta run has no backward
            raise NotImplementedError

    anchor = torch.zeros((), device="meta", requires_grad=True)  # stands for A and B

    def hook(module, args):
        return (Adapter.apply(args[0], anchor), *args[1:])

    return hook


def _layers(body) -> list:
    """The decoder's repeated layers: the longest ModuleList in it."""
    import torch

    lists = [m for m in body.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _saved_bytes(body, layers: list, seq: int, fused: bool) -> tuple[list[int], int]:
    """Bytes saved for backward by each layer and outside the layers, for one sample."""
    import torch

    params = {p.untyped_storage()._cdata for p in body.parameters()}
    params |= {b.untyped_storage()._cdata for b in body.buffers()}
    seen: dict[int, tuple[int, int]] = {}  # storage -> (bytes, layer index or -1)
    where = [-1]

    def pack(t):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in params and key not in seen:
            seen[key] = (storage.nbytes(), where[0])
        return t

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    try:
        with (
            _no_packed_sequence_check(),
            _fused_attention(fused),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            body(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = [0] * len(layers)
    outside = 0
    for size, index in seen.values():
        if index >= 0:
            per_layer[index] += size
        else:
            outside += size
    return per_layer, outside


@contextlib.contextmanager
def _no_packed_sequence_check() -> Iterator[None]:
    """transformers looks for packed sequences in `position_ids` with a data-dependent check,
    which meta tensors cannot answer; there are none in this run."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    found = getattr(masking_utils, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


@contextlib.contextmanager
def _fused_attention(fused: bool) -> Iterator[None]:
    """On the meta device, sdpa as a fused kernel saves: q, k, v, the output, a log-sum-exp."""
    if not fused:
        yield
        return
    import torch
    import torch.nn.functional as F

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # never called: the meta run has no backward
            raise NotImplementedError

    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):
        return Fused.apply(query, key, value)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
