"""Small things people type in their first hour (issue 19, point 7): `--version`, `-h`, a bare
`steadytrain`, help without type artefacts, doctor's own hint, the supervised child's pid, a
refused resume as a field-by-field diff with the exact override, a finished run said so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch

import steadytrain
from steadytrain import BadInputError, TrainConfig, Trainer

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["doctor", "config", "estimate", "plan", "finetune", "demo", "run", "report"]
COMMANDS += ["merge", "generate", "evaluate"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    return forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", *args],
        timeout=timeout,
        env={**env, "COLUMNS": "100"},
        cwd=ROOT,
    )


def test_version_and_short_help_and_a_bare_command_exit_0():
    version = cli("--version")
    assert (version.returncode, version.stdout) == (0, f"steadytrain {steadytrain.__version__}\n")
    short = cli("-h")
    assert short.returncode == 0 and "Usage: steadytrain [OPTIONS] COMMAND" in short.stdout
    bare = cli()
    assert bare.returncode == 0, bare.stderr
    assert "Usage: steadytrain [OPTIONS] COMMAND" in bare.stdout and "doctor" in bare.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_type_after_flags_nor_braces_around_arguments(command):
    result = cli(command, "-h")
    assert result.returncode == 0, result.stderr
    assert "<bool>" not in result.stdout
    usage = next(line for line in result.stdout.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage
    assert re.search(r"--help\s+-h\s+Show this message", result.stdout)


def test_doctor_does_not_send_you_to_doctor():
    result = cli("doctor", "--device", "cuda:99", "--json")
    assert result.returncode == 2
    assert "'cuda:99' is not usable" in result.stdout
    assert "steadytrain doctor" not in result.stdout


def test_run_prints_the_pid_of_each_attempt(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
    result = cli("run", "--", sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert f"steadytrain run: attempt 1 runs as pid {pid_file.read_text()}\n" in result.stderr


def fit(tmp_path, lr=0.003, max_steps=4, scheduler=None):
    torch.manual_seed(0)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(32)]
    model = torch.nn.Linear(4, 1)
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=8,
        max_steps=max_steps,
        save_every_steps=2,
        device="cpu",
        progress="off",
    )

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    optimizer = lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
    return Trainer(model, optimizer, loss_fn, data, config, scheduler=scheduler).fit()


def test_a_refused_resume_shows_the_changed_hyperparameter_and_the_exact_override(tmp_path):
    assert fit(tmp_path, max_steps=2).exit_code == 0
    with pytest.raises(BadInputError) as refused:
        fit(tmp_path, lr=0.001, max_steps=4)
    text = str(refused.value)
    assert "\n  optimizer: lr: 0.003 -> 0.001\n" in text
    assert "{'lr'" not in text  # no whole optimizer dicts
    assert text.endswith("in the config: resume_overrides: ['optimizer']")


def test_a_finished_run_says_so_and_trains_nothing(tmp_path, capfd):
    first = fit(tmp_path)
    assert (first.exit_code, first.steps) == (0, 4)
    capfd.readouterr()
    again = fit(tmp_path)
    assert (again.exit_code, again.steps, again.reason) == (0, 4, "already finished")
    err = capfd.readouterr().err
    assert "is already finished: its checkpoint step-00000004 is at step 4 of 4" in err
    assert "raise max_steps or epochs" in err
    assert "finished at step" not in err and "in 0.0s" not in err
