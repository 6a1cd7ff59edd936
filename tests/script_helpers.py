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


def killed_under_run_and_through(workload: str, tmp_path, kill_after: int) -> tuple:
    """tests/workloads/`workload` run through uninterrupted, and again under `steadytrain run`
    SIGKILLed after step `kill_after` (its marker file says it was): (the first run's
    final.pt, the second's, the steps the second resumed from)."""
    import sys

    import forkserver
    from conftest import WORKLOADS, run_workload

    from steadytrain.telemetry.files import read_jsonl

    through, killed, marker = tmp_path / "through", tmp_path / "killed", tmp_path / "marker"
    proc = run_workload(workload, str(through))
    assert proc.returncode == 0, proc.stderr[-3000:]
    supervised = forkserver.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(killed)),
            *("--backoff-initial", "0.01", "--backoff-max", "0.05", "--"),
            *(sys.executable, str(WORKLOADS / workload), str(killed), str(kill_after), str(marker)),
        ],
        timeout=300,
    )
    assert supervised.returncode == 0, supervised.stderr[-3000:]
    assert marker.exists()  # it was killed
    resumed = [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["event"] == "resume"]
    want = torch.load(through / "final.pt", weights_only=True)
    return want, torch.load(killed / "final.pt", weights_only=True), resumed
