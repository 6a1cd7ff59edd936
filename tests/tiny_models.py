"""The tiny Llama the tests build from a config (random weights, nothing downloaded): its shape,
and a model folder saved with the byte tokenizer, as a fine-tune reads one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""Two layers of 32: a forward and backward take milliseconds on a CPU."""

BYTE_TOKENS = {"vocab_size": 262, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
"""The byte tokenizer's vocabulary: 256 bytes, then its special tokens."""


def llama_config(**given: Any):
    """A `LlamaConfig` of `SHAPE` and 128 positions; `given` replaces or adds fields."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**SHAPE, "max_position_embeddings": 128, **given})


def save_byte_llama(folder: Path, **given: Any) -> Path:
    """A Llama of `llama_config(**given)` over the byte tokenizer's vocabulary, seeded (0), saved
    in `folder` with the tokenizer: a model folder a fine-tune config can name."""
    from transformers import LlamaForCausalLM

    from steadytrain.recipes.data import byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(**{**BYTE_TOKENS, **given})).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
