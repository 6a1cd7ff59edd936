"""Public training programs ported by following README.md, docs/porting.md and
docs/integrations.md as written: transformers' run_clm script with its own checkpoint detection
kept, and a plain loop over a stream whose torch.autocast stays in the loss function."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from script_helpers import exit_as_script
from tiny_models import llama_config
from torch.utils.data import DataLoader

from steadytrain import TrainConfig, Trainer
from steadytrain.telemetry.files import read_jsonl

# -- transformers' run_clm.py -------------------------------------------------------------------

BLOCK = 16


def grouped_bytes(start: int, stop: int) -> list[dict]:
    """run_clm's tokenize + group_texts, bytes for tokens: the text of a standard module."""
    ids = list(Path(os.__file__).read_bytes()[start:stop])
    return [
        {"input_ids": torch.tensor(ids[i : i + BLOCK]), "labels": torch.tensor(ids[i : i + BLOCK])}
        for i in range(0, len(ids) - BLOCK + 1, BLOCK)
    ]


def run_clm(output_dir: Path, max_steps: int, callbacks=()) -> dict:
    """run_clm.py's main(), small: its last-checkpoint detection, TrainingArguments with eval and
    save strategies, gradient accumulation and a cosine schedule, train(resume_from_checkpoint=
    last_checkpoint), save_model(). The one added line: SteadytrainCallback(). Returns the
    trained parameters."""
    from transformers import LlamaForCausalLM, TrainingArguments, default_data_collator
    from transformers import Trainer as HuggingFaceTrainer
    from transformers.trainer_utils import get_last_checkpoint

    from steadytrain.integrations.huggingface import SteadytrainCallback

    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
    )
    last_checkpoint = None
    if os.path.isdir(args.output_dir):
        last_checkpoint = get_last_checkpoint(args.output_dir)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(llama_config(vocab_size=256, max_position_embeddings=BLOCK))
    trainer = HuggingFaceTrainer(
        model=model,
        args=args,
        train_dataset=grouped_bytes(0, 1024),
        eval_dataset=grouped_bytes(1024, 1024 + 4 * BLOCK),
        data_collator=default_data_collator,
        callbacks=[SteadytrainCallback(), *callbacks],
    )
    trainer.train(resume_from_checkpoint=last_checkpoint)
    trainer.save_model()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def run_clm_reference(tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    return run_clm(tmp_path_factory.mktemp("run_clm") / "reference", 4)


def test_run_clm_s_own_newest_checkpoint_half_written_gives_way_to_a_verified_one(
    tmp_path, run_clm_reference
):
    """run_clm passes get_last_checkpoint(output_dir), the newest checkpoint-N by number, to
    train(): one a kill left half-written made Hugging Face fail to load it (a traceback, and the
    same again on every restart). The callback resumes from the newest that verifies instead,
    and the run ends at the uninterrupted run's parameters."""
    out = tmp_path / "out"
    run_clm(out, 4)
    with open(out / "checkpoint-4" / "model.safetensors", "r+b") as torn:
        torn.truncate(100)
    (out / "checkpoint-4" / "steadytrain-manifest.json").unlink()

    params = run_clm(out, 4)

    events = read_jsonl(out / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "checkpoint_skipped"] == [4]
    assert [e for e in events if e["event"] == "resume"][-1]["checkpoint"].endswith("checkpoint-2")
    for name, value in run_clm_reference.items():
        assert torch.equal(params[name], value), name


def test_the_model_run_clm_saved_in_output_dir_still_loads_after_a_rerun_fails(tmp_path):
    """trainer.save_model() writes the model's config.json into output_dir, where the callback
    writes the run's config.json when train() starts: a rerun that stopped before its own
    save_model() (a crash, a kill) left a folder from_pretrained refused ("Unrecognized model").
    The model's config.json is kept."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    class Crash(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise RuntimeError("the rerun's own error")

    out = tmp_path / "out"
    run_clm(out, 2)
    with pytest.raises(RuntimeError, match="the rerun's own error"):
        run_clm(out, 2, callbacks=[Crash()])

    AutoModelForCausalLM.from_pretrained(out)  # the saved model, as run_clm left it
    starts = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "fit_start"]
    assert starts[-1]["config"]["library"] == "transformers"  # the run's config is recorded


SLOW_EVALUATION = {
    "huggingface": """
import sys, time, torch
from transformers import Trainer, TrainingArguments
from steadytrain.integrations.huggingface import SteadytrainCallback

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        if not self.training:
            time.sleep(0.5)  # one batch of a large validation set on a slow machine
        out = self.linear(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

torch.manual_seed(0)
data = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(16)]
args = TrainingArguments(
    output_dir=sys.argv[1], per_device_train_batch_size=4, per_device_eval_batch_size=1,
    max_steps=4, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
    report_to=[], use_cpu=True, disable_tqdm=True,
)
class SlowSetUp(Trainer):
    def create_optimizer(self, *args, **kwargs):
        time.sleep(4.5)  # a large model's set-up on a slow machine, before the first step
        return super().create_optimizer(*args, **kwargs)

callback = SteadytrainCallback(hang_timeout=float(sys.argv[2]))
SlowSetUp(model=Model(), args=args, train_dataset=data, eval_dataset=data[:10],
          callbacks=[callback]).train()
""",
    "lightning": """
import sys, time, torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
from steadytrain.integrations.lightning import SteadytrainCallback

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        time.sleep(0.5)  # one batch of a large validation set on a slow machine
        self.log("val_loss", torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
x, y = torch.randn(16, 4), torch.randn(16, 1)
trainer = L.Trainer(
    default_root_dir=sys.argv[1], max_epochs=1, accelerator="cpu", logger=False,
    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    callbacks=[SteadytrainCallback(hang_timeout=float(sys.argv[2]))],
)
trainer.fit(Model(), DataLoader(TensorDataset(x, y), batch_size=4),
            DataLoader(TensorDataset(x[:10], y[:10]), batch_size=1))
""",
    "keras": """
import os, sys, time
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
from steadytrain.integrations.keras import SteadytrainCallback

class Slow(keras.layers.Layer):
    def call(self, x, training=None):
        if not training:
            time.sleep(0.5)  # one batch of a large validation set on a slow machine
        return x

rng = np.random.default_rng(0)
x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
model = keras.Sequential([keras.Input((4,)), Slow(), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
model.fit(x, y, batch_size=4, epochs=1, validation_data=(x[:10], y[:10]),
          validation_batch_size=1, verbose=0,
          callbacks=[SteadytrainCallback(sys.argv[1], hang_timeout=float(sys.argv[2]))])
""",
}


@pytest.mark.parametrize("library", sorted(SLOW_EVALUATION))
def test_an_evaluation_longer_than_the_hang_limit_is_progress(tmp_path, library):
    """run_clm evaluates at eval_steps, before that step's save (Lightning and Keras validate
    before their epoch-end save): an evaluation longer than the hang limit, with no training
    step in it, was taken for a hang (exit 75), and the restart evaluated again at the same
    step, without a new checkpoint, until `steadytrain run` gave up. Each evaluation batch is a
    heartbeat, as in the Trainer's own evaluation. Hugging Face's own set-up before its first
    step (here an optimizer built in 4.5 s; in CI two suites on two cores once stretched
    accelerate's preparation past the limit) has the set-up's allowance, as `fit()`'s has."""
    import forkserver

    module = {"huggingface": "transformers"}.get(library, library)
    if importlib.util.find_spec(module) is None:  # (keras imports its backend: not here)
        pytest.skip(f"{module} is not installed")
    script = tmp_path / "train.py"
    script.write_text(SLOW_EVALUATION[library])
    out = tmp_path / "out"
    # 10 evaluation batches of 0.5 s: 5 s of evaluation against a limit of 3 s
    proc = forkserver.run([sys.executable, str(script), str(out), "3"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    assert not [e for e in events if e["event"] == "hang"]
    assert [e for e in events if e["event"] == "checkpoint"]  # the save after the evaluation


# -- a plain loop: a stream, bf16 autocast, clipping, a LambdaLR ---------------------------------

STEPS, BATCH = 12, 8
WEIGHTS = torch.linspace(-1, 1, 8).reshape(8, 1)


def sample(i: int):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, generator=g)
    return x, x @ WEIGHTS + 0.1 * torch.randn(1, generator=g)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        i = 0
        while True:
            yield sample(i)
            i += 1


class Indexed(torch.utils.data.Dataset):
    """The stream as docs/porting.md 'Streams' says: sample i made from i, a length past the run."""

    def __len__(self):
        return 10**12

    def __getitem__(self, i):
        return sample(i)


def warm_then_halve(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.5 ** (step // 6)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def own_loop() -> torch.nn.Module:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warm_then_halve)
    for step, (x, y) in enumerate(DataLoader(Stream(), batch_size=BATCH)):
        if step == STEPS:
            break
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model


def port(run_dir: Path, autocast_in_loss_fn: bool, precision: str) -> torch.nn.Module:
    model = mlp()

    def loss_fn(model, batch):
        x, y = batch
        if not autocast_in_loss_fn:
            return F.mse_loss(model(x), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # left as the loop had it
            return F.mse_loss(model(x), y)

    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=BATCH,
        micro_batch_size=BATCH,
        max_steps=STEPS,
        max_grad_norm=1.0,
        precision=precision,
        seed=None,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        loss_fn,
        DataLoader(Indexed(), batch_size=BATCH),
        config,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, warm_then_halve),
    ).fit()
    return model


def test_a_loop_s_autocast_kept_in_loss_fn_or_given_as_precision_trains_as_the_loop(tmp_path):
    """docs/porting.md 'Mixed precision': the loop's torch.autocast left in loss_fn (the config's
    precision fp32), or removed for precision bf16, gives the loop's parameters bit for bit."""
    loop = own_loop().state_dict()
    for name, (kept, precision) in {"kept": (True, "fp32"), "config": (False, "bf16")}.items():
        ported = port(tmp_path / name, kept, precision).state_dict()
        assert all(torch.equal(ported[k], v) for k, v in loop.items()), name


@pytest.mark.parametrize(
    ("field", "given", "called"),
    [
        ("loss_fn", {"loss_fn": lambda batch: batch[0].sum()}, "loss_fn(model, batch)"),
        ("eval_fn", {"eval_fn": lambda batches: {"n": 1.0}}, "eval_fn(model, batches)"),
    ],
    ids=["loss_fn", "eval_fn"],
)
def test_a_function_that_cannot_take_what_the_trainer_passes_exits_5_naming_it(
    tmp_path, capsys, field, given, called
):
    """A loop's body moved into loss_fn(batch), or test(loader) into eval_fn(batches), without
    the model: the call failed inside steadytrain's frame, so @entrypoint printed a traceback
    and exited 1 (an internal error). It exits 5 before training, naming the function, what it
    takes and the call steadytrain makes."""
    parts = {"loss_fn": lambda model, batch: F.mse_loss(model(batch[0]), batch[1]), **given}
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]

    def trainer():
        config = TrainConfig(run_dir=str(tmp_path / "run"), effective_batch_size=4, device="cpu")
        return Trainer(
            mlp(),
            lambda params: torch.optim.SGD(params, lr=0.1),
            parts["loss_fn"],
            data,
            config,
            eval_data=data,
            eval_fn=parts.get("eval_fn"),
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 5, err
    assert "Traceback" not in err
    assert f"{field} <lambda> (test_ported_programs.py:" in err
    assert "takes (batch" in err and f"steadytrain calls {called}" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_loop_s_own_scheduler_beside_an_optimizer_function_is_refused_naming_both(
    tmp_path, capsys
):
    """mnist/main.py builds `optimizer` and `StepLR(optimizer, ...)`; a port that gives the
    Trainer `lambda params: Adadelta(params, ...)` and that StepLR stepped the loop's optimizer,
    not the run's: the run trained at its first learning rate throughout, silently. It exits 2
    before training, naming the scheduler and both ways to fix it."""
    model = mlp()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)  # the loop's, kept
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]

    def trainer():
        config = TrainConfig(
            run_dir=str(tmp_path / "run"), effective_batch_size=4, device="cpu", progress="off"
        )
        return Trainer(
            model,
            lambda params: torch.optim.Adadelta(params, lr=1.0),
            lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
            data,
            config,
            scheduler=scheduler,
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert (
        "scheduler: this StepLR was built on an optimizer (Adadelta) that is not the run's" in err
    )
    assert "scheduler=lambda opt: StepLR(opt, ...)" in err
    assert not (tmp_path / "run").exists()  # a refused start leaves nothing of its own


def test_an_optimizer_built_on_another_instance_of_the_model_is_refused(tmp_path, capsys):
    """A port that builds the model again (to reseed it) and passes the loop's optimizer, built on
    the first instance: every step updated that one and the model given to the Trainer never
    trained, silently. It exits 2 before training, naming the optimizer and the fix."""
    optimizer = torch.optim.Adadelta(mlp().parameters(), lr=1.0)  # the loop's, on its model
    model = mlp()  # built again for the port
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]

    def trainer():
        config = TrainConfig(
            run_dir=str(tmp_path / "run"), effective_batch_size=4, device="cpu", progress="off"
        )
        loss_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
        return Trainer(model, optimizer, loss_fn, data, config)

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert "optimizer: this Adadelta holds 4 parameter tensor(s), none of them the model's" in err
    assert "optimizer=lambda params: Adadelta(params, ...)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("shuffled_by", "named"),
    [
        ("config", "the config's shuffle: an epoch's order is held in memory, 8 bytes a sample"),
        ("loader", "the DataLoader's RandomSampler: an epoch's order is held in memory, 8 bytes"),
    ],
    ids=["config", "loader"],
)
def test_a_stream_ported_as_a_dataset_then_shuffled_is_refused_naming_the_order(
    tmp_path, capsys, shuffled_by, named
):
    """The stream as docs/porting.md 'Streams' ports it (10**12 samples), with the default
    shuffle of the config or a DataLoader's shuffle=True: drawing the epoch's permutation
    failed in the first step with the allocator's error, a traceback and exit 1. It exits 2
    before training, naming the order, its size against the budget and the fix."""
    data = Indexed() if shuffled_by == "config" else DataLoader(Indexed(), BATCH, shuffle=True)

    def trainer():
        config = TrainConfig(
            run_dir=str(tmp_path / "run"),
            effective_batch_size=BATCH,
            max_steps=2,
            device="cpu",
            memory_budget="1GiB",
            progress="off",
        )
        loss_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
        return Trainer(mlp(), lambda params: torch.optim.SGD(params, lr=0.1), loss_fn, data, config)

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert f"train_data: 1,000,000,000,000 samples shuffled by {named}" in err
    assert "more than the memory budget 1.00 GiB. Read them in order" in err


@pytest.mark.parametrize("micro", ["auto", 4], ids=["planned", "given"])
def test_a_loop_body_moved_into_loss_fn_with_its_backward_exits_5_naming_it(
    tmp_path, capsys, micro
):
    """docs/porting.md: loss_fn is "the body of your loop, up to loss.backward()". Moved with its
    loss.backward(), the engine's own backward (in the plan's measured pass, or in the first
    step) met a freed graph: autograd's error from steadytrain's frame, a traceback and exit 1.
    It exits 5 naming loss_fn, the two causes and the fix."""

    def loss_fn(model, batch):
        loss = F.mse_loss(model(batch[0]), batch[1])
        loss.backward()  # as the loop had it
        return loss

    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]

    def trainer():
        config = TrainConfig(
            run_dir=str(tmp_path / "run"),
            effective_batch_size=4,
            micro_batch_size=micro,
            device="cpu",
            progress="off",
        )
        return Trainer(mlp(), lambda params: torch.optim.SGD(params, lr=0.1), loss_fn, data, config)

    code, err = exit_as_script(capsys, trainer)
    assert code == 5, err
    assert "Traceback (most recent call last)" not in err
    assert "error in your code (loss_fn)" in err
    assert "loss_fn called loss.backward() itself (return the loss and nothing more" in err
