"""The fused linear cross-entropy path of `CausalLMLoss`: on CPU it falls back to the checkpointed
chunks (the same values as the plain loss); where the kernel runs, the wrapper hands it exactly
the plain loss's operands (tested on CPU with a reference kernel in Liger's interface, and on CUDA
with Liger Kernel itself)."""

from __future__ import annotations

import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from steadytrain.memory import chunked_loss, fused_loss
from steadytrain.memory.chunked_loss import CausalLMLoss, causal_lm_loss

VOCAB = 1000
TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    use_cache=False,
)


def llama(tied: bool = True, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(tie_word_embeddings=tied, **TINY, **kw)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def gemma2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Gemma2Config(head_dim=16, final_logit_softcapping=30.0, **TINY)
    config._attn_implementation = "eager"
    return Gemma2ForCausalLM(config)


def batch(seed: int = 1, rows: int = 3, seq: int = 24, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def loss_and_grads(model, loss_fn, data) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total, _count = loss_fn(model, data)
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), grads


class ReferenceKernel(torch.nn.Module):
    """A test double of `LigerFusedLinearCrossEntropyLoss` (its constructor keywords and
    `forward(lin_weight, _input, target, bias)`), computed with plain torch: it stands in for
    the Triton kernel where there is no GPU, so the wrapper's plumbing (argument order, dtypes,
    the softcap, the bias, the ignored labels) is checked on CPU. Records each call."""

    calls: ClassVar[list[dict]] = []

    def __init__(self, ignore_index, reduction, softcap):
        super().__init__()
        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap

    def forward(self, lin_weight, _input, target, bias=None):
        assert not torch.is_autocast_enabled(_input.device.type)
        ReferenceKernel.calls.append({"dtype": _input.dtype, "softcap": self.softcap})
        logits = F.linear(_input, lin_weight, bias).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")


@pytest.fixture
def reference_kernel(monkeypatch):
    """The fused path taken on CPU, through `ReferenceKernel`."""
    ReferenceKernel.calls = []
    monkeypatch.setattr(fused_loss, "_liger_loss_class", lambda: ReferenceKernel)
    monkeypatch.setattr(fused_loss, "_liger_forward_op", lambda: None)
    monkeypatch.setattr(fused_loss, "fused_available", lambda device: True)
    monkeypatch.setattr(chunked_loss, "fused_available", lambda device: True)
    return ReferenceKernel.calls


def test_on_cpu_the_fused_mode_is_the_checkpointed_chunks_with_the_plain_values():
    model, data = llama(), batch()
    loss = CausalLMLoss(chunk_tokens=16)
    assert loss.fused and loss.chunked_method(model, "cpu") == "chunked"
    assert not fused_loss.fused_available("cpu")
    fused, fused_grads = loss_and_grads(model, loss, data)
    chunked, chunked_grads = loss_and_grads(model, CausalLMLoss(chunk_tokens=16, fused=False), data)
    plain, plain_grads = loss_and_grads(model, causal_lm_loss, data)
    assert torch.equal(fused, chunked)
    assert set(fused_grads) == set(plain_grads)
    for name, grad in fused_grads.items():
        assert torch.equal(grad, chunked_grads[name]), name
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("build", [lambda: llama(tied=True), lambda: llama(tied=False), gemma2])
def test_the_wrapper_gives_the_kernel_the_plain_loss_operands(reference_kernel, build):
    model, data = build(), batch()
    loss = CausalLMLoss(chunk_tokens=16)
    assert loss.chunked_method(model, "cpu") == "fused"
    fused, fused_grads = loss_and_grads(model, loss, data)
    plain, plain_grads = loss_and_grads(model, causal_lm_loss, data)
    assert len(reference_kernel) == 1  # the fused path ran, once per call
    softcap = model.config.get_text_config().final_logit_softcapping if build is gemma2 else None
    assert reference_kernel[0]["softcap"] == softcap
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    assert set(fused_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_under_autocast_the_kernel_gets_the_autocast_dtype(reference_kernel):
    model, data = llama(), batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = CausalLMLoss(chunk_tokens=16)(model, data)
        plain, _ = causal_lm_loss(model, data)
    assert reference_kernel[0]["dtype"] == torch.bfloat16
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=0)


def test_heads_the_kernel_cannot_reproduce_take_the_checkpointed_chunks(reference_kernel):
    from peft import LoraConfig, get_peft_model

    scaled = llama()
    scaled.config.logits_scaling = 4.0
    assert "scales its logits" in fused_loss.supported_head(scaled.lm_head, scaled.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft: adapter on a tied lm_head
        adapted = get_peft_model(llama(tied=False), LoraConfig(r=4, target_modules=["lm_head"]))
    head = adapted.get_base_model().lm_head
    assert "not a plain Linear" in fused_loss.supported_head(head, adapted.config)
    loss = CausalLMLoss(chunk_tokens=16)
    assert loss.chunked_method(adapted, "cpu") == "chunked"
    fused, _ = loss(adapted, batch())
    plain, _ = causal_lm_loss(adapted, batch())
    assert reference_kernel == []
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)


def test_the_plain_mode_never_takes_the_fused_path(reference_kernel):
    model = llama()
    CausalLMLoss()(model, batch())
    assert reference_kernel == []


@pytest.mark.gpu
def test_liger_kernel_on_cuda_equals_the_plain_loss():
    pytest.importorskip("liger_kernel")
    model, data = llama(tied=True).cuda(), batch(device="cuda", rows=4, seq=256)
    loss = CausalLMLoss(chunk_tokens=128)
    assert loss.chunked_method(model, "cuda") == "fused"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused, fused_grads = loss_and_grads(model, loss, data)
        plain, plain_grads = loss_and_grads(model, causal_lm_loss, data)
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=0)
    for name, grad in plain_grads.items():
        error = (fused_grads[name] - grad).norm() / grad.norm()
        assert error < 3e-2, (name, float(error))


