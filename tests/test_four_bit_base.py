"""A 4-bit base made ready for LoRA (recipes/model.py `prepare_4bit`): over bf16 the parameters
bitsandbytes leaves unquantized (embedding, norms, output layer) stay bf16, where peft's
preparation cast them to fp32 (the 1B Llama's base held 1.55 GiB on the GPU against the
estimate's 1.02); over fp16 peft's preparation stays, and the estimate prices those at 4 bytes.
bitsandbytes runs on CUDA only, so the preparation is tested on a plain model: it touches only
what is not 4-bit."""

from __future__ import annotations

import pytest
import torch
from test_estimate import llama_3b
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain.memory.estimate import NF4_BYTES_PER_PARAM, Settings, count_parameters, estimate
from steadytrain.recipes.model import prepare_4bit


def tiny(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        use_cache=False,
    )
    return LlamaForCausalLM(config).to(dtype)


def test_a_bf16_4bit_base_keeps_its_unquantized_parameters_bf16_and_frozen():
    model = prepare_4bit(tiny(torch.bfloat16), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


def test_an_fp16_4bit_base_keeps_peft_s_fp32_preparation():
    model = prepare_4bit(tiny(torch.float16), torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("dtype", "other"), [("bf16", 2), ("fp16", 4)])
def test_the_estimate_prices_the_unquantized_parameters_as_they_are_kept(dtype, other):
    config = llama_3b()
    counts = count_parameters(config)
    settings = Settings(method="lora", load_in_4bit=True, weights_dtype=dtype, precision=dtype)
    rest = counts.total - counts.linear_in_layers
    expected = int(counts.linear_in_layers * NF4_BYTES_PER_PARAM) + rest * other
    assert estimate(config, settings).row("weights") == expected
