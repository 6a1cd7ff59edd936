"""The activation side of the estimate for Llama-style decoder layers: the bytes each op saves
for backward per token, the attention kernel's seq × seq tensors, autocast's weight copies, and
the logits and loss (docs/estimate.md derives every term). The other families' layers are in
families.py, which this module hands them to."""

from __future__ import annotations

from dataclasses import dataclass

from steadytrain.memory.model_shape import ParamCounts, Shape, lora_targets
from steadytrain.memory.settings import PRECISIONS, Settings

DROPOUT_MASK_BYTES = {"cuda": 1, "mps": 4, "cpu": 4}
"""LoRA dropout keeps its mask for backward: a 1-byte bool from CUDA's fused kernel; elsewhere
a tensor in the input's dtype (fp32 here)."""

LLAMA_FAMILIES = ("llama", "mistral", "qwen2")
"""Model types whose decoder layer is Llama's: RMSNorm, q/k/v/o projections with rotary
embeddings, grouped-query attention, SiLU-gated MLP (gate_proj, up_proj, down_proj)."""
KNOWN_FAMILIES = (
    *LLAMA_FAMILIES,
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "phi3",
    "gpt_neox",
    "gpt2",
    "olmo2",
)
"""Model types with an activation formula: Llama's layer here, the others from their
`layout.Layout` in families.py."""

SCRATCH_PROBABILITIES = {"math": 4, "eager": 2}
"""seq × seq tensors per head that one layer's attention backward allocates on top of the saved
probabilities (their gradient, the softmax input's gradient; sdpa's math kernel also a masked
copy and its mask). Measured on an H100 by bench/estimate_accuracy.py."""

FORWARD_BYTES_PER_LOGIT = 10
LOSS_BYTES_PER_LOGIT = 12
"""Cross-entropy in fp32 over the vocabulary, at its worst (log-softmax backward): the saved
log-probabilities, their gradient and the input gradient, 4 bytes each, per token per logit.
The forward holds at most 10 (the logits in the compute dtype, their fp32 copy, log-probs)."""


@dataclass
class LogitsAndLoss:
    total: int
    """At the loss's worst moment (the log-softmax backward)."""
    forward: int
    """At its worst moment in forward, for the checkpointing forward side."""
    formula: str


def logits_and_loss(shape: Shape, s: Settings, tokens: int, head_copy: int) -> LogitsAndLoss:
    """The plain loss holds every token's logits: `LOSS_BYTES_PER_LOGIT` × T × V. The chunked
    loss holds one chunk's, plus what it keeps from forward to backward (the final hidden states,
    its checkpoint's input: T × h × w) and, under autocast over fp32 weights, the output weight's
    low-precision copy, which it casts per chunk instead of saving for backward."""
    if not s.chunked_loss:
        softcap = _softcap_bytes(shape, s)
        formula = (
            f"{LOSS_BYTES_PER_LOGIT} B × {tokens:,} tokens × vocab {shape.vocab:,} "
            "(fp32 cross-entropy, log-softmax backward)"
        )
        if softcap:
            formula += f" + the logits' tanh cap, {softcap} B a logit"
        return LogitsAndLoss(
            total=(LOSS_BYTES_PER_LOGIT + softcap) * tokens * shape.vocab,
            forward=(FORWARD_BYTES_PER_LOGIT + softcap) * tokens * shape.vocab,
            formula=formula,
        )
    if s.fused_loss:
        return _fused_loss(shape, s, tokens, head_copy)
    chunk = min(s.chunk_tokens, tokens)
    w = PRECISIONS[s.weights_dtype]
    hidden = w * tokens * shape.hidden
    formula = (
        f"chunked: {LOSS_BYTES_PER_LOGIT} B × one chunk of {chunk:,} tokens × vocab "
        f"{shape.vocab:,} + hidden states kept {tokens:,} × {shape.hidden} × {w} B"
    )
    if head_copy:
        formula += f" + the output weight's {s.precision} copy (cast per chunk)"
    return LogitsAndLoss(
        total=LOSS_BYTES_PER_LOGIT * chunk * shape.vocab + hidden + head_copy,
        forward=FORWARD_BYTES_PER_LOGIT * chunk * shape.vocab + hidden + head_copy,
        formula=formula,
    )


