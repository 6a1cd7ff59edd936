"""Where steadytrain's own resume logic used to stop a run (issue 24, items 1, 3 and 7).

* A signal ends the program: after SIGINT / SIGTERM `fit()` commits a checkpoint and raises
  `steadytrain.Stopped` (130 / 143), so a script's lines after `fit()` do not run as if training
  had finished.
* A resume is never refused for being exact: the continuity probe computes what the resumed step
  computes, and a mismatch is recorded and shown, not a stop (unless `continuity_strict`).
* A damaged checkpoint is skipped with a reason, and the next older verified one is used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import events, finish, steps_logged, wait_for, workload_env

import steadytrain
from steadytrain import Callback, TrainConfig, Trainer

PLAIN_SCRIPT = """
import sys, torch
from steadytrain import TrainConfig, Trainer

run_dir, max_steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
config = TrainConfig(run_dir=run_dir, effective_batch_size=8, micro_batch_size=8, max_steps=max_steps,
                     save_every_steps=max_steps, device="cpu", progress="off", memory_watch=False)
loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), loss, data, config).fit()
torch.save(model.state_dict(), run_dir + "/final.pt")  # what a plain script does after fit()
"""


def test_sigterm_ends_a_plain_script_with_143_before_its_final_save(tmp_path: Path):
    """No `@entrypoint`, no check of the result: the line after `fit()` must not run."""
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(PLAIN_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=workload_env(),
    )
    wait_for(lambda: steps_logged(run_dir) >= 1, "a step")
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc)
    assert code == 143, err
    assert "Traceback" not in err
    assert not (run_dir / "final.pt").exists()  # not taken for a finished model
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().split("-")[1])
    assert stopped_at >= 1
    again = subprocess.run(
        [sys.executable, str(script), str(run_dir), str(stopped_at + 2)],
        capture_output=True,
        text=True,
        timeout=240,
        env=workload_env(),
    )
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[0]["step"] == stopped_at  # lost nothing
    assert (run_dir / "final.pt").exists()


class _SignalAt(Callback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_end(self, state, control, info):
        if state.step == self.step:
            os.kill(os.getpid(), self.signum)


def _tiny_fit(run_dir: Path, callbacks=(), max_steps: int = 6) -> steadytrain.FitResult:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=8, micro_batch_size=8, max_steps=max_steps,
        save_every_steps=max_steps, device="cpu", progress="off", memory_watch=False,
    )  # fmt: skip
    return Trainer(
        torch.nn.Linear(4, 2),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        data,
        config,
        callbacks=list(callbacks),
    ).fit()


def test_sigint_raises_stopped_with_130_that_a_program_can_catch(tmp_path: Path):
    with pytest.raises(steadytrain.Stopped) as stop:
        _tiny_fit(tmp_path, [_SignalAt(2, signal.SIGINT)])
    assert isinstance(stop.value, SystemExit) and stop.value.code == 130
    assert stop.value.signal == "SIGINT"
    result = stop.value.result
    assert (result.steps, result.exit_code) == (2, 130)
    assert result.checkpoint is not None and result.checkpoint.endswith("step-00000002")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    assert _tiny_fit(tmp_path).steps == 6  # and the next fit resumes
    assert events(tmp_path, "resume")[0]["step"] == 2
