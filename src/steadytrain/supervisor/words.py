"""The supervisor's console words: how a child's end is named in the restart line, counts and
seconds as the lines print them, the memory savers' names (`steadytrain.run.savers`'), and the
advice of its last word when a run does not fit (or does not even load)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from steadytrain.run import files as run_files
from steadytrain.run.savers import saver_words
from steadytrain.supervisor.child_exit import HANG, ChildExit
from steadytrain.supervisor.start_kill import run_json

GENERAL_ADVICE = (
    "shorter sequences, 16-bit weights (precision: bf16, or a fine-tune's bf16: true), a smaller "
    "model or LoRA rank, closing other programs that hold memory, or a machine with more memory; "
    "`steadytrain estimate` gives the peak of each"
)

START_ADVICE = (
    "close other programs that hold memory; load the weights in 16 bits (bf16 or fp16: "
    "from_pretrained(..., torch_dtype=torch.bfloat16), a fine-tune's bf16: true): fp32 weights take 4 bytes a parameter, so a 3B model needs "
    "12 GiB to load, 6 GiB in bf16; a 4-bit base on CUDA (a fine-tune's "
    "quantization.load_in_4bit: true, 1.5 GiB for 3B); or a smaller model; `steadytrain "
    "estimate` gives the peak of each"
)
"""What would let a model load that the OS killed while the run started: its weights are
the first large allocation, before any saver can act."""


def saver_name(name: str) -> str:
    """A memory saver as the registry (`steadytrain.run.savers`) words it."""
    return saver_words(name)


def short(death: ChildExit) -> str:
    if death.killed_by is not None:
        return f"{death.killed_by.name} (exit {death.returncode})"
    if death.returncode == HANG:
        return "a hang (exit 75)"
    return f"exit {death.returncode}"


def restarts(n: int) -> str:
    return f"{n} restart{'' if n == 1 else 's'}"


def seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def fit_advice(advice: Callable | None, run_dir: Path | None, in_force: list[str]) -> str:
    """What would make a killed run fit: `advice` (SupervisorOptions.advice: from the command
    line, the fine-tune advisor, each config key and value with the total it gives) on the run
    directory; for any other program, or where its model cannot be read, the general list."""
    if run_dir is None or advice is None:
        return GENERAL_ADVICE
    try:
        found = advice(run_dir, list(in_force))
    except Exception:  # noqa: BLE001 - advice must never stop the supervisor's last word
        return GENERAL_ADVICE
    return "; ".join(found) if found else GENERAL_ADVICE


def group_advice(run_dir: Path | None, world_size: int) -> str:
    """What would make a torchrun group's run fit, in GPUs: the run's `distributed` setting as
    its config.json says it (written by rank 0 before the first step); sharded, more GPUs
    share the model's state; replicated, every rank holds all of it, so shard it first."""
    config = run_json(run_dir / run_files.CONFIG) if run_dir is not None else None
    setting = (config or {}).get("distributed")
    more = (
        f"more GPUs with distributed: fsdp (this run had {world_size}; the parameters, "
        f"gradients and optimizer state are sharded over them, so {2 * world_size} GPUs hold "
        "half as much of them each)"
    )
    if setting == "fsdp":
        return more
    instead = (
        f"distributed: fsdp instead of ddp (each of the {world_size} ranks now holds the whole "
        "model, its gradients and optimizer state; fsdp shards them over the ranks)"
    )
    if setting in ("ddp", "replicate"):
        return f"{instead}, then {more}"
    return f"{instead}; or {more}"


def start_advice(advice: Callable | None, run_dir: Path | None, in_force: list[str]) -> str:
    """What would make a run the OS killed while it started load: the fixes for the weights'
    size, then `advice` on the run's own config where it can say more (a fine-tune's config,
    written by an attempt that got that far)."""
    found = fit_advice(advice, run_dir, in_force)
    return START_ADVICE if found == GENERAL_ADVICE else f"{START_ADVICE}; for this config: {found}"
