"""A newcomer's last refusals (issue 42), made from README.md and docs/ alone: each ends in the
exit code README's "Exit codes" gives and one message naming what was found and the fix, in a
script with `@steadytrain.entrypoint` and in a plain one without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from script_helpers import Data, exit_as_script, loss_fn

from steadytrain import TrainConfig, Trainer

SRC = Path(__import__("steadytrain").__file__).resolve().parents[1]


def config(run_dir: Path, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 2,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_model_built_on_the_meta_device_is_refused_naming_its_parameters(tmp_path, capsys):
    """`with torch.device("meta"): model = Net()` builds shapes without values: the run
    stopped with exit 1 and torch's "Cannot copy out of meta tensor" from deep in the device
    placement; refused when the Trainer is built now (exit 2), naming the parameters and the
    fix (`to_empty`, then load the weights)."""
    with torch.device("meta"):
        model = TwoLayers()

    def trainer():
        return Trainer(
            model=model,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=loss_fn,
            train_data=Data(),
            config=config(tmp_path / "run"),
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err, err
    said = " ".join(err.split())
    assert "on the meta device (a.weight, a.bias, b.weight, b.bias)" in said, err
    assert "model.to_empty(device=" in said and "load_state_dict" in said, err
    assert not (tmp_path / "run").exists()


PLAIN_SCRIPT = """
import sys

import steadytrain

if sys.argv[1] == "config":  # README's TrainConfig with a field misspelt
    steadytrain.TrainConfig(run_dir="runs/x", effective_batch_sise=64)
elif sys.argv[1] == "model_class":  # the model's class given for the model
    import torch

    steadytrain.Trainer(
        model=torch.nn.Linear,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: model(batch).sum(),
        train_data=[torch.zeros(4)] * 4,
        config=steadytrain.TrainConfig(run_dir=sys.argv[2], effective_batch_size=4),
    ).fit()
else:  # an error of the script's own, not a refusal of steadytrain's
    raise ValueError("the script's own bug")
print("after the error")
"""


@pytest.mark.parametrize(
    ("case", "code", "said"),
    [
        ("config", 2, "effective_batch_sise"),
        ("model_class", 5, "model is the class Linear, not a model"),
        ("own", 1, "ValueError: the script's own bug"),
    ],
)
def test_a_plain_script_without_the_decorator_exits_with_the_documented_code(
    tmp_path, case, code, said
):
    """docs/porting.md promises exit 2 for a bad config and exit 5 for the model's class; a
    script without `@steadytrain.entrypoint` (porting.md never showed it) got a traceback and
    exit 1. Now the refusal prints its one message and exits with its code in a plain script
    too, run as a real `python train.py`; an error of the script's own keeps its traceback and
    exit 1."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PLAIN_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), case, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    assert said in done.stderr, done.stderr
    assert "after the error" not in done.stdout
    if code == 1:
        assert "Traceback" in done.stderr
    else:
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("error: "), done.stderr


class OomOnCall:
    """A loss that raises a CUDA-style out-of-memory error on its `call`-th call, once: the
    engine's ladder halves the micro-batch and redoes that step, as for a real one."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss_fn(model, batch)


def test_an_out_of_memory_is_named_at_the_same_step_on_the_console_in_events_and_report(
    tmp_path, capsys
):
    """An out-of-memory in the third step (two done) was "step 3" on the console but step 2
    in events.jsonl and the report's events table; each names the step it happened in now,
    as fit_end's error_step names the step an error stopped."""
    from steadytrain.cli import main as cli_main
    from steadytrain.telemetry.files import read_jsonl

    run = tmp_path / "run"
    Trainer(
        model=torch.nn.Linear(4, 1),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=OomOnCall(3),
        train_data=Data(),
        config=config(run, max_steps=4, progress="auto"),
    ).fit()
    err = capsys.readouterr().err
    assert "out of memory in forward at micro-batch 4 (step 3)" in err, err
    ooms = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "oom"]
    assert [e["step"] for e in ooms] == [3]
    with pytest.raises(SystemExit) as done:
        cli_main(["report", str(run)])
    assert done.value.code in (0, None)
    page = (run / "report.html").read_text()
    row = page[page.index('data-event="oom"') :]
    assert row.split("<td>", 3)[2].startswith("3</td>"), row[:300]


