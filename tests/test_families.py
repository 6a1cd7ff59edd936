"""The activation formulas of Qwen3, Gemma 2, Gemma 3, Phi-3, GPT-NeoX, GPT-2 and OLMo 2
(memory/families.py) against the bytes autograd really keeps on the CPU: a tiny model of each
family built from its config class (no downloads), full fine-tune and peft LoRA, activation
checkpointing off and on; each storage counted once, parameters and buffers left out."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

import forkserver
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
)

from steadytrain.memory.activations import KNOWN_FAMILIES, SCRATCH_PROBABILITIES
from steadytrain.memory.analytic import analytic_for
from steadytrain.memory.estimate import estimate
from steadytrain.memory.settings import Settings

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, vocab_size=300)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILIES = {
    "qwen3": lambda: Qwen3Config(**TINY, **HEADS),
    "gemma2": lambda: Gemma2Config(**TINY, **HEADS),
    "gemma3": lambda: Gemma3TextConfig(  # windows shorter than the sequence: masked layers
        **TINY,
        **HEADS,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "phi3": lambda: Phi3Config(**TINY, **HEADS, pad_token_id=0),
    "gpt_neox": lambda: GPTNeoXConfig(**TINY, num_attention_heads=4),
    "gpt2": lambda: GPT2Config(  # GPT-2's own dropouts on the residual and the embedding
        n_embd=64, n_layer=3, n_head=4, vocab_size=300, n_positions=128, attn_pdrop=0.0
    ),
    "olmo2": lambda: Olmo2Config(**TINY, **HEADS),
}
SEQ, MICRO = 48, 2


def config_of(family: str, attention: str = "sdpa"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eos/bos ids outside the tiny vocabulary
        config = FAMILIES[family]()
    config._attn_implementation = "eager" if family == "gemma2" else attention
    return config


def model_of(config, method: str, targets: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        names = targets if targets == "all-linear" else targets.split(",")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # GPT-2's Conv1D fan_in_fan_out
            lora = LoraConfig(r=8, target_modules=names)
            model = get_peft_model(model, lora).base_model.model
    return model.train()


def saved_bytes(model, precision: str, checkpointing: bool, micro: int) -> int:
    """What autograd keeps for backward after one forward, each storage once. With
    checkpointing the layers' own tensors are recomputed: what stays is the tensors saved
    outside them plus each layer's input, and one layer's tensors at a time come back in
    backward (the largest, from a run without checkpointing)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    where = [-1]
    seen: dict[int, tuple] = {}  # address: (bytes, layer or -1, the storage)

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # kept alive so that no address is reused
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), where[0], storage))
        return t

    def enter(i):
        def hook(module, args, kwargs):
            where[0] = i
            hidden = args[0] if args else kwargs["hidden_states"]
            if checkpointing:  # the layer's input stays for its recomputation
                storage = hidden.untyped_storage()
                seen.setdefault(storage.data_ptr(), (storage.nbytes(), -1, storage))

        return hook

    hooks = [
        layer.register_forward_pre_hook(enter(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    hooks += [
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)) for layer in layers
    ]
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 300, (micro, SEQ))
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    total = sum(entry[0] for entry in seen.values())
    if not checkpointing:
        return total
    model.gradient_checkpointing_disable()
    per_layer = _per_layer(model, layers, ids, cast, params)
    return total + max(per_layer)


def _per_layer(model, layers, ids, cast, params) -> list[int]:
    where = [-1]
    per = [0] * len(layers)
    seen: dict[int, object] = {}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen and where[0] >= 0:
            seen[key] = storage  # kept alive so that no address is reused
            per[where[0]] += storage.nbytes()
        return t

    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i))
        for i, layer in enumerate(layers)
    ]
    hooks += [
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)) for layer in layers
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return per


