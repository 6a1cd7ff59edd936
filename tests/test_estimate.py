"""The analytic memory estimator: exact parameter counts, exact LoRA trainable counts, the 3B
figure, activations against the bytes autograd really saves, and the command's contract."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain.cli.memory_commands import estimate_command
from steadytrain.errors import BadInputError
from steadytrain.memory.estimate import (
    NF4_BYTES_PER_PARAM,
    Settings,
    count_parameters,
    estimate,
    load_config,
)

ALL7 = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def tiny(tied: bool = False, layers: int = 2, **kw) -> LlamaConfig:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=tied,
        use_cache=False,
        **kw,
    )
    config._attn_implementation = "sdpa"
    return config


def mid(layers: int = 8) -> LlamaConfig:
    """A shape whose activations and states are a real share of its total (a toy's total is
    mostly the runtime's fixed overhead, so no knob saves the advisor's 1 % of it); on the meta
    device it costs nothing."""
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def llama_3b() -> LlamaConfig:
    """Llama-3.2-3B's published shape."""
    return LlamaConfig(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_meta_count_equals_the_instantiated_model(tied):
    config = tiny(tied)
    real = LlamaForCausalLM(config)
    counts = count_parameters(config)
    assert counts.total == sum(p.numel() for p in real.parameters())
    assert counts.embedding == 256 * 64
    assert counts.lm_head == (0 if tied else 256 * 64)
    linear = sum(
        p.numel()
        for name, p in real.named_parameters()
        if ".layers." in name and name.endswith("proj.weight")
    )
    assert counts.linear_in_layers == linear


@pytest.mark.parametrize(
    ("targets", "tied"),
    [("q_proj,v_proj", False), (ALL7, True), ("all-linear", False), ("o_proj,lm_head", False)],
)
def test_lora_trainable_count_equals_peft(targets, tied):
    from peft import LoraConfig, get_peft_model

    config = tiny(tied)
    target_modules = "all-linear" if targets == "all-linear" else targets.split(",")
    peft_model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=8, target_modules=target_modules)
    )
    trainable, total = peft_model.get_nb_trainable_parameters()
    result = estimate(config, Settings(method="lora", lora_r=8, lora_targets=targets, seq=16))
    assert result.trainable == trainable
    assert result.params + result.trainable == total
    assert result.row("trainable adapters") == 4 * trainable
    assert result.row("gradients") == 4 * trainable
    assert result.row("optimizer states") == 2 * 4 * trainable


def test_llama_3b_fp32_weights_are_3_21_billion_params_12_85_gb_11_97_gib():
    result = estimate(llama_3b(), Settings(method="lora", seq=1024))
    assert result.params == 3_212_749_824
    weights = result.row("weights")
    assert weights == 3_212_749_824 * 4
    assert round(weights / 1e9, 2) == 12.85  # the seed's "~12 GB" is 12.85 GB ...
    assert round(weights / 2**30, 2) == 11.97  # ... which is 11.97 GiB


def _saved_bytes(model, config, settings: Settings) -> int:
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded): what
    the activation rows claim, measured on the CPU by hooking every saved tensor."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, config.vocab_size, (settings.micro_batch_size, settings.seq))
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if settings.precision == "bf16"
        else contextlib.nullcontext()
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        model(input_ids=ids, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize(
    ("method", "precision", "weights", "targets", "dropout", "attention"),
    [
        ("full", "fp32", "fp32", ALL7, 0.0, "sdpa"),
        ("full", "bf16", "fp32", ALL7, 0.0, "sdpa"),
        ("full", "bf16", "bf16", ALL7, 0.0, "sdpa"),
        ("full", "bf16", "fp32", ALL7, 0.0, "eager"),
        ("lora", "fp32", "fp32", ALL7, 0.0, "sdpa"),
        ("lora", "bf16", "fp32", "q_proj,k_proj,v_proj,o_proj", 0.0, "sdpa"),
        ("lora", "bf16", "bf16", "q_proj,v_proj", 0.0, "sdpa"),
        ("lora", "bf16", "fp32", ALL7, 0.1, "sdpa"),
        ("lora", "fp32", "fp32", "o_proj", 0.0, "eager"),
    ],
)
def test_activations_match_the_bytes_autograd_saves(
    method, precision, weights, targets, dropout, attention
):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = tiny(layers=4)
    config._attn_implementation = attention
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights]
    model = LlamaForCausalLM(config).to(dtype)
    if method == "lora":
        lora = LoraConfig(r=8, target_modules=targets.split(","), lora_dropout=dropout)
        model = get_peft_model(model, lora).base_model.model
    model.train()
    settings = Settings(
        micro_batch_size=2,
        seq=48,
        precision=precision,
        weights_dtype=weights,
        method=method,
        lora_r=8,
        lora_targets=targets,
        lora_dropout=dropout,
        attention=attention,
        device_type="cpu",
    )
    measured = _saved_bytes(model, config, settings)
    result = estimate(config, settings)
    estimated = result.row("activations") + result.row("autocast weight copies")
    if attention == "eager":  # the softmax backward's scratch is counted, but is not saved
        compute = 2 if precision == "bf16" or weights == "bf16" else 4
        estimated -= 2 * compute * config.num_attention_heads * settings.seq * 2 * settings.seq
    assert estimated == pytest.approx(measured, rel=0.06)


