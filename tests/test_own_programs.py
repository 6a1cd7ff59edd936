"""Programs as their authors wrote them: nothing changed that was not asked for (clipping, the
DataLoader's order and drop_last, the RNG streams), state carried across steps, evaluation
during training with a plateau scheduler and the best checkpoint kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import MALLOC_ENV, WORKLOADS
from safetensors.torch import load_file
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from steadytrain import BadInputError, Callback, CarriedState, TrainConfig, Trainer
from steadytrain.checkpoint.file_io import safetensors_parts
from steadytrain.checkpoint.payload import Payload
from steadytrain.checkpoint.state import DATA_ORDER_FILE, DataOrderState, Host
from steadytrain.engine.sampler import LoaderOrder, OptimizerBatchSampler, RandomDraws
from steadytrain.telemetry.files import read_jsonl

N, FEATURES = 36, 5  # batches of 8: four full ones and a short one of 4


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (N,), generator=g))


class Net(torch.nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(16, 3),
        )

    def forward(self, x):
        return self.net(x)


def classify(model, batch):
    x, label = batch
    return torch.nn.functional.cross_entropy(model(x), label)


def config(tmp_path, **over) -> TrainConfig:
    values = dict(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=8,
        micro_batch_size=8,
        epochs=2,
        save_every_steps=3,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    return TrainConfig(**(values | over))


def own_loop(model, loader, epochs, clip=None):
    """The loop the program had before steadytrain."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = classify(model, batch)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
    return losses


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def step_losses(tmp_path) -> list[float]:
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    return [r["loss"] for r in rows if r.get("kind") != "eval"]


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_a_program_that_clips_at_0_25_with_an_ordered_loader_trains_exactly_as_its_loop(tmp_path):
    torch.manual_seed(1)
    mine = Net()
    want = own_loop(mine, DataLoader(data(), batch_size=8, shuffle=False), 2, clip=0.25)
    torch.manual_seed(1)
    port = Net()
    loader = DataLoader(data(), batch_size=8, shuffle=False)
    result = Trainer(port, sgd, classify, loader, config(tmp_path, max_grad_norm=0.25)).fit()
    assert result.steps == 10  # the short last batch of each epoch is kept, as the loader does
    assert step_losses(tmp_path) == want
    assert_same_parameters(mine, port)
    samples = [r["samples"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert samples == [8, 8, 8, 8, 4] * 2


def test_no_clipping_unless_asked(tmp_path):
    torch.manual_seed(1)
    mine = Net()
    want = own_loop(mine, DataLoader(data(), batch_size=8), 2)
    torch.manual_seed(1)
    port = Net()
    Trainer(port, sgd, classify, DataLoader(data(), batch_size=8), config(tmp_path)).fit()
    assert step_losses(tmp_path) == want
    assert_same_parameters(mine, port)


def test_a_shuffling_loader_keeps_its_order_and_the_programs_random_stream(tmp_path):
    """RandomSampler draws its seed from torch's stream when the epoch starts; dropout draws
    from the same stream. With seed null the port sees the same order and the same masks."""
    torch.manual_seed(3)
    mine = Net(dropout=0.3)
    want = own_loop(mine, DataLoader(data(), batch_size=8, shuffle=True), 3)
    torch.manual_seed(3)
    port = Net(dropout=0.3)
    loader = DataLoader(data(), batch_size=8, shuffle=True)
    Trainer(port, sgd, classify, loader, config(tmp_path, seed=None, epochs=3)).fit()
    assert step_losses(tmp_path) == want
    assert_same_parameters(mine, port)


class Indexed(torch.utils.data.Dataset):
    """`size` samples, sample i made from i: nothing held but the order. Its index is a Python
    int, as a loader gives it (not a 0-d tensor taken from a held order)."""

    def __init__(self, size: int = 1_000_000):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if type(i) is not int:
            raise TypeError(f"index {i!r}: not an int")
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return x, i % 3


def test_a_shuffled_loader_over_a_million_samples_holds_its_order_in_8_mb_and_resumes_on_it(
    tmp_path,
):
    """The order a DataLoader's shuffle=True draws for an epoch is held as an int64 tensor, 8
    bytes a sample (a list of Python ints took 36); the checkpoint holds it as it is, and a run
    stopped mid-epoch at its step-3 checkpoint resumes on it to the uninterrupted run's bits.
    A shuffled evaluation loader's samples are read by int indices from its held order."""
    torch.manual_seed(0)
    order = LoaderOrder(DataLoader(Indexed(), batch_size=8, shuffle=True))(0)
    assert isinstance(order, torch.Tensor) and order.dtype == torch.int64
    assert order.nbytes == 8_000_000
    assert torch.equal(order.sort().values, torch.arange(1_000_000))

    def trained(run_dir, *stops):
        torch.manual_seed(0)
        model = Net(dropout=0.3)
        loader = DataLoader(Indexed(), batch_size=8, shuffle=True)
        evaluation = DataLoader(Indexed(20), batch_size=8, shuffle=True)
        for max_steps in stops:
            cfg = config(
                tmp_path,
                run_dir=str(run_dir),
                max_steps=max_steps,
                seed=None,
                evaluate_every_steps=2,
            )
            Trainer(model, sgd, classify, loader, cfg, eval_data=evaluation).fit()
        rows = read_jsonl(run_dir / "metrics.jsonl")
        return model, [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows]

    whole, whole_rows = trained(tmp_path / "whole", 6)
    resumed, resumed_rows = trained(tmp_path / "resumed", 3, 6)
    assert_same_parameters(whole, resumed)
    assert resumed_rows == whole_rows
    assert [step for step, _, scored in whole_rows if scored is not None] == [2, 4, 6]
    saved = load_file(
        tmp_path / "resumed" / "checkpoints" / "step-00000003" / "data_order.safetensors"
    )
    assert list(saved) == ["0"] and saved["0"].dtype == torch.int64
    assert saved["0"].nbytes == 8_000_000


SAMPLERS = {
    "random": lambda: RandomSampler(range(40)),
    "random-generator": lambda: RandomSampler(
        range(40), generator=torch.Generator().manual_seed(5)
    ),
    "subset": lambda: SubsetRandomSampler(list(range(0, 40, 3))),
    "weighted": lambda: WeightedRandomSampler(torch.arange(1.0, 41.0), 30),
    "distributed": lambda: DistributedSampler(range(40), num_replicas=2, rank=1, seed=4),
    "random-draws": lambda: RandomDraws(40, 4, 5),
}


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_each_sampler_s_order_is_held_as_int64_and_a_checkpoint_gives_the_same_batches(
    tmp_path, kind
):
    """Each epoch's order as `for batch in loader` draws it, held as an int64 tensor; the
    checkpoint's part is that tensor itself (no copy), written to the bytes an order held as a
    list wrote, and a sampler given the file back makes the same batches, of Python ints."""

    def loader():
        return DataLoader(list(range(40)), batch_size=4, sampler=SAMPLERS[kind]())

    torch.manual_seed(2)
    mine, want = loader(), []
    for epoch in (0, 1):
        if hasattr(mine.sampler, "set_epoch"):
            mine.sampler.set_epoch(epoch)
        want.append(torch.cat(list(mine)).tolist())
    torch.manual_seed(2)
    order = LoaderOrder(loader())
    for epoch in (0, 1):
        held = order(epoch)
        assert isinstance(held, torch.Tensor) and held.dtype == torch.int64
        assert held.tolist() == want[epoch]

    sampler = OptimizerBatchSampler(len(order), 4, 0, True, False, order)
    out = Payload()
    DataOrderState(sampler).save(out, {}, Host())
    assert out.tensors[DATA_ORDER_FILE]["1"] is order.drawn[1]
    file = tmp_path / DATA_ORDER_FILE
    file.write_bytes(b"".join(safetensors_parts(out.tensors[DATA_ORDER_FILE])[0]))
    as_a_list = {"1": torch.tensor(want[1], dtype=torch.int64)}  # what a list was saved as
    assert file.read_bytes() == b"".join(safetensors_parts(as_a_list)[0])

    again = LoaderOrder(loader())
    resumed = OptimizerBatchSampler(len(again), 4, 0, True, False, again)
    DataOrderState(resumed).load(Payload(tensors={DATA_ORDER_FILE: load_file(file)}), {})
    assert resumed.has_order(1)
    batches = [resumed.batch_at(1, step) for step in range(resumed.steps_per_epoch)]
    assert batches == [want[1][i : i + 4] for i in range(0, len(want[1]), 4)]
    assert all(type(i) is int for batch in batches for i in batch)


class KeySampler(torch.utils.data.Sampler):
    """A sampler of a dataset's own keys (file names), as some programs write one."""

    def __init__(self, keys):
        self.keys = keys

    def __iter__(self):
        return iter(self.keys)

    def __len__(self):
        return len(self.keys)


@pytest.mark.parametrize("key", ["sample-00003.pt", "3", 3.0, (0, 3)])
def test_a_sampler_of_keys_that_are_not_integers_is_refused_naming_the_key(tmp_path, key):
    """A sampler that yields strings, floats or tuples: exit 2 naming the sampler, the key and
    the fix, before any step (a digit string is not turned into another key silently)."""
    samples = {key: (torch.zeros(FEATURES), torch.tensor(0))}

    class Keyed(torch.utils.data.Dataset):
        def __getitem__(self, k):
            return samples[k]

        def __len__(self):
            return 1

    loader = DataLoader(Keyed(), batch_size=1, sampler=KeySampler([key]))
    trainer = Trainer(
        Net(),
        sgd,
        classify,
        loader,
        config=config(tmp_path, effective_batch_size=1, micro_batch_size=1),
    )
    with pytest.raises(BadInputError) as raised:
        trainer.fit()
    message = str(raised.value)
    assert f"KeySampler yielded {key!r} ({type(key).__name__})" in message
    assert "sampler of integer indices" in message
    assert raised.value.exit_code == 2
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def test_a_dataset_keyed_by_integers_of_its_own_trains_from_its_sampler(tmp_path):
    """Samples under integer keys that are not 0…n-1 (ids), drawn by a sampler of those keys:
    the run trains on them and resumes; the data fingerprint, which cannot read sample 0,
    checks the length only and says so (before, it read sample 0: KeyError, exit 5)."""
    g = torch.Generator().manual_seed(0)
    samples = {
        1000 + 7 * i: (torch.randn(FEATURES, generator=g), torch.tensor(i % 3)) for i in range(8)
    }

    class ById(torch.utils.data.Dataset):
        def __getitem__(self, key):
            return samples[key]

        def __len__(self):
            return len(samples)

    def fit(steps):
        torch.manual_seed(0)
        loader = DataLoader(ById(), batch_size=4, sampler=KeySampler(list(samples)))
        cfg = config(
            tmp_path,
            effective_batch_size=4,
            micro_batch_size=4,
            max_steps=steps,
            save_every_steps=2,
        )
        return Trainer(Net(), sgd, classify, loader, config=cfg).fit()

    assert fit(2).steps == 2
    assert fit(4).steps == 4  # resumed from step 2's checkpoint
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert any("checked by length only" in json.dumps(e) for e in events)
    assert any(e["event"] == "resume" for e in events)


class Normalized(Net):
    """A net that scales its input by running statistics kept out of its state_dict
    (persistent=False), updated in place in training, and a scale reassigned each step."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(FEATURES), persistent=False)
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.register_buffer("fixed", torch.ones(FEATURES), persistent=False)  # never changed

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen += 1
                self.mean.lerp_(x.mean(0), 1 / float(self.seen))
        return super().forward((x - self.mean) * self.fixed)


def test_buffers_outside_the_state_dict_that_training_changes_resume_exactly(tmp_path):
    """A run stopped at step 3 and resumed ends as the uninterrupted run, whose forward reads
    buffers registered with persistent=False and changed by training; the checkpoint holds
    those (not the one training never changes). Before, a resume restarted them from their
    initial values and trained another run, without a word."""

    def fit(run, steps):
        torch.manual_seed(0)
        model = Normalized()
        cfg = config(tmp_path, run_dir=str(tmp_path / run), max_steps=steps, shuffle=True)
        Trainer(model, sgd, classify, data(), config=cfg).fit()
        return model

    whole = fit("whole", 6)
    fit("split", 3)
    resumed = fit("split", 6)
    assert_same_parameters(resumed, whole)
    assert torch.equal(resumed.mean, whole.mean) and torch.equal(resumed.seen, whole.seen)
    saved = load_file(tmp_path / "split" / "checkpoints" / "step-00000003" / "model.safetensors")
    assert {k for k in saved if k.startswith("buffer-")} == {
        "buffer-outside-state-dict/mean",
        "buffer-outside-state-dict/seen",
    }


@pytest.mark.parametrize(
    ("setting", "field"), [({"shuffle": True}, "shuffle"), ({"drop_last": True}, "drop_last")]
)
def test_a_config_against_the_loader_is_refused_naming_the_field(tmp_path, setting, field):
    loader = DataLoader(data(), batch_size=8, shuffle=False)
    with pytest.raises(BadInputError, match=f"^{field}: the config says"):
        Trainer(Net(), sgd, classify, loader, config(tmp_path, **setting))


def test_the_start_line_lists_every_setting_that_changes_the_arithmetic(tmp_path, capsys):
    Trainer(
        Net(),
        sgd,
        classify,
        data(),
        config(tmp_path, micro_batch_size=4, max_steps=1, save_every_steps=1, progress="lines"),
    ).fit()
    event = next(
        e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "arithmetic"
    )
    assert event["dropped_per_epoch"] == 4 and event["clipping"] is None
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("arithmetic"))
    for words in (
        "clipping off",
        "shuffled each epoch (seed 0)",
        "4 sample(s) dropped per epoch",
        "precision fp32",
        "micro-batch 4 × 2 accumulated to 8",
        "reseeded from seed 0",
    ):
        assert words in line


def test_the_start_line_says_clipping_once(tmp_path, capsys):
    """'clipping gradient norm clipped to 1.0' said it twice."""
    Trainer(
        Net(),
        sgd,
        classify,
        data(),
        config(tmp_path, max_steps=1, save_every_steps=1, max_grad_norm=1.0, progress="lines"),
    ).fit()
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("arithmetic"))
    assert "clipping at gradient norm 1.0;" in line and "clipped" not in line, line


# -- state carried across steps ------------------------------------------------------------


SEQ, VOCAB, HIDDEN = 5, 11, 8


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.rnn = torch.nn.LSTM(HIDDEN, HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return self.head(out), hidden


def streams(columns: int = 8, steps: int = 6) -> TensorDataset:
    """Sample k of step s is column k's s-th chunk: an ordered loader of `columns` per batch
    walks each column's stream in order, as a batchified language-model corpus does."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (columns, steps * SEQ + 1), generator=g)
    xs, ys = [], []
    for s in range(steps):
        for k in range(columns):
            xs.append(text[k, s * SEQ : (s + 1) * SEQ])
            ys.append(text[k, s * SEQ + 1 : (s + 1) * SEQ + 1])
    return TensorDataset(torch.stack(xs), torch.stack(ys))


def carried_loss(hidden: CarriedState, fail_once: list | None = None):
    def loss_fn(model, batch):
        tokens, targets = batch
        logits, new = model(tokens, hidden.get())
        hidden.set(new)
        if fail_once:
            fail_once.pop()
            raise torch.OutOfMemoryError("out of memory (raised by the test)")
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return loss_fn


def lm_fit(run_dir, micro: int, fail_once=None, save_every=6, **over):
    torch.manual_seed(0)
    model = TinyLM()
    hidden = CarriedState(
        init=lambda n: (torch.zeros(1, n, HIDDEN), torch.zeros(1, n, HIDDEN)), batch_dim=1
    )
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=8,
        micro_batch_size=micro,
        epochs=1,
        save_every_steps=save_every,
        device="cpu",
        progress="off",
        memory_watch=False,
        shuffle=False,
        **over,
    )
    result = Trainer(
        model,
        lambda p: torch.optim.Adam(p, lr=0.01),
        carried_loss(hidden, fail_once),
        streams(),
        config,
        user_state={"hidden": hidden},
    ).fit()
    return model, hidden, result


def test_carried_state_is_per_sample_when_split_and_untouched_by_extra_passes(tmp_path):
    whole, hidden, _ = lm_fit(tmp_path / "whole", micro=8)
    split, split_hidden, _ = lm_fit(tmp_path / "split", micro=2)
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # accumulation rounds differently
    torch.testing.assert_close(hidden.value, split_hidden.value, rtol=1e-5, atol=1e-6)
    # A checkpoint every step runs the loss probe every step, and 'auto' runs the planner's
    # trial passes: neither may advance the carried state.
    probed, probed_hidden, _ = lm_fit(tmp_path / "probed", micro="auto", save_every=1)
    assert_same_parameters(whole, probed)
    assert all(torch.equal(a, b) for a, b in zip(hidden.value, probed_hidden.value, strict=True))


def test_a_step_redone_after_out_of_memory_starts_from_the_same_carried_state(tmp_path):
    redone, _, result = lm_fit(tmp_path / "redone", micro=8, fail_once=[True])
    assert result.oom_count == 1 and result.micro_batch_size == 4
    fixed, _, _ = lm_fit(tmp_path / "fixed", micro=4)
    assert_same_parameters(redone, fixed)


def test_carried_state_is_saved_and_restored_by_a_resume(tmp_path):
    whole, hidden, _ = lm_fit(tmp_path / "whole", micro=8)

    class StopAt(Callback):
        def on_step_end(self, state, control, info):
            if state.step == 3:
                control.request_stop(143, "test")

    run_dir = tmp_path / "resumed"  # the same program, stopped at step 3 and started again
    _, _, stopped = _lm_with_callbacks(run_dir, [StopAt()])
    assert stopped.steps == 3
    model, hid, result = _lm_with_callbacks(run_dir, [])
    assert result.steps == 6
    assert_same_parameters(whole, model)
    assert all(torch.equal(a, b) for a, b in zip(hidden.value, hid.value, strict=True))


def _lm_with_callbacks(run_dir, callbacks):
    torch.manual_seed(0)
    model = TinyLM()
    hidden = CarriedState(
        init=lambda n: (torch.zeros(1, n, HIDDEN), torch.zeros(1, n, HIDDEN)), batch_dim=1
    )
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=8,
        micro_batch_size=8,
        epochs=1,
        save_every_steps=6,
        device="cpu",
        progress="off",
        memory_watch=False,
        shuffle=False,
    )
    result = Trainer(
        model,
        lambda p: torch.optim.Adam(p, lr=0.01),
        carried_loss(hidden),
        streams(),
        config,
        user_state={"hidden": hidden},
        callbacks=callbacks,
    ).fit()
    return model, hidden, result


