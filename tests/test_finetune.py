"""`steadytrain finetune`: a seed-004-shaped config (annotated JSON, as the user pasted it)
fine-tunes a tiny Llama to the end, the exported adapter loads in peft with the same logits, a
SIGKILL under `steadytrain run` resumes to a bitwise-equal adapter, and config mistakes are
refused with the field named."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_byte_llama

from steadytrain.config import TrainConfig, parse_overrides
from steadytrain.errors import BadInputError, ConfigError
from steadytrain.recipes.finetune import FinetuneJob, run_finetune
from steadytrain.recipes.finetune_config import FinetuneConfig, strip_json_comments
from steadytrain.recipes.model import plan_base_load
from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent

# The seed's config block (docs of seed 004), comments and all, plus the model, data and output
# folder its snippet leaves out and a run short enough for CI.
SEED_CONFIG = """{
  "model_name_or_path": "MODEL",
  "train_file": "DATA",
  "output_dir": "OUT",
  "max_seq_length": 64,
  "num_train_epochs": 3,
  "learning_rate": 0.02,
  "per_device_train_batch_size": 2,      // Small batch for memory
  "gradient_accumulation_steps": 4,      // Effective batch = 8
  "fp16": false,                         // FP32 more stable on MPS
  "bf16": false,
  "gradient_checkpointing": true,        // Saves memory
  "optim": "adamw_torch",                // Native PyTorch optimizer
  "save_steps": 4,                       // Frequent checkpoints
  "save_total_limit": 2,                 // Keep last 2 only
  "logging_steps": 4,
  "report_to": "none",
  "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05},
  "quantization": {
    "load_in_4bit": false                // No quantization on MPS
  }
}
"""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread here and in the supervised child: the same rounding in both (the bitwise
    comparison needs it), and no OpenMP spin-waiting against other processes on a shared CI
    machine, which made steps 30× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny Llama saved with the byte tokenizer, and 64 prompt/completion records."""
    root = tmp_path_factory.mktemp("finetune")
    save_byte_llama(root / "tiny")
    lines = []
    for i in range(64):
        a, b = i % 9, (i * 7) % 11
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}"}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def write_config(workspace: Path, name: str, out: str, text: str = SEED_CONFIG) -> Path:
    path = workspace / name
    text = text.replace("MODEL", str(workspace / "tiny")).replace(
        "DATA", str(workspace / "train.jsonl")
    )
    path.write_text(text.replace("OUT", str(workspace / out)))
    return path


@pytest.fixture(scope="module")
def finished(workspace):
    """The seed-shaped config run to the end in this process: (job, result)."""
    job = FinetuneJob.from_file(write_config(workspace, "seed.json", "run-a"))
    return job, job.run()


def test_seed_config_finetunes_to_the_end_and_the_adapter_loads_in_peft(workspace, finished):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job, result = finished
    assert result.exit_code == 0 and result.steps == 24  # 64 samples / 8 per step × 3 epochs
    losses = [row["loss"] for row in read_jsonl(Path(result.run_dir) / "metrics.jsonl")]
    assert len(losses) == 24
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses

    engine = json.loads((Path(result.run_dir) / "config.json").read_text())
    assert engine["effective_batch_size"] == 8 and engine["micro_batch_size"] == 2
    assert engine["precision"] == "fp32" and engine["activation_checkpointing"] is True
    assert engine["save_every_steps"] == 4 and engine["keep_last"] == 2

    final = Path(result.run_dir) / "final"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        assert (final / name).is_file(), name
    resolved = json.loads((final / "training_config.json").read_text())
    assert resolved["per_device_train_batch_size"] == 2 and resolved["lora"]["r"] == 8
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8

    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    loaded = PeftModel.from_pretrained(base, final).eval()
    trained = job.model.eval()
    ids = torch.tensor([[256, *b"3+4=7"]])
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        # The adapter changed the model: the base alone answers differently.
        with trained.disable_adapter():
            assert not torch.equal(trained(input_ids=ids).logits, expected)


