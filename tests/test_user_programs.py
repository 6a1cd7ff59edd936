"""Programs written the way users write them, from the docs alone, each through the public
interface: the shapes of models and data the other tests rarely use."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from steadytrain import Callback, CarriedState, TrainConfig, Trainer
from steadytrain.config import load_mapping, parse_overrides
from steadytrain.errors import BadInputError, ConfigError, UserCodeError
from steadytrain.recipes.finetune import FinetuneJob
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.telemetry.files import read_jsonl


def config(tmp_path, **over) -> TrainConfig:
    values = dict(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        max_steps=4,
        save_every_steps=2,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    return TrainConfig(**(values | over))


def labelled(n: int = 64, features: int = 6) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def classify(model, batch):
    x, label = batch
    return torch.nn.functional.cross_entropy(model(x), label)


def batch_norm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


@pytest.mark.filterwarnings("ignore::steadytrain.trainer.BatchDependentModelWarning")
def test_a_batch_norm_model_plans_its_micro_batch(tmp_path):
    """BatchNorm1d cannot train on one sample; the planner's first pass at micro-batch 1 must
    not fail the user's valid program, and leaves its running statistics as they were."""
    model = batch_norm_net()
    result = Trainer(
        model, lambda p: torch.optim.SGD(p, lr=0.1), classify, labelled(), config(tmp_path)
    ).fit()
    assert result.exit_code == 0 and result.steps == 4
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["micro_batch_size"] for e in events if e["event"] == "plan"] == [16]
    same = batch_norm_net()
    Trainer(
        same,
        lambda p: torch.optim.SGD(p, lr=0.1),
        classify,
        labelled(),
        config(tmp_path, run_dir=str(tmp_path / "given"), micro_batch_size=16),
    ).fit()
    for key, value in same.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def loss_and_logits(model, batch):  # Hugging Face's compute_loss(return_outputs=True) form
    x, label = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits, label), logits


def loss_in_a_dict(model, batch):
    return {"loss": classify(model, batch)}


@pytest.mark.parametrize("micro", ["auto", 8])
@pytest.mark.parametrize(
    ("loss_fn", "words"),
    [
        (loss_and_logits, "second item is a tensor of shape"),
        (loss_in_a_dict, "returned the loss as dict, not a tensor"),
    ],
)
def test_a_loss_fn_returning_more_than_a_loss_is_their_error_exit_5(
    tmp_path, micro, loss_fn, words
):
    """The planner's trial pass (micro 'auto') and the step refuse it alike, naming loss_fn,
    instead of an internal error inside autograd or the optimizer step."""
    model = torch.nn.Linear(6, 3)
    trainer = Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn,
        labelled(),
        config(tmp_path, micro_batch_size=micro),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    assert info.value.exit_code == 5
    assert str(info.value).startswith("error in your code (loss_fn)") and words in str(info.value)


@pytest.mark.parametrize("kind", [np.int64, int, float])
def test_a_count_of_any_number_type_is_taken(tmp_path, kind):
    """A numpy integer, an int, or a float (a sum of sample weights) is one number."""

    def summed(model, batch):
        x, label = batch
        loss = torch.nn.functional.cross_entropy(model(x), label, reduction="sum")
        return loss, kind(len(label))

    model = torch.nn.Linear(6, 3)
    result = Trainer(
        model, lambda p: torch.optim.SGD(p, lr=0.1), summed, labelled(), config(tmp_path)
    ).fit()
    assert result.steps == 4


def test_the_report_of_a_run_stopped_before_its_first_step_says_why(tmp_path):
    """A run whose error came before fit_start (the planner's pass, the data) is reported as
    stopped by that error with its exit code, not as a run that has not started."""
    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        loss_and_logits,
        labelled(),
        config(tmp_path),
    )
    with pytest.raises(UserCodeError):
        trainer.fit()
    report = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "report", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert report.returncode == 0, report.stderr
    last = report.stdout.strip().splitlines()[-1]
    assert "not started" not in last
    assert "error in your code (loss_fn) before the first step" in last and "(exit 5)" in last


