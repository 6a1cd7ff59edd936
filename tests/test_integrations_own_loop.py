"""A loop of the user's own with `RunGuard`: an out-of-memory exits 76 and `steadytrain run`
restarts it with half the micro-batch, a blocked step exits 75 and is restarted, SIGTERM saves
and exits 143 and the next start resumes to the uninterrupted run's parameters. Also: the
integrations import without the libraries they serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from integration_helpers import (
    assert_same_params,
    events,
    finish,
    report,
    run_plain,
    start_plain,
    start_supervised,
    stop_with_sigterm,
)

from steadytrain import TrainConfig
from steadytrain.integrations import RunGuard
from steadytrain.telemetry.files import read_jsonl

SCRIPT = "own_loop.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("own") / "reference"
    proc = run_plain(SCRIPT, run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_oom_exits_76_and_the_restart_runs_at_half_the_micro_batch(tmp_path: Path):
    run_dir = tmp_path / "oom"
    proc = start_supervised(SCRIPT, run_dir, "--batch", "64", "--steps", "2", "--limit-mib", "150")
    code, _out, err = finish(proc)
    assert code == 0, err
    assert "exiting 76" in err
    (oom,) = events(run_dir, "oom")  # one out-of-memory, one record
    assert oom["micro_batch_size"] == 64
    restart = events(run_dir, "restart")[0]
    assert (restart["exit_code"], restart["max_micro_batch"]) == (76, 32)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r["micro_batch_size"], r["samples"]) for r in rows] == [
        (1, 32, 64),
        (2, 32, 64),
    ]
    assert "1 out-of-memory" in report(run_dir).stdout


def test_an_out_of_memory_leaving_the_step_and_the_block_is_recorded_once(tmp_path: Path):
    """The out-of-memory passes `guard.step()` and then the `with RunGuard` block's end on its
    way out: one ``oom`` record, and the report counts one."""
    import torch

    from steadytrain.telemetry.run_reading import load_run, summary_line

    guarded = RunGuard(tmp_path, config={}, memory_watch=False, micro_batch_size=8)
    with pytest.raises(SystemExit) as stop, guarded as guard, guard.step(1):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert stop.value.code == 76
    (oom,) = events(tmp_path, "oom")
    assert oom["kind"] == "torch.OutOfMemoryError" and oom["micro_batch_size"] == 8
    assert "1 out-of-memory" in summary_line(load_run(tmp_path))


def test_a_blocked_step_exits_75_and_the_restart_finishes(tmp_path: Path, reference):
    run_dir = tmp_path / "hang"
    proc = start_supervised(SCRIPT, run_dir, "--hang-at", "4", "--hang-timeout", "5")
    code, _out, err = finish(proc)
    assert code == 0, err
    hang = events(run_dir, "hang")[0]
    assert hang["step"] == 3 and "own_loop.py" in (run_dir / hang["file"]).read_text()
    assert [r["exit_code"] for r in events(run_dir, "restart")] == [75]
    assert_same_params(run_dir / "params.pt", reference / "params.pt")


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_the_next_start_resumes_exactly(tmp_path: Path, reference):
    run_dir = tmp_path / "stopped"
    stopped_at = stop_with_sigterm(start_plain(SCRIPT, run_dir, "--slow", "0.3"), run_dir)
    assert stopped_at < 6
    saved = events(run_dir, "checkpoint")[-1]
    assert saved["step"] == stopped_at  # saved on the way out
    again = run_plain(SCRIPT, run_dir)
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[0]["step"] == stopped_at
    assert_same_params(run_dir / "params.pt", reference / "params.pt")


def test_the_integrations_import_without_their_libraries():
    code = (
        "import sys\n"
        "for name in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'keras'):\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "import steadytrain.integrations.huggingface as hf\n"
        "import steadytrain.integrations.lightning as pl\n"
        "import steadytrain.integrations.keras as ks\n"
        "from steadytrain.integrations import RunGuard\n"
        "for module in (hf, pl, ks):\n"
        "    try:\n"
        "        module.SteadytrainCallback() if module is not ks else ks.SteadytrainCallback('x')\n"
        "    except ImportError as exc:\n"
        "        print('refused:', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("refused:") == 3
    assert "transformers" in proc.stdout and "lightning" in proc.stdout


def _earlier_dump(run_dir: Path) -> None:
    """The stack dump a process that hung holding the GIL left behind (the backstop's file)."""
    (run_dir / "hangs").mkdir(parents=True)
    (run_dir / "hangs" / "backstop-999999.txt").write_text(
        'Thread 0x1 (most recent call first):\n  File "train.py", line 3 in step\n'
    )


def test_runguard_and_the_trainer_record_events_in_one_order(tmp_path: Path):
    """RunGuard dispatches its events to the Trainer's default callbacks in the Trainer's order
    (steadytrain.trainer.callbacks): the hang an earlier process left is reported before this
    attempt's fit_start, under both."""
    import torch

    from steadytrain import TrainConfig, Trainer
    from steadytrain.integrations import RunGuard

    guarded, trained = tmp_path / "guard", tmp_path / "trainer"
    _earlier_dump(guarded)
    with RunGuard(guarded, config={}, memory_watch=False) as guard, guard.step(1) as row:
        row.update(loss=1.0)
    _earlier_dump(trained)
    Trainer(
        torch.nn.Linear(2, 1),
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        [(torch.randn(2), torch.randn(1)) for _ in range(4)],
        TrainConfig(run_dir=str(trained), effective_batch_size=2, max_steps=1, device="cpu"),
    ).fit()
    for run_dir in (guarded, trained):
        names = [e["event"] for e in events(run_dir)]
        assert names.index("hang") < names.index("fit_start"), (run_dir.name, names)
        assert events(run_dir, "hang")[0]["pid"] == 999999


@pytest.mark.parametrize(
    ("given", "spec"), [("0.8", 0.8), (0.5, 0.5), ("auto", 0.9), ("1GiB", 2**30)]
)
def test_runguard_takes_a_memory_budget_in_the_config_s_grammar(tmp_path: Path, given, spec):
    """The one grammar of a memory budget: a fraction as text (a script's argument, an
    environment variable) or as a number, a size, or auto, as TrainConfig takes them."""
    assert RunGuard(tmp_path / "run", memory_budget=given).budget_spec == spec


@pytest.mark.parametrize("given", ["12", "1.5", "abc"])
def test_runguard_refuses_a_memory_budget_naming_it_with_the_config_s_words(tmp_path: Path, given):
    from steadytrain.errors import BadInputError

    with pytest.raises(BadInputError) as refused:
        RunGuard(tmp_path / "run", memory_budget=given)
    with pytest.raises(Exception) as config_says:
        TrainConfig(run_dir=str(tmp_path), effective_batch_size=1, memory_budget=given)
    assert str(refused.value).startswith("memory_budget: ")
    assert str(refused.value).removeprefix("memory_budget: ") in str(config_says.value)