def test_autocast_over_fp32_weights_counts_the_low_precision_copies():
    config = tiny()
    counts = count_parameters(config)
    linear = counts.linear_in_layers + counts.lm_head
    full = estimate(config, Settings(precision="bf16", seq=8))
    assert full.row("autocast weight copies") == 2 * linear
    same = estimate(config, Settings(precision="bf16", weights_dtype="bf16", seq=8))
    assert same.row("autocast weight copies") == 0


def test_sdpa_keeps_seq_squared_probabilities_where_no_fused_kernel_runs():
    from steadytrain.memory.estimate import attention_kernel, shape_of

    shape = shape_of(llama_3b())
    assert attention_kernel(shape, Settings(device_type="mps", precision="bf16")) == "math"
    assert attention_kernel(shape, Settings(device_type="cuda")) == "math"  # fp32, 8 of 24 KV
    assert attention_kernel(shape, Settings(device_type="cuda", precision="bf16")) == "fused"
    assert attention_kernel(shape, Settings(device_type="cpu")) == "fused"
    assert attention_kernel(shape, Settings(device_type="mps", attention="flash")) == "fused"

    def per_token(seq: int, device: str) -> float:
        result = estimate(llama_3b(), Settings(method="lora", seq=seq, device_type=device))
        return result.row("activations") / seq

    assert per_token(2048, "cpu") == pytest.approx(per_token(1024, "cpu"), rel=1e-3)
    mps_growth = per_token(2048, "mps") - per_token(1024, "mps")
    # each of 28 layers keeps 24 heads × 1024 more fp32 probabilities per token, and one
    # layer's backward needs four times that as scratch
    assert mps_growth == (28 + 4) * 24 * 1024 * 4


def test_dropout_mask_is_one_byte_on_cuda_and_fp32_elsewhere():
    config = tiny(layers=3)
    common = dict(method="lora", lora_r=8, lora_targets="q_proj", lora_dropout=0.1, seq=10)
    cuda = estimate(config, Settings(device_type="cuda", precision="bf16", **common))
    cpu = estimate(config, Settings(device_type="cpu", precision="bf16", **common))
    # one q_proj per layer, 64 wide, 10 tokens: 3 bytes more per value on CPU
    assert cpu.row("activations") - cuda.row("activations") == 3 * 64 * 10 * 3


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    config = llama_3b()
    plain = estimate(config, Settings(method="lora", seq=2048))
    saved = estimate(config, Settings(method="lora", seq=2048, checkpointing=True))
    assert saved.row("activations") < plain.row("activations") / 5
    assert saved.row("activations") > 28 * 4 * 3072 * 2048  # every layer's fp32 input
    assert saved.total < plain.total
    assert saved.phase == "backward"  # the 128k-vocabulary logits outweigh one layer
    fixed = saved.row("weights") + saved.row("trainable adapters") + saved.row("optimizer states")
    layer_inputs = 2048 * (28 * 4 * 3072 + 4 * 3072 + 2 * 128 * 4)
    assert saved.peak == fixed + layer_inputs + saved.row("logits and loss")


def test_peak_is_weights_states_and_the_larger_phase():
    config = tiny()
    short = estimate(config, Settings(seq=4))
    assert short.phase == "optimizer step"
    fixed = short.row("weights") + short.row("optimizer states")
    assert short.peak == fixed + short.row("gradients") + short.row("optimizer step temporaries")
    long = estimate(config, Settings(seq=4096, micro_batch_size=4))
    assert long.phase == "backward"
    backward = (
        long.row("activations") + long.row("logits and loss") + long.row("autocast weight copies")
    )
    assert long.peak == fixed + backward
    assert long.total == long.peak + long.overhead


def test_4bit_base_quantizes_decoder_linears_only():
    config = llama_3b()
    counts = count_parameters(config)
    result = estimate(
        config, Settings(method="lora", load_in_4bit=True, weights_dtype="bf16", seq=512)
    )
    rest = counts.total - counts.linear_in_layers
    expected = int(counts.linear_in_layers * NF4_BYTES_PER_PARAM) + rest * 2
    assert result.row("weights") == expected
    assert 2.0e9 < result.row("weights") < 2.5e9  # 2.8 B linear weights at ~0.52 B + embeddings