@pytest.mark.parametrize(
    ("loader", "words"),
    [
        (lambda data: DataLoader(data, batch_size=None), "a DataLoader with batch_size=None;"),
        (lambda data: DataLoader(data, batch_sampler=[[0, 1]]), "its own batch_sampler;"),
    ],
)
def test_a_loader_that_does_not_batch_by_size_is_refused_naming_what_it_has(loader, words):
    with pytest.raises(BadInputError) as info:
        Trainer(torch.nn.Linear(6, 3), None, classify, loader(labelled()), config(Path(".")))
    assert str(info.value).startswith("train_data: ") and words in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("text", ["2e-4", "2E-4", "1e2", "-3e+1"])
def test_yaml_numbers_without_a_dot_are_numbers_in_files_and_overrides(tmp_path, text):
    """YAML 1.2 (and JSON, and every Hugging Face config) reads 2e-4 as a number; PyYAML's
    YAML 1.1 reads it as text, and the config would then refuse `learning_rate: 2e-4`."""
    path = tmp_path / "run.yaml"
    path.write_text(f"effective_batch_size: 8\nmax_grad_norm: {text}\n")
    assert load_mapping(path)["max_grad_norm"] == float(text)
    assert parse_overrides([f"learning_rate={text}"]) == {"learning_rate": float(text)}
    assert parse_overrides(["run_dir=2e-4-run"]) == {"run_dir": "2e-4-run"}


def test_a_fine_tune_yaml_with_learning_rate_2e_4_is_valid(tmp_path):
    config = tmp_path / "finetune.yaml"
    config.write_text(
        "model_name_or_path: base\ntrain_file: train.jsonl\nlearning_rate: 2e-4\n"
        "weight_decay: 1e-2\nadam_epsilon: 1e-8\n"
    )
    resolved = FinetuneConfig.load(config, ["warmup_ratio=3e-2"])
    assert (resolved.learning_rate, resolved.weight_decay, resolved.adam_epsilon) == (
        2e-4,
        1e-2,
        1e-8,
    )
    assert resolved.warmup_ratio == 3e-2


CTRL_C_BEFORE_THE_FIRST_STEP = """
import os, signal, sys, torch
from steadytrain import TrainConfig, Trainer, entrypoint

class Data(torch.utils.data.Dataset):  # Ctrl-C while fit() reads the data, before any step
    def __len__(self):
        return 16
    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGINT)
        return torch.zeros(6), 0

@entrypoint
def main():
    config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, device="cpu")
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    return Trainer(torch.nn.Linear(6, 3), lambda p: torch.optim.SGD(p, lr=0.1), loss, Data(),
                   config).fit()

main()
"""


def test_ctrl_c_before_the_first_step_exits_130_without_a_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", CTRL_C_BEFORE_THE_FIRST_STEP, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr
    assert "SIGINT" in run.stderr


def test_a_torch_device_and_dtype_are_taken_as_the_config_writes_them(tmp_path):
    config = TrainConfig(
        run_dir=str(tmp_path), effective_batch_size=8, device=torch.device("cpu"),
        precision=torch.float32,
    )  # fmt: skip
    assert (config.device, config.precision) == ("cpu", "fp32")
    assert TrainConfig(effective_batch_size=8, device=torch.device("cuda", 1)).device == "cuda:1"
    assert TrainConfig(effective_batch_size=8, precision=torch.bfloat16).precision == "bf16"
    with pytest.raises(ConfigError, match="precision: must be"):
        TrainConfig(effective_batch_size=8, precision=torch.int8)


