"""A newcomer's first mistakes, made from README.md and docs/ alone, and errors steadytrain
raises inside DataLoader worker processes: each ends in one message naming what was found and
the fix, with the exit code README's "Exit codes" gives, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_helpers import exit_as_script
from tiny_models import save_byte_llama
from torch.utils.data import DataLoader, Dataset

from steadytrain import TrainConfig, Trainer
from steadytrain.cli import main as cli_main
from steadytrain.errors import ConfigError, DiskFullError


def config(run_dir: Path, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 3,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


# -- a steadytrain error raised in a DataLoader worker ------------------------------------------


class CheckedRecords(Dataset):
    """A dataset that checks each record as it loads it and says what is wrong with a
    steadytrain error, as a program built on steadytrain's own checks does."""

    def __init__(self, error: Exception):
        self.error = error

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            raise self.error
        x = torch.full((4,), float(i))
        return x, x.sum(0, keepdim=True)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


WORKER_ERRORS = {
    "config": (ConfigError(["records[9].text: missing; give each record a text field"]), 2),
    # a constructor of more than one argument: torch could not build it again and raised a
    # RuntimeError carrying the worker's traceback (exit 1)
    "disk": (DiskFullError("disk full: could not write cache/9.pt", Path("cache"), 10, 0), 2),
}


@pytest.mark.parametrize("kind", sorted(WORKER_ERRORS))
def test_a_steadytrain_error_in_a_loader_worker_prints_its_own_message(tmp_path, capsys, kind):
    """torch raises a worker's exception again in the training process as its class built from
    "Caught X in DataLoader worker process N. Original Traceback ...": a ConfigError came out as
    one 'problem' per character of that text, a DiskFullError as a RuntimeError with a
    traceback (exit 1). Each prints what num_workers=0 prints, with the same exit code."""
    error, code = WORKER_ERRORS[kind]
    said = {}
    for workers in (0, 2):

        def trainer(workers=workers):
            torch.manual_seed(0)
            loader = DataLoader(CheckedRecords(error), batch_size=4, num_workers=workers)
            optimizer = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
            run = config(tmp_path / f"w{workers}", num_workers=workers)
            return Trainer(torch.nn.Linear(4, 1), optimizer, _loss, loader, run)

        said[workers] = exit_as_script(capsys, trainer)
    assert said[2][0] == said[0][0] == code, said
    err = said[2][1]
    assert "Traceback" not in err and "Caught" not in err and "worker process" not in err, err
    assert f"error: {error}" in err, err
    assert err.split("error: ", 1)[1] == said[0][1].split("error: ", 1)[1]


# -- the fine-tune's own folders given where the base model belongs -----------------------------


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run `steadytrain ARGS` in this process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().err


