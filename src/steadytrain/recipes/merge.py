"""`steadytrain merge`: fold a LoRA adapter into its base and write a model folder that
`transformers` loads alone (no peft, no base folder needed).

The merged folder is written the way checkpoints are: into a staging folder next to the target,
every file fsynced, then renamed into place, so an interrupted merge leaves either no folder or
a complete one, never a half-written model that loads and gives wrong answers. An existing
non-empty target is replaced only with ``force``, and only after the new one is complete.
"""

from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain.errors import BadInputError, RunDiskFullError, free_space
from steadytrain.recipes.artifact import (
    disk_full_in_save,
    dtype_name,
    load_config,
    load_model,
    load_tokenizer,
    parse_dtype,
    quantization_of,
    quiet_transformers,
    remove_leftovers,
    resolve_artifact,
    saved_dtype,
)
from steadytrain.recipes.options import MergeOptions
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, replace_dir, sync_tree


@dataclass(frozen=True)
class MergeResult:
    out_dir: Path
    adapter: Path
    base: str
    dtype: torch.dtype
    files: tuple[str, ...]
    bytes: int

    def summary(self) -> str:
        size = self.bytes / 2**20
        return (
            f"merged adapter {self.adapter} into base {self.base} ({dtype_name(self.dtype)})\n"
            f"wrote {self.out_dir} ({len(self.files)} files, {size:,.1f} MiB); load it with "
            f"AutoModelForCausalLM.from_pretrained({str(self.out_dir)!r})"
        )


def merge(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str | None = None,
    dtype: str | None = None,
    force: bool = False,
) -> MergeResult:
    """Load the base (in `dtype`: fp32, bf16, fp16; default the dtype it was saved in), apply
    the adapter, merge it into the weights and save model and tokenizer to `out_dir`.

    The merge runs on CPU: it needs the whole base once, with no activations, and CPU memory is
    the largest pool on every machine steadytrain targets. A quantized base is refused: its
    weights would be dequantized, merged and requantized, each step losing precision, so the
    merged model would not be the one you evaluated."""
    artifact = resolve_artifact(adapter_dir, base, what="ADAPTER")
    if not artifact.is_adapter:
        raise BadInputError(
            f"ADAPTER: {artifact.path} is a complete model (config.json, no adapter_config.json); "
            "there is nothing to merge. Give the fine-tune's final/ folder or its run directory"
        )
    out = Path(out_dir).expanduser()
    _check_out_dir(out, artifact.path, artifact.base, force)
    requested = parse_dtype(dtype)
    config = load_config(artifact)
    quantized = quantization_of(config)
    if quantized is not None:
        raise BadInputError(
            f"base model: {artifact.base} is stored quantized ({quantized}); merging into "
            "quantized weights is lossy. Merge into the full-precision base instead: pass "
            "--base with the original bf16/fp32 model folder (a QLoRA adapter merges into it "
            "directly), and quantize the merged model afterwards if you need to"
        )
    load_as = requested or saved_dtype(config) or torch.float32
    model = load_model(artifact, load_as)
    merged = model.merge_and_unload()
    tokenizer = load_tokenizer(artifact)

    remove_leftovers(out)  # of a merge killed mid-way: a whole model each
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _save(merged, tokenizer, staging)
        files = tuple(sorted(p.name for p in staging.iterdir()))
        size = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
        replace_dir(staging, out)
    except BaseException as exc:
        full = _disk_full(exc, merged, staging, out)
        if full is not None:
            raise full from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return MergeResult(out, artifact.path, str(artifact.base), load_as, files, size)


def _disk_full(exc: BaseException, model: Any, staging: Path, out: Path) -> Exception | None:
    """Exit 6 naming the file being written and the space left (while the partial merge still
    takes its room), when `exc` says the disk filled up; nothing is left at --out of it."""
    found = disk_full_in_save(exc, model, staging, out)
    if found is None:
        return None
    error, path = found
    free = free_space(out.parent)
    kept = " (the folder there before is kept)" if os.path.lexists(out) else ""
    return RunDiskFullError(
        path,
        error,
        detail=f"disk full: could not write {path} ({error.strerror})"
        + (f"; {free} free on that filesystem" if free else "")
        + f". Nothing of this merge is left at {out}{kept}.\nFree some space, or merge onto "
        "another disk: steadytrain merge ADAPTER --out DIR",
    )


def _check_out_dir(out: Path, adapter: Path, base: str | None, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out: {out} is a file; give a folder path for the merged model")
    resolved = out.resolve()
    inputs = [adapter.resolve()]
    if base is not None and Path(base).exists():
        inputs.append(Path(base).resolve())
    for source in inputs:
        if resolved == source or resolved in source.parents:
            raise BadInputError(
                f"--out: {out} is or contains the input {source}; writing there would replace "
                "the model being merged. Choose another folder"
            )
    if out.is_dir() and not _empty(out) and not force:
        raise BadInputError(
            f"--out: {out} exists and is not empty; choose another folder or pass --force to "
            "replace it (the old folder is removed only after the new one is complete)"
        )
    if not out.parent.exists():
        raise BadInputError(f"--out: the parent folder {out.parent} does not exist; create it")


def _empty(folder: Path) -> bool:
    """Nothing in `folder` but what the OS leaves in a folder it showed (`.DS_Store`)."""
    return all(run_files.is_os_clutter(p.name) for p in folder.iterdir())


def _save(model: Any, tokenizer: Any, folder: Path) -> None:
    make_folder(folder, root=folder.parent)  # --out's staging folder, never through a link
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4; 5 writes safetensors only
    with quiet_transformers():
        model.save_pretrained(folder, **kwargs)
        tokenizer.save_pretrained(folder)
    sync_tree(folder)


def merge_command(*args: Any, console: Any = None, **options: Any) -> int:
    """`steadytrain merge`: merge, print what was written; exit 0 (errors raise, exit 2). The
    arguments and options are `MergeOptions`' (ADAPTER may be positional)."""
    from rich.console import Console

    o = MergeOptions(*args, **options)
    console = console or Console()
    result = merge(o.adapter, o.out, base=o.base, dtype=o.dtype, force=o.force)
    console.print(result.summary(), markup=False, highlight=False, soft_wrap=True)
    return 0


__all__ = ["MergeResult", "merge", "merge_command"]
