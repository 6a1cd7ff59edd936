"""More programs ported from their docs alone (README.md, docs/porting.md), fed data shaped as
real programs shape it: batches a collate_fn makes as dataclasses or Hugging Face
BatchEncodings, a recurrent model's sequence-first layout, and callbacks that leave the model in
evaluation mode or autograd off. Each trains, splits into micro-batches as the whole batch, and
resumes to the uninterrupted run's numbers, or is refused with the documented exit code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from script_helpers import exit_as_script, killed_under_run_and_through
from torch.utils.data import DataLoader, TensorDataset

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.telemetry.files import read_jsonl


def config(run_dir: Path, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 8,
            "micro_batch_size": 8,
            "max_steps": 4,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


def regression() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, x @ torch.linspace(-1, 1, 4).reshape(4, 1))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


# -- batches a collate_fn makes as its own class ------------------------------------------------


@dataclasses.dataclass
class Batch:
    """A collate_fn's batch as a dataclass (torchtune, many vision codebases)."""

    x: torch.Tensor
    y: torch.Tensor
    ids: list[str]


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    y: torch.Tensor
    ids: list[str]


def batch_encoding(x, y, ids):
    """What transformers' tokenizers and DataCollatorWithPadding return: a BatchEncoding, read
    by attribute (`batch.input_ids`) as well as by key."""
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding({"x": x, "y": y, "ids": ids})


@pytest.mark.parametrize("kind", [Batch, FrozenBatch, batch_encoding], ids=lambda k: k.__name__)
def test_a_collate_fn_s_own_batch_class_is_split_into_micro_batches_of_that_class(tmp_path, kind):
    """A collate_fn returning a dataclass failed in the first step with 'cannot tell the batch
    size of a Batch' (a traceback, exit 1); one returning a BatchEncoding was split into plain
    dicts, so loss_fn's `batch.x` failed (exit 5) where the program's own loop worked. Each
    micro-batch is now of the batch's class with its fields sliced (the strings with the
    tensors), and the split gives the whole batch's parameters up to rounding."""

    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        return kind(x, torch.stack([s[1] for s in samples]), [f"{float(v):.4f}" for v in x[:, 0]])

    expected = type(collate([regression()[0]]))

    def train(run_dir: Path, micro: int) -> tuple[torch.nn.Module, list]:
        seen = []

        def loss_fn(model, batch):
            assert type(batch) is expected
            seen.append((len(batch.x), [f"{float(v):.4f}" for v in batch.x[:, 0]] == batch.ids))
            return F.mse_loss(model(batch.x), batch.y)

        model = mlp()
        loader = DataLoader(regression(), batch_size=8, collate_fn=collate)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        Trainer(model, optimizer, loss_fn, loader, config(run_dir, micro_batch_size=micro)).fit()
        return model, seen

    whole, seen_whole = train(tmp_path / "whole", 8)
    split, seen_split = train(tmp_path / "split", 2)
    assert seen_whole == [(8, True)] * 4
    assert seen_split == [(2, True)] * 16  # each micro-batch's ids are its own samples'
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b)


# -- torchvision's detection references: tuple(zip(*batch)) ----------------------------------


