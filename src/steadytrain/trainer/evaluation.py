"""The run's evaluation set up from the config, `eval_data` and `eval_fn`: settings that need
evaluation data refused without it, and the loop's `Evaluation` at the config's cadence."""

from __future__ import annotations

from typing import Any

from steadytrain.config import TrainConfig
from steadytrain.engine import StepRunner
from steadytrain.engine.evaluation import EvalFn, Evaluation, takes_metric
from steadytrain.errors import BadInputError
from steadytrain.trainer.data import DataSource, eval_batches


def check_evaluation(
    cfg: TrainConfig, scheduler: Any, eval_data: DataSource | None, eval_fn: EvalFn | None
) -> None:
    """Evaluation settings without evaluation data, and a metric-driven scheduler without
    evaluation, are refused before training, naming the field."""
    wanted = [f for f in ("eval_every_steps", "eval_every_epochs", "keep_best") if getattr(cfg, f)]
    if eval_data is None and (wanted or eval_fn is not None):
        raise BadInputError(
            f"eval_data: {', '.join(wanted) or 'eval_fn'} given, but no evaluation data; "
            "pass Trainer(eval_data=...) or remove the evaluation settings"
        )
    if takes_metric(scheduler) and eval_data is None:
        raise BadInputError(
            f"scheduler: {type(scheduler).__name__}.step() needs a metric; give "
            "Trainer(eval_data=...) so that each evaluation steps it with eval_metric "
            f"({cfg.eval_metric!r}), evaluating every epoch unless eval_every_steps or "
            "eval_every_epochs says otherwise"
        )


def make_evaluation(
    cfg: TrainConfig,
    runner: StepRunner,
    scheduler: Any,
    source: DataSource | None,
    eval_fn: EvalFn,
) -> Evaluation | None:
    """The loop's evaluation (None without eval_data): each epoch (and after the last step)
    unless a cadence is set."""
    if source is None:
        return None
    every_epochs = cfg.eval_every_epochs
    default = every_epochs is None and cfg.eval_every_steps is None
    if default:  # each epoch's end, and the end of a run that max_steps ends mid-epoch
        every_epochs = 1
    loader_batch = source.loader.batch_size if source.loader is not None else None
    batch = cfg.eval_batch or loader_batch or cfg.effective_batch_size
    return Evaluation(
        runner=runner,
        batches=lambda index: eval_batches(source, batch, index),
        eval_fn=eval_fn,
        every_steps=cfg.eval_every_steps,
        every_epochs=every_epochs,
        scheduler=scheduler if takes_metric(scheduler) else None,
        metric=cfg.eval_metric,
        mode=cfg.eval_mode,
        at_end=default,
        needs_metric=cfg.keep_best,
    )
