"""`compile: true`: a Hugging Face model's decoder layers are compiled in place after the plan
and before the first step; the run trains as the eager one does (to float tolerance), its
checkpoints hold the same tensor names, and where torch.compile cannot build kernels the run is
refused before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import llama_config

from steadytrain import TrainConfig, Trainer
from steadytrain.engine.compiling import compile_blocks
from steadytrain.errors import ConfigError
from steadytrain.memory.chunked_loss import CausalLMLoss
from steadytrain.telemetry.files import read_jsonl

LAYERS = 2


def lora_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama_config(vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (16, 32), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def train(run_dir: Path, compile: bool | str):
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=4,
        micro_batch_size=2,
        max_steps=3,
        save_every_steps=3,
        device="cpu",
        precision="fp32",
        progress="off",
        compile=compile,
    )
    model = lora_llama()
    result = Trainer(
        model, lambda p: torch.optim.AdamW(p, lr=1e-2), CausalLMLoss(), data(), config
    ).fit()
    return result, model


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_ones(tmp_path: Path):
    _, eager_model = train(tmp_path / "eager", compile=False)
    compiled, model = train(tmp_path / "compiled", compile=True)
    assert compiled.exit_code == 0 and compiled.steps == 3
    (event,) = [
        e for e in read_jsonl(tmp_path / "compiled" / "events.jsonl") if e["event"] == "compile"
    ]
    assert event["compiled"] == LAYERS and event["blocks"] == "LlamaDecoderLayer"
    assert not event["whole_model"]
    layers = model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    losses = [m["loss"] for m in read_jsonl(tmp_path / "compiled" / "metrics.jsonl")]
    expected = [m["loss"] for m in read_jsonl(tmp_path / "eager" / "metrics.jsonl")]
    assert losses == pytest.approx(expected, rel=1e-4)
    assert losses[-1] < losses[0]
    # In place: the parameter names, so the checkpoints, are the eager model's.
    assert list(model.state_dict()) == list(eager_model.state_dict())
    assert sorted(p.name for p in (tmp_path / "compiled" / "checkpoints").glob("*/*")) == sorted(
        p.name for p in (tmp_path / "eager" / "checkpoints").glob("*/*")
    )


def test_without_a_compiler_the_run_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch
):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="compile: true on CPU needs a C\\+\\+ compiler"):
        train(tmp_path / "run", compile=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_on_mps_the_model_stays_eager():
    model = lora_llama()
    event = compile_blocks(model, "mps")
    assert event["compiled"] == 0 and "eager" in event["message"]
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_a_model_without_named_blocks_is_compiled_whole():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    event = compile_blocks(model, "cpu")
    assert event["whole_model"] and event["blocks"] == "Sequential"
    assert model._compiled_call_impl is not None
    assert model(torch.ones(2, 4)).shape == (2, 1)


def test_a_compiled_run_resumes_to_the_bit(tmp_path: Path):
    """Stopped after 2 steps and resumed to 4, compiled both times: the uninterrupted compiled
    run's losses and adapter, bit for bit (the compiled kernels are the same in both)."""

    def fit(run_dir: Path, steps: int):
        config = TrainConfig(
            run_dir=str(run_dir),
            effective_batch_size=4,
            micro_batch_size=2,
            max_steps=steps,
            save_every_steps=1,
            device="cpu",
            precision="fp32",
            progress="off",
            compile=True,
        )
        model = lora_llama()
        Trainer(
            model, lambda p: torch.optim.AdamW(p, lr=1e-2), CausalLMLoss(), data(), config
        ).fit()
        return {k: v for k, v in model.state_dict().items() if "lora_" in k}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit(tmp_path / "cut", 2)
        resumed = fit(tmp_path / "cut", 4)
        whole = fit(tmp_path / "whole", 4)
    finally:
        torch.set_num_threads(threads)
    events = [e["event"] for e in read_jsonl(tmp_path / "cut" / "events.jsonl")]
    assert events.count("compile") == 2 and "resume" in events
    assert [m["loss"] for m in read_jsonl(tmp_path / "cut" / "metrics.jsonl")] == [
        m["loss"] for m in read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    ]
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_auto_compiles_on_cuda_with_triton_and_nowhere_else(monkeypatch):
    import importlib.util

    from steadytrain.engine import compiling

    real = importlib.util.find_spec
    monkeypatch.setattr(
        compiling.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "triton" else real(name, *a),
    )
    assert compiling.compile_wanted("auto", "cuda")
    assert not compiling.compile_wanted("auto", "cpu")
    assert not compiling.compile_wanted("auto", "mps")
    assert compiling.compile_wanted(True, "cpu") and not compiling.compile_wanted(False, "cuda")
    monkeypatch.setattr(
        compiling.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real(name, *a),
    )
    assert not compiling.compile_wanted("auto", "cuda")  # no Triton: eager, not refused


def test_the_default_auto_leaves_a_cpu_run_eager(tmp_path: Path):
    run_dir = tmp_path / "run"
    result, model = train(run_dir, compile="auto")
    assert result.exit_code == 0
    assert not [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "compile"]
    assert all(m._compiled_call_impl is None for m in model.modules())