def fused_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """The tokens whose logits the fused kernel holds at once: Liger Kernel's chunk, the tokens
    divided by ceil(vocab / hidden), rounded up to a power of two, at most every token."""
    parts = -(-vocab // hidden)
    rows = -(-tokens // parts)
    return min(1 << (rows - 1).bit_length(), tokens)


def _fused_loss(shape: Shape, s: Settings, tokens: int, head_copy: int) -> LogitsAndLoss:
    """The fused linear cross-entropy (memory/fused_loss.py) computes the loss and its gradient
    in forward, a chunk of rows at a time: one chunk's logits in the compute dtype (the gradient
    is written over them), the gradient of the hidden states for every token (kept for the
    backward), the hidden states themselves and, where they are in another dtype, their copy in
    the compute dtype."""
    w, c = PRECISIONS[s.weights_dtype], PRECISIONS[s.precision] if s.autocast else None
    c = c or w
    rows = fused_chunk_rows(tokens, shape.hidden, shape.vocab)
    states = tokens * shape.hidden
    total = c * rows * shape.vocab + w * states + c * states + (c * states if c != w else 0)
    formula = (
        f"fused: {c} B × {rows:,} tokens' logits × vocab {shape.vocab:,} + hidden states kept "
        f"{tokens:,} × {shape.hidden} × {w} B + their gradient × {c} B"
        + (f" + their {s.precision} copy" if c != w else "")
    )
    if head_copy:
        formula += f" + the output weight's {s.precision} copy"
    return LogitsAndLoss(total=total + head_copy, forward=total + head_copy, formula=formula)


def _softcap_bytes(shape: Shape, s: Settings) -> int:
    """Gemma 2 caps the logits with tanh (final_logit_softcapping), which keeps its output, in
    the logits' dtype, until the loss's backward reaches it."""
    if shape.layout is None or not shape.layout.final_softcap:
        return 0
    return PRECISIONS[s.precision] if s.autocast else PRECISIONS[s.weights_dtype]


STAGES = ("norm1", "qkv_in", "attention", "o_in", "norm2", "mlp_in", "mlp_inner", "down_in")
"""The parts of a Llama decoder layer in forward order; `layer_stage_bytes` gives each one's
saved bytes per token."""
_FIRST_STAGE = {
    "q_proj": "qkv_in",
    "k_proj": "qkv_in",
    "v_proj": "qkv_in",
    "o_proj": "o_in",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "down_in",
}


def layer_stage_bytes(shape: Shape, s: Settings) -> dict[str, float]:
    """Bytes each part of one decoder layer saves for backward, per token (docs/estimate.md
    derives every term). `w` is the weights (and residual stream) dtype, `c` the compute dtype:
    autocast's when on, else the weights'. Under autocast over fp32 weights every linear casts
    its input separately, so an input shared in fp32 becomes one low-precision copy per
    consumer."""
    h, i = shape.hidden, shape.intermediate
    hq = shape.heads * shape.head_dim
    w = PRECISIONS[s.weights_dtype]
    c = PRECISIONS[s.precision] if s.autocast else w
    full = s.method == "full"
    targets = set(s.targets)
    everything = targets == {"all-linear"}

    def lora(name: str) -> bool:
        return not full and (everything or name in targets)

    def group(names: tuple[str, ...], width: int, dtype: int, saved_already: bool) -> float:
        """Saved bytes for one input tensor of `dtype` feeding the linears `names`."""
        shared = False
        total = 0.0
        for name in names:
            if full:
                if s.autocast and dtype != c:
                    total += c * width
                else:
                    shared = True
            if lora(name):
                if s.lora_dropout > 0:
                    mask = DROPOUT_MASK_BYTES[s.device_type]
                    total += mask * width + (c if s.autocast else 4) * width
                elif s.autocast:
                    total += c * width
                elif dtype == 4:
                    shared = True
                else:
                    total += 4 * width
        if shared and not saved_already:
            total += dtype * width
        return total

    norm = 4 * h + (w * h if full else 0)
    return {
        "norm1": norm,
        "qkv_in": group(("q_proj", "k_proj", "v_proj"), h, w, False),
        "attention": _attention_bytes(shape, s, c),
        "o_in": group(("o_proj",), hq, c, True),
        "norm2": norm,
        "mlp_in": group(("gate_proj", "up_proj"), h, w, False),
        "mlp_inner": 3 * c * i,
        "down_in": group(("down_proj",), i, c, False),
    }


def _attention_bytes(shape: Shape, s: Settings, c: int) -> float:
    """What one layer's attention saves per token, by kernel (`attention_kernel`)."""
    nh, hq = shape.heads, shape.heads * shape.head_dim
    kernel = attention_kernel(shape, s)
    if kernel == "eager":
        probs = c if c != 4 else 0
        return c * (4 * hq) + s.seq * nh * (4 + probs)
    if kernel == "math":
        return c * (4 * hq) + s.seq * nh * c
    return c * (2 * hq + 2 * shape.kv_heads * shape.head_dim) + 4 * nh


def attention_kernel(shape: Shape, s: Settings) -> str:
    """What attention keeps: 'fused' (flash or memory-efficient: q, k, v, output, log-sum-exp),
    'math' (sdpa's fallback: scaled q and k, repeated v, the seq × seq probabilities per head)
    or 'eager'. sdpa falls back to math on MPS in training, and on CUDA in fp32 with grouped
    KV heads (flash takes no fp32; the memory-efficient kernel takes no grouped heads)."""
    if s.attention == "eager" or (shape.layout is not None and shape.layout.eager_only):
        return "eager"
    if s.attention == "flash":
        return "fused"
    compute = PRECISIONS[s.precision] if s.autocast else PRECISIONS[s.weights_dtype]
    if s.device_type == "mps":
        return "math"
    if s.device_type == "cuda" and compute == 4 and shape.kv_heads < shape.heads:
        return "math"
    return "fused"


def first_layer_start(s: Settings) -> str:
    """With a frozen embedding, nothing in the first layer needs a gradient before the first
    LoRA-wrapped linear, so autograd saves nothing there."""
    if s.method == "full" or s.targets == ("all-linear",):
        return STAGES[0]
    stages = [_FIRST_STAGE[t] for t in s.targets if t in _FIRST_STAGE]
    return min(stages, key=STAGES.index) if stages else STAGES[0]


@dataclass
class Activations:
    """Activation bytes, split the way the peak needs them."""

    total: int
    """The activations row: everything saved at once (with checkpointing: the layer inputs,
    the outside-the-layers part and one recomputed layer)."""
    kept: int
    """With checkpointing: what stays for the whole backward (layer inputs, final norm)."""
    one_layer: int
    """One layer's saved tensors plus the attention backward's seq × seq scratch."""
    formula: str
    inputs: int = 0
    """With checkpointing: the layer inputs within `kept`, what offload moves to host memory."""
    recomputed: int = 0
    """With checkpointing: the tensors the recomputed layer saves for its backward, within
    `one_layer` (what a compiled layer keeps a share of; the rest of `one_layer` is attention's
    scratch and the tiled MLP's piece and gradients)."""


def activations_of(shape: Shape, s: Settings, tokens: int) -> Activations:
    if shape.layout is not None:
        from steadytrain.memory.families import family_activations  # it builds on this module

        return family_activations(shape, s, tokens)
    w = PRECISIONS[s.weights_dtype]
    c = PRECISIONS[s.precision] if s.autocast else w
    stages = layer_stage_bytes(shape, s)
    start = STAGES.index(first_layer_start(s))
    piece = 0.0  # the tiled MLP: one piece's inside, recomputed in the backward
    if s.tiled_mlp and tokens > s.tile_tokens:
        stages, piece = _tiled_stages(stages, w * shape.hidden)
        piece = piece * s.tile_tokens + TILED_BACKWARD_HIDDEN * shape.hidden * tokens
    per_layer = sum(stages.values())
    first = sum(v for k, v in stages.items() if STAGES.index(k) >= start)
    full = s.method == "full"
    head = 4 * shape.hidden + (w * shape.hidden if full else 0)
    if full:
        head += (c if s.autocast and w != c else w) * shape.hidden
    rope = 2 * shape.head_dim * w
    outside = head + rope
    kernel = attention_kernel(shape, s)
    scratch = SCRATCH_PROBABILITIES.get(kernel, 0) * c * shape.heads * s.seq
    one_layer = int(tokens * (per_layer + scratch) + piece)
    inputs = tokens * w * shape.hidden * shape.layers if s.checkpointing else 0
    if s.checkpointing:
        kept = inputs + int(tokens * outside)
        total = kept + one_layer
        formula = (
            f"checkpointing: {tokens:,} tokens × ({shape.layers} layer inputs × {w} B × "
            f"{shape.hidden} + final norm/rope {outside:,.0f} B + one layer recomputed "
            f"{per_layer:,.0f} B)"
        )
    else:
        kept = 0
        total = int(tokens * ((shape.layers - 1) * per_layer + first + outside + scratch) + piece)
        formula = (
            f"{tokens:,} tokens × ({shape.layers} layers × {per_layer:,.0f} B + final norm/rope "
            f"{outside:,.0f} B)"
        )
        if first != per_layer:
            formula += f", the first layer {first:,.0f} B (nothing before the first adapter)"
    if piece:
        formula += (
            f"; the MLP tiled by {s.tile_tokens:,} tokens: a layer keeps its input, one "
            f"piece's inside is recomputed at a time, and the backward's gradients "
            f"({TILED_BACKWARD_HIDDEN} B × hidden a token) with it: {piece:,.0f} B"
        )
    if kernel != "fused":
        where = "eager attention" if kernel == "eager" else f"sdpa's math kernel on {s.device_type}"
        formula += (
            f"; {where} keeps seq {s.seq} × {shape.heads} heads probabilities per token, and "
            f"{SCRATCH_PROBABILITIES[kernel]}× that as scratch in one layer's backward"
        )
    recomputed = int(tokens * per_layer) if s.checkpointing else 0
    return Activations(total, kept, one_layer, formula, inputs, recomputed)


TILED_BACKWARD_HIDDEN = 14
"""Bytes × hidden a token that a recomputed layer's backward holds beside its saved tensors once
its MLP is tiled: the residual stream's gradient, RMSNorm's fp32 gradients, attention's
gradients of q, k and v, the pieces' input gradients before they are joined. The untiled MLP's
inside outweighed them; tiled, they set the peak. Measured on an H200 by
bench/long_context_lever.py (the 1B Llama shape, LoRA r16, offload and the fused loss): the
peaks at 98,304 and 131,072 tokens exceed the saved tensors by 13.2 and 13.9 B × hidden a
token."""
MLP_STAGES = ("mlp_in", "mlp_inner", "down_in")
"""The stages of a Llama layer that are its MLP's (what the tiled MLP keeps for one piece only)."""


def _tiled_stages(stages: dict[str, float], kept: int) -> tuple[dict[str, float], float]:
    """A layer's bytes a token with its MLP tiled (`memory.tiled_mlp`): each piece's checkpoint
    keeps the MLP's input, `kept` bytes a token (a hidden vector in the weights' dtype, as
    `mlp_in`), and nothing of the inside; and the bytes a token of the inside, which exists for
    one piece at a time (its recomputation in the backward)."""
    inside = sum(stages[k] for k in MLP_STAGES)
    tiled = {k: 0.0 if k in MLP_STAGES else v for k, v in stages.items()}
    tiled["mlp_in"] = float(kept)
    return tiled, inside


def weight_copies(shape: Shape, counts: ParamCounts, s: Settings) -> tuple[int, int, int, str]:
    """Autocast over fp32 weights casts each weight to the compute dtype per use. Trainable
    weights' casts are cached until autocast exits (all of them live through the forward);
    frozen weights' casts are saved for backward by every linear whose input needs a gradient.
    A 4-bit base is dequantized one layer at a time and keeps no copy. LoRA's fp32 adapters are
    trainable weights: under autocast their casts are cached through the forward too.

    Returns (the row, one layer's copies, the output layer's copy, the formula)."""
    row, one, head_copy, formula = _base_copies(shape, counts, s)
    if s.method != "lora" or not s.autocast or PRECISIONS[s.precision] == 4:
        return row, one, head_copy, formula
    c = PRECISIONS[s.precision]
    adapters = sum(
        s.lora_r * (m.in_features + m.out_features)
        for m in lora_targets(counts, s.targets, s.vocabulary)
    )
    formula = "" if row == 0 else formula + "; "
    formula += f"the LoRA adapters' {adapters:,} params × {c} B ({s.precision}), cached"
    return row + c * adapters, one, head_copy, formula


def _base_copies(shape: Shape, counts: ParamCounts, s: Settings) -> tuple[int, int, int, str]:
    w = PRECISIONS[s.weights_dtype]
    layer_linear = sum(m.in_features * m.out_features for m in counts.linears if m.in_layers)
    head = shape.vocab * shape.hidden
    if s.load_in_4bit:
        c = PRECISIONS[s.precision] if s.autocast else w
        one = c * layer_linear // max(shape.layers, 1)
        return one, one, 0, "4-bit base: one layer dequantized at a time"
    if not s.autocast or w == PRECISIONS[s.precision]:
        return 0, 0, 0, "none: the weights are already in the compute dtype"
    c = PRECISIONS[s.precision]
    one, head_copy = c * layer_linear // shape.layers, c * head
    full = s.method == "full"
    if full or not s.checkpointing:
        n = layer_linear + head
        why = "cached for the forward" if full else "saved for backward by frozen linears"
        return c * n, one, head_copy, f"{n:,} linear weights × {c} B ({s.precision}), {why}"
    return (
        one + head_copy,
        one,
        head_copy,
        f"checkpointing: one layer's and the output layer's weights × {c} B",
    )
