"""`steadytrain finetune --dry-run` and `steadytrain config FILE` on a fine-tune config: what a
fine-tune would do, without loading the model or training. The resolved settings (Hugging Face
names and // comments accepted), the memory estimate with the fine-tune's own settings, the plan
this makes, and the files it would write (or resume from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from steadytrain.recipes.finetune_config import FinetuneConfig, load_config_file
from steadytrain.recipes.finetune_resume import held_run
from steadytrain.run import files as run_files

# Keys only a fine-tune config has: a file holding one of them is read as a fine-tune config,
# except one whose only such key is output_dir beside effective_batch_size (a TrainConfig's
# required field, which a fine-tune computes): a Trainer's config with Hugging Face's folder name.
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
    if "effective_batch_size" in data and not any(key in data for key in FINETUNE_KEYS[:3]):
        return False  # a Trainer's config that names its folder as Hugging Face does
    return any(key in data for key in FINETUNE_KEYS)


def dry_run(config: FinetuneConfig, console: Any = None) -> int:
    """Print what `steadytrain finetune` would do with `config`; exit 3 where the run would
    stop with exit 3 (`finetune_memory.refusal`: not even micro-batch 1 with every saver the
    config allows fits its budget, the config's `memory_budget` and `device` resolved as the
    run resolves them), else 0. The training data is tokenised as the run tokenises it, where
    the tokenizer is on this machine, so the estimate prices what a batch is padded to: the
    longest sample where every one is shorter than max_seq_length. Where its start does not fit, the advisor says in the config's
    keys what would. A missing data file is said (the run would stop on it with exit 2). Exit 2
    where output_dir holds a run this config may not resume (the run refuses it the same way)."""
    from steadytrain.cli.memory_commands import render_advice, render_estimate
    from steadytrain.recipes.finetune_memory import (
        advice,
        data_lengths,
        longest_length,
        refusal,
        run_plan,
        target,
    )

    engine = config.to_train_config()
    typer.echo("settings (resolved, as final/training_config.json will hold them):")
    typer.echo(json.dumps(config.resolved(), indent=2))
    for note in config.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"engine: {json.dumps(json.loads(engine.to_json()))}")
    for problem in config.data_file_problems():
        typer.echo(f"data: {problem}: the run would stop there (exit 2)")
    for problem in config.model_folder_problems():
        typer.echo(f"model: {problem}: the run would stop there (exit 2)")
    lengths, why = data_lengths(config)  # a batch is padded to its longest, not max_seq_length
    typer.echo(
        lengths.said(config)
        if lengths is not None
        else f"data: lengths unknown, {why}: the estimate prices activations at max_seq_length "
        f"{config.max_seq_length:,}"
    )
    where = target(config)
    plan, result = run_plan(config, where, lengths)
    result.budget, result.budget_source = where.budget, where.source
    typer.echo("memory estimate (LoRA with this config's settings, at the run's start):")
    render_estimate(result, console, advice(config, result))
    typer.echo(
        f"plan: {config.effective_batch_size} samples per optimizer step, "
        f"{config.world_size} process(es); precision {config.precision}; budget from "
        f"{where.source}:"
    )
    for line in plan.describe():
        typer.echo(f"  {line}")
    longest = longest_length(config, where)
    if longest:
        typer.echo(f"  {longest}")
    if plan.fits is False and result.fits is not False:  # the planner found nothing that fits
        render_advice(advice(config, result), console)
    stop = refusal(config, where.device_type, where.budget, lengths)
    if stop is not None:
        typer.echo(f"the run stops here (exit 3): {stop}")
    elif plan.fits is False:
        typer.echo(
            "  the run starts there; where memory runs out, the ladder halves the micro-batch "
            "and turns on the savers left: at micro-batch 1 with all of them the estimate fits"
        )
    held, refused = _held(config)
    if refused:
        typer.echo(f"the run stops here (exit 2): {held}")
    typer.echo("files:")
    for line in ([] if refused else [held] if held else []) + _files(config):
        typer.echo(f"  {line}")
    return 2 if refused else 3 if stop is not None else 0


def _held(config: FinetuneConfig) -> tuple[str, bool]:
    """What the run does with the run output_dir holds ('' where none), as the run decides it
    before anything loads (`resume_changes`): resumes it, saying the changes it keeps, or
    refuses it (True, with the run's message)."""
    from steadytrain.errors import BadInputError
    from steadytrain.recipes.finetune_resume import resume_changes

    out = Path(config.output_dir)
    if not (out / run_files.CHECKPOINTS / run_files.LATEST).exists():
        return "", False
    held = held_run(out)
    try:
        changes = resume_changes(config, out)
    except BadInputError as exc:
        return str(exc), True
    line = f"{out} holds {held}: the fine-tune resumes it" + (
        " at its last step (a raised max_steps or num_train_epochs trains further) and "
        "writes final/ again"
        if held.startswith("a finished")
        else ""
    )
    if changes:
        line += "; changed since it started, keeping it the same run: " + "; ".join(changes)
    return line, False


def _files(config: FinetuneConfig) -> list[str]:
    out = Path(config.output_dir)
    checkpoints = out / run_files.CHECKPOINTS
    lines = []
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
