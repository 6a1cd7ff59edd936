"""torch's BatchNorm refusing a training batch of one value per channel (BatchNorm1d given one
sample of features), said in the run's terms: at micro-batch 1 after the out-of-memory ladder's
last halving (does not fit, exit 3), or on an optimizer batch of one sample, the epoch's last
when the dataset's length leaves one over (bad input, exit 2: drop_last is the fix)."""

from __future__ import annotations

ONE_SAMPLE_NORM = "Expected more than 1 value per channel when training"


def one_sample_norm_does_not_fit(exc: ValueError) -> str:
    return (
        "does not fit: micro-batch 2 ran out of memory, and micro-batch 1 cannot train this "
        "model: its BatchNorm layers need more than one value per channel in training "
        f"({exc}).\n"
        "  what helps: a step that needs less memory (shorter inputs, a smaller model), more "
        "memory for the run (memory_budget, closing other programs), or GroupNorm/LayerNorm in "
        "place of BatchNorm1d, which train on one sample."
    )


def one_sample_batch(exc: ValueError, step: int) -> str:
    return (
        f"train_data: the batch of step {step} holds 1 sample, and the model's BatchNorm layers "
        f"cannot train on one ({exc}): the epoch's last batch, where the dataset's length is "
        "one more than a multiple of effective_batch_size. Drop it: drop_last=True on the "
        "DataLoader (drop_last: true in the config for a dataset); a run directory with "
        "checkpoints then resumes with resume_overrides: ['drop_last']"
    )
