"""The seed users' first commands, as they would type them: their configs written with the names
they bring from guides and other trainers, their typos, a missing file, a budget too small.
Each answer is checked for what the user needs from it: the documented exit code and one message
that names the key or file and says the fix. In-process through `steadytrain.cli.main` where the
process is not what is tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_workload
from integration_helpers import run_plain, workload_env
from tiny_models import save_byte_llama

from steadytrain import Trainer
from steadytrain.cli import main as cli_main
from steadytrain.config import TrainConfig
from steadytrain.errors import ConfigError
from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `steadytrain ARGS` in this process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


# -- seed 000 / 003: a PyTorch script's config, written with the names of the guides -------------

SEED_000_YAML = """\
# my M1 Max run: batch 64 did not fit, so 16 at a time, accumulated 4 times
run_dir: runs/m1
effective_batch_size: 64
gradient_accumulation_steps: 4
checkpoint_dir: runs/m1/ckpt
fp16: true
learning_rate: 0.001
pin_memory: true
"""


def test_trainer_names_from_other_configs_say_where_the_setting_lives(capsys, tmp_path):
    """A TrainConfig file written with Hugging Face's and the DataLoader's names: each key is
    refused (exit 2) with the field that holds the setting here, or where it is given instead,
    not with the list of every field alone."""
    config = tmp_path / "train.yaml"
    config.write_text(SEED_000_YAML)
    code, _, err = cli(capsys, "config", str(config))
    assert code == 2
    assert "(5 problem(s))" in err, err
    lines = {
        line.split(":")[0].strip(" -"): line for line in err.splitlines() if ": unknown" in line
    }
    assert (
        "did you mean 'effective_batch_size' or 'micro_batch_size'?"
        in lines["gradient_accumulation_steps"]
    )
    assert "accumulate 4 passes" in lines["gradient_accumulation_steps"]
    assert "did you mean 'run_dir'?" in lines["checkpoint_dir"]
    assert "did you mean 'precision'?" in lines["fp16"]
    assert "precision: fp16" in lines["fp16"]
    assert "Trainer(optimizer=lambda params:" in lines["learning_rate"]
    assert "memory is pinned on CUDA, where it helps" in lines["pin_memory"]
    assert "Traceback" not in err


def test_a_trainer_config_with_output_dir_is_checked_as_a_trainer_config(capsys, tmp_path):
    """`output_dir` (Hugging Face's folder name) beside `effective_batch_size` in the config of
    a script: `steadytrain config` checks it as the TrainConfig it is (output_dir: did you mean
    run_dir), not as a fine-tune config missing model_name_or_path and train_file."""
    config = tmp_path / "train.yaml"
    config.write_text("effective_batch_size: 64\nmicro_batch_size: 16\noutput_dir: runs/m1\n")
    code, _, err = cli(capsys, "config", str(config))
    assert code == 2
    message = " ".join(err.split())
    assert "(1 problem(s))" in message, message
    assert "output_dir: unknown field; did you mean 'run_dir'?" in message
    assert "model_name_or_path" not in message


def test_output_dir_in_a_script_config_names_run_dir(tmp_path):
    """The same names through the Python API the user's script calls (`TrainConfig.load`), where
    `output_dir` (Hugging Face's) is a TrainConfig's unknown key: the error names run_dir."""
    config = tmp_path / "train.yaml"
    config.write_text(
        "effective_batch_size: 64\noutput_dir: runs/m1\ngradient_checkpointing: true\n"
    )
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(config)
    assert info.value.exit_code == 2
    text = str(info.value)
    assert "output_dir: unknown field; did you mean 'run_dir'?" in text
    assert "gradient_checkpointing: unknown field; did you mean 'activation_checkpointing'?" in text


def test_a_duration_with_a_unit_is_not_told_to_drop_quotes_it_never_had():
    """`hang_timeout: 5m` (a duration as other tools write it): the message says what the field
    takes, not 'write it without quotes', which is for a number written as text ('3')."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(effective_batch_size=64, hang_timeout="5m", epochs="3")
    lines = {line.split(":")[0].strip(" -"): line for line in str(info.value).splitlines()}
    assert "must be 'auto' or a number > 0 (found '5m')" in lines["hang_timeout"]
    assert "without quotes" not in lines["hang_timeout"]
    assert "write it without quotes (found '3')" in lines["epochs"]


# -- seed 004: the LoRA fine-tune from a JSON config ---------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny Llama saved with the byte tokenizer (the user's `model_name_or_path`), and
    prompt/completion records as data/train.jsonl."""
    root = tmp_path_factory.mktemp("seed-users")
    save_byte_llama(root / "tiny", max_position_embeddings=2048)
    (root / "data").mkdir()
    records = [
        json.dumps({"prompt": f"{i % 9}+{(i * 7) % 11}=", "completion": f"{i % 9 + (i * 7) % 11}"})
        for i in range(32)
    ]
    (root / "data" / "train.jsonl").write_text("\n".join(records) + "\n")
    return root


def seed_004_config(workspace: Path, out: Path, **changes) -> Path:
    """The seed's config (examples/finetune_config.json, comments and all) pointed at the tiny
    model, the data and `out`, with `changes` applied as `--set` would."""
    text = (ROOT / "examples" / "finetune_config.json").read_text()
    text = text.replace('"meta-llama/Llama-3.2-3B"', json.dumps(str(workspace / "tiny")))
    text = text.replace('"data/train.jsonl"', json.dumps(str(workspace / "data" / "train.jsonl")))
    text = text.replace('"eval_file": "data/eval.jsonl",', "")
    text = text.replace('"models/checkpoints"', json.dumps(str(out)))
    path = out.parent / f"{out.name}.json"
    path.write_text(text)
    return path


def test_a_budget_nothing_fits_says_the_fix_in_words(capsys, workspace, tmp_path):
    """memory_budget below what micro-batch 1 with every saver needs, where no setting of the
    config lowers the estimate enough: exit 3 before anything loads or is written, and the
    message says what would change it (a larger memory_budget) as a sentence, not an empty list
    followed by 'or'."""
    out = tmp_path / "out"
    config = seed_004_config(workspace, out)
    code, _, err = cli(
        capsys, "finetune", "--config", str(config), "--set", "memory_budget=100MiB",
        "--set", "max_seq_length=32",
    )  # fmt: skip
    assert code == 3, err
    message = " ".join(err.split())
    assert "memory_budget: the estimate at micro-batch 1" in message
    assert "): or a larger" not in message, message
    assert "what would change it" in message and "a larger `memory_budget`" in message
    assert not out.exists()


def test_the_ladders_lora_rank_on_a_finished_run_is_refused_as_a_finished_run(
    capsys, workspace, tmp_path
):
    """The seed's troubleshooting ladder ("Solution 4: reduce LoRA rank", r 16 -> 8) applied to
    the output_dir of a run that finished: refused (exit 2) before anything is written, naming
    the change and calling the run what it is, finished at its last step, not interrupted; the
    dry-run says the same and that a rerun trains nothing more unless the run is lengthened, and
    answers each change as the run does: refused with exit 2, or resumed naming the change."""
    out = tmp_path / "out"
    config = seed_004_config(workspace, out)
    short = ["--set", "max_steps=2", "--set", "save_steps=2"]
    code, _, err = cli(capsys, "finetune", "--config", str(config), *short)
    assert code == 0, err
    log = (out / "training.log").read_text()
    code, _, err = cli(capsys, "finetune", "--config", str(config), *short, "--set", "lora.r=8")
    assert code == 2, err
    message = " ".join(err.split())
    assert f"resume: {out} holds a finished run (step 2 of 2)" in message, message
    assert "lora.r: 16 -> 8" in message
    assert "interrupted" not in message
    assert (out / "training.log").read_text() == log  # nothing written
    code, said, _ = cli(capsys, "finetune", "--config", str(config), *short, "--dry-run")
    assert code == 0
    said = " ".join(said.split())
    assert (
        f"{out} holds a finished run (step 2 of 2): the fine-tune resumes it at its last step"
        in said
    )
    # The dry-run of the ladder's steps gives the run's answer: refused, exit 2, the same message.
    for change in ("lora.r=8", "gradient_accumulation_steps=4", "fp16=true", "shuffle=false"):
        code, _, told = cli(capsys, "finetune", "--config", str(config), *short, "--set", change)
        code_dry, said_dry, _ = cli(
            capsys, "finetune", "--config", str(config), *short, "--set", change, "--dry-run"
        )
        assert code == code_dry == 2, said_dry
        said_dry = " ".join(said_dry.split())
        assert f"the run stops here (exit 2): resume: {out} holds a finished run" in said_dry
        assert "the fine-tune resumes it" not in said_dry
        assert f"resume: {out} holds a finished run" in " ".join(told.split())
        assert "fingerprint" not in told  # said before the base loads, not by the engine
        if change.startswith("gradient_accumulation_steps"):
            assert "gradient_accumulation_steps 8 with per_device_train_batch_size 1" in said_dry
        if change == "fp16=true":
            assert "fp16: False -> True (the dtype the frozen base loads in" in said_dry
    assert 'allow it on purpose with "resume_overrides": ["shuffle"]' in said_dry
    code, said, _ = cli(
        capsys, "finetune", "--config", str(config), *short, "--set", "logging_steps=1",
        "--dry-run",
    )  # fmt: skip
    assert code == 0
    assert "keeping it the same run: logging_steps: 10 -> 1" in " ".join(said.split())
    # Written out as the values the run already had (the engine's shuffle, fp32): the same run.
    code, said, _ = cli(
        capsys, "finetune", "--config", str(config), *short, "--set", "shuffle=true",
        "--set", "precision=fp32", "--dry-run",
    )  # fmt: skip
    assert code == 0, said
    assert "the fine-tune resumes it" in " ".join(said.split())
    # `export` given the adapter it already wrote (final/) names the folder export takes.
    code, _, err = cli(capsys, "export", str(out / "final"))
    assert code == 2
    message = " ".join(err.split())
    assert f"{out / 'final'}: is an exported adapter already" in message, message
    assert f"(here: steadytrain export {out})" in message


def test_plan_given_the_config_file_or_the_models_config_json_names_what_to_give(
    capsys, workspace, tmp_path
):
    """After `steadytrain estimate my-run.json` works, the user tries `plan` the same way, and
    `estimate` on the model's config.json: exit 2, each naming what to give instead (the dry-run
    for a fine-tune config, the folder for a config.json), with no traceback."""
    config = seed_004_config(workspace, tmp_path / "out")
    code, _, err = cli(capsys, "plan", str(config), "--effective-batch", "8")
    assert code == 2
    message = " ".join(err.split())
    assert f"{config} is a fine-tune config, not a model folder" in message
    assert f"steadytrain finetune --config {config} --dry-run" in message
    assert f"steadytrain plan {workspace / 'tiny'} --effective-batch N" in message
    code, _, err = cli(capsys, "estimate", str(workspace / "tiny" / "config.json"))
    assert code == 2
    message = " ".join(err.split())
    assert (
        f"is the model's config file; pass the folder that holds it: '{workspace / 'tiny'}'"
        in message
    )
    assert "Traceback" not in err


# -- seed 000: a PyTorch script whose memory budget is below what the process already holds ------


class Images(torch.utils.data.Dataset):
    """Small seeded images and labels, as the seed's image classifier trains on."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 8, 8, generator=g), torch.tensor(i % 4)


def image_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def image_trainer(tmp_path, micro, budget) -> Trainer:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=8,
        micro_batch_size=micro,
        max_steps=1,
        memory_budget=budget,
        device="cpu",
        progress="off",
    )
    return Trainer(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=image_loss,
        train_data=Images(),
        config=config,
    )