def finetune_config(tmp_path: Path, name: str, **changes) -> Path:
    settings = {
        "model_name_or_path": str(tmp_path / "tiny"),
        "train_file": str(tmp_path / "train.jsonl"),
        "output_dir": str(tmp_path / name),
        "max_seq_length": 32,
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "lora": {"r": 2, "lora_alpha": 4},
        **changes,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny model, its data, and a finished fine-tune of it in `first` (adapter in first/final)."""
    root = tmp_path_factory.mktemp("newcomer")
    save_byte_llama(root / "tiny")
    records = [json.dumps({"text": f"{i} plus {i} is {2 * i}"}) for i in range(8)]
    (root / "train.jsonl").write_text("\n".join(records) + "\n")
    with pytest.raises(SystemExit) as info:
        cli_main(["finetune", "--config", str(finetune_config(root, "first"))])
    assert info.value.code == 0
    assert (root / "first" / "final" / "adapter_config.json").is_file()
    return root


def test_the_fine_tunes_output_dir_given_as_the_model_is_named_a_run_directory(
    trained, tmp_path, capsys
):
    """ "Continue from my fine-tune": model_name_or_path set to the last run's output_dir, whose
    config.json is the run's. The tokenizer load ended in transformers' ValueError and a
    traceback (exit 1); estimate and plan said to 'check config.json'."""
    given = str(trained / "first")
    again = finetune_config(trained, "second", model_name_or_path=given)
    code, err = cli(capsys, "finetune", "--config", str(again))
    assert code == 2, err
    assert "Traceback" not in err
    assert f"model_name_or_path: {given!r} is a steadytrain run directory" in err, err
    assert f"give the base model ({str(trained / 'tiny')!r})" in err, err
    assert f"its adapter is in {str(trained / 'first' / 'final')!r}" in err, err
    assert not (trained / "second").exists()
    for command in (["estimate", given], ["plan", given, "--effective-batch", "4"]):
        code, err = cli(capsys, *command)
        assert code == 2, err
        assert f"model: {given!r} is a steadytrain run directory" in err, err


def test_the_adapter_folder_given_as_the_model_names_its_base(trained, capsys):
    """The adapter folder (final/) given as the model: 'has no config.json; give the folder
    that save_pretrained wrote' sent the user looking for a config.json. It says it is an
    adapter and names its base, from adapter_config.json."""
    given = str(trained / "first" / "final")
    again = finetune_config(trained, "third", model_name_or_path=given)
    code, err = cli(capsys, "finetune", "--config", str(again))
    assert code == 2, err
    assert f"model_name_or_path: {given!r} holds a LoRA adapter (adapter_config.json)" in err, err
    assert f"give its base model ({str(trained / 'tiny')!r}, its adapter_config" in err, err
    code, err = cli(capsys, "estimate", given)
    assert code == 2, err
    assert f"model: {given!r} holds a LoRA adapter" in err, err


# -- a memory cap written without its unit ------------------------------------------------------


def test_a_memory_size_without_a_unit_is_refused_naming_the_unit(trained, capsys):
    """memory_budget: "16" (text, no unit) was read as 16 bytes: the fine-tune stopped with
    exit 3, 'over the budget of 16 B', as if the model did not fit; `estimate --memory 16`
    likewise. Refused as bad input, showing the size with its unit."""
    config = finetune_config(trained, "unitless", memory_budget="16")
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    assert "memory_budget: '16' has no unit" in err and "'16GiB'" in err, err
    code, err = cli(capsys, "estimate", str(trained / "tiny"), "--memory", "16")
    assert code == 2, err
    assert "--memory: '16' has no unit" in err and "'16GiB'" in err, err
    # One grammar with `estimate --memory-budget 0.8` (issue 39): '0.8' is the fraction, as 0.8.
    fraction = TrainConfig(run_dir=str(trained / "r"), effective_batch_size=1, memory_budget="0.8")
    assert fraction.memory_budget == 0.8 and fraction.budget_bytes_or_fraction() == 0.8


# -- a file where a folder belongs, and values written in another trainer's shape ---------------


def test_a_weights_file_given_as_the_model_names_its_folder(trained, capsys):
    """model_name_or_path set to the weights file: 'folder .../model.safetensors does not
    exist', of a file that is there."""
    weights = trained / "tiny" / "model.safetensors"
    config = finetune_config(trained, "weights", model_name_or_path=str(weights))
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    assert "does not exist" not in err, err
    assert f"model_name_or_path: {str(weights)!r} is a file" in err, err
    assert f"give the folder that holds it: {str(trained / 'tiny')!r}" in err, err


def test_an_output_dir_that_is_a_file_is_named_a_file(trained, capsys):
    """output_dir set to the data file (or a folder under it): 'cannot write .lock there (File
    exists)', which names neither the file nor the fix. The file keeps its bytes."""
    data = trained / "train.jsonl"
    before = data.read_bytes()
    for output_dir in (data, data / "run"):
        config = finetune_config(trained, "filed", output_dir=str(output_dir))
        code, err = cli(capsys, "finetune", "--config", str(config))
        assert code == 2, err
        assert f"{data} is a file, not a folder" in err, err
        assert "give output_dir (run_dir) a folder" in err, err
    assert data.read_bytes() == before


def test_a_settings_block_given_as_one_number_says_what_it_holds(trained, capsys):
    """ "lora": 16 (the rank, as a guide's LORA_R=16): 'must be LoraSettings', the name of a
    Python class the user never sees."""
    config = finetune_config(trained, "block", lora=16)
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    assert "LoraSettings" not in err, err
    assert 'lora: must be a mapping of its settings, {"r": ..., "lora_alpha": ...' in err, err
    assert "(found 16)" in err, err


@pytest.mark.parametrize(
    ("written", "seconds"), [("5m", "300"), ("300s", "300"), ("1.5 h", "5400")]
)
def test_a_timeout_written_with_a_time_unit_is_told_the_seconds(tmp_path, written, seconds):
    """hang_timeout: 5m (as other tools write a duration): told what the field takes, not how
    many seconds that is."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(run_dir=str(tmp_path), effective_batch_size=8, hang_timeout=written)
    line = next(p for p in info.value.problems if p.startswith("hang_timeout"))
    assert f"(found {written!r}); it is a number of seconds: write {seconds}" in line, line


def test_a_run_file_given_where_the_run_folder_belongs_names_the_folder(trained, capsys):
    """`steadytrain report RUN/metrics.jsonl` said 'no such run directory' of a file that is
    there; `steadytrain export RUN/training_config.json` 'does not exist or is not a folder'."""
    run = trained / "first"
    code, err = cli(capsys, "report", str(run / "metrics.jsonl"))
    assert code == 2, err
    assert "no such" not in err and f"{run / 'metrics.jsonl'} is a file" in err, err
    assert f"give the folder that holds it: {run}" in err, err
    code, err = cli(capsys, "export", str(run / "training_config.json"))
    assert code == 2, err
    assert f"RUN_DIR: {run / 'training_config.json'} is a file" in err, err
    assert "does not exist" not in err and f"({run}, if this file is in it)" in err, err


def test_doctor_given_a_file_as_the_run_dir_fails_naming_it(trained, capsys):
    """`steadytrain doctor --run-dir train.jsonl` measured the free space there and passed;
    the run would stop at its start."""
    data = trained / "train.jsonl"
    code, out = cli_out(capsys, "doctor", "--run-dir", str(data / "run"), "--json")
    found = {f["check"]: f for f in json.loads(out)["findings"]}
    assert code == 2, out
    assert found["disk"]["status"] == "fail", found["disk"]
    assert (
        found["disk"]["message"] == f"run directory {data / 'run'}: {data} is a file, not a folder"
    )


def cli_out(capsys, *args: str) -> tuple[int, str]:
    """Run `steadytrain ARGS` in this process; (exit code, stdout)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().out


def test_a_data_file_beside_the_config_run_from_elsewhere_is_found_and_said(
    trained, tmp_path, capsys, monkeypatch
):
    """A project with its config and data side by side, the command run from another folder
    (`steadytrain finetune --config proj/cfg.json`): 'data/train.jsonl does not exist; check the
    path', of a file that is there, beside the config. Said where it is and both fixes."""
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "train.jsonl").write_bytes((trained / "train.jsonl").read_bytes())
    config = finetune_config(trained, "beside", train_file="data/train.jsonl")
    (tmp_path / "proj" / "cfg.json").write_bytes(config.read_bytes())
    monkeypatch.chdir(tmp_path)
    code, err = cli(capsys, "finetune", "--config", "proj/cfg.json")
    assert code == 2, err
    said = " ".join(err.split())
    wanted = str(tmp_path / "proj" / "data" / "train.jsonl")
    assert f"train_file: data file data/train.jsonl does not exist in {tmp_path}" in said, said
    assert "it is beside the config, as proj/data/train.jsonl: run the command from proj" in said
    assert f"or write train_file as {wanted!r}" in said, said
    assert not (trained / "beside").exists()