class FailsAtCall:
    """A loss with a bug that shows on its `call`-th call."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.call:
            raise KeyError("label")
        return loss_fn(model, batch)


@pytest.mark.parametrize(
    ("failing_call", "said"),
    [(1, "no checkpoint was saved yet, so the run starts from the beginning"), (4, "")],
)
def test_an_error_in_your_code_says_where_the_rerun_starts(tmp_path, capsys, failing_call, said):
    """An error in the loss at the first step said "the run resumes from its last checkpoint"
    where none had been saved; it says the rerun starts from the beginning now, and names the
    checkpoint's step where there is one (saved every 2 steps, failing in step 4: step 2)."""
    said = said or "the run resumes from its last checkpoint (step 2)"

    def trainer():
        return Trainer(
            model=torch.nn.Linear(4, 1),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            loss_fn=FailsAtCall(failing_call),
            train_data=Data(),
            config=config(tmp_path / "run", max_steps=6, save_every_steps=2),
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 5, err
    assert f"Fix it and run again: {said}." in " ".join(err.split()), err


def test_plan_with_probe_on_a_lora_model_shows_no_library_warning(tmp_path, capsys):
    """`steadytrain plan --probe --method lora` printed transformers' FutureWarning about
    `is_gradient_checkpointing` (peft reads it), which is nothing the user can change."""
    import warnings

    from tiny_models import save_byte_llama

    from steadytrain.cli import main as cli_main

    folder = save_byte_llama(tmp_path / "llama")
    command = ["plan", str(folder), "--effective-batch-size", "2", "--seq", "16"]
    with warnings.catch_warnings(record=True) as shown, pytest.raises(SystemExit) as done:
        warnings.simplefilter("always")
        cli_main([*command, "--probe", "--method", "lora"])
    assert done.value.code in (0, None), capsys.readouterr().err
    assert not [w for w in shown if issubclass(w.category, FutureWarning)], [
        str(w.message) for w in shown
    ]


def _finetune_project(root: Path, **changes) -> Path:
    """A project folder with a tiny model, its data and a fine-tune config side by side;
    `changes` go into the config."""
    import json

    from tiny_models import save_byte_llama

    save_byte_llama(root / "tiny")
    (root / "data").mkdir()
    records = [json.dumps({"text": f"{i} plus {i} is {2 * i}"}) for i in range(8)]
    (root / "data" / "train.jsonl").write_text("\n".join(records) + "\n")
    settings = {
        "model_name_or_path": str(root / "tiny"),
        "train_file": str(root / "data" / "train.jsonl"),
        "output_dir": str(root / "out"),
        "max_seq_length": 32,
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "lora": {"r": 2, "lora_alpha": 4},
        **changes,
    }
    (root / "cfg.json").write_text(json.dumps(settings))
    return root / "cfg.json"


def _finetune(capsys, config: Path) -> tuple[int, str]:
    from steadytrain.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["finetune", "--config", str(config)])
    return done.value.code, " ".join(capsys.readouterr().err.split())


