"""`steadytrain finetune` on an output_dir that holds an interrupted run: nothing is written
before the run is known to be this run (a refused start leaves training_config.json and
training.log as they were), and a changed setting gets one answer naming it, its old and new
value, and an override that works or a new output_dir. Through the CLI (forked from a warm
process: tests/forkserver.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from tiny_models import save_byte_llama

from steadytrain.recipes.finetune import run_finetune
from steadytrain.safety.lock import RunLock

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama fine-tune stopped at step 2 of 4 with a checkpoint: (config, output_dir)."""
    root = tmp_path_factory.mktemp("identity")
    save_byte_llama(
        root / "tiny",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    records = [{"prompt": f"{i % 7}+{i % 5}=", "completion": f"{i % 7 + i % 5}"} for i in range(16)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "run"
    path = root / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_name_or_path": str(root / "tiny"),
                "train_file": str(root / "train.jsonl"),
                "output_dir": str(out),
                "max_seq_length": 16,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 1,
                "max_steps": 2,
                "save_steps": 2,
                "logging_steps": 1,
                "optim": "adamw_torch",
                "lora": {"r": 4, "lora_alpha": 8},
            }
        )
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_finetune(path).exit_code == 0
    finally:
        torch.set_num_threads(threads)
    assert (out / "checkpoints" / "latest").exists()
    return path, out


def finetune(config: Path, *sets: str):
    args = [a for s in sets for a in ("--set", s)]
    return forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "finetune", "--config", str(config), *args],
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )


def written(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("training_config.json", "training.log")}


def test_a_start_refused_by_the_lock_writes_nothing(interrupted):
    config, out = interrupted
    before = written(out)
    with RunLock(out):  # another process holds the run
        done = finetune(config, "max_steps=4")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert written(out) == before


def test_a_start_refused_as_a_different_run_writes_nothing(interrupted, tmp_path):
    config, out = interrupted
    data = Path(json.loads(config.read_text())["train_file"])
    original = data.read_bytes()
    before = written(out)
    data.write_text(original.decode().replace("+", "-"))  # the same file, other samples
    try:
        done = finetune(config, "max_steps=4")
    finally:
        data.write_bytes(original)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said
    assert "belongs to a different run" in said and "data:" in said, said
    assert "Traceback" not in said
    assert written(out) == before


def test_a_changed_lora_rank_is_one_answer_naming_it_and_a_new_output_dir(interrupted):
    config, out = interrupted
    before = written(out)
    done = finetune(config, "lora.r=8", "max_steps=4")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said
    assert "lora.r: 4 -> 8" in said, said
    assert "start a new output_dir" in said, said
    assert "keeping it the same run" not in said and "Traceback" not in said, said
    assert "resume_overrides" not in said, said  # no override loads another adapter shape
    assert said.count("error:") == 1, said
    assert written(out) == before


def test_a_changed_seed_names_the_override_that_works(interrupted):
    config, _ = interrupted
    refused = finetune(config, "seed=7", "max_steps=4")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2, said
    assert "seed: 42 -> 7" in said and '"resume_overrides": ["seed"]' in said, said

    allowed = finetune(config, "seed=7", "max_steps=3", 'resume_overrides=["seed"]')
    said = " ".join(allowed.stderr.split())
    assert allowed.returncode == 0, said
    assert "Traceback" not in said
