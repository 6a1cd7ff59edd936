"""Rerunning a fine-tune on an interrupted output_dir: which changes keep the run the same run.

A setting changed since the run started gets one answer, before anything loads or is written:

* the same run, said on the first line and resumed: the batch split
  (``per_device_train_batch_size`` × ``gradient_accumulation_steps`` while the effective batch
  stays), the memory savers, logging, saving, evaluation, the length of the run;
* another run, refused (exit 2) naming the setting, its old and new value, and the fix: a
  changed effective batch, seed or data may be allowed on purpose with ``resume_overrides``
  (which then works); a setting the saved state holds or was built from (the base model, the
  adapter's rank, targets and scale, quantization, the optimizer's and the schedule's
  hyperparameters) can only be set back, or the run started in a new output_dir.

The engine's own identity check (`checkpoint.identity.check_identity`) still guards the resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.run import files as run_files

BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")


def resume_changes(config: FinetuneConfig, run_dir: Path) -> list[str]:
    """What changed since the interrupted run in `run_dir` started (one line each, `key: old ->
    new`, nested keys dotted: `lora.r`); [] for a new run. Raises BadInputError when a change
    makes it another run and ``resume_overrides`` does not allow it."""
    recorded = _recorded(run_dir)
    if recorded is None:
        return []
    now = config.resolved()
    before, after = _flat(recorded), _flat(now)
    changed = [
        key
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key) and key != "resume_overrides"
    ]
    old = _effective(recorded, config.world_size)
    allowed = set(now.get("resume_overrides") or [])
    if (
        old is not None
        and old != config.effective_batch_size
        and "effective_batch_size" not in allowed
    ):
        raise BadInputError(_batch_refusal(old, recorded, config, run_dir))
    refused = [
        _refusal(key, before.get(key), after.get(key))
        for key in changed
        if _defining(key) is not None
        and _defining(key)[1] not in allowed
        and _in_effect(key, before) != _in_effect(key, after)
    ]
    if refused:
        raise BadInputError(
            f"resume: {run_dir} holds {held_run(run_dir)}; "
            + ("this change makes" if len(refused) == 1 else "these changes make")
            + " it another run:\n  "
            + "\n  ".join(refused)
        )
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in changed]


# setting (or its block) -> (what the saved state holds of it, the resume_overrides entry that
# allows the change, None where none can: the saved tensors or states were built from it)
_DEFINING: dict[str, tuple[str, str | None]] = {
    "model_name_or_path": ("the frozen base the adapter was trained on", None),
    "lora.r": ("the shapes of the adapter's saved tensors", None),
    "lora.target_modules": ("which layers the saved adapter tensors belong to", None),
    "lora.lora_alpha": ("the scale the saved adapter was trained with", None),
    "quantization": ("the base weights the adapter was trained on", None),
    "fp16": ("the dtype the frozen base loads in: the base the adapter was trained on", None),
    "bf16": ("the dtype the frozen base loads in: the base the adapter was trained on", None),
    "precision": ("the dtype the frozen base loads in: the base the adapter was trained on", None),
    "learning_rate": ("the optimizer's saved state (it would keep the old value)", None),
    "weight_decay": ("the optimizer's saved state (it would keep the old value)", None),
    "adam_beta1": ("the optimizer's saved state (it would keep the old value)", None),
    "adam_beta2": ("the optimizer's saved state (it would keep the old value)", None),
    "adam_epsilon": ("the optimizer's saved state (it would keep the old value)", None),
    "optim": ("the optimizer's saved state", None),
    "lr_scheduler_type": ("the schedule's saved state", None),
    "warmup_steps": ("the schedule's saved state", None),
    "warmup_ratio": ("the schedule's saved state", None),
    "seed": ("the data order and the random draws", "seed"),
    "shuffle": ("the data order", "shuffle"),
    "drop_last": ("the samples each epoch holds", "drop_last"),
    "train_file": ("the training data", "data"),
    "max_seq_length": ("the training data (its token windows)", "data"),
    "packing": ("the training data (its token windows)", "data"),
}


def _in_effect(key: str, values: dict[str, Any]) -> Any:
    """The value `key` has in the run: a pass-through key left out is the engine's default
    (shuffle, drop_last: true), and fp16, bf16 and precision are one setting, the precision."""
    if key in ("fp16", "bf16", "precision"):
        given = values.get("precision")
        if given is not None:
            return given
        return "fp16" if values.get("fp16") else "bf16" if values.get("bf16") else "fp32"
    if key in ("shuffle", "drop_last"):
        return True if values.get(key) is None else values.get(key)
    return values.get(key)


def _defining(key: str) -> tuple[str, str | None] | None:
    """What a change of `key` changes, and the override that allows it; None: the same run."""
    return _DEFINING.get(key) or _DEFINING.get(key.split(".", 1)[0])


def _refusal(key: str, old: Any, new: Any) -> str:
    what, override = _defining(key)
    fix = (
        f'or allow it on purpose with "resume_overrides": ["{override}"]'
        if override is not None
        else "or start a new output_dir"
    )
    return f"{key}: {old!r} -> {new!r} ({what}); set it back to {old!r}, {fix}"


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested blocks as dotted keys: {"lora": {"r": 8}} -> {"lora.r": 8}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


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


def held_run(run_dir: Path) -> str:
    """The run `run_dir` holds, in words, from its newest checkpoint's saved step: 'a finished
    run (step 8 of 8)', 'an interrupted run (step 22 of 400)', or 'a run' where that cannot be
    read. A finished run resumes too: at its last step, training nothing unless its length is
    raised."""
    checkpoints = run_dir / run_files.CHECKPOINTS
    try:
        name = (checkpoints / run_files.LATEST).read_text(encoding="utf-8").strip()
        state = checkpoints / name / "trainer_state.json"  # checkpoint.state.STATE_FILE
        saved = json.loads(state.read_text(encoding="utf-8"))
        step, last = int(saved["state"]["step"]), int(saved["state"]["max_steps"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return "a run"
    kind = "a finished run" if step >= last else "an interrupted run"
    return f"{kind} (step {step} of {last})"


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
        f"resume: {run_dir} holds {held_run(run_dir)} with an effective batch of {old} ({was}); "
        f"this config gives {config.effective_batch_size} ({now}), which makes it another run. "
        f"To go on with less memory keep the product at {old}: {keep}. To change the batch on "
        f'purpose, add "resume_overrides": ["effective_batch_size"] to the config, or use a '
        f"new output_dir."
    )


__all__ = ["held_run", "resume_changes"]