def test_a_budget_below_what_the_process_holds_is_said_so_by_the_plan(tmp_path):
    """memory_budget as a fraction of usable memory that comes to less than the process
    already holds before the first pass (the interpreter and torch alone are hundreds of MiB on
    CPU): the plan's reasons say the run is already over its budget and what to set, not that
    'the peak may reach' a limit above it."""
    image_trainer(tmp_path, "auto", 1e-6).fit()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    (plan,) = [e for e in events if e.get("event") == "plan"]
    said = " ".join(plan["reasons"])
    assert "already over the budget before the first pass" in said, said
    assert "set memory_budget above what is in use" in said
    assert "the peak may reach" not in said


def test_evaluate_with_its_two_arguments_swapped_says_the_order(capsys, workspace):
    """The seed's "run evaluation" after the fine-tune, model first and data second: exit 2 before
    anything loads, saying the data file comes first and the command in that order."""
    model, data = workspace / "tiny", workspace / "data" / "train.jsonl"
    code, _, err = cli(capsys, "evaluate", str(model), str(data))
    assert code == 2
    message = " ".join(err.split())
    assert f"EVAL_FILE: {model} is a folder, not a data file" in message, message
    assert f"steadytrain evaluate {data} {model}" in message


def test_target_modules_given_as_comma_separated_names_shows_the_list_to_write(
    capsys, workspace, tmp_path
):
    """`--set lora.target_modules=q_proj,v_proj` (how names are listed on other command lines):
    exit 2 showing the list form, with --set as it is typed; that form then works."""
    config = seed_004_config(workspace, tmp_path / "out")
    code, _, err = cli(
        capsys, "finetune", "--config", str(config), "--set", "lora.target_modules=q_proj,v_proj",
        "--dry-run",
    )  # fmt: skip
    assert code == 2
    message = " ".join(err.split())
    assert "lora.target_modules: must be 'all-linear' or a list of module names" in message
    shown = "lora.target_modules=[q_proj, v_proj]"
    assert f"(with --set: '{shown}')" in message, message
    code, said, _ = cli(capsys, "finetune", "--config", str(config), "--set", shown, "--dry-run")
    assert code == 0
    assert "LoRA r=16 on q_proj,v_proj" in " ".join(said.split())


