"""Where the command `steadytrain run` supervises writes its run: read from the command line
before it starts, so progress and restarts are counted in the right folder without --run-dir.

A fine-tune (``steadytrain finetune --config FILE [--set k=v]`` or ``python -m
steadytrain.recipes.finetune ...``) writes to its config's ``output_dir``. Any other command using
``Trainer`` announces its ``run_dir`` to the supervisor when `fit()` starts
(`steadytrain.run.files.ENV_ANNOUNCE_FD`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from steadytrain.errors import SteadytrainError

_FINETUNE = ("finetune", "steadytrain.recipes.finetune")


def finetune_run_dir(command: Sequence[str]) -> Path | None:
    """The ``output_dir`` of a fine-tune command, with its ``--set`` overrides; None for another
    command, or a config that cannot be read (the child will say what is wrong with it)."""
    args = list(command)
    starts = [i for i, arg in enumerate(args) if arg in _FINETUNE]
    if not starts:
        return None
    config, overrides = _options(args[starts[0] + 1 :])
    if config is None:
        return None
    from steadytrain.recipes.finetune_config import FinetuneConfig

    try:
        return Path(FinetuneConfig.load(config, overrides).output_dir)
    except SteadytrainError:
        return None


def _options(args: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        if arg == "--config":
            config = value
        elif arg.startswith("--config="):
            config = arg.partition("=")[2]
        elif arg == "--set" and value is not None:
            overrides.append(value)
        elif arg.startswith("--set="):
            overrides.append(arg.partition("=")[2])
    return config, overrides


__all__ = ["finetune_run_dir"]
