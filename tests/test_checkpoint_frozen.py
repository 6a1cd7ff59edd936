"""A checkpoint holds what resuming needs, and no more: no frozen parameter is saved, also not
an output layer tied to frozen embeddings (Llama 3.2's `tie_word_embeddings`), and the run
resumes from such a checkpoint bit for bit. In process, through the public `Trainer`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from steadytrain import Trainer

STEPS, STOP = 4, 2


def tied_lora() -> torch.nn.Module:
    """A tiny Llama whose output layer is its (frozen) embedding matrix, with a LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    base = LlamaForCausalLM(config)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, lora)


def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def fit(run_dir: Path, max_steps: int) -> torch.nn.Module:
    model = tied_lora()
    data = [
        torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i)) for i in range(16)
    ]
    config = {
        "run_dir": str(run_dir),
        "effective_batch_size": 4,
        "micro_batch_size": 4,
        "max_steps": max_steps,
        "save_every_steps": 1,
        "seed": 0,
        "device": "cpu",
        "async_save": False,
        "progress": "off",
    }
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    assert Trainer(model, optimizer, loss, data, config).fit().exit_code == 0
    return model


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tied_embedding_lora_checkpoint_holds_only_trainable_tensors_and_resumes_bitwise(
    tmp_path,
):
    whole = fit(tmp_path / "whole", STEPS)

    run_dir = tmp_path / "stopped"
    fit(run_dir, STOP)
    saved = load_file(run_dir / "checkpoints" / f"step-{STOP:08d}" / "model.safetensors")
    model = tied_lora()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in model.named_buffers()} & set(model.state_dict())
    assert set(saved) - buffers == names  # the LoRA matrices: no lm_head, no embeddings
    assert not any("lm_head" in k or "embed_tokens" in k for k in saved)

    resumed = fit(run_dir, STEPS)  # the same run, to its end, from the checkpoint of step 2
    want, got = trainable(whole), trainable(resumed)
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