# -- seed 001: a Keras fit with the callback, stopped and started again ----------------------


def test_a_keras_fit_started_again_says_where_it_resumes(tmp_path):
    """The Keras user's fit, run again on its run directory (after a stop, or with more
    epochs): the console says which checkpoint it resumes from and the epoch fit() goes on at,
    as the Trainer's 'resuming at step N' does; before, only events.jsonl said so."""
    run_dir = tmp_path / "keras"
    env = workload_env(KERAS_BACKEND="torch")
    first = run_plain("keras_fit.py", run_dir, "--epochs", "1", env=env)
    assert first.returncode == 0, first.stderr
    again = run_plain("keras_fit.py", run_dir, "--epochs", "2", env=env)
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stderr.split())
    checkpoint = run_dir / "checkpoints" / "step-00000004"
    assert (
        f"steadytrain: resuming from {checkpoint} (step 4): fit() goes on at epoch 2 of 2" in said
    )
    assert "resuming" not in first.stderr
    done = run_plain("keras_fit.py", run_dir, "--epochs", "2", env=env)
    assert done.returncode == 0, done.stderr
    checkpoint = run_dir / "checkpoints" / "step-00000008"
    said = " ".join(done.stderr.split())
    assert (
        f"resuming from {checkpoint} (step 8): all 2 epochs are done, fit() trains nothing" in said
    )