# -- the Trainer's arguments of the wrong kind --------------------------------------------------


def _regression():
    x = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


WRONG_ARGUMENTS = {
    # the model's class where the model belongs: 'torch.device' object has no attribute '_apply'
    "model": (
        {"model": torch.nn.Linear},
        "error in your code (model) before the first step: model is the class Linear, not a "
        "model: build it first, model=Linear(...)",
    ),
    # a name where the function belongs: TypeError: 'str' object is not callable, exit 1
    "collate_fn": (
        {"collate_fn": "default"},
        "error in your code (collate_fn) before the first step: collate_fn is 'default' (str), "
        "not a function: steadytrain calls collate_fn(samples)",
    ),
    "loss_fn": (
        {"loss_fn": "mse"},
        "error in your code (loss_fn) before the first step: loss_fn is 'mse' (str), not a "
        "function: steadytrain calls loss_fn(model, batch)",
    ),
    # torch's loss module, as other trainers take one: a traceback from inside F.mse_loss
    "loss_module": (
        {"loss_fn": torch.nn.MSELoss()},
        "error in your code (loss_fn) before the first step: loss_fn is torch's MSELoss(), a "
        "loss of (output, target), but steadytrain calls loss_fn(model, batch) and trains on "
        "what it returns: write def loss_fn(model, batch): inputs, targets = batch; return "
        "MSELoss()(model(inputs), targets)",
    ),
    # a function as a callback: accepted, and never called
    "callbacks": (
        {"callbacks": [lambda state, control, info: None]},
        "error in your code (callbacks) before the first step: callbacks[0] is a function "
        "(<lambda>), which no event calls: a callback is an object whose on_* methods are "
        "called (subclass steadytrain.Callback and define on_step_end(self, state, control, "
        "info), for one)",
    ),
    # the callback's class, not an instance: exit 1 with chained tracebacks
    "callback_class": (
        {"callbacks": [type("Printer", (), {"on_step_end": lambda self, s, c, i: None})]},
        "error in your code (callbacks) before the first step: callbacks[0] is the class "
        "Printer, not a callback: pass an instance, callbacks=[Printer()]",
    ),
}