class HistoryOptimizer(torch.optim.Optimizer):
    """SGD whose state keeps the last gradient norms in a deque: a checkpoint of it could not
    be read back with torch.load(weights_only=True)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("norms", collections.deque(maxlen=3))
                history.append(float(p.grad.norm()))
                p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_state_a_resume_could_not_load_stops_at_the_first_save(tmp_path):
    """Found at the first checkpoint, naming the optimizer, the entry and its type (exit 2),
    instead of training on to a run whose every checkpoint a resume refuses."""
    model = torch.nn.Linear(6, 3)
    trainer = Trainer(
        model, HistoryOptimizer(model.parameters()), classify, labelled(), config(tmp_path)
    )
    with pytest.raises(BadInputError) as info:
        trainer.fit()
    text = str(info.value)
    assert text.startswith("optimizer: ") and "deque" in text and "'norms'" in text
    assert "weights_only=True" in text and info.value.exit_code == 2
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_the_seed_config_as_shipped_fails_at_once_offline_naming_data_and_model(
    tmp_path, monkeypatch
):
    """examples/finetune_config.json run where neither its data nor its hub model is here: the
    missing data file is named before any model is looked up, and with the data present a hub
    id that is not cached fails without waiting for the hub client's retries."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    example = Path(__file__).resolve().parent.parent / "examples" / "finetune_config.json"
    with pytest.raises(BadInputError) as missing:  # every problem it can see, at once
        FinetuneJob(FinetuneConfig.load(example, ["output_dir=out"]))
    said = str(missing.value)
    assert "\n  - train_file: data file data/train.jsonl does not exist" in said, said
    assert "\n  - eval_file: data file data/eval.jsonl does not exist" in said, said
    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / "data" / name).write_text('{"text": "hello"}\n')
    with pytest.raises(BadInputError) as info:
        FinetuneJob(FinetuneConfig.load(example, ["output_dir=out"]))
    text = str(info.value)
    assert text.startswith("model_name_or_path: hub id 'meta-llama/Llama-3.2-3B' is not in")
    assert "127.0.0.1" in text and "local folder" in text


@pytest.mark.parametrize(
    ("returned", "words"),
    [
        (0.5, "returned float, not a dict"),
        ({"accuracy": "high"}, "'accuracy' is str"),
        ({"accuracy": torch.tensor([1.0, 2.0])}, "'accuracy' is a tensor of shape (2,)"),
    ],
)
def test_an_eval_fn_that_returns_no_numbers_is_their_error_naming_eval_fn(
    tmp_path, returned, words
):
    def eval_fn(model, batches):
        for _ in batches:
            pass
        return returned

    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        classify,
        labelled(),
        config(tmp_path, eval_every_steps=2, micro_batch_size=16),
        eval_data=labelled(16),
        eval_fn=eval_fn,
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    text = str(info.value)
    assert info.value.exit_code == 5 and text.startswith("error in your code (eval_fn) at step 2")
    assert words in text and "{name: number}" in text


def test_eval_data_without_a_cadence_is_evaluated_when_max_steps_ends_mid_epoch(tmp_path):
    """Given eval_data and neither eval_every_steps nor eval_every_epochs, a run that
    max_steps ends before its first epoch's end still evaluates once, after its last step."""
    Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        classify,
        labelled(),
        config(tmp_path, max_steps=2, micro_batch_size=16),
        eval_data=labelled(16),
    ).fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], "eval_loss" in r) for r in rows if r.get("kind") == "eval"] == [(2, True)]


class TinyGRU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.rnn = torch.nn.Embedding(11, 8), torch.nn.GRU(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return self.head(out), hidden


def epoch_reset_run(run_dir, stop_at=None):
    """A language model whose hidden state starts again each epoch (init_hidden at the top of
    each epoch); 3 steps an epoch, a checkpoint at each epoch's end."""
    torch.manual_seed(0)
    model = TinyGRU()
    hidden = CarriedState(init=lambda n: torch.zeros(1, n, 8), batch_dim=1, reset_each_epoch=True)

    def loss_fn(model, batch):
        tokens, targets = batch
        logits, new = model(tokens, hidden.get())
        hidden.set(new)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    class StopAt(Callback):
        def on_step_end(self, state, control, info):
            if state.step == stop_at:
                control.request_stop(143, "stopped by the test")

    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 11, (12, 6), generator=g)
    data = TensorDataset(text[:, :5], text[:, 1:])
    cfg = config(
        Path(run_dir), run_dir=str(run_dir), effective_batch_size=4, micro_batch_size=4,
        max_steps=None, epochs=2, save_every_steps=3, shuffle=False,
    )  # fmt: skip
    result = Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.5),
        loss_fn,
        data,
        cfg,
        user_state={"hidden": hidden},
        callbacks=[StopAt()],
    ).fit()
    return model, result


