"""The loss reads nothing from the GPU that it can know on the host: a batch of full windows
(no attention mask, no position ids) skips transformers' packed-sequence check, whose answer
for positions the model builds itself is always "not packed"; packed windows keep the check and
their block-diagonal mask. The fused loss's backward scales the kernel's gradients on the
device instead of asking whether the incoming gradient is 1 (Liger's module reads it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils

from steadytrain.memory import chunked_loss, fused_loss
from steadytrain.memory.chunked_loss import CausalLMLoss, causal_lm_loss

VOCAB = 300


def llama(tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_cache=False,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def ids(rows: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture
def packed_checks(monkeypatch) -> list[int]:
    """Counts the calls of transformers' packed-sequence check that reach it."""
    calls: list[int] = []
    original = masking_utils.find_packed_sequence_indices

    def counted(position_ids):
        calls.append(1)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_full_windows_skip_the_packed_check_with_the_model_s_own_values(
    packed_checks, chunk_tokens
):
    model, tokens = llama(), ids(3, 24)
    labels = tokens.clone()
    labels[:, :4] = -100
    total, count = causal_lm_loss(
        model, {"input_ids": tokens, "labels": labels}, chunk_tokens=chunk_tokens
    )
    total.backward()
    assert packed_checks == []  # the check, a read of the GPU before every forward, skipped
    ours = grads_of(model)
    logits = model(input_ids=tokens, use_cache=False).logits  # the model's own path
    assert packed_checks  # which runs the check
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    reference = F.cross_entropy(
        logits.reshape(-1, VOCAB).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    reference.backward()
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)
    assert int(count) == int((targets != -100).sum())
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_packed_windows_keep_the_check_and_their_block_diagonal_mask(packed_checks, chunk_tokens):
    """Two samples packed into one row with restarting position ids give the loss of the two
    samples as rows of their own: each attends only to itself."""
    model, tokens = llama(), ids(2, 12, seed=3)
    packed = {
        "input_ids": tokens.reshape(1, 24),
        "labels": tokens.reshape(1, 24).clone(),
        "position_ids": torch.arange(12).repeat(2).reshape(1, 24),
    }
    packed["labels"][0, 12] = -100  # the second sample's first token is not a target of the first
    total, _ = causal_lm_loss(model, packed, chunk_tokens=chunk_tokens)
    assert packed_checks  # the check ran: its answer is the block-diagonal mask
    rows, _ = causal_lm_loss(
        model, {"input_ids": tokens, "labels": tokens.clone()}, chunk_tokens=chunk_tokens
    )
    torch.testing.assert_close(total, rows, rtol=1e-5, atol=1e-5)
    crossed, _ = causal_lm_loss(  # the same row read as one sequence differs: the mask matters
        model, {"input_ids": packed["input_ids"], "labels": packed["labels"]}
    )
    assert not torch.allclose(crossed, rows, rtol=1e-3, atol=1e-3)


def reference_forward(calls):
    """A stand-in for Liger's `fused_linear_cross_entropy_forward` (its keywords, the summed
    loss first and the gradients last, computed in the forward), in plain torch."""

    def forward(*, _input, weight, target, bias, ignore_index, reduction, softcap):
        assert reduction == "sum"
        calls.append(softcap)
        with torch.enable_grad():
            x = _input.detach().requires_grad_(True)
            w = weight.detach().requires_grad_(weight.requires_grad)
            logits = F.linear(x, w, bias).float()
            loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
            wanted = [x, w] if w.requires_grad else [x]
            grads = torch.autograd.grad(loss, wanted)
        grad_weight = grads[1] if w.requires_grad else None
        return loss.detach(), None, None, None, grads[0], grad_weight, None

    return forward


@pytest.mark.parametrize("tied", [True, False])
def test_the_fused_backward_scales_by_the_incoming_gradient_on_the_device(monkeypatch, tied):
    calls: list = []
    monkeypatch.setattr(fused_loss, "_liger_forward_op", lambda: reference_forward(calls))
    monkeypatch.setattr(fused_loss, "fused_available", lambda device: True)
    monkeypatch.setattr(chunked_loss, "fused_available", lambda device: True)
    model, tokens = llama(tied=tied), ids(3, 20)
    data = {"input_ids": tokens, "labels": tokens.clone()}
    fused, _ = CausalLMLoss(chunk_tokens=16)(model, data)
    (fused * 0.375).backward()  # an incoming gradient that is not 1
    assert calls == [None]
    ours = grads_of(model)
    plain, _ = causal_lm_loss(model, data)
    (plain * 0.375).backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    theirs = grads_of(model)
    assert set(ours) == set(theirs)
    assert ("lm_head.weight" in ours) is not tied
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def decoder_masks(model) -> list:
    """The attention_mask each call of the model's decoder gets."""
    seen: list = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    return seen


@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_the_fine_tune_s_micro_batch_without_padding_is_computed_without_its_mask(chunk_tokens):
    """A collated micro-batch whose samples all fill its width has a mask of all ones: the
    fine-tune's loss leaves it out (so the model reads no mask on the GPU), with the same values;
    a micro-batch with padding keeps it."""
    from steadytrain.engine.batching import split_batch
    from steadytrain.recipes.data import LMLoss, collate, lm_inputs

    model = llama()
    tokens = ids(4, 16)
    samples = [
        {"input_ids": t[:n], "labels": t[:n]} for t, n in zip(tokens, [16, 16, 11, 7], strict=True)
    ]
    full, padded = split_batch(collate(samples, pad_id=0), 2)
    seen = decoder_masks(model)
    loss = LMLoss(chunk_tokens=chunk_tokens)
    for piece, masked in ((full, False), (padded, True)):
        seen.clear()
        total, count = loss(model, piece)
        total.backward()
        ours = grads_of(model)
        assert (seen[0] is not None) is masked
        inputs, labels = lm_inputs(piece)
        assert "attention_mask" in inputs  # the mask the collate made, all ones or not
        reference, ref_count = causal_lm_loss(
            model, {**inputs, "labels": labels}, chunk_tokens=chunk_tokens
        )
        reference.backward()
        torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)
        assert int(count) == int(ref_count)
        for name, grad in grads_of(model).items():
            torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)