def test_user_state_without_the_two_methods_is_refused():
    with pytest.raises(BadInputError, match="user_state: 'h' is a Tensor"):
        Trainer(
            Net(),
            sgd,
            classify,
            data(),
            {"effective_batch_size": 8},
            user_state={"h": torch.ones(1)},
        )


# -- evaluation during training ------------------------------------------------------------


def test_a_plateau_scheduler_is_driven_by_evaluation_and_the_best_is_kept(tmp_path):
    """The program: train an epoch, validate, scheduler.step(val_loss); with an lr so high that
    the validation loss stops falling, the plateau scheduler cuts it."""
    train, val = data(), TensorDataset(*[t[:12] for t in data().tensors])

    def plateau(optimizer):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)

    torch.manual_seed(0)
    mine = Net()
    optimizer = sgd(mine.parameters())
    scheduler = plateau(optimizer)
    want_lr, want_val = [], []
    for _ in range(4):
        for batch in DataLoader(train, batch_size=8):
            optimizer.zero_grad()
            classify(mine, batch).backward()
            optimizer.step()
        mine.eval()
        with torch.no_grad():
            val_loss = sum(
                torch.nn.functional.cross_entropy(mine(x), y, reduction="sum").item()
                for x, y in DataLoader(val, batch_size=6)
            ) / len(val)
        mine.train()
        scheduler.step(val_loss)
        want_val.append(val_loss)
        want_lr.append(optimizer.param_groups[0]["lr"])

    def val_metrics(model, batches):
        total = sum(
            torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
            for x, y in batches
        )
        return {"val_loss": total / len(val)}

    torch.manual_seed(0)
    port = Net()
    Trainer(
        port,
        sgd,
        classify,
        DataLoader(train, batch_size=8),
        config(tmp_path, epochs=4, eval_metric="val_loss", keep_best=True),
        scheduler=plateau,
        eval_data=DataLoader(val, batch_size=6),
        eval_fn=val_metrics,
    ).fit()
    assert_same_parameters(mine, port)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["val_loss"] for r in evals] == want_val
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    lr_after_eval = [
        next(r["lr"] for r in rows if r.get("step") == e["step"] + 1) for e in evals[:-1]
    ]
    assert lr_after_eval == want_lr[:-1] and len(set(want_lr)) > 1  # the scheduler did cut it
    best_step = min(evals, key=lambda r: r["val_loss"])["step"]
    kept = list((tmp_path / "run" / "best" / "checkpoints").glob("step-*"))
    assert [p.name for p in kept] == [f"step-{best_step:08d}"]


