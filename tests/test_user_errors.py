"""Errors in the user's own code (issue 19, point 1): an exception raised in the loss function,
the model's forward, the dataset, the collate function or a callback is reported as theirs: the
message names the function and the step, the traceback shows only their frames, and the exit
code is 5; under `steadytrain run` the same error at the same step is not restarted again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.errors import OutOfMemoryInYourCode, UserCodeError, user_code_error
from steadytrain.telemetry.files import read_jsonl
from steadytrain.telemetry.run_reading import load_run, summary_line

ROOT = Path(__file__).resolve().parent.parent
STEADYTRAIN = str(ROOT / "src" / "steadytrain")


def data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return list(zip(x, x.sum(1, keepdim=True), strict=True))


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def fit(tmp_path, loss_fn=mse, dataset=None, model=None, **kwargs):
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 1)
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=8,
        max_steps=4,
        device="cpu",
        log_every_steps=100,
    )
    opt = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    return Trainer(model, opt, loss_fn, dataset or data(), config, **kwargs).fit()


def fails(tmp_path, **kwargs) -> UserCodeError:
    with pytest.raises(UserCodeError) as info:
        fit(tmp_path, **kwargs)
    error = info.value
    assert error.exit_code == 5
    assert STEADYTRAIN not in error.frames  # their frames only
    return error


def test_a_loss_that_is_not_one_number_names_loss_fn_and_the_fix(tmp_path):
    def per_sample(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y, reduction="none")

    error = fails(tmp_path, loss_fn=per_sample)
    text = str(error)
    assert text.startswith("error in your code (loss_fn) at step 1: loss_fn returned the loss")
    assert "shape (8, 1)" in text and 'reduction="mean"' in text
    event = read_jsonl(tmp_path / "run" / "events.jsonl")[-1]
    assert (event["event"], event["step"], event["exit_code"]) == ("error", 1, 5)


def test_an_error_in_forward_names_forward_and_the_loss_fn_that_called_it(tmp_path):
    class Model(torch.nn.Linear):
        fail = False

        def forward(self, x):
            if self.fail:
                raise ValueError("shapes do not match")
            return super().forward(x)

    class FailFromStep3(Callback):
        def on_step_end(self, state, control, info):
            model.fail = state.step == 2

    model = Model(4, 1)
    error = fails(tmp_path, model=model, callbacks=[FailFromStep3()])
    assert error.step == 3
    assert error.where.startswith("forward (test_user_errors.py:")
    assert ", called from mse (test_user_errors.py:" in error.where
    assert "ValueError: shapes do not match" in str(error)
    assert isinstance(error, ValueError)  # `except ValueError` around fit() still catches it
    assert 'raise ValueError("shapes do not match")' in error.frames
    assert "return torch.nn.functional.mse_loss(model(x), y)" in error.frames


def test_an_error_in_the_dataset_names_getitem(tmp_path):
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            if index == 31:
                raise KeyError(f"no sample {index}")
            return data()[index]

    error = fails(tmp_path, dataset=Broken())
    assert error.where.startswith("__getitem__ (test_user_errors.py:")
    assert "KeyError: 'no sample 31'" in str(error)


def test_an_error_in_a_callback_names_it_and_its_step(tmp_path):
    class Stops(Callback):
        def on_step_end(self, state, control, info):
            if state.step == 2:
                raise RuntimeError("my callback failed")

    error = fails(tmp_path, callbacks=[Stops()])
    assert error.step == 2
    assert error.where.startswith("on_step_end (test_user_errors.py:")
    assert "at step 2: RuntimeError: my callback failed" in str(error)


def test_an_error_in_collate_is_theirs(tmp_path):
    def collate(samples):
        raise TypeError("cannot stack")

    error = fails(tmp_path, collate_fn=collate)
    assert error.where.startswith("collate (test_user_errors.py:")


def too_big() -> torch.Tensor:
    """A real allocator failure on any machine: 1 EiB."""
    return torch.empty(2**60, dtype=torch.uint8)


def test_out_of_memory_building_the_optimizer_exits_3_saying_a_smaller_micro_batch_wont_help(
    tmp_path,
):
    """Out of memory in the user's code outside a step (here the optimizer factory, before the
    first step) is not a bug to fix in their code (exit 5) and not one the ladder can shrink:
    exit 3, as a run that does not fit, naming the function and what helps."""

    def build_optimizer(params):
        state = too_big()
        return torch.optim.SGD(params, lr=0.01, weight_decay=float(state.numel()))

    torch.manual_seed(0)
    config = TrainConfig(run_dir=str(tmp_path / "run"), effective_batch_size=8, max_steps=2)
    trainer = Trainer(torch.nn.Linear(4, 1), build_optimizer, mse, data(), config)
    with pytest.raises(OutOfMemoryInYourCode) as info:
        trainer.fit()
    error = info.value
    assert error.exit_code == 3
    assert isinstance(error, RuntimeError)  # `except RuntimeError` around fit() still catches it
    text = str(error)
    assert text.startswith("out of memory in your code (too_big (test_user_errors.py:")
    assert "called from build_optimizer (test_user_errors.py:" in text
    assert "before the first step: RuntimeError:" in text and "can't allocate memory" in text
    assert "a smaller micro-batch does not help" in text
    assert STEADYTRAIN not in error.frames
    event = read_jsonl(tmp_path / "run" / "events.jsonl")[-1]
    assert (event["event"], event["exit_code"], event["in_your_code"]) == ("error", 3, True)
    assert "stopped by out of memory in your code (too_big (" in summary_line(
        load_run(tmp_path / "run")
    )


def test_out_of_memory_in_a_callback_exits_3_at_its_step(tmp_path):
    class Hoards(Callback):
        def on_step_end(self, state, control, info):
            if state.step == 2:
                too_big()

    with pytest.raises(OutOfMemoryInYourCode) as info:
        fit(tmp_path, callbacks=[Hoards()])
    assert info.value.step == 2 and info.value.exit_code == 3
    assert str(info.value).startswith("out of memory in your code (too_big (test_user_errors.py:")
    assert "called from on_step_end" in str(info.value) and "at step 2:" in str(info.value)


def test_errors_inside_libraries_alone_are_not_the_users():
    """Frames only in steadytrain and installed packages: not theirs, it stays a bug (exit 1)."""
    try:
        torch.zeros(2).view(3)
    except RuntimeError as exc:
        error = exc
    assert user_code_error(error.with_traceback(None)) is None
    assert user_code_error(KeyboardInterrupt()) is None


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from steadytrain import Trainer, TrainConfig, entrypoint

    def loss_fn(model, batch):
        x, y = batch
        raise ValueError("my bug")

    @entrypoint
    def main():
        data = [(torch.randn(4), torch.randn(1)) for _ in range(16)]
        model = torch.nn.Linear(4, 1)
        config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, max_steps=2,
                             device="cpu")
        return Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn, data, config).fit()

    main()
    """
)