def test_the_planner_s_trial_runs_say_how_the_chunked_loss_is_computed(reference_kernel):
    from steadytrain.memory.savers import MemorySavers

    model = llama()
    savers = MemorySavers(model, CausalLMLoss())
    assert savers.trial_run(lambda size: None, None).method == "plain"
    assert savers.trial_run(lambda size: None, 1024).method == "fused"
    assert MemorySavers(model, CausalLMLoss(fused=False)).chunked_method() == "chunked"


def _switchable_losses():
    """Every switchable loss the product ships: the `Trainer`'s `CausalLMLoss` and the
    fine-tune's `LMLoss` (recipes/data.py), which the planner switches alike."""
    from steadytrain.recipes.data import LMLoss

    return [CausalLMLoss, LMLoss]


@pytest.mark.parametrize("loss_class", _switchable_losses(), ids=lambda c: c.__name__)
def test_a_loss_whose_chunked_mode_says_fused_computes_with_the_kernel(
    reference_kernel, loss_class
):
    """The planner reads `chunked_method` for its reasons and measures the chunked mode by
    calling the loss: a subclass that drops `fused` on the way to `causal_lm_loss` (the
    fine-tune's `LMLoss` did) is measured and trained with the checkpointed chunks while the
    plan says "fused"."""
    model, data = llama(tied=False), batch()
    loss = loss_class()
    assert loss.fused
    loss.set_chunking(16)
    assert loss.chunked_method(model, "cpu") == "fused"
    fused, fused_grads = loss_and_grads(model, loss, data)
    assert len(reference_kernel) == 1
    plain, plain_grads = loss_and_grads(model, causal_lm_loss, data)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    reference_kernel.clear()
    off = loss_class(chunk_tokens=16, fused=False)
    assert off.chunked_method(model, "cpu") == "chunked"
    off(model, data)
    assert reference_kernel == []  # asked off, the kernel is not taken either


def test_the_fine_tune_s_planner_trial_of_the_chunked_loss_runs_the_kernel(reference_kernel):
    """The fine-tune's plan measures the chunked loss it will train with: the trial run that
    says "fused" computes through the kernel, on a collated batch (trimmed to its longest
    sample), the same pass as a `Trainer` given `CausalLMLoss`."""
    from steadytrain.engine.side_pass import trial_pass
    from steadytrain.memory.savers import MemorySavers
    from steadytrain.recipes.data import LMLoss, collate

    model = llama(tied=False)
    samples = [{"input_ids": ids, "labels": ids} for ids in batch(rows=2)["input_ids"]]
    collated = collate(samples, pad_id=0)
    loss = LMLoss()
    savers = MemorySavers(model, loss)
    run = savers.trial_run(lambda size: trial_pass(model, loss, collated), 1024)
    assert run.method == "fused"
    run(2, False)
    assert len(reference_kernel) == 1