@pytest.mark.parametrize("kind", sorted(WRONG_ARGUMENTS))
def test_a_trainer_argument_of_the_wrong_kind_is_named(tmp_path, capsys, kind):
    """What a newcomer passes from memory of other libraries: the model's class, a loss or
    collate function's name, a plain function as a callback. Each ended in a traceback from
    deep inside the run (exit 1) or was silently ignored; named at the start now (exit 5)."""
    given, said = WRONG_ARGUMENTS[kind]

    def trainer():
        arguments = {
            "model": torch.nn.Linear(4, 1),
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
            "loss_fn": _loss,
            "train_data": _regression(),
            "config": config(tmp_path / "run"),
            **given,
        }
        return Trainer(**arguments)

    code, err = exit_as_script(capsys, trainer)
    assert code == 5, err
    assert "Traceback" not in err, err
    assert f"error: {said}" in " ".join(err.split()), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_list_saved_as_jsonl_is_told_to_be_renamed(trained, tmp_path, capsys, indent):
    """records.json's shape (a list of objects) saved as train.jsonl: 'line 1: expected a JSON
    object, found a list' on one line, or 'invalid JSON' on every line of it pretty-printed."""
    records = [{"text": f"{i} plus {i}"} for i in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(records, indent=indent))
    config = finetune_config(trained, "listed", train_file=str(data))
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    said = " ".join(err.split())
    assert f"data file {data} holds one JSON list of 4 records, where a .jsonl file holds" in said
    assert "rename it to train.json (a .json file is read whole)" in said, said
    assert not (trained / "listed").exists()


def test_a_memory_cap_under_another_name_points_at_memory_budget(trained, tmp_path, capsys):
    """max_memory (accelerate's name), memory_limit (a guide's): 'unknown field; the fields
    are: ...' and eighty names, none of them pointed at."""
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(
            {"run_dir": str(tmp_path), "effective_batch_size": 8, "memory_limit": "16GB"}
        )
    assert "memory_limit: unknown field; did you mean 'memory_budget'? (the memory the run" in str(
        info.value
    )
    config = finetune_config(trained, "capped", max_memory="16GiB")
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    assert "max_memory: unknown field; did you mean 'memory_budget'? (the memory" in err, err