def test_supervised_script_exits_5_and_is_not_restarted_when_the_error_repeats(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    result = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir),
         "--backoff-initial", "0.05", "--", sys.executable, str(script), str(run_dir)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 5, result.stderr
    err = result.stderr
    # The planner's trial pass calls loss_fn first, before step 1.
    assert (
        "error in your code (loss_fn (train.py:7)) before the first step: ValueError: my bug" in err
    )
    assert 'raise ValueError("my bug")' in err
    assert "Traceback (most recent call last)" not in err
    assert err.count("starting attempt") == 2  # the first start and one restart, no more
    assert "the same error as the attempt before, at the same step (before the first step)" in err
    end = read_jsonl(run_dir / "events.jsonl")[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_end", 5)


def test_the_stop_line_names_the_step_that_failed_and_leaves_the_error_to_its_own_line(
    tmp_path, capfd
):
    """The console's last line of a run stopped by an error says the step the error happened
    in (not the last finished one) and its kind; the error's text is not glued into it (it
    follows whole, once, as the error itself)."""
    calls = []

    def third_fails(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom in the third batch")
        return mse(model, batch)

    fails(tmp_path, loss_fn=third_fails)
    at = read_jsonl(tmp_path / "run" / "events.jsonl")[-1]["step"]  # the "error" event's
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"stopped at step {at} by an error in your code (third_fails "), last
    assert f"(exit 5; {at - 1} step(s) done;" in last and "boom" not in last


class HalvingEveryStep(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler class of the user's own, built from the optimizer alone."""

    def get_lr(self):
        return [group["lr"] * 0.5 for group in self.optimizer.param_groups]


def test_a_scheduler_class_is_built_from_the_optimizer_like_a_factory(tmp_path):
    fit(tmp_path, scheduler=HalvingEveryStep)
    lrs = [m["lr"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    # halved when built and after each step (the logged lr is the next step's)
    assert lrs == [0.01 * 0.5**k for k in range(2, 6)]


def test_a_scheduler_class_that_needs_more_than_the_optimizer_names_the_fix(tmp_path):
    from steadytrain.errors import BadInputError

    with pytest.raises(BadInputError, match=r"scheduler: StepLR\(optimizer\).*step_size") as info:
        fit(tmp_path, scheduler=torch.optim.lr_scheduler.StepLR)
    assert "scheduler=lambda opt: StepLR(opt, ...)" in str(info.value)


def _tree(run_dir: Path) -> dict[str, bytes | None]:
    """Every path under `run_dir` (folders as None) with its bytes."""
    return {
        str(p.relative_to(run_dir)): None if p.is_dir() else p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
    }


@pytest.mark.parametrize(
    "refused",
    [
        {"scheduler": torch.optim.lr_scheduler.StepLR},  # found while the set-up builds it
        {"eval_fn": lambda model, batches: {"score": 1.0}},  # without eval_data: found there
    ],
    ids=["scheduler", "eval_fn"],
)
def test_a_start_refused_for_bad_input_leaves_the_run_directory_as_it_found_it(tmp_path, refused):
    """Refused at the set-up (exit 2), after the run directory was locked and watched: a fresh
    run directory is not left behind (no lock, no empty hangs/), and one with an earlier run
    keeps every file byte for byte, with no lock or folder of the refused start's."""
    from steadytrain.entry import entrypoint

    def refused_fit():
        return entrypoint(lambda: fit(tmp_path, **refused))()

    with pytest.raises(SystemExit) as ended:
        refused_fit()
    assert ended.value.code == 2
    assert not (tmp_path / "run").exists()

    fit(tmp_path)  # an earlier run, finished
    before = _tree(tmp_path / "run")
    with pytest.raises(SystemExit) as ended:
        refused_fit()
    assert ended.value.code == 2
    assert _tree(tmp_path / "run") == before