def test_a_resume_from_an_epoch_end_checkpoint_with_state_reset_each_epoch(tmp_path):
    """The checkpoint at an epoch's last step records the loss of the next epoch's first step,
    which starts from the reset state: the resume's check must expect that loss."""
    whole, _ = epoch_reset_run(tmp_path / "whole")
    _, stopped = epoch_reset_run(tmp_path / "resumed", stop_at=3)
    assert stopped.steps == 3
    resumed, result = epoch_reset_run(tmp_path / "resumed")
    assert result.exit_code == 0 and result.steps == 6
    continuity = [
        e for e in read_jsonl(tmp_path / "resumed" / "events.jsonl") if e["event"] == "continuity"
    ]
    assert [(e["step"], e["equal"]) for e in continuity] == [(4, True)]
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_every_public_name_shows_in_dir_for_completion():
    import steadytrain

    assert {"Trainer", "FitResult", "CarriedState", "TrainConfig"} <= set(dir(steadytrain))


def test_an_optimizer_whose_step_needs_a_closure_is_refused_naming_it(tmp_path):
    """pytorch/examples time_sequence_prediction trains with LBFGS, whose step() requires a
    closure: refused before training (exit 2, naming the optimizer and the way out) instead of
    a TypeError from inside the step; nothing is written to the run directory."""
    model = torch.nn.Linear(6, 3)
    trainer = Trainer(
        model, lambda p: torch.optim.LBFGS(p, lr=0.8), classify, labelled(), config(tmp_path)
    )
    with pytest.raises(BadInputError) as info:
        trainer.fit()
    assert info.value.exit_code == 2
    message = str(info.value)
    assert message.startswith("optimizer: LBFGS.step() needs a closure")
    assert "AdamW" in message and "docs/porting.md" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("wrap", ["model_output", "dict"])
def test_a_loss_fn_returning_the_model_output_is_told_to_return_its_loss(tmp_path, wrap):
    """A Hugging Face user writes `return model(**batch)`: the output holds the loss, and the
    error (exit 5, naming loss_fn) says to return it, `outputs.loss`."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    def loss_fn(model, batch):
        x, label = batch
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, label)
        if wrap == "dict":
            return {"loss": loss, "logits": logits}
        return SequenceClassifierOutput(loss=loss, logits=logits)

    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn,
        labelled(),
        config(tmp_path),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    assert info.value.exit_code == 5
    assert 'holds a "loss" tensor; return that (`model(**batch).loss`' in str(info.value)


class TinyVAE(torch.nn.Module):
    """pytorch/examples vae/main.py's model, small; the noise comes with the sample."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = (
            torch.nn.Linear(16, 8),
            torch.nn.Linear(8, 2),
            torch.nn.Linear(8, 2),
        )
        self.fc3, self.fc4 = torch.nn.Linear(2, 8), torch.nn.Linear(8, 16)

    def forward(self, x, eps):
        h = torch.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + eps * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(torch.relu(self.fc3(z)))), mu, logvar