def test_a_fine_tune_names_every_problem_of_its_config_at_once_and_finds_the_model_beside_it(
    tmp_path, capsys, monkeypatch
):
    """Run from another folder, a config naming its model folder and data file relative to
    itself, and an optimizer for CUDA on a CPU: the model was taken for a hub id, and each
    problem came alone, one run each. One run names all three now, the model found beside the
    config as the data file is (exit 2), before anything is loaded."""
    config = _finetune_project(
        tmp_path / "proj",
        model_name_or_path="tiny",
        train_file="data/train.jsonl",
        optim="adamw_torch_fused",
    )
    monkeypatch.chdir(tmp_path)
    code, said = _finetune(capsys, config.relative_to(tmp_path))
    assert code == 2, said
    assert "Traceback" not in said
    assert "(3 problem(s))" in said, said
    assert "optim: adamw_torch_fused is for CUDA" in said, said
    assert "train_file: data file data/train.jsonl does not exist in" in said, said
    assert "model_name_or_path: folder tiny does not exist in" in said, said
    assert "it is beside the config, as proj/tiny: run the command from proj" in said, said
    assert f"or write model_name_or_path as {str(tmp_path / 'proj' / 'tiny')!r}" in said, said
    assert not (tmp_path / "proj" / "out").exists()


def test_a_base_model_folder_without_a_tokenizer_is_refused_at_the_start(tmp_path, capsys):
    """A base model saved without its tokenizer (model.save_pretrained only): transformers'
    traceback after the memory estimate (exit 1). Refused at the start now (exit 2), naming
    the folder, the tokenizer files looked for and how to save them."""
    config = _finetune_project(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "tiny" / name).unlink(missing_ok=True)
    code, said = _finetune(capsys, config)
    assert code == 2, said
    assert "Traceback" not in said
    assert f"model_name_or_path: {tmp_path / 'tiny'} has no tokenizer (none of" in said, said
    assert "tokenizer.save_pretrained(folder)" in said, said
    assert not (tmp_path / "out").exists()


def test_a_forever_sampler_is_told_the_num_samples_the_run_reads(tmp_path, capsys):
    """minGPT's loader draws `RandomSampler(data, replacement=True, num_samples=int(1e10))`,
    "forever": refused (its order does not fit the budget) with advice to read in order or give
    the dataset a __len__, which does not fit a sampler that draws with replacement. Told the
    num_samples the run reads now: max_steps × effective_batch_size."""
    from torch.utils.data import DataLoader, RandomSampler

    data = Data()
    forever = RandomSampler(data, replacement=True, num_samples=int(1e10))

    def trainer():
        return Trainer(
            model=torch.nn.Linear(4, 1),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            loss_fn=loss_fn,
            train_data=DataLoader(data, sampler=forever, batch_size=4),
            config=config(tmp_path / "run", memory_budget="1GiB"),
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    said = " ".join(err.split())
    assert "Its num_samples=10,000,000,000 is how many samples it draws" in said, said
    assert "num_samples=max_steps × effective_batch_size = 8" in said, said


def test_the_readme_scheduler_and_callback_example_runs(tmp_path, monkeypatch, capsys):
    """README's "Schedulers and callbacks" shows what `scheduler=` takes and how a callback is
    written (the README said neither); its code runs as shown."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Schedulers and callbacks") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "step 2: loss " in out and "step 4: loss " in out, out
    assert (tmp_path / "runs" / "callbacks" / "metrics.jsonl").is_file()


def test_a_constant_learning_rate_is_drawn_flat_on_whole_step_ticks(tmp_path):
    """The report drew a constant learning rate on matplotlib's ±5 % axis (it read as a
    change) with ticks at 0.5, 1.5 steps; the axis now runs from 0 to twice the rate, and the
    step ticks are whole numbers."""
    from steadytrain.telemetry.plots import plot_loss_lr
    from steadytrain.telemetry.run_reading import load_run

    Trainer(
        model=torch.nn.Linear(4, 1),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=loss_fn,
        train_data=Data(),
        config=config(tmp_path / "run", max_steps=3),
    ).fit()
    figure = plot_loss_lr(load_run(tmp_path / "run"))
    lr_axis = figure.axes[1]
    assert lr_axis.get_ylim() == pytest.approx((0.0, 0.02))
    ticks = [t for t in lr_axis.get_xticks() if lr_axis.get_xlim()[0] <= t <= lr_axis.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
