"""A mid-run checkpoint of a fine-tune as a peft adapter folder (`steadytrain export RUN_DIR
--step N`), so the adapter of step 750 can be tried before the run ends.

A checkpoint holds what training changed (the adapter's tensors, the optimizer, the RNG), in the
engine's format; peft reads ``adapter_config.json`` and ``adapter_model.safetensors``. The export
rebuilds the run's model exactly as the fine-tune did (its ``training_config.json``, written into
the run directory when training starts), loads the verified checkpoint into it and saves the
adapter the way ``final/`` is saved, atomically, under ``RUN_DIR/adapters/step-NNNNNNNN/``.
`merge`, `generate` and `evaluate` given a checkpoint folder export it this way first. Finding
and reading the checkpoint is the checkpoint package's (checkpoint/export.py); rebuilding the
fine-tune's model and writing the adapter is this recipe's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from steadytrain.checkpoint.export import checkpoint_folder, is_checkpoint_folder, load_trained
from steadytrain.errors import BadInputError
from steadytrain.recipes.finetune import TRAINING_CONFIG, export_adapter
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.run import files as run_files

ADAPTERS = run_files.ADAPTERS


def export_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """Write RUN_DIR/adapters/step-NNNNNNNN/ (peft adapter, tokenizer, training_config.json)
    from the checkpoint of `step` and return it; an existing export is reused."""
    run_dir = Path(run_dir).expanduser()
    if run_dir.is_file():
        raise BadInputError(
            f"RUN_DIR: {run_dir} is a file; give the fine-tune's output_dir, the folder that "
            f"holds checkpoints/ ({run_dir.parent}, if this file is in it)"
        )
    if not run_dir.is_dir():
        raise BadInputError(f"RUN_DIR: {run_dir} does not exist or is not a folder")
    folder = checkpoint_folder(run_dir, step)
    target = run_dir / ADAPTERS / folder.name
    if (target / "adapter_config.json").is_file():
        return target
    config = _training_config(run_dir)
    model, tokenizer = _rebuild(config)
    load_trained(model, run_dir, folder)  # verified against its manifest
    return export_adapter(model, tokenizer, config, target, root=run_dir)


def export_checkpoint_folder(folder: Path) -> Path:
    """`export_checkpoint` for a checkpoint folder given by its path."""
    return export_checkpoint(folder.parent.parent, int(folder.name.removeprefix("step-")))


def _training_config(run_dir: Path) -> FinetuneConfig:
    path = run_dir / TRAINING_CONFIG
    if not path.is_file():
        raise BadInputError(
            f"{path}: not found, so this is not a fine-tune's run directory (or it was written "
            "by a steadytrain before 0.x that did not record its config); a run of your own "
            "Trainer has no adapter to export"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path}: cannot be read as JSON ({exc})") from None
    return FinetuneConfig.from_dict(data, source=str(path))


def _rebuild(config: FinetuneConfig) -> tuple[torch.nn.Module, object]:
    """The base (fp32, on the CPU: only the adapter is saved) with the run's adapter added."""
    from steadytrain.device import resolve_device
    from steadytrain.recipes.model import (
        add_lora,
        load_base_model,
        load_tokenizer,
        plan_base_load,
        resolve_model_path,
    )

    cpu = config.model_copy(
        update={"quantization": config.quantization.model_copy(update={"load_in_4bit": False})}
    )
    device = resolve_device("cpu")
    model_path = resolve_model_path(cpu.model_name_or_path)
    base = load_base_model(cpu, model_path, plan_base_load(cpu, "cpu", "fp32"), device)
    return add_lora(base, cpu), load_tokenizer(model_path)


__all__ = ["ADAPTERS", "export_checkpoint", "export_checkpoint_folder", "is_checkpoint_folder"]