@pytest.mark.slow  # the seed-night test does this under `run` with no --run-dir
def test_sigkill_under_the_supervisor_resumes_to_a_bitwise_equal_adapter(workspace):
    short = ["max_steps=6", "save_steps=2"]
    reference = FinetuneJob.from_file(write_config(workspace, "ref.json", "run-ref"), short).run()
    config = write_config(workspace, "killed.json", "run-killed")
    run_dir = workspace / "run-killed"
    cmd = [
        sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir),
        "--backoff-initial", "0.01", "--",
        sys.executable, "-m", "steadytrain.recipes.finetune", "--config", str(config),
        "--set", short[0], "--set", short[1],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    supervisor = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    killed_after = None
    try:
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while killed_after is None and time.monotonic() < deadline and supervisor.poll() is None:
            if latest.exists():
                killed_after = latest.read_text().strip()
                os.kill(psutil.Process(supervisor.pid).children()[0].pid, signal.SIGKILL)
            time.sleep(0.01)
        _, err = supervisor.communicate(timeout=300)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == 0, err
    assert killed_after is not None
    events = read_jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert "restart" in names and "resume" in names, names  # killed mid-run, then resumed
    assert [e["step"] for e in events if e["event"] == "fit_end"] == [6]

    ours = load_file(run_dir / "final" / "adapter_model.safetensors")
    theirs = load_file(Path(reference.run_dir) / "final" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_yaml_config_reads_like_the_json_one_and_set_reaches_into_blocks(workspace, tmp_path):
    import yaml

    json_path = write_config(workspace, "seed-yaml-ref.json", "run-y")
    data = json.loads(strip_json_comments(json_path.read_text()))
    yaml_path = tmp_path / "seed.yaml"
    yaml_path.write_text(yaml.safe_dump(data))
    from_json, from_yaml = FinetuneConfig.load(json_path), FinetuneConfig.load(yaml_path)
    assert from_yaml.resolved() == from_json.resolved()
    assert from_yaml.to_train_config() == from_json.to_train_config()

    changed = FinetuneConfig.load(yaml_path, ["lora.r=4", "max_steps=8", "memory_budget=2GiB"])
    assert changed.lora.r == 4 and changed.lora.lora_alpha == 16
    train = changed.to_train_config()
    assert train.max_steps == 8 and train.memory_budget == "2GiB"


def test_a_set_without_a_value_is_shown_a_key_this_config_takes(tmp_path):
    """`--set foo` names an example that a fine-tune config accepts as well as a TrainConfig."""
    path = tmp_path / "run.json"
    path.write_text('{"model_name_or_path": "m", "train_file": "t.jsonl"}')
    with pytest.raises(BadInputError, match="field=value") as refused:
        FinetuneConfig.load(path, ["per_device_train_batch_size"])
    example = str(refused.value).rpartition("e.g. ")[2]
    assert FinetuneConfig.load(path, [example]).resolved()["max_steps"] == 10
    engine = TrainConfig(
        run_dir=str(tmp_path), effective_batch_size=8, **parse_overrides([example])
    )
    assert engine.max_steps == 10


def test_the_mapping_onto_the_engine_config(monkeypatch):
    base = {"model_name_or_path": "m", "train_file": "t.jsonl"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = FinetuneConfig(
        **base,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        bf16=True,
        max_steps=100,
        warmup_ratio=0.1,
        max_grad_norm=0,
        dataloader_num_workers=2,
        keep_last=3,  # steadytrain's name for save_total_limit
        hang_timeout=900,  # steadytrain-only: passes through
    )
    train = config.to_train_config()
    assert isinstance(train, TrainConfig)
    assert (train.effective_batch_size, train.micro_batch_size) == (24, 4)
    assert train.precision == "bf16" and train.max_grad_norm is None
    assert (train.num_workers, train.keep_last, train.hang_timeout) == (2, 3, 900)
    assert train.save_every_steps == 100  # the default 250 is capped at max_steps
    assert train.seed == 42 and train.run_dir == "runs/finetune"
    assert config.schedule(steps_per_epoch=7) == (100, 10)
    monkeypatch.delenv("WORLD_SIZE")
    defaults = FinetuneConfig(**base).to_train_config()
    assert defaults.precision == "fp32" and defaults.epochs == 3 and defaults.max_steps is None
    assert defaults.activation_checkpointing == "auto"
    assert FinetuneConfig(**base, precision="auto").to_train_config().precision == "auto"


def test_every_config_problem_is_reported_at_once_with_the_field_named():
    with pytest.raises(ConfigError) as caught:
        FinetuneConfig(
            model_name_or_path="m",
            train_file="t.jsonl",
            learning_rat=1e-4,
            fp16=True,
            bf16=True,
            save_steps=100,
            save_every_steps=50,
            lora={"rank": 8},
            optim="adamw_8bit",
            hang_timeout=-1,
            num_train_epochs=1.5,
            micro_batch_size=4,
        )
    problems = caught.value.problems
    text = "\n".join(problems)
    assert "learning_rat: unknown field; did you mean 'learning_rate'?" in text
    assert "lora.rank: unknown field; did you mean 'r'? (peft's LoraConfig names it so)" in text
    assert "save_steps, save_every_steps: the same setting given twice" in text
    assert "optim: must be 'adamw_torch'" in text
    assert text.count("hang_timeout:") == 1
    assert "num_train_epochs: must be a whole number" in text
    assert "micro_batch_size: not set directly here" in text
    assert len(problems) == 7, problems  # fp16+bf16 is checked once the fields are valid

    with pytest.raises(ConfigError, match="fp16, bf16: both true"):
        FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", fp16=True, bf16=True)
    with pytest.raises(ConfigError, match="save_steps \\(save_every_steps\\): must be at most"):
        FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", save_steps=9, max_steps=5)
    with pytest.raises(ConfigError, match="push_to_hub"):
        FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", push_to_hub=True)
    quiet = FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", run_name="x")
    assert quiet.notes == ["run_name: ignored (the run is named by output_dir)"]


def test_4bit_is_refused_on_cpu_naming_the_field_and_the_fallback_loads_unquantized(
    workspace, tmp_path
):
    four_bit = SEED_CONFIG.replace('"load_in_4bit": false', '"load_in_4bit": true')
    path = write_config(workspace, "seed-4bit.json", "run-4bit", four_bit)
    with pytest.raises(BadInputError) as caught:
        run_finetune(path)
    message = str(caught.value)
    assert message.startswith("quantization.load_in_4bit: 4-bit needs CUDA and bitsandbytes")
    assert "this run trains on cpu" in message and "quantization.fallback" in message
    assert caught.value.exit_code == 2
    assert not (workspace / "run-4bit").exists()  # refused before anything was written

    config = FinetuneConfig.load(path, ["quantization.fallback=bf16"])
    load = plan_base_load(config, "cpu", "fp32")
    assert load.dtype == torch.bfloat16 and not load.load_in_4bit
    assert "4-bit is not possible here (this run trains on cpu)" in load.message
    with pytest.raises(BadInputError, match="bitsandbytes is not installed"):
        plan_base_load(FinetuneConfig.load(path), "cuda", "bf16", bnb_available=False)


def test_offload_is_refused_on_cpu_before_the_base_loads(workspace):
    offload = SEED_CONFIG.replace(
        '"gradient_checkpointing": true', '"gradient_checkpointing": "offload"'
    )
    path = write_config(workspace, "seed-offload.json", "run-offload", offload)
    with pytest.raises(ConfigError) as caught:
        run_finetune(path)
    (problem,) = caught.value.problems
    assert problem.startswith("gradient_checkpointing: 'offload' needs a GPU") and "cpu" in problem
    assert caught.value.exit_code == 2 and not (workspace / "run-offload").exists()


def test_json_comments_are_stripped_outside_strings_only_and_errors_keep_their_place(tmp_path):
    text = '{\n  "a": "http://x /* y */", // c\n  /* b\n  */ "b": "\\"//"\n}'
    assert json.loads(strip_json_comments(text)) == {"a": "http://x /* y */", "b": '"//'}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  // fine\n  "model_name_or_path": "m",\n  "train_file": "t",\n}\n')
    with pytest.raises(BadInputError, match="line 5, column 1: a trailing comma"):
        FinetuneConfig.load(bad)


def test_the_shipped_example_config_loads():
    config = FinetuneConfig.load(ROOT / "examples" / "finetune_config.json")
    assert config.per_device_train_batch_size == 1 and config.gradient_accumulation_steps == 8
    assert config.to_train_config().precision == "fp32"


def steadytrain_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow
def test_the_command_line_chain_after_a_finetune(workspace, finished, tmp_path):
    """What the fine-tune prints as next steps, through the `steadytrain` command itself:
    generate, evaluate (base vs adapter), merge, then evaluate the merged model."""
    _, result = finished
    final = str(Path(result.run_dir) / "final")

    made = steadytrain_cli("generate", final, "3+4=", "--max-new-tokens", "3", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout.splitlines()[0])["prompt"] == "3+4="

    scored = steadytrain_cli("evaluate", str(workspace / "train.jsonl"), final, "--json")
    assert scored.returncode == 0, scored.stderr
    by_model = {r["model"]: r for r in json.loads(scored.stdout)["results"]}
    assert by_model["base + adapter"]["perplexity"] < by_model["base"]["perplexity"]

    merged = tmp_path / "merged"
    done = steadytrain_cli("merge", final, "--out", str(merged))
    assert done.returncode == 0, done.stderr
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    again = steadytrain_cli("evaluate", str(workspace / "train.jsonl"), str(merged), "--json")
    assert again.returncode == 0, again.stderr
    (alone,) = json.loads(again.stdout)["results"]
    assert alone["loss"] == pytest.approx(by_model["base + adapter"]["loss"], rel=1e-4)

    refused = steadytrain_cli("merge", final, "--out", str(merged))
    assert refused.returncode == 2 and "--force" in refused.stderr


def test_evaluation_each_epoch_and_every_n_steps_reaches_metrics_and_the_console(workspace, capfd):
    """The seed shows Eval Loss each epoch: with eval data, `evaluation_strategy: epoch` (the
    default) evaluates at each epoch's end, `steps` every eval_steps steps; rows of kind "eval"
    in metrics.jsonl and a line on the console; `no` evaluates only after training."""
    text = SEED_CONFIG.replace(
        '"output_dir": "OUT",', '"output_dir": "OUT",\n  "eval_split": 0.25,'
    ).replace('"num_train_epochs": 3,', '"num_train_epochs": 2,\n  "evaluation_strategy": "epoch",')
    job = FinetuneJob.from_file(write_config(workspace, "eval-epoch.json", "run-eval", text))
    assert job.train_config.eval_every_epochs == 1
    result = job.run()
    assert result.exit_code == 0
    rows = read_jsonl(Path(result.run_dir) / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert len(evals) == 2 and all(r["eval_loss"] > 0 for r in evals)
    assert "eval" in capfd.readouterr().err.lower()

    steps = FinetuneConfig(
        model_name_or_path="m",
        train_file="t.jsonl",
        eval_split=0.1,
        eval_strategy="steps",
        eval_steps=3,
    ).to_train_config()
    assert (steps.eval_every_steps, steps.eval_every_epochs) == (3, None)
    never = FinetuneConfig(
        model_name_or_path="m", train_file="t.jsonl", eval_split=0.1, evaluation_strategy="no"
    )
    assert not never.evaluates_during_training()
    assert never.to_train_config().eval_every_epochs is None
    no_data = FinetuneConfig(model_name_or_path="m", train_file="t.jsonl").to_train_config()
    assert no_data.eval_every_epochs is None


def test_too_few_packed_windows_for_one_batch_is_refused_naming_the_fine_tune_keys(workspace):
    """64 short records packed into windows of 1024 tokens make one sample: the refusal names
    the keys of this config (packing, max_seq_length, the two batch keys), not engine fields."""
    config = write_config(workspace, "packed.json", "run-packed")
    with pytest.raises(BadInputError) as info:
        FinetuneJob.from_file(config, ["packing=true", "max_seq_length=1024"])
    text = str(info.value)
    assert text.startswith("train_file: 1 training sample(s) after packing")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length"):
        assert key in text


def test_the_final_evaluation_starts_where_training_ended_and_halves_on_out_of_memory(
    workspace, capfd
):
    """Training runs out of memory above 2 samples per forward, so it ends at micro-batch 2; the
    evaluation after it (eval data, none during training) starts at 2, not at the starting 4,
    and its out-of-memory above 1 sample is halved and redone: the fine-tune ends with exit 0
    and the eval loss said, after final/ is written. The out-of-memory is torch's own error type,
    raised by the embedding when a batch is larger than the limit of the current mode."""
    job = FinetuneJob.from_file(
        write_config(workspace, "final-eval.json", "run-final-eval"),
        [
            "num_train_epochs=1",
            "per_device_train_batch_size=4",
            "gradient_accumulation_steps=2",
            "eval_split=0.25",
            "evaluation_strategy='no'",
        ],
    )
    evaluated: list[int] = []

    def tight(module, args):
        size = args[0].shape[0]
        if not module.training:
            evaluated.append(size)
        if size > (2 if module.training else 1):
            raise torch.OutOfMemoryError(f"out of memory: a batch of {size} (the test's limit)")

    job.model.get_input_embeddings().register_forward_pre_hook(tight)
    result = job.run()
    assert result.exit_code == 0 and result.micro_batch_size == 2
    assert (Path(result.run_dir) / "final" / "adapter_model.safetensors").is_file()
    assert evaluated[0] == 2 and set(evaluated[1:]) == {1}
    assert len(evaluated) == 1 + 16  # the first batch failed; then the 16 eval samples one by one
    err = capfd.readouterr().err
    assert "eval: out of memory at batch size 2; redoing the same samples at 1" in err
    assert re.search(r"eval: loss \d+\.\d+ \(perplexity", err)

    # One sample that does not fit: said and skipped, never an error after a finished training.
    def none_fits(module, args):
        if not module.training:
            raise torch.OutOfMemoryError("out of memory: the test's limit")

    job.model.get_input_embeddings().register_forward_pre_hook(none_fits)
    assert job.final_evaluation(2) is None
    err = capfd.readouterr().err
    assert "eval: skipped: one eval sample of" in err and "lower max_seq_length" in err
