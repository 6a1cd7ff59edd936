"""A newcomer's first mistakes, made from README.md and docs/ alone, and errors steadytrain
raises inside DataLoader worker processes: each ends in one message naming what was found and
the fix, with the exit code README's "Exit codes" gives, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from script_helpers import exit_as_script
from torch.utils.data import DataLoader, Dataset

from steadytrain import TrainConfig, Trainer
from steadytrain.errors import ConfigError, DiskFullError


def config(run_dir: Path, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 3,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


# -- a steadytrain error raised in a DataLoader worker ------------------------------------------


class CheckedRecords(Dataset):
    """A dataset that checks each record as it loads it and says what is wrong with a
    steadytrain error, as a program built on steadytrain's own checks does."""

    def __init__(self, error: Exception):
        self.error = error

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            raise self.error
        x = torch.full((4,), float(i))
        return x, x.sum(0, keepdim=True)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


WORKER_ERRORS = {
    "config": (ConfigError(["records[9].text: missing; give each record a text field"]), 2),
    # a constructor of more than one argument: torch could not build it again and raised a
    # RuntimeError carrying the worker's traceback (exit 1)
    "disk": (DiskFullError("disk full: could not write cache/9.pt", Path("cache"), 10, 0), 2),
}


@pytest.mark.parametrize("kind", sorted(WORKER_ERRORS))
def test_a_steadytrain_error_in_a_loader_worker_prints_its_own_message(tmp_path, capsys, kind):
    """torch raises a worker's exception again in the training process as its class built from
    "Caught X in DataLoader worker process N. Original Traceback ...": a ConfigError came out as
    one 'problem' per character of that text, a DiskFullError as a RuntimeError with a
    traceback (exit 1). Each prints what num_workers=0 prints, with the same exit code."""
    error, code = WORKER_ERRORS[kind]
    said = {}
    for workers in (0, 2):

        def trainer(workers=workers):
            torch.manual_seed(0)
            loader = DataLoader(CheckedRecords(error), batch_size=4, num_workers=workers)
            optimizer = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
            run = config(tmp_path / f"w{workers}", num_workers=workers)
            return Trainer(torch.nn.Linear(4, 1), optimizer, _loss, loader, run)

        said[workers] = exit_as_script(capsys, trainer)
    assert said[2][0] == said[0][0] == code, said
    err = said[2][1]
    assert "Traceback" not in err and "Caught" not in err and "worker process" not in err, err
    assert f"error: {error}" in err, err
    assert err.split("error: ", 1)[1] == said[0][1].split("error: ", 1)[1]