class Detector(torch.nn.Module):
    """A torchvision detection model's interface, small: a list of images and a list of target
    dicts (boxes and labels, a different count per image) in, a dict of losses out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.box = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 4)
        self.cls = torch.nn.Linear(4, 3)

    def forward(self, images, targets):
        box_losses, class_losses = [], []
        for image, target in zip(images, targets, strict=True):
            feature = self.conv(image[None]).mean((2, 3))
            n = len(target["boxes"])
            box_losses.append(F.l1_loss(self.box(feature).expand(n, 4), target["boxes"]))
            class_losses.append(F.cross_entropy(self.cls(feature).expand(n, 3), target["labels"]))
        return {
            "loss_box": torch.stack(box_losses).mean(),
            "loss_classifier": torch.stack(class_losses).mean(),
        }


def test_torchvision_s_detection_collate_of_tuples_per_sample_splits_by_image(tmp_path):
    """The detection tutorial's `collate_fn = lambda batch: tuple(zip(*batch))`: a tuple of
    images and a tuple of target dicts, one item per image. Read as fields, the first image's
    channels were taken for the batch size and each image tensor was sliced. Each tuple is
    read as one item per image: micro-batches of 2 get 2 images and their own targets, and
    train as the whole batch up to rounding."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(32):
        count = 1 + i % 3
        target = {
            "boxes": torch.rand(count, 4, generator=g),
            "labels": torch.randint(0, 3, (count,), generator=g),
        }
        samples.append((torch.randn(3, 6, 6, generator=g), target))

    def train(micro: int) -> tuple[torch.nn.Module, list]:
        model, seen = Detector(), []

        def loss_fn(model, batch):
            images, targets = batch
            seen.append([len(t["boxes"]) for t in targets])
            return sum(model(list(images), list(targets)).values())

        collate_fn = lambda batch: tuple(zip(*batch))  # noqa: B905, E731 (as the tutorial)
        loader = DataLoader(samples, batch_size=8, collate_fn=collate_fn)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        run_config = config(tmp_path / str(micro), micro_batch_size=micro)
        Trainer(model, optimizer, loss_fn, loader, run_config).fit()
        return model, seen

    whole, seen_whole = train(8)
    split, seen_split = train(2)
    assert seen_whole[0] == [1, 2, 3, 1, 2, 3, 1, 2]  # each image's box count
    assert seen_split[:4] == [[1, 2], [3, 1], [2, 3], [1, 2]]
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b)


# -- a recurrent model's sequence-first batches (pytorch/examples word_language_model) ----------

SEQ, VOCAB = 6, 12


def token_windows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (SEQ + 1,), generator=g) for _ in range(32)]


class Rnn(torch.nn.Module):
    """word_language_model's RNNModel, small: its forward takes (seq, batch) tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Embedding(VOCAB, 8)
        self.rnn = torch.nn.GRU(8, 8)  # batch_first=False, as the example
        self.decoder = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens):
        output, _ = self.rnn(self.encoder(tokens))
        return self.decoder(output)


def sequence_first(samples):
    """batchify's layout: the sequence first, then the batch."""
    windows = torch.stack(samples).t()  # (seq + 1, batch)
    return windows[:-1], windows[1:]


