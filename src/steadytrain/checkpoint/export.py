"""A committed checkpoint's trainable tensors into a rebuilt model: what exporting a mid-run
checkpoint as an adapter reads (`steadytrain export RUN_DIR --step N`; the fine-tune recipe
rebuilds the model and writes the adapter, recipes/checkpoint_export.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from steadytrain.checkpoint.state import MODEL_FILE, load_model_tensors
from steadytrain.checkpoint.store import MANIFEST, CheckpointStore
from steadytrain.errors import BadInputError
from steadytrain.run import files as run_files


def is_checkpoint_folder(path: Path) -> bool:
    """A committed checkpoint folder: RUN_DIR/checkpoints/step-NNNNNNNN with its manifest."""
    return (
        path.parent.name == run_files.CHECKPOINTS
        and path.name.startswith("step-")
        and (path / MANIFEST).is_file()
        and (path / MODEL_FILE).is_file()
    )


def checkpoint_folder(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step` in `run_dir` (the newest that verifies when None)."""
    store = CheckpointStore(run_dir)
    committed = dict(store.committed())
    if step is None:
        latest = store.latest()
        if latest is None and (Path(run_dir) / "adapter_config.json").is_file():
            up = [p for p in Path(run_dir).parents[:2] if (p / run_files.CHECKPOINTS).is_dir()]
            raise BadInputError(
                f"{run_dir}: is an exported adapter already (it holds adapter_config.json), not "
                "a run directory: give it to generate, merge or evaluate as it is; export takes "
                "the fine-tune's output_dir"
                + (f" (here: steadytrain export {up[0]})" if up else "")
            )
        if latest is None:
            raise BadInputError(f"{run_dir}: has no checkpoint yet; nothing to export")
        return latest[1]
    if step not in committed:
        have = ", ".join(str(s) for s in sorted(committed)) or "none"
        raise BadInputError(
            f"--step {step}: {run_dir / 'checkpoints'} holds no checkpoint of that step "
            f"(committed: {have}); save_total_limit keeps only the newest ones"
        )
    return committed[step]


def load_trained(model: torch.nn.Module, run_dir: Path, folder: Path) -> None:
    """The checkpoint in `folder`, verified against its manifest, into `model`'s trainable
    tensors (the model's frozen base is its own)."""
    payload = CheckpointStore(run_dir).load(folder)
    load_model_tensors(model, payload.tensors[MODEL_FILE])
