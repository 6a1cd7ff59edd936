"""Fused LoRA projections (engine/fused_projections.py): a layer's q, k, v and gate, up LoRA A
products computed as one product per group train exactly as the unfused ones (loss and every
LoRA gradient, float32 on the CPU, eager and traced by dynamo), leave the adapter peft saves as
it was, fall back to peft's own forward where the fused path does not apply, and are turned on
by `compile_blocks` for CUDA runs only."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama_config

from steadytrain.engine import compiling
from steadytrain.engine.compiling import compile_blocks
from steadytrain.engine.fused_projections import Group, fuse_projections

pytest.importorskip("peft")
LAYERS = 2


def lora_llama(dropout: float = 0.0):
    """A tiny Llama with LoRA on its 7 projections; B drawn at random so that every LoRA
    gradient is non-zero (peft starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama_config(vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=64)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(LlamaForCausalLM(config), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    return model


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def loss_and_gradients(model):
    model.zero_grad()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same_training(fused, plain):
    loss, grads = loss_and_gradients(fused)
    plain_loss, plain_grads = loss_and_gradients(plain)
    assert torch.allclose(loss, plain_loss, rtol=1e-6)
    assert grads.keys() == plain_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grad, plain_grads[name], rtol=1e-5, atol=1e-7), name


def counting_groups(monkeypatch) -> list[int]:
    calls: list[int] = []
    compute = Group.compute
    monkeypatch.setattr(Group, "compute", lambda self, x: calls.append(1) or compute(self, x))
    return calls


def test_fused_groups_train_as_the_unfused_projections(monkeypatch):
    """Loss and every LoRA gradient match the unfused model's; each group computes once a
    forward (two groups a layer), not once a member."""
    calls = counting_groups(monkeypatch)
    model = lora_llama()
    event = fuse_projections(model)
    assert event == {"groups": 2 * LAYERS, "fused": ["gate_proj+up_proj", "q_proj+k_proj+v_proj"]}
    assert_same_training(model, lora_llama())
    assert len(calls) == 2 * LAYERS


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_fused_layers_trace_as_one_graph_and_train_the_same():
    """Each layer traced by dynamo (the `aot_eager` backend: no kernels to build) with its
    fused groups in one graph gives the unfused model's loss and gradients, twice over."""
    model = lora_llama()
    fuse_projections(model)
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 16, 32)
    positions = torch.arange(16)[None]
    embeddings = model.base_model.model.model.rotary_emb(hidden, positions)
    explained = torch._dynamo.explain(layer)(
        hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions
    )
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    for block in model.base_model.model.model.layers:
        block.compile(backend="aot_eager")
    plain = lora_llama()
    assert_same_training(model, plain)
    assert_same_training(model, plain)


def test_the_saved_adapter_and_the_merged_model_are_the_unfused_ones(tmp_path):
    """peft saves the same keys and values (to float tolerance) from a fused model after a step
    of training, and `merge_and_unload` gives the same model."""
    from safetensors.torch import load_file

    models = {}
    for name in ("fused", "plain"):
        model = lora_llama()
        if name == "fused":
            fuse_projections(model)
        loss_and_gradients(model)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
        model.save_pretrained(tmp_path / name)
        models[name] = model
    fused = load_file(tmp_path / "fused" / "adapter_model.safetensors")
    plain = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    assert fused.keys() == plain.keys()
    assert all(torch.allclose(fused[k], plain[k], rtol=1e-5, atol=1e-7) for k in plain)
    logits = [models[n].merge_and_unload()(input_ids=IDS).logits for n in ("fused", "plain")]
    assert torch.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6)


def test_members_run_peft_forward_where_the_fused_path_does_not_apply():
    """A member called with an input its group did not compute, or with the adapters off,
    gives what peft's own forward gives."""
    model = lora_llama()
    plain = lora_llama()
    fuse_projections(model)
    attention = model.base_model.model.model.layers[0].self_attn
    plain_attention = plain.base_model.model.model.layers[0].self_attn
    x, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    assert torch.allclose(attention.q_proj(x), plain_attention.q_proj(x), atol=1e-6)
    assert torch.allclose(attention.k_proj(other), plain_attention.k_proj(other), atol=1e-6)
    assert torch.allclose(attention.v_proj(x), plain_attention.v_proj(x), atol=1e-6)
    with model.disable_adapter(), plain.disable_adapter():
        assert torch.allclose(
            model(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=1e-5, atol=1e-6
        )


def test_compile_blocks_fuses_the_groups_of_cuda_runs_only(monkeypatch):
    """A CUDA run's compile (the compiler check and inductor stood in for) fuses every group and
    says so; a CPU run's, a run with `FUSED_PROJECTIONS` off and LoRA with dropout fuse none."""
    monkeypatch.setattr(compiling, "check_compiler", lambda device_type: None)
    monkeypatch.setattr(compiling, "recomputing_inductor", lambda *a, **k: "inductor")
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: None)
    event = compile_blocks(lora_llama(), "cuda")
    assert event["fused_projections"] == 2 * LAYERS
    assert (
        "4 groups of projections fused (gate_proj+up_proj, q_proj+k_proj+v_proj)"
        in (event["message"])
    )
    assert compile_blocks(lora_llama(), "cpu")["fused_projections"] == 0
    assert compile_blocks(lora_llama(dropout=0.1), "cuda")["fused_projections"] == 0
    monkeypatch.setattr(compiling, "FUSED_PROJECTIONS", False)
    model = lora_llama()
    assert compile_blocks(model, "cuda")["fused_projections"] == 0
    assert not any(hasattr(m, "fused_group") for m in model.modules())
