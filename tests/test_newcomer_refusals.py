"""A newcomer's last refusals (issue 42), made from README.md and docs/ alone: each ends in the
exit code README's "Exit codes" gives and one message naming what was found and the fix, in a
script with `@steadytrain.entrypoint` and in a plain one without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from script_helpers import Data, exit_as_script, loss_fn

from steadytrain import TrainConfig, Trainer

SRC = Path(__import__("steadytrain").__file__).resolve().parents[1]


def config(run_dir: Path, **given) -> TrainConfig:
    return TrainConfig(
        **{
            "run_dir": str(run_dir),
            "effective_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 2,
            "seed": 0,
            "device": "cpu",
            "progress": "off",
            "memory_watch": False,
            **given,
        }
    )


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_model_built_on_the_meta_device_is_refused_naming_its_parameters(tmp_path, capsys):
    """`with torch.device("meta"): model = Net()` builds shapes without values: the run
    stopped with exit 1 and torch's "Cannot copy out of meta tensor" from deep in the device
    placement; refused when the Trainer is built now (exit 2), naming the parameters and the
    fix (`to_empty`, then load the weights)."""
    with torch.device("meta"):
        model = TwoLayers()

    def trainer():
        return Trainer(
            model=model,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=loss_fn,
            train_data=Data(),
            config=config(tmp_path / "run"),
        )

    code, err = exit_as_script(capsys, trainer)
    assert code == 2, err
    assert "Traceback" not in err, err
    said = " ".join(err.split())
    assert "on the meta device (a.weight, a.bias, b.weight, b.bias)" in said, err
    assert "model.to_empty(device=" in said and "load_state_dict" in said, err
    assert not (tmp_path / "run").exists()


PLAIN_SCRIPT = """
import sys

import steadytrain

if sys.argv[1] == "config":  # README's TrainConfig with a field misspelt
    steadytrain.TrainConfig(run_dir="runs/x", effective_batch_sise=64)
elif sys.argv[1] == "model_class":  # the model's class given for the model
    import torch

    steadytrain.Trainer(
        model=torch.nn.Linear,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: model(batch).sum(),
        train_data=[torch.zeros(4)] * 4,
        config=steadytrain.TrainConfig(run_dir=sys.argv[2], effective_batch_size=4),
    ).fit()
else:  # an error of the script's own, not a refusal of steadytrain's
    raise ValueError("the script's own bug")
print("after the error")
"""


@pytest.mark.parametrize(
    ("case", "code", "said"),
    [
        ("config", 2, "effective_batch_sise"),
        ("model_class", 5, "model is the class Linear, not a model"),
        ("own", 1, "ValueError: the script's own bug"),
    ],
)
def test_a_plain_script_without_the_decorator_exits_with_the_documented_code(
    tmp_path, case, code, said
):
    """docs/porting.md promises exit 2 for a bad config and exit 5 for the model's class; a
    script without `@steadytrain.entrypoint` (porting.md never showed it) got a traceback and
    exit 1. Now the refusal prints its one message and exits with its code in a plain script
    too, run as a real `python train.py`; an error of the script's own keeps its traceback and
    exit 1."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PLAIN_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), case, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    assert said in done.stderr, done.stderr
    assert "after the error" not in done.stdout
    if code == 1:
        assert "Traceback" in done.stderr
    else:
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("error: "), done.stderr