# -- seed 001: training that stalls with no error ------------------------------------------------


def test_a_hang_is_said_on_the_console_without_empty_or_nested_fields(tmp_path):
    """A step that stalls (the seed's "halts with no error at all"), hang_action report: the
    console's hang line names the phase and the stack file, without fields that hold nothing
    ('collective None', the run outside a collective) or a whole record ('memory {…}')."""
    result = run_workload(
        "hang.py", str(tmp_path / "run"), "--action", "report", "--block", "sleep", "--at", "2",
        "--block-seconds", "3", "--steps", "3", "--once", str(tmp_path / "marker"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = [s for s in result.stderr.splitlines() if s.startswith("hang: ")]
    assert "phase step" in line and "hangs/" in line, line
    assert "None" not in line and "{…}" not in line, line


def test_alpaca_records_are_told_how_to_write_them(capsys, workspace, tmp_path):
    """Training data in the Alpaca layout ("instruction", "input", "output") or ShareGPT's
    ("conversations"), as many guides ship it: exit 2 before the model loads, saying which
    fields to write them as."""
    data = tmp_path / "alpaca.jsonl"
    rows = [{"instruction": f"Add {i} and 1", "input": "", "output": str(i + 1)} for i in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = seed_004_config(workspace, tmp_path / "out")
    code, _, err = cli(capsys, "finetune", "--config", str(config), "--set", f"train_file={data}")
    assert code == 2
    message = " ".join(err.split())
    assert 'line 1: has the Alpaca fields "instruction", "input", "output"' in message, message
    assert (
        'write "prompt" (the instruction, then the input) and "completion" (the output)' in message
    )
    assert not (tmp_path / "out" / "final").exists()
    sharegpt = tmp_path / "sharegpt.jsonl"
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    sharegpt.write_text(json.dumps({"conversations": turns}) + "\n")
    code, _, err = cli(
        capsys, "finetune", "--config", str(config), "--set", f"train_file={sharegpt}"
    )
    assert code == 2
    assert 'has "conversations" (ShareGPT\'s), not "messages"' in " ".join(err.split()), err


def test_supervising_a_fine_tune_with_another_run_dir_is_refused_before_it_starts(
    capsys, workspace, tmp_path
):
    """`steadytrain run --run-dir runs/x -- steadytrain finetune --config ...` whose output_dir is
    another folder: the supervisor would watch a folder the run never writes, and count every
    restart as one without progress. Exit 2 before anything starts, naming both folders."""
    out = tmp_path / "out"
    config = seed_004_config(workspace, out)
    elsewhere = tmp_path / "runs" / "x"
    code, _, err = cli(
        capsys, "run", "--run-dir", str(elsewhere), "--",
        "steadytrain", "finetune", "--config", str(config),
    )  # fmt: skip
    assert code == 2
    message = " ".join(err.split())
    assert f"--run-dir {elsewhere} is not the fine-tune's output_dir {out}" in message, message
    assert "leave out --run-dir" in message
    assert not elsewhere.exists() and not out.exists()


def test_a_budget_size_below_what_the_process_holds_is_said_at_the_start(tmp_path, capsys):
    """memory_budget given as a size below what the process holds with the model in place
    (50MB on CPU, where torch alone is hundreds of MiB): the start says so, naming
    memory_budget, both sizes and the fix, on the console and in events.jsonl, where the run
    used to train far over its budget without a word."""
    image_trainer(tmp_path, 2, "50MB").fit()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    notes = [e["message"] for e in events if e.get("event") == "note"]
    told = [n for n in notes if n.startswith("memory_budget: 47.68 MiB is less than this")]
    assert len(told) == 1, notes
    assert "of resident memory" in told[0] and "leave it out (auto" in told[0]
    assert "memory_budget: 47.68 MiB is less than this" in capsys.readouterr().err


def test_a_config_file_given_without_config_is_told_where_it_goes(capsys, tmp_path):
    """`steadytrain finetune my.json --dry-run`, the file where `--config FILE` belongs: exit 2
    with typer's "Missing option" and the command as it should be typed."""
    config = tmp_path / "my.json"
    config.write_text("{}")
    code, _, err = cli(capsys, "finetune", str(config), "--dry-run")
    assert code == 2
    assert "Missing option '--config'" in err
    assert (
        f"The config file goes after --config: steadytrain finetune --config {config} --dry-run"
        in err
    )