def test_adam8bit_keeps_small_tensors_in_fp32():
    config = tiny()
    result = estimate(config, Settings(optimizer="adamw8bit", seq=8))
    counts = count_parameters(config)
    big = sum(n for n in counts.tensors if n >= 4096)
    small = counts.total - big
    assert small > 0 and big > 0
    assert result.row("optimizer states") == int(2 * (1 + 4 / 256) * big) + 8 * small


def test_unknown_family_counts_params_and_says_activations_are_unknown(monkeypatch):
    """A family without a formula whose forward cannot run on the meta device either (forced
    here: OPT does run there, tests/test_estimate_families.py) says unknown, not a guess."""
    from transformers import OPTConfig, OPTForCausalLM

    from steadytrain.memory import measured

    def cannot(*args, **kwargs):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    monkeypatch.setattr(measured, "measured_activations", cannot)
    config = OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=128,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
    )
    result = estimate(config, Settings(seq=16))
    assert result.params == sum(p.numel() for p in OPTForCausalLM(config).parameters())
    assert result.row("activations") is None
    assert result.total is None
    assert any("opt" in n and "probe" in n for n in result.notes)


def test_bad_settings_name_every_flag():
    with pytest.raises(BadInputError) as info:
        Settings(micro_batch_size=0, precision="fp8", optimizer="lion").check()
    message = str(info.value)
    assert "--micro-batch" in message and "--precision" in message and "--optimizer" in message
    with pytest.raises(BadInputError, match="--method lora"):
        Settings(load_in_4bit=True, weights_dtype="bf16").check()
    with pytest.raises(BadInputError, match="gate_proj"):
        estimate(tiny(), Settings(method="lora", lora_targets="c_attn"))


def test_local_directory_config(tmp_path):
    tiny(tied=True).save_pretrained(tmp_path)
    config = load_config(str(tmp_path))
    assert config.hidden_size == 64 and config.tie_word_embeddings
    with pytest.raises(BadInputError, match="is not a directory"):
        load_config(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match=r"no config\.json"):
        load_config(str(tmp_path / "empty"))


def test_command_json_and_exit_codes(tmp_path, capsys):
    tiny().save_pretrained(tmp_path)
    code = estimate_command(str(tmp_path), seq=64, memory="2GiB", json_output=True)
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["fits"] is True
    assert data["params"] == count_parameters(tiny()).total
    assert [r["name"] for r in data["rows"]] == [
        "weights",
        "trainable adapters",
        "gradients",
        "optimizer states",
        "optimizer step temporaries",
        "activations",
        "autocast weight copies",
        "logits and loss",
        "framework/allocator overhead",
    ]
    code = estimate_command(str(tmp_path), seq=64, memory="300MiB", json_output=True)
    assert code == 3 and json.loads(capsys.readouterr().out)["fits"] is False
    with pytest.raises(BadInputError, match="--memory"):
        estimate_command(str(tmp_path), memory="sixteen")


def test_a_tiny_fine_tune_on_cpu_is_held_to_what_its_process_really_takes(
    tmp_path, capsys, monkeypatch
):
    """On CPU memory_budget is what the whole process may use. A tiny Llama's fine-tune peaks
    near 400 MiB resident with a CPU-only torch and near 1 GiB with one built for CUDA
    (OVERHEAD_FIXED_CPU*), so `finetune --dry-run` at 450 MiB says it fits with the first and
    not with the second, and under 400 MiB with neither."""
    from tiny_models import save_byte_llama

    from steadytrain.cli import main

    save_byte_llama(tmp_path / "tiny")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    config = {
        "model_name_or_path": str(tmp_path / "tiny"),
        "train_file": str(tmp_path / "train.jsonl"),
        "max_seq_length": 32,
        "device": "cpu",
        "lora": {"r": 4},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "finetune.json").write_text(json.dumps(config))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    for cuda, budget, code in ((None, 450, 0), (None, 390, 3), ("13.0", 450, 3), ("13.0", 1100, 0)):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        capsys.readouterr()
        given = ["--config", str(tmp_path / "finetune.json"), "--set", f"memory_budget={budget}MiB"]
        with pytest.raises(SystemExit) as done:
            main(["finetune", "--dry-run", *given])
        said = capsys.readouterr()
        assert done.value.code == code, (cuda, said.out + said.err)
        verdict = "fits" if code == 0 else "does not fit"
        of = f"{budget / 1024:.2f} GiB" if budget >= 1024 else f"{budget}.00 MiB"
        assert re.search(rf"peak: estimated [\d.]+ [MG]iB of {of}: {verdict}", said.out), said.out