def vae_loss_summed_over_the_batch(model, x, eps):
    recon, mu, logvar = model(x, eps)
    bce = torch.nn.functional.binary_cross_entropy(recon, x, reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def test_a_loss_summed_over_the_batch_ported_as_a_pair_is_the_loop_at_any_split(tmp_path):
    """vae/main.py sums its loss over the batch. Ported as docs/porting.md says, (loss_sum,
    samples) with SGD's lr times the batch size, the update is the loop's at micro 16 and 4."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(64, 16, generator=g), torch.randn(64, 2, generator=g))

    def params(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.manual_seed(0)
    model = TinyVAE()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, eps in DataLoader(data, batch_size=16):
        optimizer.zero_grad()
        vae_loss_summed_over_the_batch(model, x, eps).backward()
        optimizer.step()
    loop = params(model)

    def loss_fn(model, batch):
        x, eps = batch
        return vae_loss_summed_over_the_batch(model, x, eps), len(x)

    ported = []
    for micro in (16, 4):
        torch.manual_seed(0)
        model = TinyVAE()
        Trainer(
            model,
            lambda p: torch.optim.SGD(p, lr=1e-3 * 16),
            loss_fn,
            DataLoader(data, batch_size=16),
            config(tmp_path, run_dir=str(tmp_path / f"micro-{micro}"), micro_batch_size=micro),
        ).fit()
        ported.append(params(model))
    torch.testing.assert_close(ported[0], loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ported[1], loop, rtol=1e-5, atol=1e-6)


class Stream(torch.utils.data.Dataset):
    """A stream written as docs/porting.md says: sample i made from i, a length past any run."""

    def __len__(self):
        return 10**15

    def __getitem__(self, i):
        x = torch.randn(6, generator=torch.Generator().manual_seed(i))
        return x, int(i % 3)


@pytest.mark.parametrize("loader", [False, True], ids=["dataset", "dataloader"])
def test_a_stream_of_any_length_trains_and_resumes_as_the_same_run(tmp_path, loader):
    """A dataset of 10**15 samples read in order, alone or in a DataLoader as a port passes it:
    no order of that length is ever held, and a run stopped at its step-3 checkpoint and
    resumed ends at the uninterrupted run's params."""

    def trained(run_dir, *stops):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(6, 3))
        data = DataLoader(Stream(), batch_size=16) if loader else Stream()
        for max_steps in stops:
            order = {} if loader else {"shuffle": False}  # a DataLoader's sampler is its order
            cfg = config(tmp_path, run_dir=str(run_dir), max_steps=max_steps, seed=None, **order)
            Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), classify, data, cfg).fit()
        return model[1].weight.detach().clone()

    whole = trained(tmp_path / "whole", 6)
    resumed = trained(tmp_path / "resumed", 3, 6)
    assert torch.equal(resumed, whole)
    assert [
        e["step"]
        for e in read_jsonl(tmp_path / "resumed" / "events.jsonl")
        if e["event"] == "resume"
    ] == [3]


def test_a_shuffled_order_is_the_permutation_runs_before_were_resumed_on():
    """The permutation is kept per epoch as a tensor now; its batches are the indices the
    seeded randperm gave before, so a checkpoint written mid-epoch resumes on the same order."""
    from steadytrain.engine.sampler import OptimizerBatchSampler

    sampler = OptimizerBatchSampler(num_samples=50, batch_size=8, seed=3)
    for epoch in (0, 1, 0):
        drawn = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1_000_003 + epoch))
        assert list(sampler.batch_at(epoch, 2)) == drawn.tolist()[16:24]
        assert all(type(i) is int for i in sampler.batch_at(epoch, 2))
    sampler.set_position(1, 5)
    assert [list(b) for b in sampler] == [
        torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1)).tolist()[
            40:48
        ]
    ]


def test_a_gan_s_optimizers_by_name_are_refused_as_several_optimizers(tmp_path):
    """dcgan keeps optimizerG and optimizerD; given as a dict, the refusal is the one a list
    gets (naming 'Several optimizers' in docs/porting.md), not 'expected an optimizer'."""
    generator, discriminator = torch.nn.Linear(6, 3), torch.nn.Linear(3, 1)
    optimizers = {
        "g": torch.optim.Adam(generator.parameters()),
        "d": torch.optim.Adam(discriminator.parameters()),
    }
    trainer = Trainer(generator, optimizers, classify, labelled(), config(tmp_path))
    with pytest.raises(BadInputError, match=r"optimizer: 2 optimizers given.*Several optimizers"):
        trainer.fit()
    trainer = Trainer(generator, lambda p: None, classify, labelled(), config(tmp_path))
    with pytest.raises(BadInputError, match="the function returned NoneType"):
        trainer.fit()


def loss_as_a_float(model, batch):  # the loss logged the way it is printed
    return classify(model, batch).item()


def loss_as_numpy(model, batch):
    return np.float32(classify(model, batch).item())


def loss_detached(model, batch):
    return classify(model, batch).detach()


def loss_not_returned(model, batch):
    classify(model, batch)


