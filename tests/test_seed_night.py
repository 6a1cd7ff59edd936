"""The seed-004 user's night (issue 14), through the command line: the seed's config block pasted
verbatim (with its // comments) plus the lines a user adds, a tiny Llama built offline.

A misspelt target module is refused by name; the docs' short run works as written; a SIGKILL
under `steadytrain run` without --run-dir is found, counted as progress and resumed to a bitwise
equal adapter; a mid-run checkpoint exports as a peft adapter that generate takes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import psutil
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_byte_llama

from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent

# The seed's "Configuration" block, as the user pasted it, then the lines the user adds.
SEED_BLOCK = """{
  "per_device_train_batch_size": 1,      // Small batch for memory
  "gradient_accumulation_steps": 8,      // Effective batch = 8
  "fp16": false,                         // FP32 more stable on MPS
  "bf16": false,
  "gradient_checkpointing": true,        // Saves memory
  "optim": "adamw_torch",                // Native PyTorch optimizer
  "save_steps": 250,                     // Frequent checkpoints
  "save_total_limit": 2,                 // Keep last 2 only
  "quantization": {
    "load_in_4bit": false                // No quantization on MPS
  },
"""
SHORT = ["--set", "max_steps=6", "--set", "save_steps=2"]  # CI-sized, as docs/finetune.md runs it
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny Llama saved with the byte tokenizer, and 32 prompt/completion records."""
    root = tmp_path_factory.mktemp("seed-night")
    save_byte_llama(root / "tiny", max_position_embeddings=2048)
    lines = [
        json.dumps({"prompt": f"{i % 9}+{(i * 7) % 11}=", "completion": f"{i % 9 + (i * 7) % 11}"})
        for i in range(32)
    ]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def seed_config(workspace: Path, out: str, extra: str = "") -> Path:
    """The seed's block verbatim, closed by the model, data and output lines the user adds."""
    path = workspace / f"{out}.json"
    added = (
        f'  "model_name_or_path": "{workspace / "tiny"}",\n'
        f'  "train_file": "{workspace / "train.jsonl"}",\n'
        f"{extra}"
        f'  "output_dir": "{workspace / out}"\n'
        "}\n"
    )
    path.write_text(SEED_BLOCK + added)
    return path


def steadytrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", *args],
        env=ENV,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_misspelt_target_module_is_refused_naming_it_and_the_closest_names(workspace):
    config = seed_config(workspace, "typo", '  "lora": {"target_modules": ["q_proj", "v_porj"]},\n')
    done = steadytrain("finetune", "--config", str(config), *SHORT)
    said = " ".join(done.stderr.split())  # the console wraps long lines
    assert done.returncode == 2, said
    assert "lora.target_modules: 'v_porj' matches no module" in said, said
    assert "did you mean 'v_proj'" in said, said
    assert not (workspace / "typo").exists()  # refused before anything was written


def test_the_docs_short_run_works_as_written_and_max_steps_alone_names_save_steps(workspace):
    config = seed_config(workspace, "docs")
    alone = steadytrain("finetune", "--config", str(config), "--set", "max_steps=2")
    said = " ".join(alone.stderr.split())
    assert alone.returncode == 2 and "must be at most max_steps 2" in said, said
    docs = Path(ROOT / "docs" / "finetune.md").read_text()
    assert "--set max_steps=2 --set save_steps=2" in docs
    done = steadytrain("finetune", "--config", str(config), "--set", "max_steps=2", "--set",
                       "save_steps=2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (workspace / "docs" / "final" / "adapter_model.safetensors").is_file()
    log = (workspace / "docs" / "training.log").read_text()  # what the console showed
    for line in done.stderr.splitlines():
        assert line in log, line
    assert "finished at step 2" in log and "adapter:" in log, log
    # The memory was checked before the base loaded, with the fine-tune's own settings.
    said = " ".join(done.stderr.split())
    assert "memory: estimated" in said and "at micro-batch 1 against a budget of" in said, said
    assert said.index("memory: estimated") < said.index("model: ")


def run_killed_once(cmd: list[str], run_dir: Path) -> tuple[subprocess.Popen, str, str]:
    """Start `cmd` (a supervisor), SIGKILL its training child once a checkpoint is committed;
    returns (process, step killed after, its stderr)."""
    supervisor = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
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
    assert killed_after is not None, err
    return supervisor, killed_after, err


def test_the_seed_night_under_run_without_run_dir_resumes_bitwise(workspace):
    reference = steadytrain("finetune", "--config", str(seed_config(workspace, "ref")), *SHORT)
    assert reference.returncode == 0, reference.stderr
    run_dir = workspace / "night"
    cmd = [
        sys.executable, "-m", "steadytrain.cli", "run", "--backoff-initial", "0.01", "--",
        sys.executable, "-m", "steadytrain.cli", "finetune", "--config",
        str(seed_config(workspace, "night")), *SHORT,
    ]  # fmt: skip
    supervisor, _, err = run_killed_once(cmd, run_dir)
    assert supervisor.returncode == 0, err
    assert "run dir not known" not in err, err
    events = read_jsonl(run_dir / "events.jsonl")
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["progressed"] is True, restarts
    assert restarts[0]["restarts_without_progress"] == 0
    assert [e["step"] for e in events if e["event"] == "fit_end"] == [6]

    ours = load_file(run_dir / "final" / "adapter_model.safetensors")
    theirs = load_file(workspace / "ref" / "final" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.slow
def test_a_mid_run_checkpoint_exports_to_a_peft_adapter_that_generate_takes(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = workspace / "ref"
    if not (run_dir / "final").is_dir():
        done = steadytrain("finetune", "--config", str(seed_config(workspace, "ref")), *SHORT)
        assert done.returncode == 0, done.stderr
    missing = steadytrain("export", str(run_dir), "--step", "1")
    assert missing.returncode == 2 and "--step 1" in missing.stderr, missing.stderr
    exported = steadytrain("export", str(run_dir), "--step", "4")
    assert exported.returncode == 0, exported.stderr
    folder = run_dir / "adapters" / "step-00000004"
    assert f"adapter: {folder}" in exported.stdout

    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    adapter = PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([[256, *b"3+4=7"]])
    final_tensors = load_file(run_dir / "final" / "adapter_model.safetensors")
    step4 = load_file(folder / "adapter_model.safetensors")
    assert step4.keys() == final_tensors.keys()
    assert any(not torch.equal(step4[k], final_tensors[k]) for k in step4)  # step 4, not 6
    with torch.no_grad():
        assert torch.isfinite(adapter(input_ids=ids).logits).all()

    checkpoint = run_dir / "checkpoints" / "step-00000006"
    text = steadytrain("generate", str(checkpoint), "3+4=", "--max-new-tokens", "3", "--json")
    assert text.returncode == 0, text.stderr
    assert (run_dir / "adapters" / "step-00000006" / "adapter_model.safetensors").is_file()
    step6 = load_file(run_dir / "adapters" / "step-00000006" / "adapter_model.safetensors")
    for name, tensor in final_tensors.items():  # the last checkpoint is the final adapter
        assert torch.equal(step6[name], tensor), name


def announcing_child(run_dir: Path) -> str:
    """A child that announces `run_dir` as a Trainer does, writes a newer checkpoint each attempt
    and fails its first two attempts."""
    return (
        "import os, pathlib, sys\n"
        "from steadytrain.safety.supervised import announce_run_dir\n"
        f"run = pathlib.Path({str(run_dir)!r})\n"
        "announce_run_dir(run)\n"
        "(run / 'checkpoints').mkdir(parents=True, exist_ok=True)\n"
        "attempt = int(os.environ['STEADYTRAIN_RESTART'])\n"
        "(run / 'checkpoints' / 'latest').write_text(f'step-{attempt + 1:08d}')\n"
        "sys.exit(1 if attempt < 2 else 0)\n"
    )


def test_a_trainer_child_announces_its_run_dir_to_the_supervisor(tmp_path):
    run_dir = tmp_path / "announced"
    child = announcing_child(run_dir)
    done = steadytrain("run", "--max-restarts", "0", "--backoff-initial", "0.01", "--",
                       sys.executable, "-c", child)  # fmt: skip
    # Two failures, each after a new checkpoint: progress, so --max-restarts 0 does not give up.
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("(announced by the child)") == 1, done.stderr
    restarts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [e["progressed"] for e in restarts] == [True, True], restarts

    quiet = steadytrain("run", "--max-restarts", "1", "--backoff-initial", "0.01", "--",
                        sys.executable, "-c", "import sys; sys.exit(1)")  # fmt: skip
    assert quiet.returncode == 4, quiet.stderr
    assert quiet.stderr.count("announced no run dir") == 1, quiet.stderr


def test_a_trainer_child_writing_elsewhere_than_the_given_run_dir_is_followed_there(tmp_path):
    """`steadytrain run --run-dir A` around a script whose Trainer writes to B: the child
    announces B, the supervisor says so and counts B's checkpoints as progress, so two failures
    after new checkpoints do not exhaust --max-restarts 0 (before: A never changed, and the
    supervisor gave up on a run that was making progress)."""
    given, run_dir = tmp_path / "given", tmp_path / "own"
    child = announcing_child(run_dir)
    done = steadytrain("run", "--run-dir", str(given), "--max-restarts", "0",
                       "--backoff-initial", "0.01", "--", sys.executable, "-c", child)  # fmt: skip
    assert done.returncode == 0, done.stderr
    told = f"the child writes its run to {run_dir}, not to the run dir given ({given})"
    assert done.stderr.count(told) == 1, done.stderr
    restarts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [e["progressed"] for e in restarts] == [True, True], restarts


def test_the_announcement_goes_only_to_the_supervisor_s_own_pipe(tmp_path):
    """A process that did not inherit the supervisor's pipe but has its variable (a torchrun
    rank) may hold a file of its own at that number: nothing is written to it, whether the
    variable names the number alone, another inode, or the file's own inode; the pipe it names
    gets the run dir."""
    from steadytrain.run.files import ENV_ANNOUNCE_FD
    from steadytrain.safety.supervised import announce_run_dir

    with open(tmp_path / "own-file", "wb") as own:
        fd, inode = own.fileno(), os.fstat(own.fileno()).st_ino
        for value in (str(fd), f"{fd}:{inode + 1}", f"{fd}:{inode}"):
            announce_run_dir(tmp_path / "run", {ENV_ANNOUNCE_FD: value})
    assert (tmp_path / "own-file").read_bytes() == b""
    read_end, write_end = os.pipe()
    try:
        value = f"{write_end}:{os.fstat(write_end).st_ino}"
        announce_run_dir(tmp_path / "run", {ENV_ANNOUNCE_FD: value})
        assert os.read(read_end, 4096).decode() == f"{tmp_path / 'run'}\n"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_resume_goes_on_when_the_effective_batch_is_kept_and_names_the_field_when_not(workspace):
    config = seed_config(workspace, "refit")
    run_dir = workspace / "refit"
    child = subprocess.Popen(
        [sys.executable, "-m", "steadytrain.cli", "finetune", "--config", str(config), *SHORT],
        stderr=subprocess.DEVNULL,
        env=ENV,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)  # interrupted, as the OS would
    finally:
        child.wait(timeout=60)
    assert (run_dir / "checkpoints" / "latest").exists()

    halved = steadytrain("finetune", "--config", str(config), *SHORT,
                         "--set", "gradient_accumulation_steps=4")  # fmt: skip
    said = " ".join(halved.stderr.split())
    assert halved.returncode == 2, said
    assert (
        "effective batch of 8 (per_device_train_batch_size 1 × gradient_accumulation_steps 8)"
        in said
    )
    assert "this config gives 4" in said
    assert "gradient_accumulation_steps 8 with per_device_train_batch_size 1" in said
    assert '"resume_overrides": ["effective_batch_size"]' in said

    kept = steadytrain("finetune", "--config", str(config), *SHORT,
                       "--set", "per_device_train_batch_size=2",
                       "--set", "gradient_accumulation_steps=4",
                       "--set", "gradient_checkpointing=false")  # fmt: skip
    said = " ".join(kept.stderr.split())
    assert kept.returncode == 0, said
    assert "resume: changed since the run started, keeping it the same run:" in said
    for change in ("gradient_accumulation_steps: 8 -> 4", "per_device_train_batch_size: 1 -> 2",
                   "gradient_checkpointing: True -> False"):  # fmt: skip
        assert change in said, said
    events = read_jsonl(run_dir / "events.jsonl")
    assert "resume" in [e["event"] for e in events]
    assert [e["step"] for e in events if e["event"] == "fit_end"] == [6]


@pytest.mark.slow
def test_fp16_skipped_steps_are_counted_shown_and_reported_without_a_foreign_warning(workspace):
    config = seed_config(workspace, "half")
    done = steadytrain("finetune", "--config", str(config), "--set", "fp16=true",
                       "--set", "max_steps=4", "--set", "save_steps=4")  # fmt: skip
    said = " ".join(done.stderr.split())
    assert done.returncode == 0, said
    rows = read_jsonl(workspace / "half" / "metrics.jsonl")
    skipped = sum(1 for row in rows if row["skipped"])
    assert skipped >= 1, rows  # 65536, the scaler's first scale, overflows fp16 gradients
    assert f"{skipped} step(s) skipped by fp16 (inf/NaN gradients)" in said, said
    assert "lr_scheduler.step()" not in said, said
    saved = json.loads(
        (workspace / "half" / "checkpoints" / "step-00000004" / "trainer_state.json").read_text()
    )
    assert saved["state"]["skipped_steps"] == skipped
    report = steadytrain("report", str(workspace / "half"))
    assert report.returncode == 0, report.stderr
    assert f"{skipped} fp16-skipped step(s)" in report.stdout, report.stdout
    assert "fp16 skipped steps" in (workspace / "half" / "report.html").read_text()


@pytest.mark.slow
def test_config_dry_run_and_estimate_read_the_commented_seed_config(workspace):
    config = seed_config(workspace, "dry")
    for args in (("config", str(config)), ("finetune", "--dry-run", "--config", str(config))):
        done = steadytrain(*args)
        said = " ".join(done.stdout.split())
        assert done.returncode == 0, done.stderr
        assert "settings (resolved" in said and '"gradient_accumulation_steps": 8' in said, said
        assert '"effective_batch_size": 8, "micro_batch_size": 1' in said, said  # the engine's
        assert "LoRA r=16 on all-linear" in said, said  # the fine-tune's defaults, not full
        assert "fits: " in said and "plan: 8 samples per optimizer step" in said, said
        assert "training.log" in said and "final/" in said and "every 250 steps" in said, said
        assert not (workspace / "dry").exists()  # nothing written, nothing loaded

    estimate = steadytrain("estimate", str(config))
    said = " ".join(estimate.stdout.split())
    assert estimate.returncode == 0, estimate.stderr
    assert "LoRA r=16 on all-linear" in said and "micro-batch 1" in said, said
    assert "activation checkpointing" in said, said
