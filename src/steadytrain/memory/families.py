"""The activation formulas of the decoder families beyond Llama's (Qwen3, Gemma 2/3, Phi-3,
GPT-NeoX, GPT-2, OLMo 2): one layer, part by part, from the family's `Layout`. Each term is a
tensor an op of the transformers modeling code saves for backward, in bytes per token, the same
derivation as Llama's (`activations.layer_stage_bytes`; docs/estimate.md, "Other families")."""

from __future__ import annotations

from steadytrain.memory.activations import (
    DROPOUT_MASK_BYTES,
    SCRATCH_PROBABILITIES,
    Activations,
    attention_kernel,
)
from steadytrain.memory.layout import Layout
from steadytrain.memory.model_shape import Shape
from steadytrain.memory.settings import PRECISIONS, Settings

PARTS = (
    "attn_norm",
    "attn_in",
    "qk_norm",
    "attention",
    "o_in",
    "attn_out",
    "mlp_norm",
    "mlp_in",
    "mlp_inner",
    "down_in",
    "mlp_out",
)
"""The parts of a layer in forward order (`layer_bytes` gives each one's bytes per token)."""


def family_activations(shape: Shape, s: Settings, tokens: int) -> Activations:
    """The activations row of a family with a `Layout`, as `activations.activations_of` gives
    Llama's: every layer's parts (sliding-window layers apart when they get a mask), the first
    layer without what precedes its first adapter, the outside, and attention's backward scratch
    where it keeps seq × seq probabilities."""
    layout = shape.layout
    kernel = attention_kernel(shape, s)
    variants = {
        masked: layer_bytes(shape, s, layout, kernel, masked)
        for masked in {layout.masked(n, s.seq) for n in range(shape.layers)}
    }
    sums = [sum(variants[layout.masked(n, s.seq)].values()) for n in range(shape.layers)]
    free = first_layer_free(layout, s)
    first = sum(v for k, v in variants[layout.masked(0, s.seq)].items() if k not in free)
    outside = outside_bytes(shape, s, layout)
    c = PRECISIONS[s.precision] if s.autocast else PRECISIONS[s.weights_dtype]
    w = PRECISIONS[s.weights_dtype]
    scratch = SCRATCH_PROBABILITIES.get(kernel, 0) * c * shape.heads * s.seq
    one_layer = int(tokens * (max(sums) + scratch))
    widest = max(sums)
    inputs = tokens * w * shape.hidden * shape.layers if s.checkpointing else 0
    if s.checkpointing:
        kept = inputs + int(tokens * outside)
        total = kept + one_layer
        formula = (
            f"{shape.family}, checkpointing: {tokens:,} tokens × ({shape.layers} layer inputs × "
            f"{w} B × {shape.hidden} + final norm/rotary {outside:,.0f} B + one layer "
            f"recomputed {widest:,.0f} B)"
        )
    else:
        kept = 0
        total = int(tokens * (sum(sums) - sums[0] + first + outside + scratch))
        per_layer = " or ".join(f"{v:,.0f}" for v in sorted(set(sums)))
        formula = (
            f"{shape.family}: {tokens:,} tokens × ({shape.layers} layers × {per_layer} B + final "
            f"norm/rotary {outside:,.0f} B)"
        )
        if first != sums[0]:
            formula += f", the first layer {first:,.0f} B (nothing before the first adapter)"
    if len(variants) > 1:
        formula += "; sliding-window layers get a mask and repeat grouped KV heads"
    if kernel != "fused":
        formula += (
            f"; {kernel} attention keeps seq {s.seq} × {shape.heads} heads probabilities per "
            f"token, and {SCRATCH_PROBABILITIES[kernel]}× that as scratch in one layer's backward"
        )
    recomputed = int(tokens * widest) if s.checkpointing else 0
    return Activations(total, kept, one_layer, formula, inputs, recomputed)


