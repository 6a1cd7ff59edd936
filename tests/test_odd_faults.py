"""Faults planted where a careless writer would not look: the run directory's own files damaged
or replaced between two starts (a folder where a file belongs, a file where a folder belongs),
then what a user runs next (`fit()` again, `steadytrain report`). Each ends in the documented
exit code and one message naming the path and the fix, no traceback, and what the run had
already written (its checkpoints) kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from steadytrain import TrainConfig, Trainer, run_files
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.cli import main as cli_main
from steadytrain.errors import BadInputError

BAD_INPUT = 2


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        return x, x.sum(0, keepdim=True)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def fit(run_dir: Path, max_steps: int):
    torch.manual_seed(0)
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=4,
        micro_batch_size=4,
        max_steps=max_steps,
        save_every_steps=2,
        device="cpu",
        log_every_steps=100,
    )
    model = torch.nn.Linear(4, 1)
    return Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn, Data(), config).fit()


def cli(capsys, *args: str) -> tuple[int, str]:
    """`steadytrain ARGS` in this process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of 2 steps with its checkpoint at step 2; each test damages a copy of it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    fit(run_dir, max_steps=2)
    return run_dir


def copy_of(finished_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, symlinks=True)
    return run_dir


@pytest.mark.parametrize("name", [run_files.EVENTS, run_files.METRICS, run_files.HEARTBEAT])
def test_a_folder_where_a_run_file_belongs_is_exit_2_naming_it(
    finished_run, tmp_path, capsys, name
):
    """events.jsonl, metrics.jsonl or the heartbeat replaced by a folder between two starts: the
    next fit() stops with exit 2 naming that path and the fix (not an IsADirectoryError, exit 1
    as a bug), and the checkpoint is kept; `steadytrain report` says the same without a
    traceback."""
    run_dir = copy_of(finished_run, tmp_path)
    target = run_dir / name
    target.unlink(missing_ok=True)
    target.mkdir()
    (target / "inside").write_bytes(b"kept")

    with pytest.raises(BadInputError) as info:
        fit(run_dir, max_steps=4)
    assert info.value.exit_code == BAD_INPUT
    assert f"{target} is a folder" in str(info.value) and "move the folder away" in str(info.value)
    assert (target / "inside").read_bytes() == b"kept"
    found = CheckpointStore(run_dir).latest()
    assert found is not None and found[0] >= 2  # metrics.jsonl is first written at the end

    if name != run_files.HEARTBEAT:  # the report reads the two JSON-lines files
        code, err = cli(capsys, "report", str(run_dir))
        assert code == BAD_INPUT, err
        assert f"{target} is a folder" in err and "Traceback" not in err


def test_a_file_where_the_checkpoints_folder_belongs_is_exit_2_naming_it(finished_run, tmp_path):
    """checkpoints/ replaced by a plain file: the next fit() stops with exit 2 naming it and the
    fix, not a NotADirectoryError (exit 1 as a bug); the file keeps its bytes."""
    run_dir = copy_of(finished_run, tmp_path)
    checkpoints = run_dir / run_files.CHECKPOINTS
    shutil.rmtree(checkpoints)
    checkpoints.write_bytes(b"not a folder")

    with pytest.raises(BadInputError) as info:
        fit(run_dir, max_steps=4)
    assert info.value.exit_code == BAD_INPUT
    assert f"{checkpoints} is not a folder" in str(info.value)
    assert "move it away" in str(info.value)
    assert checkpoints.read_bytes() == b"not a folder"
