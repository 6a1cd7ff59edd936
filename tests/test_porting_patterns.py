"""The patterns of docs/porting.md that the ported examples do not show, each as a tiny program
written from the page, run through the public API: batches drawn at random each step
(nanoGPT's get_batch), an evaluation before the first step and on two splits at an interval, a
checkpoint once per epoch, the keep_best weights loaded back, and which step the logged lr is.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset, TensorDataset

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.engine.sampler import RandomDraws
from steadytrain.telemetry.files import read_jsonl

VOCAB, BLOCK, BATCH, LR = 11, 8, 4, 1e-2
DATA = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5))


class TinyLM(torch.nn.Module):
    """nanoGPT's interface: forward(idx, targets) -> (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.embed(idx)))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def get_lr(it: int) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay to a tenth."""
    warmup, decay = 2, 12
    if it < warmup:
        return LR * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay - warmup))
    return LR / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - LR / 10)


class NanoSchedule(torch.optim.lr_scheduler.LRScheduler):
    """get_lr(step) as the learning rate itself (not base_lr × a factor: bit-exact)."""

    def get_lr(self):
        return [get_lr(self.last_epoch) for _ in self.optimizer.param_groups]


class Windows(Dataset):
    """Item i is what get_batch builds from index i: BLOCK tokens and the same shifted by one."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return len(self.data) - BLOCK

    def __getitem__(self, i: int):
        return self.data[i : i + BLOCK], self.data[i + 1 : i + 1 + BLOCK]


def lm_loss(model, batch):
    x, y = batch
    return model(x, y)[1]


def nanogpt_loop(steps: int, per_epoch: int | None = None) -> TinyLM:
    """The loop as nanoGPT writes it, with its batches drawn from a generator of their own
    (`per_epoch`: seeded again with 1337 + epoch every so many steps)."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1337)
    for it in range(steps):
        if per_epoch and it % per_epoch == 0:
            g.manual_seed(1337 + it // per_epoch)
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        ix = torch.randint(len(DATA) - BLOCK, (BATCH,), generator=g)
        x = torch.stack([DATA[i : i + BLOCK] for i in ix])
        y = torch.stack([DATA[i + 1 : i + 1 + BLOCK] for i in ix])
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, control, info):
        if state.step == self.step:
            control.request_stop(reason="stopped by the test")


def config(run_dir: Path, **over) -> TrainConfig:
    values = dict(
        run_dir=str(run_dir),
        effective_batch_size=BATCH,
        micro_batch_size=BATCH,
        max_steps=10,
        save_every_steps=3,
        seed=None,  # the program seeded torch itself, as nanoGPT does
        device="cpu",
        precision="fp32",
        progress="off",
        memory_watch=False,
    )
    return TrainConfig(**(values | over))


def port(run_dir: Path, steps_per_epoch: int, callbacks=(), **over) -> tuple[TinyLM, object]:
    torch.manual_seed(0)
    model = TinyLM()
    windows = Windows(DATA)
    loader = DataLoader(
        windows, batch_size=BATCH, sampler=RandomDraws(len(windows), BATCH, steps_per_epoch, 1337)
    )
    result = Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=LR),
        lm_loss,
        loader,
        config(run_dir, **over),
        scheduler=lambda optimizer: NanoSchedule(optimizer),
        callbacks=list(callbacks),
    ).fit()
    return model, result


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_batches_drawn_at_random_each_step_are_nanogpt_s_bit_for_bit_and_resume_exactly(tmp_path):
    """RandomDraws gives the loop's torch.randint batches; the port's parameters equal the
    loop's bit for bit; a run stopped at step 6 (mid-epoch, after an epoch boundary at 4) and
    started again ends where an uninterrupted run of the same epochs ends; and the lr logged at
    step k is the one step k + 1 uses (get_lr(k)), the scheduler having stepped after step k."""
    loop = nanogpt_loop(10)
    ported, _ = port(tmp_path / "one_epoch", steps_per_epoch=10)
    assert same(ported, loop)
    rows = [r for r in read_jsonl(tmp_path / "one_epoch" / "metrics.jsonl") if "lr" in r]
    assert [r["lr"] for r in rows] == [get_lr(r["step"]) for r in rows]

    whole, _ = port(tmp_path / "whole", steps_per_epoch=4)
    port(tmp_path / "cut", steps_per_epoch=4, callbacks=[StopAt(6)])
    resumed, result = port(tmp_path / "cut", steps_per_epoch=4)
    assert result.steps == 10 and same(resumed, whole)
    assert same(whole, nanogpt_loop(10, per_epoch=4))  # epoch e draws from seed 1337 + e


