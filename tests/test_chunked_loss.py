"""The chunked causal-LM loss: the same loss, count and gradients as the plain loss (which is
Hugging Face's own), less memory, measured on the CPU, and the same losses through the Trainer."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain.errors import BadInputError
from steadytrain.memory.chunked_loss import (
    CausalLMLoss,
    causal_lm_loss,
    chunked_causal_lm_loss,
)
from steadytrain.memory.estimate import Settings, estimate

VOCAB = 1000
BF16_RTOL = 2e-2
"""bf16 autocast: the chunk's matmul may round differently from the whole batch's (another
kernel blocking); per-token losses agree to bf16's 8 bits of mantissa, sums and gradients to
about 1 %."""


def tiny_config(tied: bool, **kw) -> LlamaConfig:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        use_cache=False,
        **kw,
    )
    config._attn_implementation = "sdpa"
    return config


def build(tied: bool, lora: str | None = None) -> torch.nn.Module:
    """A tiny Llama with random weights; `lora`: peft target_modules ("all-linear" or a
    comma-separated list). LoRA B starts at zero, so it is set random: otherwise the adapters'
    A gradients are zero in both modes and would prove nothing."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tied))
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if lora == "all-linear" else lora.split(",")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # peft: adapter on a tied lm_head
            model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def batch(b: int = 3, seq: int = 37, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random tokens; each row's first few labels (its "prompt") are -100, a different number
    per row, so rows carry different label counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    labels = ids.clone()
    for row in range(b):
        labels[row, : 2 + 5 * row] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def loss_and_grads(model, data, chunk_tokens, precision="fp32"):
    model.zero_grad(set_to_none=True)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with cast:
        loss_sum, count = causal_lm_loss(model, data, chunk_tokens=chunk_tokens)
    loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return loss_sum.detach(), count, grads


@pytest.mark.parametrize(
    ("tied", "lora", "precision"),
    [
        (False, None, "fp32"),
        (True, None, "fp32"),
        (True, "all-linear", "fp32"),
        (False, "q_proj,v_proj,lm_head", "fp32"),
        (True, None, "bf16"),
        (True, "all-linear", "bf16"),
    ],
)
def test_chunked_equals_plain_loss_count_and_every_gradient(tied, lora, precision):
    model = build(tied, lora)
    data = batch()
    plain, plain_count, plain_grads = loss_and_grads(model, data, None, precision)
    # 3 × 37 = 111 positions in chunks of 16: six full chunks and an uneven last one of 15
    chunked, count, grads = loss_and_grads(model, data, 16, precision)

    expected_count = int((data["labels"][:, 1:] != -100).sum())
    assert (
        int(plain_count) == int(count) == expected_count == 3 * 36 - (1 + 6 + 11)
    )  # position 0 has no label
    assert count.dtype == torch.int64
    rtol = 1e-6 if precision == "fp32" else BF16_RTOL
    assert float(chunked) == pytest.approx(float(plain), rel=rtol)
    if tied and lora is None:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert grads.keys() == plain_grads.keys()
    if lora == "q_proj,v_proj,lm_head":
        assert any("lm_head.lora_A" in name for name in grads)
    for name, grad in grads.items():
        want = plain_grads[name]
        scale = want.abs().max().item()
        assert scale > 0, name
        tolerance = (1e-5 if precision == "fp32" else BF16_RTOL) * scale
        assert (grad - want).abs().max().item() <= tolerance, name


def test_plain_mode_is_hugging_faces_own_loss_times_the_count():
    model = build(tied=True)
    data = batch()
    with torch.no_grad():
        loss_sum, count = causal_lm_loss(model, data)
        hf = model(input_ids=data["input_ids"], labels=data["labels"]).loss
    assert float(loss_sum) == pytest.approx(float(hf * count), rel=1e-6)


def test_masked_tokens_contribute_nothing():
    """Changing the labels under -100 changes nothing; the sum is over label tokens only, and an
    all-masked batch gives zero, a zero count and zero gradients (not NaN)."""
    model = build(tied=False)
    data = batch()
    with torch.no_grad():
        per_token = torch.nn.functional.cross_entropy(
            model(input_ids=data["input_ids"]).logits[:, :-1].reshape(-1, VOCAB).float(),
            data["input_ids"][:, 1:].reshape(-1),
            reduction="none",
        ).view(3, 36)
    keep = data["labels"][:, 1:] != -100
    loss_sum, _ = causal_lm_loss(model, data, chunk_tokens=10)
    assert float(loss_sum.detach()) == pytest.approx(float(per_token[keep].sum()), rel=1e-6)
    assert float(per_token[~keep].sum()) > 1.0  # the masked tokens would have counted

    masked = {**data, "labels": torch.full_like(data["labels"], -100)}
    loss_sum, count = causal_lm_loss(model, masked, chunk_tokens=10)
    loss_sum.backward()
    assert float(loss_sum.detach()) == 0.0 and int(count) == 0
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 111, 4096])
def test_any_chunk_size_gives_the_plain_loss(chunk_tokens):
    """One token per chunk, uneven chunks, exactly the batch, and a chunk larger than it."""
    model = build(tied=True)
    data = batch()
    plain, _, plain_grads = loss_and_grads(model, data, None)
    chunked, _, grads = loss_and_grads(model, data, chunk_tokens)
    assert float(chunked) == pytest.approx(float(plain), rel=1e-6)
    embed = grads["model.embed_tokens.weight"]  # tied: from the embedding and every chunk
    want = plain_grads["model.embed_tokens.weight"]
    assert (embed - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_without_grad_it_runs_no_checkpoint_and_gives_the_same_loss():
    model = build(tied=True)
    data = batch()
    with torch.no_grad():
        plain, _ = causal_lm_loss(model, data)
        chunked, count = chunked_causal_lm_loss(model, data)
    assert not chunked.requires_grad
    assert float(chunked) == pytest.approx(float(plain), rel=1e-6)
    assert int(count) == int((data["labels"][:, 1:] != -100).sum())


def test_logit_softcapping_and_scaling_are_applied_as_the_model_does():
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        use_cache=False,
    )
    data = batch(b=2, seq=20)
    for model_class, config in (
        (Gemma2ForCausalLM, Gemma2Config(head_dim=16, final_logit_softcapping=3.0, **common)),
        (GraniteForCausalLM, GraniteConfig(logits_scaling=4.0, **common)),
    ):
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        model = model_class(config).train()
        with torch.no_grad():  # logits of several units, where the cap and the scale bite
            torch.nn.init.normal_(model.lm_head.weight, std=1.0)
        plain, _ = causal_lm_loss(model, data)
        chunked, _ = causal_lm_loss(model, data, chunk_tokens=8)
        assert chunked.requires_grad
        assert float(chunked.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
        with torch.no_grad():  # the transform matters: without it the loss differs
            hidden = model.model(input_ids=data["input_ids"]).last_hidden_state
            untransformed = torch.nn.functional.cross_entropy(
                model.lm_head(hidden)[:, :-1].reshape(-1, VOCAB),
                data["labels"][:, 1:].reshape(-1),
                reduction="sum",
            )
        assert float(untransformed) != pytest.approx(float(plain.detach()), rel=1e-3)


def test_unsupported_families_and_bad_inputs_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    data = batch(b=2, seq=12)
    plain, count = causal_lm_loss(gpt2, data)  # the plain loss works for any causal LM
    assert plain.requires_grad and int(count) > 0
    with pytest.raises(BadInputError, match=r"chunk_tokens.*'gpt2'.*chunk_tokens=None"):
        causal_lm_loss(gpt2, data, chunk_tokens=8)
    model = build(tied=True)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(BadInputError, match="chunk_tokens"):
            causal_lm_loss(model, data, chunk_tokens=bad)
    with pytest.raises(BadInputError, match=r"batch: .*'labels'"):
        causal_lm_loss(model, {"input_ids": data["input_ids"]}, chunk_tokens=8)
    with pytest.raises(BadInputError, match="batch: "):
        causal_lm_loss(model, {"input_ids": data["input_ids"], "labels": data["labels"][:, 1:]})


def test_under_the_models_activation_checkpointing_the_values_are_the_same():
    """The engine's OOM ladder turns on the model's own checkpointing; the chunked loss calls
    the model's body, whose layers then recompute, and still gives the plain gradients."""
    model = build(tied=True, lora="all-linear")
    data = batch()
    plain, _, plain_grads = loss_and_grads(model, data, None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chunked, _, grads = loss_and_grads(model, data, 16)
    assert float(chunked) == pytest.approx(float(plain), rel=1e-6)
    for name, grad in grads.items():
        want = plain_grads[name]
        assert (grad - want).abs().max().item() <= 1e-5 * want.abs().max().item(), name


def test_causal_lm_loss_object_switches_chunking_on_once():
    model = build(tied=True)
    data = batch()
    loss = CausalLMLoss()
    plain, _, _ = loss_and_grads(model, data, loss.chunk_tokens)
    assert loss.enable_chunking(16) is True
    assert loss.enable_chunking(16) is False  # already that small: the ladder moves on
    assert loss.enable_chunking(64) is False
    assert loss.enable_chunking(8) is True and loss.chunk_tokens == 8
    chunked, _ = loss(model, data)
    assert float(chunked.detach()) == pytest.approx(float(plain), rel=1e-6)
    with pytest.raises(BadInputError, match="chunk_tokens"):
        CausalLMLoss(chunk_tokens=0)


def test_distributed_data_parallel_is_refused_for_the_chunked_loss(tmp_path):
    """DDP synchronises gradients only through its own forward, which a chunked loss skips."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(build(tied=True))
        data = batch(b=2, seq=12)
        plain, _ = causal_lm_loss(ddp, data)
        assert plain.requires_grad
        with pytest.raises(BadInputError, match="DistributedDataParallel"):
            causal_lm_loss(ddp, data, chunk_tokens=8)
    finally:
        dist.destroy_process_group()


def test_prompt_learning_adapters_are_refused():
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(
        LlamaForCausalLM(tiny_config(tied=True)),
        PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    )
    with pytest.raises(BadInputError, match="PREFIX_TUNING"):
        causal_lm_loss(model, batch(b=2, seq=12), chunk_tokens=8)


# -- memory -----------------------------------------------------------------------------------


class LivePeak(TorchDispatchMode):
    """Peak bytes of the tensors that ops create while the mode is on, live at once: every op
    output's storage is counted when it appears and uncounted when its tensor is freed (autograd
    keeps a saved tensor's Python object alive with it). Parameters and inputs existed before, so
    this is the step's own memory, what a GPU's max_memory_allocated adds on top of them."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key and key not in self.live:
                    self.live[key] = t.untyped_storage().nbytes()
                    self.now += self.live[key]
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(t, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def step_peak(model, data, chunk_tokens) -> int:
    model.zero_grad(set_to_none=True)
    mode = LivePeak()
    with mode:
        loss_sum, _ = causal_lm_loss(model, data, chunk_tokens=chunk_tokens)
        loss_sum.backward()
    return mode.peak


def test_chunked_loss_peak_holds_one_chunk_of_logits_not_all():
    """4 × 64 = 256 tokens × vocab 1000: the plain loss's logits alone are 256,000 values. The
    chunked loss's peak is lower by about 12 B per logit of the tokens outside one chunk, what
    the estimator's logits row says (within 15 %), and a smaller chunk lowers it further."""
    model = build(tied=True)
    data = batch(b=4, seq=64)
    tokens, chunk = 256, 32
    plain = step_peak(model, data, None)
    chunked = step_peak(model, data, chunk)
    assert step_peak(model, data, 128) > chunked
    measured_saving = plain - chunked
    assert measured_saving > 8 * (tokens - chunk) * VOCAB

    settings = dict(micro_batch_size=4, seq=64, method="full", device_type="cpu")
    config = tiny_config(tied=True)
    predicted = estimate(config, Settings(**settings)).row("logits and loss") - estimate(
        config, Settings(**settings, chunked_loss=True, chunk_tokens=chunk)
    ).row("logits and loss")
    assert predicted == pytest.approx(measured_saving, rel=0.15)


def test_chunked_loss_saves_no_full_vocabulary_tensor_for_backward():
    """Between forward and backward the plain loss keeps tokens × vocab values (the log-
    probabilities); the chunked loss keeps none: a plain Python loop over chunks would keep
    every chunk's."""
    model = build(tied=True, lora="all-linear")
    data = batch(b=4, seq=64)

    def vocabulary_wide_saved(chunk_tokens) -> list[int]:
        """numel of the saved tensors that hold one value per vocabulary entry per token."""
        sizes = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == VOCAB:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            causal_lm_loss(model, data, chunk_tokens=chunk_tokens)
        return sizes

    assert max(vocabulary_wide_saved(None)) >= 4 * 63 * VOCAB
    assert vocabulary_wide_saved(32) == []


# -- through the engine -----------------------------------------------------------------------


def test_trainer_losses_are_the_same_with_the_chunked_loss(tmp_path):
    from steadytrain import TrainConfig, Trainer
    from steadytrain.telemetry.files import read_jsonl

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (16, 24), generator=g)
    samples = []
    for i in range(16):
        labels = ids[i].clone()
        labels[: i % 6] = -100
        samples.append({"input_ids": ids[i].clone(), "labels": labels})

    def run(name, loss_fn):
        model = build(tied=True, lora="all-linear")
        Trainer(
            model=model,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
            loss_fn=loss_fn,
            train_data=samples,
            config=TrainConfig(
                run_dir=str(tmp_path / name),
                effective_batch_size=8,
                micro_batch_size=4,
                max_steps=4,
                save_every_steps=4,
                device="cpu",
                seed=0,
            ),
        ).fit()
        return [m["loss"] for m in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in m]

    plain = run("plain", causal_lm_loss)
    chunked = run("chunked", CausalLMLoss(chunk_tokens=20))
    assert len(plain) == 4
    assert chunked == pytest.approx(plain, rel=1e-5)
    assert plain[-1] < plain[0]
