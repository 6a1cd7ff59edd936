"""How a decoder family's layer is built, read off its Hugging Face config: the facts the
activation formulas of `families.py` need (which norm, where the norms sit, which linears read
which tensor, the MLP's shape, rotary, dropout, sliding windows, softcapping). Each family's
entry says what its transformers modeling code does; docs/estimate.md derives the bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    norm: str = "rms"
    """'rms': Llama's RMSNorm (fp32 inside, `weight * x.to(dtype)`); 'rms_fp32': the weight
    multiplies the fp32 normalised input (Gemma's x·(1 + weight), OLMo 2's weight·x); 'layer':
    LayerNorm (it saves its input, mean and rstd; autocast runs it in fp32 on CUDA and MPS)."""
    pre_norms: bool = True
    """A norm before attention and before the MLP (OLMo 2 has none: it norms their outputs)."""
    post_norms: bool = False
    """A norm on the attention output and on the MLP output (Gemma 2/3 sandwich, OLMo 2)."""
    qk_norm: str | None = None
    """'head': a norm over each head of q and k (Qwen3, Gemma 3); 'full': over the whole
    q and k projections (OLMo 2)."""
    attn_linears: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    """The linears that read the attention input; one name when q, k and v are one fused
    projection (Phi-3 qkv_proj, GPT-NeoX query_key_value, GPT-2 c_attn)."""
    out_linear: str = "o_proj"
    mlp_linears: tuple[str, ...] = ("gate_proj", "up_proj")
    """The linears that read the MLP input (Phi-3 gate_up_proj, GPT-NeoX dense_h_to_4h, GPT-2
    c_fc)."""
    down_linear: str = "down_proj"
    gated: bool = True
    """act(gate) × up (SiLU or GELU); else act(fc) alone (GPT-NeoX, GPT-2)."""
    python_gelu: bool = False
    """GPT-2's gelu_new is written in Python: pow, tanh and two products each save a tensor."""
    rotary: float = 1.0
    """Share of each head's width that rotary embeddings turn; 0 for learned positions."""
    rotary_by_cat: bool = False
    """Partial rotary joins the turned and the passed part with torch.cat (GPT-NeoX, Phi-3): q
    and k come out contiguous, so on the CPU sdpa's output is copied before the output linear."""
    parallel: bool = False
    """GPT-NeoX's parallel residual: attention and MLP both read the layer input."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs (GPT-2 resid_pdrop, Phi-3, GPT-NeoX)."""
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_softcap: float | None = None
    """Gemma 2's tanh capping of the attention scores (eager attention only)."""
    final_softcap: float | None = None
    """Gemma 2's tanh capping of the logits: one more tensor of every logit is kept."""
    eager_only: bool = False
    """The family has no sdpa path in transformers (Gemma 2)."""
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    """Per layer, whether it attends through a sliding window (then, at sequences of the
    window or longer, sdpa gets a mask tensor and grouped KV heads are repeated)."""

    def masked(self, layer: int, seq: int) -> bool:
        """Whether sdpa gets an explicit mask in `layer` (transformers skips it, using
        is_causal, while the sequence is shorter than the window)."""
        if self.sliding_window is None or not self.sliding_layers:
            return False
        return self.sliding_layers[layer] and seq >= self.sliding_window


LAYOUTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(norm="rms_fp32", pre_norms=False, post_norms=True, qk_norm="full"),
    "gemma2": dict(norm="rms_fp32", post_norms=True, eager_only=True),
    "gemma3_text": dict(norm="rms_fp32", post_norms=True, qk_norm="head"),
    "phi3": dict(attn_linears=("qkv_proj",), mlp_linears=("gate_up_proj",), rotary_by_cat=True),
    "gpt_neox": dict(
        norm="layer",
        attn_linears=("query_key_value",),
        out_linear="dense",
        mlp_linears=("dense_h_to_4h",),
        down_linear="dense_4h_to_h",
        gated=False,
        rotary_by_cat=True,
    ),
    "gpt2": dict(
        norm="layer",
        attn_linears=("c_attn",),
        out_linear="c_proj",
        mlp_linears=("c_fc",),
        down_linear="c_proj",
        gated=False,
        rotary=0.0,
    ),
}
"""Each family's departures from Llama's layer (the `Layout` defaults)."""
LAYOUTS["gemma3"] = LAYOUTS["gemma3_text"]


def layout_of(text) -> Layout | None:
    """The layout of a text config's family, or None for Llama's own (llama, mistral, qwen2:
    `activations.layer_stage_bytes`) and for families without one."""
    family = getattr(text, "model_type", None)
    if family not in LAYOUTS:
        return None
    fields = dict(LAYOUTS[family])
    rope = getattr(text, "rope_parameters", None) or {}
    if fields.get("rotary", 1.0) and isinstance(rope, dict):
        fields["rotary"] = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
    if family == "gpt2":
        fields["python_gelu"] = getattr(text, "activation_function", "gelu_new") == "gelu_new"
    if family == "gpt_neox":
        fields["parallel"] = bool(getattr(text, "use_parallel_residual", True))
    fields.update(_dropouts(text))
    if family == "gemma2":
        fields["attn_softcap"] = getattr(text, "attn_logit_softcapping", None)
    fields["final_softcap"] = getattr(text, "final_logit_softcapping", None)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if window and family in ("gemma2", "gemma3_text", "gemma3", "phi3", "qwen3", "olmo2"):
        layers = int(text.num_hidden_layers)
        sliding = (
            tuple(t == "sliding_attention" for t in types)
            if types
            else (True,) * layers  # Phi-3: every layer slides when a window is set
        )
        fields.update(sliding_window=int(window), sliding_layers=sliding)
    return Layout(**fields)


def _dropouts(text) -> dict[str, float]:
    """Training-time dropout probabilities under each family's names."""
    hidden = _first(text, "resid_pdrop", "hidden_dropout")
    embedding = _first(text, "embd_pdrop", "hidden_dropout")
    attention = _first(text, "attn_pdrop", "attention_dropout")
    return dict(hidden_dropout=hidden, embedding_dropout=embedding, attention_dropout=attention)


def _first(text, *names: str) -> float:
    for name in names:
        value = getattr(text, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0