def split_windows(data: torch.Tensor, split: int, count: int) -> TensorDataset:
    g = torch.Generator().manual_seed(split)
    ix = torch.randint(len(data) - BLOCK, (count,), generator=g)
    x = torch.stack([data[i : i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
    return TensorDataset(x, y, torch.full((count,), split))


SPLITS = ("train", "val")
TRAIN_DATA, VAL_DATA = DATA[:250], DATA[250:]


def loss_per_split(model, batches) -> dict[str, float]:
    """eval_fn over samples of both splits, each tagged with its split: nanoGPT's estimate_loss."""
    sums, counts = torch.zeros(2), torch.zeros(2)
    for x, y, split in batches:
        logits, _ = model(x, y)
        each = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        sums.index_add_(0, split, each)
        counts.index_add_(0, split, torch.ones_like(each))
    return {f"{name}_loss": float(sums[i] / counts[i]) for i, name in enumerate(SPLITS)}


class EvaluateFirst(Callback):
    """Evaluates before the first step (not again on a resume), as `if iter_num % eval_interval
    == 0` does at iteration 0."""

    def __init__(self, model, data):
        self.model, self.data, self.seen = model, data, []

    def on_fit_start(self, state, control, info):
        if state.step == 0:
            self.model.eval()
            # fork_rng: iterating a DataLoader draws its workers' seed from torch's stream
            with torch.no_grad(), torch.random.fork_rng():
                batches = DataLoader(self.data, batch_size=BATCH)
                self.seen.append((state.step, loss_per_split(self.model, batches)))
            self.model.train()


def two_split_run(run_dir: Path, first: bool, **over):
    torch.manual_seed(0)
    model = TinyLM()
    windows = Windows(TRAIN_DATA)
    evaluation = torch.utils.data.ConcatDataset(
        [split_windows(TRAIN_DATA, 0, 8), split_windows(VAL_DATA, 1, 8)]
    )
    start = EvaluateFirst(model, evaluation)
    loader = DataLoader(windows, batch_size=BATCH, shuffle=True)
    Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=LR),
        lm_loss,
        loader,
        config(run_dir, max_steps=6, save_every_steps=6, **over),
        eval_data=evaluation,
        eval_fn=loss_per_split,
        callbacks=[start] if first else [],
    ).fit()
    return model, start


def test_an_evaluation_before_the_first_step_and_on_two_splits_at_an_interval(tmp_path):
    """eval_fn scores samples tagged with their split ({train_loss, val_loss} rows every 3
    steps); a callback evaluates once before the first step; neither changes the training."""
    torch.manual_seed(0)
    untouched = TinyLM()
    model, start = two_split_run(tmp_path / "run", True, evaluate_every_steps=3, eval_batch=4)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in rows] == [3, 6]
    assert all({"train_loss", "val_loss"} <= set(r) for r in rows)
    evaluation = start.data
    untouched.eval()
    with torch.no_grad():
        expected = loss_per_split(untouched, DataLoader(evaluation, batch_size=BATCH))
    assert start.seen == [(0, expected)]
    model.eval()
    with torch.no_grad():
        final = loss_per_split(model, DataLoader(evaluation, batch_size=BATCH))
    assert final == pytest.approx({k: rows[-1][k] for k in final}, rel=1e-6)
    plain, _ = two_split_run(tmp_path / "plain", False, evaluate_every_steps=3, eval_batch=4)
    assert same(model, plain)


class Snapshots(Callback):
    """The parameters after each evaluation that was the best so far."""

    def __init__(self, model):
        self.model, self.best = model, {}

    def on_evaluation_end(self, state, control, info):
        if info["best"]:
            self.best[state.step] = {k: v.clone() for k, v in self.model.state_dict().items()}


def load_best(model: torch.nn.Module, run_dir: Path) -> int:
    """docs/porting.md: the keep_best weights back into the model; returns their step."""
    best = Path(run_dir) / "best" / "checkpoints"
    folder = best / (best / "latest").read_text().strip()
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return int(folder.name.removeprefix("step-"))


def test_a_checkpoint_once_per_epoch_and_the_best_weights_loaded_back_at_the_end(tmp_path):
    """save_every_steps = len(loader): one checkpoint at each epoch's end (keep_last as many);
    keep_best with an evaluation each epoch keeps the best one, and the page's few lines load
    it back into the model: the parameters the model had after that epoch's step."""
    torch.manual_seed(0)
    model = TinyLM()
    windows = Windows(TRAIN_DATA)
    loader = DataLoader(windows, batch_size=BATCH, sampler=RandomDraws(len(windows), BATCH, 3, 7))
    evaluation = split_windows(VAL_DATA, 1, 8)
    snapshots = Snapshots(model)
    Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=0.3),  # large: some epochs get worse
        lm_loss,
        loader,
        config(
            tmp_path / "run",
            max_steps=None,
            epochs=5,
            save_every_steps=len(loader),
            keep_last=5,
            keep_best=True,
        ),
        eval_data=evaluation,
        eval_fn=lambda model, batches: {"eval_loss": loss_per_split(model, batches)["val_loss"]},
        callbacks=[snapshots],
    ).fit()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved == [f"step-{3 * epoch:08d}" for epoch in range(1, 6)]
    step = load_best(model, tmp_path / "run")
    assert step == max(snapshots.best)
    for key, value in model.state_dict().items():
        assert torch.equal(value, snapshots.best[step][key]), key
