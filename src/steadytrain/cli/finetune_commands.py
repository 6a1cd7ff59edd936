"""`steadytrain finetune --dry-run` and `steadytrain config FILE` on a fine-tune config: what a
fine-tune would do, without loading the model or training. The resolved settings (Hugging Face
names and // comments accepted), the memory estimate with the fine-tune's own settings, the plan
this makes, and the files it would write (or resume from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from steadytrain import run_files
from steadytrain.recipes.finetune_config import FinetuneConfig, load_config_file

# Keys only a fine-tune config has: a file holding one of them is read as a fine-tune config.
FINETUNE_KEYS = ("model_name_or_path", "train_file", "per_device_train_batch_size", "output_dir")


def is_finetune_file(path: str) -> bool:
    """True for a JSON (comments allowed) or YAML file with a fine-tune's keys."""
    file = Path(path)
    if not file.is_file() or file.suffix.lower() not in (".json", ".yaml", ".yml"):
        return False
    try:
        data = load_config_file(file)
    except Exception:  # noqa: BLE001 (not ours to judge here: the TrainConfig reader says why)
        return False
    return any(key in data for key in FINETUNE_KEYS)


def dry_run(config: FinetuneConfig, console: Any = None) -> int:
    """Print what `steadytrain finetune` would do with `config`; exit 3 when the estimate says
    it does not fit, else 0."""
    from steadytrain.cli.memory_commands import render_estimate, resolve_target
    from steadytrain.memory.settings import from_options
    from steadytrain.recipes.finetune_memory import estimate_finetune, estimate_settings

    engine = config.to_train_config()
    typer.echo("settings (resolved, as final/training_config.json will hold them):")
    typer.echo(json.dumps(config.resolved(), indent=2))
    for note in config.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"engine: {json.dumps(json.loads(engine.to_json()))}")
    budget, source, settings = resolve_target(from_options("estimate", estimate_settings(config)))
    result = estimate_finetune(config, settings.device_type, budget)
    result.budget_source = source
    typer.echo("memory estimate (LoRA with this config's settings):")
    render_estimate(result, console)
    typer.echo(_plan_line(config, result.fits))
    typer.echo("files:")
    for line in _files(config):
        typer.echo(f"  {line}")
    return 3 if result.fits is False else 0


def _plan_line(config: FinetuneConfig, fits: bool | None) -> str:
    batch = (
        f"plan: {config.effective_batch_size} samples per optimizer step = micro-batch "
        f"{config.per_device_train_batch_size} × {config.gradient_accumulation_steps} "
        f"accumulation × {config.world_size} process(es); activation checkpointing "
        f"{config.gradient_checkpointing}; precision {config.precision}"
    )
    if fits is False:
        return (
            f"{batch}; the micro-batch does not fit by the estimate: out-of-memory will halve "
            "it (micro_batch_size: auto measures before training)"
        )
    return batch + ("; fits by the estimate" if fits else "")


def _files(config: FinetuneConfig) -> list[str]:
    out = Path(config.output_dir)
    checkpoints = out / run_files.CHECKPOINTS
    lines = []
    if (checkpoints / run_files.LATEST).exists():
        lines.append(f"{out} holds an interrupted run: the fine-tune resumes it")
    every = config.to_train_config().save_every_steps
    lines += [
        f"{out / run_files.CONFIG}, {out / run_files.TRAINING_CONFIG}: the resolved configs",
        f"{out / run_files.METRICS}, {out / run_files.EVENTS}: one line per step, the events",
        f"{out / run_files.TRAINING_LOG}: what the console shows",
        f"{checkpoints}/step-NNNNNNNN/: every {every} steps, the newest "
        f"{config.save_total_limit} kept (steadytrain export {out} --step N makes one an adapter)",
        f"{out / run_files.FINAL}/: the adapter (adapter_model.safetensors, adapter_config.json), "
        "the tokenizer and training_config.json",
    ]
    return lines


__all__ = ["dry_run", "is_finetune_file"]