class _Sizes:
    """The widths and byte sizes one layer's formulas share."""

    def __init__(self, shape: Shape, s: Settings, layout: Layout):
        self.layout, self.s = layout, s
        self.h, self.i = shape.hidden, shape.intermediate or 4 * shape.hidden
        self.nh, self.nkv = shape.heads, shape.kv_heads
        self.hq, self.hkv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.w = PRECISIONS[s.weights_dtype]
        self.c = PRECISIONS[s.precision] if s.autocast else self.w
        self.full = s.method == "full"
        self.everything = s.targets == ("all-linear",)
        self.adapter = self.c if s.autocast else 4  # dtype of a LoRA adapter's activations
        # autocast runs layer_norm and pow in fp32 on CUDA and MPS (not on the CPU): LayerNorm
        # then returns fp32; RMSNorm returns the input dtype
        self.fp32_ops = s.autocast and s.device_type != "cpu"
        self.norm_out = 4 if layout.norm == "layer" and self.fp32_ops else self.w

    def wrapped(self, name: str) -> bool:
        return not self.full and (self.everything or name in self.s.targets)

    def inputs(self, names: tuple[str, ...], width: int, dtype: int, saved: bool) -> float:
        """What the linears `names` save of their one input tensor (of `dtype` bytes, `saved`
        already by another op). A full fine-tune saves the input for the weight's gradient,
        under autocast each linear its own cast; a LoRA adapter saves its input (autocast's or
        dropout's copy, else the input itself when fp32) and its rank-r intermediate."""
        s, c = self.s, self.c
        shared, total = False, 0.0
        for name in names:
            if self.full:
                if s.autocast and dtype != c:
                    total += c * width
                else:
                    shared = True
            if self.wrapped(name):
                total += s.lora_r * self.adapter
                if s.lora_dropout > 0:
                    total += (
                        DROPOUT_MASK_BYTES.get(s.device_type or "cuda", 1) + self.adapter
                    ) * width
                elif s.autocast:
                    total += c * width
                elif dtype == 4:
                    shared = True
                else:
                    total += 4 * width
        return total + (dtype * width if shared and not saved else 0)

    def norm(self, width: int, dtype: int, rows: float = 1) -> float:
        """One norm over `width` values of `dtype` bytes, `rows` normalised rows per token."""
        kind = self.layout.norm
        if kind == "layer":  # input, mean and rstd per row (fp32 on the CPU only for fp32 input)
            saved = 4 if self.fp32_ops else dtype
            stats = 4 if saved == 4 or self.s.device_type != "cpu" else saved
            return saved * width + 2 * stats * rows
        normalised = (dtype if kind == "rms" else 4) * width if self.full else 0
        return 4 * width + 4 * rows + normalised  # the fp32 input, rsqrt, the normalised input

    def dropout(self, p: float, dtype: int) -> float:
        """A dropout's mask on an h-wide tensor: a bool from CUDA's fused kernel, else a tensor
        of the input's dtype."""
        if p <= 0:
            return 0.0
        return (1 if self.s.device_type == "cuda" else dtype) * self.h


def layer_bytes(shape: Shape, s: Settings, layout: Layout, kernel: str, masked: bool) -> dict:
    """Bytes each part of one layer saves for backward, per token. `kernel` is attention's
    (`activations.attention_kernel`), `masked` whether sdpa gets a mask in this layer."""
    z = _Sizes(shape, s, layout)
    h, c, w = z.h, z.c, z.w
    attn_in_dtype = z.norm_out if layout.pre_norms else w
    parts = dict.fromkeys(PARTS, 0.0)
    if layout.pre_norms:
        parts["attn_norm"] = z.norm(h, w)
    parts["attn_in"] = z.inputs(layout.attn_linears, h, attn_in_dtype, False)
    if layout.qk_norm:
        rows_q, rows_k = (z.nh, z.nkv) if layout.qk_norm == "head" else (1, 1)
        parts["qk_norm"] = _qk_norm(z, z.hq, rows_q) + _qk_norm(z, z.hkv, rows_k)
    parts["attention"], out_saved = _attention(shape, z, kernel, masked)
    parts["o_in"] = z.inputs((layout.out_linear,), z.hq, c, out_saved)
    parts["attn_out"] = z.dropout(layout.hidden_dropout, c)
    if layout.post_norms:
        parts["attn_out"] += z.norm(h, c)
    if layout.parallel:  # the MLP's norm reads the layer input the attention's norm saved
        parts["mlp_norm"] = z.norm(h, w) - (0 if z.fp32_ops and w != 4 else w * h)
    elif layout.pre_norms:
        parts["mlp_norm"] = z.norm(h, w)
    parts["mlp_in"] = z.inputs(layout.mlp_linears, h, attn_in_dtype, False)
    inner, down_dtype = _mlp_inside(z)
    parts["mlp_inner"] = inner
    parts["down_in"] = z.inputs((layout.down_linear,), z.i, down_dtype, False)
    parts["mlp_out"] = z.dropout(layout.hidden_dropout, c)
    if layout.post_norms:
        parts["mlp_out"] += z.norm(h, c)
    return parts