def test_a_metric_scheduler_without_evaluation_is_refused_naming_it(tmp_path):
    trainer = Trainer(
        Net(),
        sgd,
        classify,
        data(),
        config(tmp_path),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
    )
    with pytest.raises(
        BadInputError, match=r"^scheduler: ReduceLROnPlateau.step\(\) needs a metric"
    ):
        trainer.fit()


def test_evaluation_shrinks_its_own_micro_batch_on_out_of_memory(tmp_path):
    failures = [True]

    def metrics(model, batches):
        sizes = []
        for x, _ in batches:
            if failures and len(x) > 3:
                failures.pop()
                raise torch.OutOfMemoryError("out of memory (raised by the test)")
            sizes.append(len(x))
        return {"eval_loss": 1.0, "sizes": float(sum(sizes))}

    result = Trainer(
        Net(),
        sgd,
        classify,
        data(),
        config(tmp_path, max_steps=4, evaluate_every_steps=2),
        eval_data=TensorDataset(*[t[:8] for t in data().tensors]),
        eval_fn=metrics,
    ).fit()
    assert result.micro_batch_size == 8  # the training's micro-batch is untouched
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [(e["phase"], e["micro_batch_size"]) for e in events if e["event"] == "oom"] == [
        ("evaluation", 8)
    ]
    evals = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["sizes"] for r in evals] == [8.0, 8.0]  # every sample, in micro-batches of 4