def own_loop() -> torch.nn.Module:
    model = Rnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for data, targets in DataLoader(token_windows(), batch_size=8, collate_fn=sequence_first):
        loss = F.cross_entropy(model(data).reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def test_a_sequence_first_batch_is_refused_naming_its_layout_and_the_port_that_trains(
    tmp_path, capsys
):
    """The example's (seq, batch) layout given as it is: steadytrain splits a batch along its
    first dimension, so a micro-batch of 4 took 4 time steps of all 8 sequences, counted them as
    4 samples and trained on, silently. The batch is refused at once (exit 2, naming the
    collate_fn, the place, its shape against the sample count and the fix); the port the message
    gives (batch first, transposed back in loss_fn) trains as the loop, bit for bit at the whole
    batch and up to rounding when split."""

    def trainer():
        loss_fn = lambda model, batch: F.cross_entropy(  # noqa: E731
            model(batch[0]).reshape(-1, VOCAB), batch[1].reshape(-1)
        )
        loader = DataLoader(token_windows(), batch_size=8, collate_fn=sequence_first)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
        return Trainer(
            Rnn(), optimizer, loss_fn, loader, config(tmp_path / "as-is", micro_batch_size=4)
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert (
        "train_data: collate_fn sequence_first made a batch of 8 samples whose item 0 is a "
        "tensor of shape (6, 8): 6 along its first dimension" in err
    )
    assert "a sequence-first (seq, batch) layout as (batch, seq), transposed back in loss_fn" in err

    def batch_first(samples):  # the port: the samples first, as steadytrain splits them
        windows = torch.stack(samples)
        return windows[:, :-1], windows[:, 1:]

    def loss_fn(model, batch):
        data, targets = (t.t() for t in batch)  # back to the example's (seq, batch)
        return F.cross_entropy(model(data).reshape(-1, VOCAB), targets.reshape(-1))

    loop = own_loop()
    for micro in (8, 4):
        port = Rnn()
        loader = DataLoader(token_windows(), batch_size=8, collate_fn=batch_first)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
        run_config = config(tmp_path / f"port-{micro}", micro_batch_size=micro, seed=None)
        Trainer(port, optimizer, loss_fn, loader, run_config).fit()
        for a, b in zip(loop.parameters(), port.parameters(), strict=True):
            if micro == 8:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b)


def test_a_value_of_the_whole_batch_is_refused_by_name_also_from_loader_workers(tmp_path, capsys):
    """Class weights put in the batch by a collate_fn were sliced with the samples, each
    micro-batch weighting by a part of them. Refused naming the key; from a DataLoader worker
    the refusal came back as torch's "Caught BadInputError in DataLoader worker process 0" with
    the worker's traceback: it is the one line now."""

    def with_weights(samples):
        x, y = (torch.stack(column) for column in zip(*samples, strict=True))
        return {"x": x, "y": y, "class_weights": torch.ones(3)}

    def trainer():
        loss_fn = lambda model, batch: F.mse_loss(model(batch["x"]), batch["y"])  # noqa: E731
        loader = DataLoader(regression(), batch_size=8, collate_fn=with_weights, num_workers=2)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        return Trainer(mlp(), optimizer, loss_fn, loader, config(tmp_path, micro_batch_size=4))

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err and "Caught" not in err
    assert (
        "error: train_data: collate_fn with_weights made a batch of 8 samples whose "
        "'class_weights' is a tensor of shape (3,): 3 along its first dimension" in err
    )


# -- a dataset one sample longer than a multiple of the batch ----------------------------------


def test_a_last_batch_of_one_sample_for_batch_norm_exits_2_naming_drop_last(tmp_path, capsys):
    """33 samples in a DataLoader of batch 8 without drop_last: the epoch's fifth batch holds one
    sample, which BatchNorm1d refuses in training. It stopped with torch's words as an error in
    loss_fn (exit 5), after the checkpoint's look-ahead had already failed on that batch at
    step 4 and lost step 4's checkpoint. Step 4's checkpoint is kept, and step 5 exits 2 naming
    the batch, its one sample and the fix, with which the run resumes and finishes."""
    g = torch.Generator().manual_seed(0)
    samples = TensorDataset(torch.randn(33, 4, generator=g), torch.randn(33, 1, generator=g))

    def trainer(drop_last: bool, **given):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
        )
        loss_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
        loader = DataLoader(samples, batch_size=8, drop_last=drop_last)
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        run_config = config(tmp_path, max_steps=None, epochs=2, save_every_steps=2, **given)
        return Trainer(model, optimizer, loss_fn, loader, run_config)

    code, err = exit_as_script(capsys, lambda: trainer(False))
    assert code == 2, err
    assert "Traceback" not in err
    assert "train_data: the batch of step 5 holds 1 sample, and the model's BatchNorm" in err
    assert "drop_last=True on the DataLoader" in err and "resume_overrides: ['drop_last']" in err
    assert (tmp_path / "checkpoints" / "step-00000004").is_dir()

    result = trainer(True, resume_overrides=["drop_last"]).fit()
    assert result.steps == 8
    resumes = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [4]


# -- callbacks that evaluate and forget to switch back ------------------------------------------