@pytest.mark.parametrize("micro", ["auto", 8])
@pytest.mark.parametrize(
    ("loss_fn", "words"),
    [
        (loss_as_a_float, "returned the loss as float ("),
        (loss_as_numpy, "returned the loss as float32 ("),
        (loss_detached, "a tensor that does not require grad"),
        (loss_not_returned, "returned the loss as None (is its `return` missing?)"),
    ],
)
def test_a_loss_fn_returning_a_number_backward_cannot_run_on_is_told_what_to_return(
    tmp_path, micro, loss_fn, words
):
    """`loss.item()`, a numpy number, a detached tensor or None: exit 5 naming loss_fn, what it
    returned and what to return, from the planner's pass and the step alike (not a traceback
    from autograd)."""
    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn,
        labelled(),
        config(tmp_path, micro_batch_size=micro),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    text = str(info.value)
    assert info.value.exit_code == 5 and text.startswith("error in your code (loss_fn)")
    assert words in text
    assert "not `loss.item()`" in text or "Return the loss as the model's forward" in text


def token_samples(lengths) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in lengths:
        tokens = torch.randint(0, 11, (n,), generator=g)
        samples.append({"input_ids": tokens, "labels": tokens.clone()})
    return samples


class TinyLM(torch.nn.Module):
    """A language model whose forward takes the batch's keywords, as a Hugging Face one does."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("micro", ["auto", 4])
def test_token_samples_of_different_lengths_without_padding_name_two_samples_and_the_fix(
    tmp_path, micro
):
    """No collate_fn, samples of 5 to 12 tokens: exit 5 naming the field, two samples by their
    dataset index and their lengths, and Collator, not the internal PerSample type."""
    lengths = [5 + (i * 7) % 8 for i in range(16)]  # 5, 12, 11, ... tokens
    trainer = Trainer(
        TinyLM(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda model, batch: model(**batch),
        token_samples(lengths),
        config(tmp_path, effective_batch_size=16, micro_batch_size=micro, shuffle=False),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    text = str(info.value)
    assert info.value.exit_code == 5 and "PerSample" not in text
    assert text.startswith("error in your code (data) ")
    words = "'input_ids' of each sample: samples 0 and 1 have 5 and 12 tokens (this batch: 5 to 12"
    assert words in text
    assert "collate_fn=Collator(pad_id)" in text


@pytest.mark.parametrize("index", ["columns", "ellipsis", "mask"])
def test_token_samples_of_different_lengths_sliced_as_a_tensor_get_the_same_refusal(
    tmp_path, index
):
    """The commonest first use of a text batch, `x[:, :3]`, on samples of different lengths
    without a collate_fn: the documented exit 5 naming two samples and Collator, as `.shape`
    gets, not list's "list indices must be integers or slices, not tuple"."""
    take = {
        "columns": lambda x: x[:, :3],
        "ellipsis": lambda x: x[..., 0],
        "mask": lambda x: x[torch.ones(16, dtype=torch.bool)],
    }[index]

    def loss_fn(model, batch):
        ids = take(batch["input_ids"])
        return model(ids, ids)

    trainer = Trainer(
        TinyLM(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn,
        token_samples([5 + (i * 7) % 8 for i in range(16)]),
        config(tmp_path, effective_batch_size=16, micro_batch_size=16, shuffle=False),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    text = str(info.value)
    assert info.value.exit_code == 5 and "list indices" not in text
    assert "samples 0 and 1 have 5 and 12 tokens" in text
    assert "collate_fn=Collator(pad_id)" in text


def test_a_sample_of_another_shape_is_named_by_its_dataset_index_and_both_shapes(tmp_path):
    data = [(x.clone(), y) for x, y in labelled(32)]
    data[21] = (torch.randn(7), 1)
    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        classify,
        data,
        config(tmp_path, micro_batch_size=16),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    text = str(info.value)
    assert info.value.exit_code == 5 and "PerSample" not in text
    assert (
        "item 0 of each sample: sample 21 has shape (7,) where the 15 other samples of its " in text
    )
    assert "batch have shape (6,)" in text


class DiesInAWorker(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None and index == 5:
            os._exit(3)
        return torch.zeros(6), 0


def test_a_data_loader_worker_that_dies_is_one_line_naming_it_and_num_workers_0(tmp_path):
    trainer = Trainer(
        torch.nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        classify,
        DiesInAWorker(),
        config(tmp_path, micro_batch_size=16, num_workers=2),
    )
    with pytest.raises(UserCodeError) as info:
        trainer.fit()
    error = info.value
    assert error.exit_code == 5 and error.where == "DataLoader worker" and not error.frames
    text = str(error)
    assert "a DataLoader worker (pid " in text and "rerun with num_workers=0" in text
    assert "Traceback" not in text and len(text.splitlines()) == 2


def tiny_llama_folder(folder: Path, **generation) -> Path:
    """A 2-layer Llama with random weights and the byte tokenizer, saved as a model folder;
    `generation`: the generation_config.json it ships (none when empty)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from steadytrain.recipes.data import byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=256, eos_token_id=257, pad_token_id=258, **generation
    )
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_generate_samples_by_default_and_says_with_what(tmp_path):
    """`steadytrain generate MODEL PROMPT` as the export's `next:` line prints it: greedy
    decoding of a small model repeats itself ("the the the"), so without --temperature it
    samples (the model's generation_config where it samples, else temperature 0.7, top_p 0.9)
    and prints the settings it used; --temperature 0 is still greedy."""
    import io

    from rich.console import Console

    from steadytrain.recipes.generate import generate, generate_command

    folder = tiny_llama_folder(tmp_path / "plain")
    out, err = io.StringIO(), io.StringIO()
    settings = dict(max_new_tokens=24, device="cpu", json_output=True)
    generate_command(
        str(folder), prompt="the cat", console=Console(file=out), err_console=Console(file=err),
        **settings,
    )  # fmt: skip
    assert "sampling at temperature 0.7, top_p 0.9" in err.getvalue() and "seed 0" in err.getvalue()
    default = json.loads(out.getvalue())["completion"]
    sampled = generate(folder, ["the cat"], max_new_tokens=24, temperature=0.7, top_p=0.9)
    greedy = generate(folder, ["the cat"], max_new_tokens=24, temperature=0.0)
    assert default == sampled[0].completion != greedy[0].completion

    own = tiny_llama_folder(tmp_path / "own", do_sample=True, temperature=1.3, top_k=5)
    said = []
    generate(own, ["the cat"], max_new_tokens=4, on_sampling=lambda s: said.append(s.describe(0)))
    assert said == [
        "sampling at temperature 1.3, top_p 1, top_k 5 (the model's generation_config), seed 0"
    ]


def test_a_config_file_loads_in_python_with_overrides_as_the_docs_say(tmp_path):
    """`TrainConfig.load(path, overrides)` as README and docs/config.md show it; the README's
    command table names every command the CLI has (`export` was missing)."""
    path = tmp_path / "train.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\neffective_batch_size: 8\nmax_steps: 100\n")
    loaded = TrainConfig.load(path, {"max_steps": 10})
    assert (loaded.max_steps, loaded.effective_batch_size) == (10, 8)
    with pytest.raises(ConfigError, match="max_stepz"):
        TrainConfig.load(path, {"max_stepz": 10})
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert "TrainConfig.load(" in readme
    assert "TrainConfig.load(" in (root / "docs" / "config.md").read_text()
    from steadytrain.cli import app

    commands = [c.name or c.callback.__name__ for c in app.registered_commands]
    missing = [
        c for c in commands if f"| `steadytrain {c}" not in readme and f"`{c} " not in readme
    ]
    assert not missing, missing


def test_a_model_folder_without_weights_is_bad_input_naming_the_weights(tmp_path):
    """A folder with config.json (and a tokenizer) but no weights file: exit 2 naming the
    folder and the weights looked for, not a traceback from transformers."""
    from steadytrain.recipes.generate import generate

    folder = tiny_llama_folder(tmp_path / "no_weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(BadInputError) as info:
        generate(folder, ["the cat"], max_new_tokens=2)
    text = str(info.value)
    assert info.value.exit_code == 2 and "cannot load the weights of" in text
    assert str(folder) in text and "model.safetensors" in text
