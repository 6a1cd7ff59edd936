"""How a fit ends: its `FitResult`, the run already finished before it started, and a Ctrl-C
outside the training steps (nothing of a step to save)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.config import TrainConfig
from steadytrain.errors import SIGNAL_EXITS, Stopped
from steadytrain.events import TrainState


@dataclass(frozen=True)
class FitResult:
    """What `fit()` did. `exit_code` follows DESIGN.md (0 finished, 130/143 stopped by a signal:
    then `fit()` raises `steadytrain.Stopped` carrying this result)."""

    steps: int
    final_loss: float | None
    micro_batch_size: int
    reason: str
    exit_code: int
    run_dir: str
    checkpoint: str | None = None
    oom_count: int = 0


def fit_result(
    state: TrainState, reason: str, code: int, run_dir: Path, store: CheckpointStore
) -> FitResult:
    """The result of a fit that ended with `reason` and exit `code`, naming its newest
    committed checkpoint."""
    committed = store.committed()
    checkpoint = str(committed[-1][1]) if committed else None
    return FitResult(
        state.step,
        state.last_loss,
        state.micro_batch_size,
        reason,
        code,
        str(run_dir),
        checkpoint,
        state.oom_count,
    )


def already_finished(state: TrainState, store: CheckpointStore, run_dir: Path) -> FitResult:
    """A run whose checkpoint is already at max_steps: nothing to train, and it says so."""
    print(
        f"steadytrain: {run_dir} is already finished: its checkpoint {store.committed()[-1][1].name}"
        f" is at step {state.step} of {state.max_steps}; nothing to train (the model holds its "
        "weights). To train further, raise max_steps or epochs (the run resumes from there); to "
        "start over, use a new run_dir.",
        file=sys.stderr,
        flush=True,
    )
    return fit_result(state, "already finished", 0, run_dir, store)


def stopped_before_the_loop(run_dir: Path, cfg: TrainConfig) -> Stopped:
    """Ctrl-C while the loop's handler is not in place (the set-up, the resume, the plan's
    probes, compiling; or the end, after it): nothing of a step to save. It ends `fit()` as a
    Ctrl-C in the loop does, with `steadytrain.Stopped` (130), so a program's own
    `except KeyboardInterrupt` does not carry on as if training had finished; its result
    names the checkpoint the next start resumes from, if any."""
    committed: list[tuple[int, Path]] = []
    with contextlib.suppress(OSError):  # a folder it cannot read: said as a new start
        committed = CheckpointStore(run_dir).committed()
    step, folder = committed[-1] if committed else (0, None)
    print(
        f"\nsteadytrain: SIGINT outside the training steps: nothing new to save; the next "
        f"start begins at step {step}; exiting with {SIGNAL_EXITS['SIGINT']}",
        file=sys.stderr,
        flush=True,
    )
    size = cfg.micro_batch_size
    result = FitResult(
        step,
        None,
        size if isinstance(size, int) else 0,
        "stopped by SIGINT outside the training steps",
        SIGNAL_EXITS["SIGINT"],
        str(run_dir),
        folder and str(folder),
    )
    return Stopped("SIGINT", result, saved=False)
