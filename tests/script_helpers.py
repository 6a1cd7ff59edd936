"""What several test files write the way a user's script does: a tiny regression dataset with
its loss, and a fit run as an `@steadytrain.entrypoint` script runs it."""

from __future__ import annotations

import pytest
import torch


class Data(torch.utils.data.Dataset):
    """16 samples: x = (i, i, i, i), y = the sum of x."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        return x, x.sum(0, keepdim=True)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def exit_as_script(capsys, trainer) -> tuple[int, str]:
    """`trainer()`'s fit in an `@steadytrain.entrypoint` main, as a ported script runs it: the
    exit code and what it printed on stderr."""
    import steadytrain

    @steadytrain.entrypoint
    def main():
        return trainer().fit()

    with pytest.raises(SystemExit) as stopped:
        main()
    return stopped.value.code, capsys.readouterr().err
