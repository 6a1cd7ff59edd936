"""Accumulation is exact: however a batch is split, the optimizer sees the one-shot gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from steadytrain import TrainConfig, Trainer
from steadytrain.device import resolve_device
from steadytrain.engine import StepRunner, resolve_precision
from steadytrain.engine.batching import split_batch
from steadytrain.events import Control, Dispatcher, StepMetrics, TrainState

# Everything runs in float64, so "equal up to rounding" can be checked tightly.


def regression(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    model.double()
    return model, list(zip(x, y, strict=True))


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def one_step_delta(model, data, micro, tmp_path, **cfg):
    """Parameters after one SGD(lr=1) step minus before: the negative gradient."""
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    config = TrainConfig(
        run_dir=str(tmp_path / f"m{micro}"),
        effective_batch_size=len(data),
        micro_batch_size=micro,
        max_steps=1,
        save_every_steps=1,
        device="cpu",
        shuffle=False,
        max_grad_norm=None,
        **cfg,
    )
    Trainer(model, lambda p: torch.optim.SGD(p, lr=1.0), mse, data, config).fit()
    return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]


def reference_grad(model, data, loss_fn=mse):
    model = copy.deepcopy(model)
    batch = torch.utils.data.default_collate(data)
    loss_fn(model, batch).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("micro", [24, 12, 8, 3])  # splits of 1, 2, 3 and 8 micro-batches
def test_mean_loss_split_equals_one_shot(micro, tmp_path):
    model, data = regression(24)
    ref = reference_grad(model, data)
    for got, want in zip(one_step_delta(model, data, micro, tmp_path), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def runner_for(model, loss_fn, micro):
    device = resolve_device("cpu")
    state = TrainState(micro_batch_size=micro, effective_batch_size=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    emit = Dispatcher([], state, Control())
    return StepRunner(
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        device=device,
        precision=resolve_precision("fp32", device),
        state=state,
        emit=emit,
    )


@pytest.mark.parametrize("micro", [5, 7, 11, 23])  # uneven: the last micro-batch is smaller
def test_uneven_split_weights_by_sample_share(micro):
    model, data = regression(24)
    ref = reference_grad(model, data)
    trained = copy.deepcopy(model)
    before = [p.detach().clone() for p in trained.parameters()]
    metrics = StepMetrics(
        runner_for(trained, mse, micro).run(torch.utils.data.default_collate(data))
    )
    assert metrics["micro_steps"] == -(-24 // micro)
    for b, p, want in zip(before, trained.parameters(), ref, strict=True):
        torch.testing.assert_close(b - p.detach(), want, rtol=1e-12, atol=1e-12)


def test_partial_last_batch_through_the_public_api(tmp_path):
    """drop_last=False: 14 samples, batches of 8 → the second batch has 6, split 4 + 2."""
    model, data = regression(14)
    trained = copy.deepcopy(model)
    config = TrainConfig(
        run_dir=str(tmp_path),
        effective_batch_size=8,
        micro_batch_size=4,
        epochs=1,
        device="cpu",
        shuffle=False,
        drop_last=False,
        max_grad_norm=None,
    )
    Trainer(trained, lambda p: torch.optim.SGD(p, lr=0.1), mse, data, config).fit()
    expect = copy.deepcopy(model)
    opt = torch.optim.SGD(expect.parameters(), lr=0.1)
    for chunk in (data[:8], data[8:]):
        opt.zero_grad()
        mse(expect, torch.utils.data.default_collate(chunk)).backward()
        opt.step()
    for got, want in zip(trained.parameters(), expect.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- token-weighted losses with padding --------------------------------------------------------

PAD = -100


def token_data(n=16, vocab=11, max_len=9):
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(n):
        length = min(2 + i // 2, max_len)  # uneven lengths, so padding differs per sample
        ids = torch.randint(0, vocab, (max_len,), generator=g)
        labels = ids.clone()
        labels[length:] = PAD
        samples.append({"input_ids": ids, "labels": labels})
    return samples


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, dtype=torch.float64)
        self.out = torch.nn.Linear(dim, vocab, dtype=torch.float64)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def token_sum_loss(model, batch):
    logits = model(batch["input_ids"])
    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=PAD, reduction="sum"
    )
    return loss_sum, (batch["labels"] != PAD).sum()


def token_mean_loss(model, batch):
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=PAD
    )


@pytest.mark.parametrize("micro", [16, 8, 5, 3, 1])
def test_token_weighted_split_equals_one_shot_token_mean(micro):
    torch.manual_seed(0)
    model, data = TinyLM(), token_data()
    ref = reference_grad(model, data, token_mean_loss)
    trained = copy.deepcopy(model)
    before = [p.detach().clone() for p in trained.parameters()]
    batch = torch.utils.data.default_collate(data)
    metrics = StepMetrics(runner_for(trained, token_sum_loss, micro).run(batch))
    assert metrics["tokens"] == int((batch["labels"] != PAD).sum())
    with torch.no_grad():
        want_loss = token_mean_loss(model, batch).item()
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-12)
    for b, p, want in zip(before, trained.parameters(), ref, strict=True):
        torch.testing.assert_close(b - p.detach(), want, rtol=1e-12, atol=1e-12)


def test_sample_weighting_of_a_token_mean_would_be_biased():
    """The reason for (loss_sum, count): averaging per-micro-batch token means is not the batch's
    token mean when padding differs. Guards the test above against a vacuous pass."""
    torch.manual_seed(0)
    model, data = TinyLM(), token_data()
    batch = torch.utils.data.default_collate(data)
    with torch.no_grad():
        whole = token_mean_loss(model, batch).item()
        halves = [token_mean_loss(model, part).item() for part in split_batch(batch, 8)]
    assert abs(sum(halves) / 2 - whole) > 1e-6


def test_token_division_and_clipping_match_torch_clip_grad_norm():
    torch.manual_seed(0)
    model, data = TinyLM(), token_data()
    ref_model = copy.deepcopy(model)
    token_mean_loss(ref_model, torch.utils.data.default_collate(data)).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    assert want_norm > 0.05  # clipping is active
    trained = copy.deepcopy(model)
    before = [p.detach().clone() for p in trained.parameters()]
    runner = runner_for(trained, token_sum_loss, 5)
    runner.max_grad_norm = 0.05
    metrics = StepMetrics(runner.run(torch.utils.data.default_collate(data)))
    assert metrics["grad_norm"] == pytest.approx(float(want_norm), rel=1e-12)
    for b, p, ref in zip(before, trained.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), ref.grad, rtol=1e-12, atol=1e-12)