ANNOTATED = (
    '{\n  // my M1 run\n  "run_dir": "RUN",\n  "effective_batch_size": 64 /* samples */\n}\n'
)


def test_an_annotated_json_config_loads_and_as_yaml_is_told_its_name(tmp_path, capsys):
    """JSON with comments, pasted from a guide, as the fine-tune's config takes it: as a
    TrainConfig file it was 'not valid JSON: Expecting property name ... at line 2', and saved
    as .yaml 'expected ',' or '}', but got ':''."""
    annotated = ANNOTATED.replace("RUN", str(tmp_path / "run"))
    (tmp_path / "train.json").write_text(annotated)
    assert TrainConfig.load(tmp_path / "train.json").effective_batch_size == 64
    (tmp_path / "train.yaml").write_text(annotated)
    code, err = cli(capsys, "config", str(tmp_path / "train.yaml"))
    assert code == 2, err
    said = " ".join(err.split())
    assert "it is JSON with comments, which YAML does not read: name it train.json" in said, said


def test_a_config_and_data_saved_as_utf_16_are_told_to_be_saved_as_utf_8(trained, tmp_path, capsys):
    """An editor's "Unicode" (UTF-16) encoding: 'is not UTF-8 text; is it a config?'."""
    config = finetune_config(trained, "wide")
    (tmp_path / "wide.json").write_text(config.read_text(), encoding="utf-16")
    code, err = cli(capsys, "finetune", "--config", str(tmp_path / "wide.json"))
    assert code == 2, err
    assert f"config file {tmp_path / 'wide.json'} is UTF-16 text, not UTF-8: save it" in err, err
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n', encoding="utf-16")
    config = finetune_config(trained, "wide-data", train_file=str(tmp_path / "train.jsonl"))
    code, err = cli(capsys, "finetune", "--config", str(config))
    assert code == 2, err
    assert f"data file {tmp_path / 'train.jsonl'} is UTF-16 text, not UTF-8" in err, err


def test_estimate_asked_for_qlora_by_name_is_told_the_flags(trained, capsys):
    """`estimate MODEL --method qlora`, as guides name it: 'is not one of full, lora'."""
    code, err = cli(capsys, "estimate", str(trained / "tiny"), "--method", "qlora")
    assert code == 2, err
    said = " ".join(err.split())
    assert (
        "--method: 'qlora' is not one of full, lora; QLoRA is --method lora --load-in-4bit" in said
    )


# -- a resume after the model changed shape -----------------------------------------------------


class TwoLayers(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, width), torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _fit_two_layers(run_dir: Path, width: int, **given):
    data = [(torch.full((4,), float(i)), torch.ones(1) * i) for i in range(16)]
    trainer = Trainer(
        TwoLayers(width),
        lambda p: torch.optim.SGD(p, lr=0.01),
        _loss,
        data,
        config(run_dir, save_every_steps=2, **given),
    )
    return trainer.fit()


@pytest.mark.parametrize("overrides", [[], ["model"]])
def test_a_resume_after_a_layer_changed_width_names_the_parameter_and_offers_no_override(
    tmp_path, overrides
):
    """A layer widened between two starts of one run_dir: exit 2 naming each parameter whose
    shape changed, old -> new, and no `resume_overrides` (none can load tensors into another
    shape); with `resume_overrides: ['model']` set anyway, the same answer, never 'no checkpoint
    verifies ... restore from a backup' about checkpoints that are intact."""
    _fit_two_layers(tmp_path / "run", 16, max_steps=2)
    with pytest.raises(Exception) as info:
        _fit_two_layers(tmp_path / "run", 32, resume_overrides=overrides)
    text = str(info.value)
    assert getattr(info.value, "exit_code", None) == 2, text
    assert "a.weight: shape (16, 4) -> (32, 4)" in text
    assert "b.weight: shape (1, 16) -> (1, 32)" in text
    assert "resume_overrides: [" not in text and "backup" not in text
    assert "new run_dir" in text