class EvaluatesAndForgets(Callback):
    """A program's own evaluation after step 2, written in a callback that does not switch back:
    `model.eval()` left on, or `torch.set_grad_enabled(False)` left off."""

    def __init__(self, model: torch.nn.Module, left: str):
        self.model, self.left = model, left

    def on_step_end(self, state, control, info):
        if state.step != 2:
            return
        if self.left == "eval":
            self.model.eval()
        else:
            torch.set_grad_enabled(False)
        self.model(regression().tensors[0])  # the evaluation itself


@pytest.mark.parametrize("left", ["eval", "no_grad"])
def test_a_callback_that_leaves_eval_mode_or_autograd_off_trains_and_resumes_exactly(
    tmp_path, left
):
    """Left in eval mode, the steps after the callback trained without dropout and on BatchNorm's
    running statistics, while a run resumed after them started in training mode: the resumed
    run ended elsewhere than the uninterrupted one. With autograd left off, the next step failed
    inside steadytrain (a traceback, exit 1). Each step now trains in training mode with
    autograd on, as fit() starts and as a resume starts, so both end at the same parameters."""

    def run(run_dir: Path, steps: int) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3),
            torch.nn.Linear(16, 1),
        )  # fmt: skip
        loss_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
        run_config = config(run_dir, max_steps=steps, save_every_steps=2)
        callbacks = [EvaluatesAndForgets(model, left)]
        optimizer = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
        try:
            Trainer(model, optimizer, loss_fn, regression(), run_config, callbacks=callbacks).fit()
        finally:
            torch.set_grad_enabled(True)  # what the callback left off, for the tests after
        return model

    through = run(tmp_path / "through", 6)
    run(tmp_path / "stopped", 4)
    resumed = run(tmp_path / "stopped", 6)
    for name, value in through.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


# -- an EMA of the weights ----------------------------------------------------------------------


def test_an_ema_updated_in_a_callback_after_the_save_is_refused_naming_it(tmp_path, capsys):
    """An EMA given as user_state and updated after each step in a plain callback, the first
    way a port writes timm's `model_ema.update(model)`: plain callbacks run after the step's
    checkpoint took the state, so every checkpoint held the EMA one update behind and a resumed
    run ended at another EMA than the run that went on, silently. The run stops at its first
    step (exit 2), naming the state, the callback and the fix."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def trainer():
        model = mlp()
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

        class UpdateEma(Callback):
            def on_step_end(self, state, control, info):
                ema.update_parameters(model)

        loss_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
        optimizer = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
        run_config = config(tmp_path / "run", save_every_steps=2)
        return Trainer(
            model, optimizer, loss_fn, regression(), run_config,
            user_state={"ema": ema}, callbacks=[UpdateEma()],
        )  # fmt: skip

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert (
        "user_state: 'ema' changed at the end of step 1 after the checkpoint took it, in a "
        "callback that runs after the save (UpdateEma)" in err
    )
    assert "give that callback state_dict() and load_state_dict()" in err


def test_a_vision_loop_with_an_ema_killed_under_steadytrain_run_ends_as_the_uninterrupted_run(
    tmp_path,
):
    """A conv net with BatchNorm and Dropout, AdamW with two param groups (no weight decay for
    norms and biases), OneCycleLR as the PyTorch docs build it, clipping, an EMA kept as
    docs/porting.md says, and the program's own evaluation every 5 steps in a callback that
    forgets model.train(): SIGKILLed after step 11 under `steadytrain run`, it resumes from
    step 8 and ends with the uninterrupted run's weights, running statistics and EMA, bit for
    bit. (Before, the steps after an evaluation trained in eval mode while the resumed ones
    did not.)"""
    want, got, resumed = killed_under_run_and_through("ported_vision.py", tmp_path, kill_after=11)
    assert resumed == [8]
    for part in ("model", "ema"):
        for name, value in want[part].items():
            assert torch.equal(got[part][name], value), f"{part}.{name}"
