"""The last edges of writing: a full disk during the fine-tune's final export is exit 6 naming
the file and the space left (not a SafetensorError traceback, which `steadytrain run` would
restart in a loop), and `steadytrain report` on a read-only run directory is exit 2 offering
--out. Both on a real tmpfs (the kernel itself says ENOSPC, EROFS); where mounting is not
allowed they are skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from disks import fill, mount, tmpfs

from steadytrain.cli import main as cli_main
from steadytrain.errors import RunDiskFullError

DISK_FULL = 6


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB tmpfs."""
    with tmpfs(tmp_path / "tiny", "1m") as point:
        yield point


@pytest.mark.parametrize(
    "left,file",
    [
        (0, "README.md"),  # peft's first file: an OSError
        (128 * 1024, "adapter_model.safetensors"),  # 290 KiB of LoRA: safetensors' error
    ],
)
def test_disk_full_during_the_final_export_is_exit_6_naming_the_file(tiny_disk, left, file):
    """The export cannot be written: RunDiskFullError (exit 6) names the file and the space
    left; no half export is left behind."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from steadytrain.recipes.data import byte_tokenizer
    from steadytrain.recipes.finetune import export_final
    from steadytrain.recipes.finetune_config import FinetuneConfig

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    model = get_peft_model(base, LoraConfig(r=64, target_modules="all-linear"))
    config = FinetuneConfig.from_dict(
        {"model_name_or_path": "tiny", "train_file": "t.jsonl", "output_dir": "out"}
    )
    run_dir = tiny_disk / "run"
    run_dir.mkdir()
    fill(tiny_disk / "filler")
    filler = tiny_disk / "filler"
    os.truncate(filler, filler.stat().st_size - left)

    with pytest.raises(RunDiskFullError) as info:
        export_final(model, tokenizer, config, run_dir)

    message = str(info.value)
    assert info.value.exit_code == DISK_FULL
    assert str(run_dir / "final" / file) in message, message
    assert "free on that filesystem" in message and "disk full" in message
    assert sorted(p.name for p in run_dir.iterdir()) == []  # no staging folder, no final/


def write_small_run(run_dir: Path) -> None:
    run_dir.mkdir()
    rows = [{"step": s, "time": 1000.0 + s, "loss": 1.0 / s, "lr": 0.1} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [{"time": 1000.0, "event": "fit_start", "step": 0}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_report_on_a_read_only_run_directory_is_exit_2_offering_out(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    disk = tmp_path / "ro"
    disk.mkdir()
    mount(disk, "size=1m")
    try:
        write_small_run(disk / "run")
        done = subprocess.run(
            ["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True, timeout=20
        )
        assert done.returncode == 0, done.stderr

        with pytest.raises(SystemExit) as info:
            cli_main(["report", str(disk / "run")])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert "--out" in err and str(disk / "run") in err and "Traceback" not in err

        elsewhere = tmp_path / "pages"
        elsewhere.mkdir()
        with pytest.raises(SystemExit) as info:
            cli_main(["report", str(disk / "run"), "--out", str(elsewhere)])
        assert info.value.code == 0, capsys.readouterr().err
        assert (elsewhere / "report.html").stat().st_size > 0
        assert sorted(p.name for p in (elsewhere / "report").iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=20)


def test_disk_full_at_the_start_of_a_fine_tune_names_the_file_and_the_space_left(
    tiny_disk, tmp_path, capsys
):
    """`steadytrain finetune` on a disk already full: exit 6 naming the file it could not write
    and the space left (it said only "a write failed")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from steadytrain.recipes.data import byte_tokenizer

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    rows = [{"prompt": f"{i % 9}+1=", "completion": str(i % 9 + 1)} for i in range(32)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tiny_disk / "out"
    config = {
        "model_name_or_path": str(tmp_path / "tiny"),
        "train_file": str(tmp_path / "train.jsonl"),
        "output_dir": str(out),
        "max_seq_length": 32,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "lora": {"r": 4},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    fill(tiny_disk / "filler")

    with pytest.raises(SystemExit) as info:
        cli_main(["finetune", "--config", str(tmp_path / "config.json")])
    err = capsys.readouterr().err
    assert info.value.code == DISK_FULL, err
    assert f"could not write {out}" in err and "free on that filesystem" in err, err
    assert "Traceback" not in err