def test_a_long_evaluation_is_progress_for_the_watchdog_not_a_hang(tmp_path):
    """Each evaluation micro-batch is a heartbeat: an evaluation several hang_timeouts long,
    made of short batches, is no hang."""

    def slow(model, batches):
        for _ in batches:
            time.sleep(0.25)
        return {"eval_loss": 0.0}

    Trainer(
        Net(),
        sgd,
        classify,
        data(),
        config(
            tmp_path,
            max_steps=3,
            evaluate_every_steps=2,
            hang_timeout=2.0,
            hang_action="report",
        ),
        eval_data=DataLoader(data(), batch_size=1),  # 36 heartbeats 0.25 s apart
        eval_fn=slow,
    ).fit()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e for e in events if e["event"] == "hang"] == []
    assert any(r.get("kind") == "eval" for r in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


# -- a save that fits ------------------------------------------------------------------------


def test_under_a_cap_with_no_room_for_a_second_copy_saves_are_written_without_a_shrink(tmp_path):
    """A model with 64 MiB of weights under a cap that holds them, their gradients and little
    more: a background save's copy held during the next step would run it out of memory; the
    saves go synchronous, from the tensors themselves, and the micro-batch never shrinks."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(WORKLOADS / "big_state.py"), str(run_dir), "--cap-mib", "110"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **MALLOC_ENV},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text()) == {
        "steps": 6,
        "micro_batch_size": 8,
        "oom_count": 0,
    }
    events = read_jsonl(run_dir / "events.jsonl")
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    assert all(e["mode"] == "sync" and "is free" in e["why_sync"] for e in saves)
    assert not [e for e in events if e["event"] in ("oom", "shrink")]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-00000004",
        "step-00000006",
    ]
