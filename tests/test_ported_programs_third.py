"""A third set of programs ported from their docs alone (README.md, docs/porting.md), over
datasets of shapes the fixtures never had: torch's Subset and ConcatDataset of samples that
are NumPy arrays beside Python floats, a mapping of columns given as the dataset, an empty
one. Each trains and resumes to the uninterrupted run's numbers, or is refused with the
documented exit code and a message naming what to change, never a traceback."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from script_helpers import exit_as_script, killed_under_run_and_through
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset

from steadytrain import TrainConfig, Trainer


def config(run_dir, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 8,
            "micro_batch_size": 8,
            "max_steps": 2,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


def regression() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def fit(run_dir, data, **given):
    def trainer():
        model = torch.nn.Linear(4, 1)
        sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
        return Trainer(model, sgd, mse, data, config(run_dir, **given))

    return trainer


def test_the_siamese_network_over_a_concat_of_subsets_killed_under_run_ends_as_run_through(
    tmp_path,
):
    """pytorch/examples `siamese_network` (pairs of images, BCE, Adadelta, StepLR per epoch)
    over a ConcatDataset of two Subsets whose samples are NumPy arrays and a Python float,
    shuffled by its DataLoader: SIGKILLed after step 7 under `steadytrain run`, it resumes from
    step 6 and ends with the uninterrupted run's weights, bit for bit."""
    want, got, resumed = killed_under_run_and_through("ported_siamese.py", tmp_path, kill_after=7)
    assert resumed == [6]
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subset_with_indices_outside_its_dataset_exits_5_naming_the_index_and_the_fix(
    tmp_path, capsys, workers
):
    """torch's own Subset and TensorDataset raise the IndexError, with no frame of the user's
    code in it. Before, the run stopped with exit 1 and steadytrain's traceback, as if the
    error were its own; from loader workers too."""
    data = Subset(regression(), [0, 1, 2, 3, 4, 5, 6, 100])
    code, err = exit_as_script(capsys, fit(tmp_path, data, shuffle=False, num_workers=workers))
    assert code == 5, err
    assert "Traceback" not in err
    assert "error in your code (the dataset, Subset[7]) at step 1: Subset[7] raised" in err
    assert "stopped at step 1 by an error in your code (the dataset, Subset[7]) (exit 5" in err
    assert "(None)" not in err
    assert "not readable by those indices (Subset[7] raised IndexError: index 100" in err
    assert "index 100 is out of bounds for dimension 0 with size 32" in err
    assert "every index below len() must give a sample" in err
    assert "a Subset's indices must lie inside its dataset" in err


def test_the_error_a_library_dataset_raises_is_still_caught_as_its_own_type(tmp_path):
    """Code around fit() that catches IndexError still catches the dataset's."""
    data = ConcatDataset([Subset(regression(), [0, 1, 2, 3]), Subset(regression(), [4, 5, 6, 99])])
    with pytest.raises(IndexError, match=r"ConcatDataset\[7\] raised IndexError"):
        fit(tmp_path, data, shuffle=False)().fit()


@pytest.mark.parametrize("kind", [dict, UserDict])
def test_a_mapping_of_columns_given_as_the_dataset_exits_2_naming_its_columns(
    tmp_path, capsys, kind
):
    """`{"x": x, "y": y}` (or a tokenizer's output, a dict of lists) has len() 2, its columns.
    Before, it was taken as 2 samples: refused as fewer than one batch, or, with a batch of 2,
    a KeyError traceback at the first step."""
    x, y = regression().tensors
    for batch in (8, 2):
        given = {"effective_batch_size": batch, "micro_batch_size": batch}
        code, err = exit_as_script(capsys, fit(tmp_path, kind(x=x, y=y), **given))
        assert code == 2, err
        assert "Traceback" not in err
        assert (
            "train_data: a mapping of columns ('x': 32 rows, 'y': 32 rows), whose len() 2 "
            "counts its columns, not samples" in err
        )
        assert "TensorDataset(x, y)" in err


@pytest.mark.parametrize(
    "empty", [lambda: Subset(regression(), []), lambda: DataLoader(Subset(regression(), []))]
)
def test_an_empty_dataset_exits_2_naming_it_and_where_to_look(tmp_path, capsys, empty):
    code, err = exit_as_script(capsys, fit(tmp_path, empty()))
    assert code == 2, err
    assert "Traceback" not in err
    assert "train_data: the dataset is empty (len() 0)" in err
    assert "a filter or Subset that kept no sample" in err


def test_dcgan_s_two_optimizers_from_an_optimizer_function_exit_2_naming_several_optimizers(
    tmp_path, capsys
):
    """pytorch/examples `dcgan` builds optimizerD and optimizerG; a port that returns both from
    the optimizer function gets the message for several optimizers, as when it passes the
    pair itself. Before: 'the function returned list', with no way out named."""
    netG, netD = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"G": netG, "D": netD})

    def both(params):
        return [
            torch.optim.Adam(netD.parameters(), 2e-4),
            torch.optim.Adam(netG.parameters(), 2e-4),
        ]

    data = TensorDataset(torch.randn(16, 4))

    def trainer():
        return Trainer(model, both, lambda m, b: m["D"](b[0]).mean(), data, config(tmp_path))

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err
    assert "optimizer: 2 optimizers given; steadytrain takes one optimizer step per batch" in err
    assert "docs/porting.md, 'Several optimizers'" in err