def estimated(config, settings: Settings) -> int:
    """The estimate's activations (and autocast's weight copies, which autograd saves too),
    less the attention backward's scratch, which is working memory rather than saved, plus
    Gemma 2's tanh of the logits (saved in forward; the estimate has it in the logits row)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = estimate(config, settings)
    assert "measured" not in next(r.formula for r in result.rows if r.name == "activations")
    total = result.row("activations") + result.row("autocast weight copies")
    text = config.get_text_config()
    c = 2 if settings.autocast or settings.weights_dtype == "bf16" else 4
    if getattr(text, "final_logit_softcapping", None):
        total += c * settings.micro_batch_size * settings.seq * text.vocab_size
    if config._attn_implementation == "eager":
        scratch = SCRATCH_PROBABILITIES["eager"] * c * text.num_attention_heads * settings.seq
        total -= scratch * settings.seq * settings.micro_batch_size
    return total


def check(
    family,
    method,
    checkpointing,
    *,
    targets="all-linear",
    precision="fp32",
    attention="sdpa",
    weights="fp32",
    micro=MICRO,
):
    config = config_of(family, attention)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights]
    model = model_of(config, method, targets, dtype)
    real = saved_bytes(model, precision, checkpointing, micro)
    settings = Settings(
        micro_batch_size=micro,
        seq=SEQ,
        method=method,
        lora_r=8,
        lora_targets=targets,
        precision=precision,
        weights_dtype=weights,
        checkpointing=checkpointing,
        attention=config._attn_implementation,
        device_type="cpu",
    )
    guess = estimated(config, settings)
    assert guess == pytest.approx(real, rel=0.05), (family, guess, real, guess / real - 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_the_bytes_autograd_keeps(family, method, checkpointing):
    check(family, method, checkpointing)


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("gpt2", "c_attn"),
        ("gpt_neox", "query_key_value,dense_4h_to_h"),
        ("phi3", "qkv_proj,gate_up_proj"),
        ("qwen3", "q_proj,v_proj"),
        ("gemma3", "o_proj,down_proj"),
    ],
)
def test_each_familys_own_lora_target_names(family, targets):
    check(family, "lora", False, targets=targets)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gpt_neox", "olmo2", "gemma3"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_eager_attention(family, method):
    """At micro-batch 1: eager attention's matmul takes v (a view of a fused q/k/v output) as
    it is then, and copies it at larger micro-batches; the estimate keeps the larger figure."""
    check(family, method, False, attention="eager", micro=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("method", "weights"), [("lora", "bf16"), ("full", "fp32"), ("full", "bf16")]
)
def test_bf16_autocast(family, method, weights):
    """CPU autocast runs LayerNorm and pow in bf16 (CUDA's runs them in fp32: the estimate
    follows `device_type`). Without checkpointing: with it, autocast's cache of the adapters'
    casts outlives the layers but is no saved tensor, so the hooks here cannot see it."""
    check(family, method, False, precision="bf16", weights=weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_estimate_knows_every_family(family):
    config = config_of(family)
    assert config.get_text_config().model_type in KNOWN_FAMILIES
    settings = Settings(seq=SEQ, method="lora", lora_targets="all-linear", device_type="cuda")
    result = estimate(config, settings)
    assert result.activations_known and result.total > result.peak > 0
    assert not any("unknown" in note or "measured" in note for note in result.notes)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_live_model_of_every_family_gets_the_analytic_estimate(family):
    """The trainer's cross-check and the plan read the live model: no family falls back."""
    model = model_of(config_of(family), "lora", "all-linear")
    batch = {"input_ids": torch.zeros(MICRO, SEQ, dtype=torch.long)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    analytic, why = analytic_for(
        model, batch, precision="fp32", optimizer=optimizer, device_type="cpu"
    )
    assert why is None and analytic is not None
    assert analytic.settings.method == "lora"
    assert analytic.at(1, False).total > 0


SMOKE = ("gpt2", "gemma2")  # a Conv1D family and a softcapped, sandwich-normed one: each
# family's formula is checked above; this is the bench's own code path, estimate and plan


def test_the_gpu_bench_runs_in_smoke_mode(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "families.py"
    out = tmp_path / "families.json"
    done = forkserver.run(
        [sys.executable, str(script), "--smoke", "--families", ",".join(SMOKE), "--out", str(out)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    data = json.loads(out.read_text())
    assert {row["family"] for row in data["estimate"]} == set(SMOKE)
    assert all(row["estimate_peak"] > 0 and not row["error"] for row in data["estimate"])
    plans = {row["family"]: row for row in data["plan"]}
    assert set(plans) == set(SMOKE)
    for row in plans.values():  # the CPU has no peak counter; the plan and the sweep do run
        assert "error" not in row and row["planned_micro"] >= 1 and not row["out_of_memory"]
        assert row["tokens_per_s"] > 0 and row["best"]["tokens_per_s"] > 0