def _qk_norm(z: _Sizes, width: int, rows: float) -> float:
    """A norm over a projection's output (compute dtype): its fp32 input, a copy unless the
    compute dtype is fp32."""
    return z.norm(width, z.c, rows)


def _attention(shape: Shape, z: _Sizes, kernel: str, masked: bool) -> tuple[float, bool]:
    """(bytes, whether the output linear's input is already among them). Grouped KV heads are
    repeated when a mask is given (sdpa's GQA path takes none) or in eager attention. A fused
    q/k/v projection's output stays whole when v is a view of it."""
    layout, c, s = z.layout, z.c, z.s
    repeated = z.nkv < z.nh and (masked or kernel != "fused")
    kv = c * (z.hq if repeated else z.hkv)
    fused_qkv = len(layout.attn_linears) == 1
    whole = c * (z.hq + 2 * z.hkv)  # the fused projection's output
    if fused_qkv and not layout.rotary:
        qkv = whole  # q, k and v are all views of it
    elif fused_qkv and not repeated:
        qkv = c * z.hq + kv + whole  # q and k turned (new tensors), v a view
    else:
        qkv = c * z.hq + 2 * kv
    if kernel == "fused":
        mask = c * s.seq if masked else 0  # sdpa converts the boolean mask to c, per layer
        shared = s.device_type == "cuda" or not layout.rotary_by_cat
        return qkv + c * z.hq + 4 * z.nh + mask, shared
    probs = s.seq * z.nh
    if kernel == "math":
        return qkv + c * z.hq + probs * c, True
    kept = 4 + (c if c != 4 else 0)  # fp32 softmax, its cast to c for the matmul
    if layout.attn_softcap:
        kept += c  # tanh of the scaled scores
    if layout.attention_dropout > 0:
        kept += DROPOUT_MASK_BYTES.get(s.device_type or "cuda", 1) + c
    return qkv + probs * kept, False


def _mlp_inside(z: _Sizes) -> tuple[float, int]:
    """(bytes inside the MLP, the dtype of the down projection's input). Gated: act's input,
    its output and up's output (Phi-3's fused gate_up output holds the first and the last).
    Plain: act's input. GPT-2's gelu_new in Python: pow's input, tanh's output, x / 2 and
    1 + tanh; under autocast on CUDA and MPS pow runs in fp32, so it saves an fp32 copy of x and
    everything after it is fp32 but x / 2."""
    c, i = z.c, z.i
    if z.layout.gated:
        return 3 * c * i, c
    if not z.layout.python_gelu:
        return c * i, c
    t = 4 if z.fp32_ops else c
    return c * i + 3 * t * i, t


def outside_bytes(shape: Shape, s: Settings, layout: Layout) -> float:
    """Per token, outside the layers: the final norm, the output layer's input (full
    fine-tune), rotary cos and sin (in the residual dtype), the embedding's dropout mask."""
    z = _Sizes(shape, s, layout)
    total = z.norm(z.h, z.w)
    if z.full:
        total += (z.c if s.autocast and z.norm_out != z.c else z.norm_out) * z.h
        total += z.dropout(layout.embedding_dropout, z.w)
    rotary = int(shape.head_dim * layout.rotary)
    return total + 2 * rotary * z.w


def first_layer_free(layout: Layout, s: Settings) -> set[str]:
    """Parts of the first layer that save nothing under LoRA: with a frozen embedding, no
    gradient flows before the first adapter. GPT-NeoX's parallel branches both read the layer
    input, so each is free up to its own first adapter."""
    if s.method == "full":
        return set()
    targets = set(s.targets)
    every = targets == {"all-linear"}
    wrapped = {
        part
        for part, names in (
            ("attn_in", layout.attn_linears),
            ("o_in", (layout.out_linear,)),
            ("mlp_in", layout.mlp_linears),
            ("down_in", (layout.down_linear,)),
        )
        if every or targets & set(names)
    }
    branches = [PARTS[:6], PARTS[6:]] if layout.parallel else [PARTS]
    free: set[str] = set()
    for branch in branches:
        first = next((i for i, part in enumerate(branch) if part in wrapped), len(branch))
        free |= set(branch[:first])
    return free
