"""What a compiled decoder layer keeps for backward, as a share of what the eager layer keeps,
per model family: read by the estimate (its activations row with `--compile`) and by the plan
(a sample's growth in a compiled run)."""

from __future__ import annotations

from typing import Any

COMPILED_GROWTH = {
    "llama": 0.5,
    "mistral": 0.5,
    "qwen2": 0.5,
    "qwen3": 0.5,
    "gemma2": 0.45,
    "gemma3_text": 0.5,
    "gemma3": 0.5,
    "phi3": 0.6,
    "gpt_neox": 0.7,
    "gpt2": 0.3,
    "olmo2": 0.55,
}
"""What a sample adds to the peak once the layers are compiled, as a share of what it adds in
the eager passes the plan measures, per family (`model_type`), for modes without checkpointing
whose loss is chunked or fused (where the growth is the layers' activations). A compiled layer
keeps what its matrix multiplies made and recomputes the elementwise rest (engine/compiling.py).
From `bench/compiled_growth.py` (the activations autograd saves, compiled against eager, at
each family's public shape scaled down; rounded up to the next 0.05) and, for Llama, an H100 at
full scale (docs/benchmarks.md). Mistral and Qwen2 are Llama's layer. A family not named here
gets no credit (1.0), nor do other modes: the plain loss's logits do not shrink, and a
checkpointed layer keeps only its input."""


def family_share(model_type: str | None) -> float:
    """`COMPILED_GROWTH` of a family by its `model_type`, or 1.0 (no credit) when unnamed."""
    return COMPILED_GROWTH.get(model_type, 1.0)


def compiled_growth(model: Any) -> float:
    """`COMPILED_GROWTH` of `model`'s family (a Hugging Face model or a peft wrapper of one),
    or 1.0 (no credit) for a family it does not name."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return family_share(getattr(text, "model_type", None))
