"""Rerunning a fine-tune on an interrupted output_dir: which changes keep the run the same run.

The engine refuses a resume whose run-defining settings changed (`safety.state.check_identity`).
In a fine-tune's terms the seed's own advice is to lower ``per_device_train_batch_size``, to
change ``gradient_accumulation_steps`` or to switch ``gradient_checkpointing``: when the effective
batch (per_device_train_batch_size × gradient_accumulation_steps × processes) is unchanged these
are the same run and the resume goes on, saying what changed. A changed effective batch is
refused here, before anything loads, in the config's own names, with the `resume_overrides` entry
that would allow it on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadytrain import run_files
from steadytrain.errors import BadInputError
from steadytrain.recipes.finetune_config import FinetuneConfig

BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")


def resume_changes(config: FinetuneConfig, run_dir: Path) -> list[str]:
    """What changed since the interrupted run in `run_dir` started (one line each, `key: old ->
    new`); [] for a new run. Raises BadInputError when the effective batch changed and
    ``resume_overrides`` does not allow it."""
    recorded = _recorded(run_dir)
    if recorded is None:
        return []
    now = config.resolved()
    changed = [
        f"{key}: {recorded.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(recorded) | set(now))
        if recorded.get(key) != now.get(key) and key != "resume_overrides"
    ]
    old = _effective(recorded, config.world_size)
    allowed = "effective_batch_size" in (now.get("resume_overrides") or [])
    if old is not None and old != config.effective_batch_size and not allowed:
        raise BadInputError(_batch_refusal(old, recorded, config, run_dir))
    return changed


def _effective(recorded: dict[str, Any], world_size: int) -> int | None:
    sizes = [recorded.get(key) for key in BATCH]
    if not all(isinstance(size, int) for size in sizes):
        return None
    return sizes[0] * sizes[1] * world_size


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """The config the run in `run_dir` started with, when it has a checkpoint to resume."""
    path = run_dir / run_files.TRAINING_CONFIG
    if not (run_dir / run_files.CHECKPOINTS / run_files.LATEST).exists() or not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the engine's own identity check still guards the resume
    return value if isinstance(value, dict) else None


def _batch_refusal(
    old: int, recorded: dict[str, Any], config: FinetuneConfig, run_dir: Path
) -> str:
    was = " × ".join(f"{key} {recorded.get(key)}" for key in BATCH)
    now = " × ".join(f"{key} {getattr(config, key)}" for key in BATCH)
    per_device = config.per_device_train_batch_size
    keep = (
        f"gradient_accumulation_steps {old // (per_device * config.world_size)} with "
        f"per_device_train_batch_size {per_device}"
        if old % (per_device * config.world_size) == 0
        else f"per_device_train_batch_size {recorded.get(BATCH[0])} with "
        f"gradient_accumulation_steps {recorded.get(BATCH[1])}"
    )
    return (
        f"resume: {run_dir} holds an interrupted run with an effective batch of {old} ({was}); "
        f"this config gives {config.effective_batch_size} ({now}), which makes it another run. "
        f"To go on with less memory keep the product at {old}: {keep}. To change the batch on "
        f'purpose, add "resume_overrides": ["effective_batch_size"] to the config, or use a '
        f"new output_dir."
    )


__all__ = ["resume_changes"]