def test_command_table_says_does_not_fit_with_knobs(tmp_path):
    from rich.console import Console

    mid().save_pretrained(tmp_path)
    console = Console(record=True, width=200)
    code = estimate_command(str(tmp_path), seq=2048, memory="1MiB", console=console)
    text = console.export_text()
    assert code == 3
    assert "does not fit" in text and "--checkpointing" in text and "weights" in text


def test_offline_hub_id_is_a_bad_input_naming_the_id(tmp_path):
    code = (
        "from steadytrain.errors import BadInputError\n"
        "from steadytrain.memory.estimate import load_config\n"
        "try:\n"
        "    load_config('someone/not-cached-model')\n"
        "except BadInputError as exc:\n"
        "    print(exc)\n"
        "    raise SystemExit(exc.exit_code)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "someone/not-cached-model" in done.stdout
    assert "local directory" in done.stdout


def test_chunked_loss_row_holds_one_chunk_and_the_hidden_states():
    config = llama_3b()  # vocab 128,256, hidden 3072
    common = dict(
        method="lora", micro_batch_size=8, seq=1024, precision="bf16", weights_dtype="bf16"
    )
    plain = estimate(config, Settings(**common))
    chunked = estimate(config, Settings(**common, chunked_loss=True, chunk_tokens=1024))
    assert plain.row("logits and loss") == 12 * 8192 * 128256
    assert chunked.row("logits and loss") == 12 * 1024 * 128256 + 2 * 8192 * 3072
    assert plain.peak - chunked.peak == plain.row("logits and loss") - chunked.row(
        "logits and loss"
    )
    assert plain.row("activations") == chunked.row("activations")
    assert any("--chunked-loss" in n for n in plain.notes)
    assert not any("--chunked-loss" in n for n in chunked.notes)
    # a chunk larger than the micro-batch's tokens holds them all: chunking buys nothing
    short = estimate(config, Settings(**{**common, "micro_batch_size": 1}, chunked_loss=True))
    assert short.row("logits and loss") == 12 * 1024 * 128256 + 2 * 1024 * 3072


def test_chunked_loss_casts_the_output_weight_per_chunk_instead_of_saving_it():
    """Under autocast over fp32 weights the plain loss saves the output layer's bf16 copy for
    backward (weight copies row); the chunked loss casts it per chunk (logits row)."""
    config = tiny(layers=2)
    common = dict(method="lora", seq=64, micro_batch_size=4, precision="bf16")
    plain = estimate(config, Settings(**common))
    chunked = estimate(config, Settings(**common, chunked_loss=True, chunk_tokens=32))
    head_copy = 2 * 256 * 64
    assert plain.row("autocast weight copies") - chunked.row("autocast weight copies") == head_copy
    assert chunked.row("logits and loss") == 12 * 32 * 256 + 4 * 256 * 64 + head_copy


def test_chunked_loss_with_checkpointing_moves_the_peak_off_the_logits():
    """With checkpointing the 128k logits set the backward peak; chunked, they shrink below
    one recomputed layer, and the peak falls by about the logits' difference."""
    config = llama_3b()
    common = dict(
        method="lora", seq=2048, checkpointing=True, precision="bf16", weights_dtype="bf16"
    )
    plain = estimate(config, Settings(**common))
    chunked = estimate(config, Settings(**common, chunked_loss=True, chunk_tokens=256))
    assert chunked.row("logits and loss") == 12 * 256 * 128256 + 2 * 2048 * 3072
    assert plain.phase == chunked.phase == "backward"
    assert plain.peak - chunked.peak > 2.5 * 2**30  # 2.9 GiB of logits, 0.4 GiB chunked


def test_chunked_loss_flags_reach_the_command_and_are_checked(tmp_path, capsys):
    tiny().save_pretrained(tmp_path)
    args = dict(seq=64, micro_batch_size=4, memory="2GiB", json_output=True)
    estimate_command(str(tmp_path), **args)
    plain = json.loads(capsys.readouterr().out)
    estimate_command(str(tmp_path), **args, chunked_loss=True, chunk_tokens=16)
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["settings"]["chunked_loss"] is True
    assert chunked["settings"]["chunk_tokens"] == 16

    def logits(data):
        return next(r["bytes"] for r in data["rows"] if r["name"] == "logits and loss")

    assert logits(chunked) == 12 * 16 * 256 + 4 * 256 * 64 < logits(plain)
    with pytest.raises(BadInputError, match="--chunk-tokens"):
        estimate_command(str(tmp_path), **args, chunked_loss=True, chunk_tokens=0)