def saved_by_one_layer(model, ids) -> dict[tuple[int, ...], int]:
    """The activations one decoder layer saves for backward: shape → how many, leaving out the
    parameters, the layer's input and the rotary tables (no batch dimension)."""
    base = model.get_base_model().model
    hidden = base.embed_tokens(ids).detach().requires_grad_(True)
    positions = torch.arange(ids.shape[1])[None]
    rotary = base.rotary_emb(hidden, positions)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, ...]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage().data_ptr()
        batch_dim = t.dim() and t.shape[0] in (ids.shape[0], ids.numel())
        if storage not in params and storage != hidden.untyped_storage().data_ptr() and batch_dim:
            saved[storage] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = base.layers[0](hidden, position_embeddings=rotary, position_ids=positions)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    counts: dict[tuple[int, ...], int] = {}
    for shape in saved.values():
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def test_a_compiled_layer_keeps_what_its_matrix_multiplies_made_and_recomputes_the_rest():
    """The compiled block saves the MLP's two products (gate, up) but not SiLU(gate) × up, the
    down projection's input, and neither norm's output: elementwise results it recomputes in
    backward (compiling.RECOMPUTE_BUDGET), where the eager layer keeps four tensors that wide."""
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    eager = lora_llama()
    compiled = lora_llama()
    compile_blocks(compiled, "cpu")
    intermediate = eager.config.intermediate_size
    kept_eager = saved_by_one_layer(eager, ids)
    kept = saved_by_one_layer(compiled, ids)
    wide = sum(n for shape, n in kept.items() if shape[-1] == intermediate)
    wide_eager = sum(n for shape, n in kept_eager.items() if shape[-1] == intermediate)
    assert wide == 2 and wide_eager == 4  # eager: gate, up, SiLU(gate), the product
    assert sum(kept.values()) < sum(kept_eager.values())
    # The same function: the gradients of every LoRA weight agree with the eager layer's.
    for (name, a), (_, b) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        if a.grad is not None:
            assert b.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6), name


class Replayed(torch.autograd.Function):
    """x @ weight.T whose backward, as a CUDA graph's replay does, writes the weight's gradient
    into the same memory every time and hands out a new tensor over it."""

    @staticmethod
    def forward(ctx, x, weight, memory):
        ctx.save_for_backward(x, weight)
        ctx.memory = memory
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.memory.copy_(grad.t() @ x)
        memory = ctx.memory
        over_memory = torch.empty(0).set_(
            memory.untyped_storage(), 0, memory.shape, memory.stride()
        )
        return grad @ weight, over_memory, None


class GraphLikeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
        )
        self.memory = torch.zeros(3, 4)

    def forward(self, x):
        return Replayed.apply(x, self.weight, self.memory)


def test_gradients_a_graph_replay_rewrites_still_accumulate_over_micro_batches():
    """Under CUDA graphs a compiled block's backward hands out its gradients in the graph's own
    memory, which the next micro-batch's replay rewrites: `stable_gradients` gives autograd a
    copy, so the summed gradient is the plain layer's (the replayed one alone doubles the last
    micro-batch's instead)."""
    from steadytrain.engine.compiling import stable_gradients

    g = torch.Generator().manual_seed(4)
    pieces = [torch.randn(5, 4, generator=g) for _ in range(3)]
    plain = torch.nn.Linear(4, 3, bias=False)
    block = GraphLikeBlock()
    with torch.no_grad():
        plain.weight.copy_(block.weight)
    stable_gradients(block)
    for x in pieces:
        (plain(x) ** 2).sum().backward()
        (block(x) ** 2).sum().backward()
    assert torch.allclose(block.weight.grad, plain.weight.grad, atol=1e-5)
    assert block.weight.grad.untyped_storage().data_ptr() != block.memory.data_ptr()


def test_cuda_graphs_are_asked_for_cuda_blocks_only(monkeypatch):
    """`CUDA_GRAPHS` on: a CPU run's blocks are compiled without graphs and their parameters
    get no gradient copies."""
    from steadytrain.engine import compiling

    monkeypatch.setattr(compiling, "CUDA_GRAPHS", True)
    asked: list[tuple] = []
    monkeypatch.setattr(
        compiling, "recomputing_inductor", lambda *a, **k: asked.append((a, k)) or "inductor"
    )
    model = lora_llama()
    compile_blocks(model, "cpu")
    assert asked == [((compiling.RECOMPUTE_BUDGET,), {})]
    assert not any(p._backward_hooks for p in model.parameters())
    assert not model._forward_pre_hooks


def test_cuda_blocks_graphed_copy_their_gradients_and_mark_each_forward(monkeypatch):
    """`CUDA_GRAPHS` on, a CUDA run (the compiler check and inductor stood in for): every
    trainable parameter of the blocks hands autograd a copy, and each forward of the model
    begins a new step of the graphs."""
    from steadytrain.engine import compiling

    monkeypatch.setattr(compiling, "CUDA_GRAPHS", True)
    monkeypatch.setattr(compiling, "check_compiler", lambda device_type: None)
    asked: list[tuple] = []
    monkeypatch.setattr(
        compiling, "recomputing_inductor", lambda *a, **k: asked.append((a, k)) or "inductor"
    )
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = lora_llama()
    compile_blocks(model, "cuda")
    assert asked == [((compiling.RECOMPUTE_BUDGET,), {"cudagraphs": True})]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p._backward_hooks for p in trainable)
    assert not any(p._backward_hooks for p in model.parameters() if not p.requires_grad)
    model._forward_pre_hooks[next(iter(model._forward_pre_hooks))](model, ())
    assert marks == [1]
