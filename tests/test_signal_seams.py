"""Signals, the supervisor and the resume check where a user meets them, past the cases the
other files test: restarts that each start smaller are not "the same failure again"; a Ctrl-C
before the first step and a program that ends with 0 after a stop are stops, not finishes; a
learning rate or schedule that `resume_overrides` lets through is the one trained with.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import sys
from pathlib import Path

import forkserver
import pytest
import torch

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.errors import BadInputError
from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.telemetry.files import read_jsonl

FAST = {"backoff_initial": 0.01, "backoff_max": 0.02}

# A trainer's stand-in: each attempt writes the metrics line of a step at the micro-batch it may
# start with (STEADYTRAIN_MAX_MICRO_BATCH, 64 without a cap), then is killed for memory (its own
# SIGKILL, the counter below rising as the kernel's would) unless that micro-batch is at most
# FITS; it records the cap each attempt saw.
KILLED_UNTIL_SMALL = r"""
import json, os, signal, sys
from pathlib import Path

run_dir, fits = Path(sys.argv[1]), int(sys.argv[2])
cap = os.environ.get("STEADYTRAIN_MAX_MICRO_BATCH")
micro = int(cap) if cap else 64
run_dir.mkdir(parents=True, exist_ok=True)
with open(run_dir / "attempts.txt", "a") as f:
    f.write(f"{cap}\n")
with open(run_dir / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 3, "micro_batch_size": micro}) + "\n")
if micro > fits:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _supervise_kills(tmp_path: Path, fits: int, max_restarts: int) -> tuple[int, str, list]:
    script = tmp_path / "train.py"
    script.write_text(KILLED_UNTIL_SMALL)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    counter = itertools.count()  # the cgroup's oom_kill count: +1 at each kill
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    supervisor = Supervisor(
        [sys.executable, str(script), str(run_dir), str(fits)],
        SupervisorOptions(run_dir=run_dir, max_restarts=max_restarts, **FAST),
        environ=environ,
        out=out,
        oom_kill_count=lambda: next(counter),
    )
    code = supervisor.run()
    caps = (run_dir / "attempts.txt").read_text().split()
    return code, out.getvalue(), caps


def test_memory_kills_that_each_halve_the_micro_batch_do_not_use_up_max_restarts(tmp_path):
    """Killed by the OS at micro-batch 64, 32, 16 and 8 without a checkpoint in between, under
    --max-restarts 1: each restart starts smaller, so none is the same failure again; the run
    that fits at 4 finishes instead of being given up at 32."""
    code, out, caps = _supervise_kills(tmp_path, fits=4, max_restarts=1)
    assert code == 0, out
    assert caps == ["None", "32", "16", "8", "4"]
    assert "gave up" not in out
    restarts = read_jsonl(tmp_path / "run" / "events.jsonl")
    restarts = [e for e in restarts if e["event"] == "restart"]
    assert [e["max_micro_batch"] for e in restarts] == [32, 16, 8, 4]
    assert [e["restarts_without_progress"] for e in restarts] == [0, 0, 0, 0]
    assert "it starts smaller, so it is not counted as the same failure again (0 of 1" in out


def test_memory_kills_at_micro_batch_1_still_give_up_after_max_restarts(tmp_path):
    """Nothing smaller to try: the kills at micro-batch 1 are the same failure again, counted, and
    the supervisor gives up (exit 4) instead of retrying forever."""
    code, out, caps = _supervise_kills(tmp_path, fits=0, max_restarts=1)
    assert code == 4, out
    assert caps == ["None", "32", "16", "8", "4", "2", "1", "1"]
    assert "gave up after 1 restart without a new checkpoint" in out
    end = read_jsonl(tmp_path / "run" / "events.jsonl")[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_gave_up", 4)
    assert json.dumps(end)  # a complete record


# -- Ctrl-C before the loop takes SIGINT over ------------------------------------------------

# A user's script in the plain-PyTorch habit: Ctrl-C is caught, and the model saved as final.
# The first loss call (the planner's probe of `micro_batch_size: auto`) gets a Ctrl-C.
CATCHES_CTRL_C = r"""
import os, signal, sys, torch
from steadytrain import TrainConfig, Trainer

run_dir, interrupt = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
calls = []

def loss_fn(m, b):
    calls.append(1)
    if interrupt and len(calls) == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])

config = TrainConfig(run_dir=run_dir, effective_batch_size=8, micro_batch_size="auto", max_steps=3,
                     device="cpu", progress="off", memory_watch=False)
try:
    Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn, data, config).fit()
except KeyboardInterrupt:
    print("interrupted: saving the model", file=sys.stderr)
torch.save(model.state_dict(), run_dir + "/final.pt")
"""


def test_ctrl_c_while_auto_plans_ends_the_script_with_130_not_as_finished(tmp_path):
    """Ctrl-C during `micro_batch_size: auto`'s probes (before the loop installs its handler)
    ends `fit()` as a Ctrl-C in the loop does: `steadytrain.Stopped` (130), which a script's
    `except KeyboardInterrupt` does not take for its own, so its final save does not run; one
    line says so, no traceback; the next start trains to the end."""
    script = tmp_path / "train.py"
    script.write_text(CATCHES_CTRL_C)
    run_dir = tmp_path / "run"
    stopped = forkserver.run([sys.executable, str(script), str(run_dir), "1"], timeout=120)
    assert stopped.returncode == 130, stopped.stderr
    assert "interrupted: saving the model" not in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (
        "SIGINT outside the training steps: nothing new to save; the next start begins at step 0;"
        in (stopped.stderr)
    )
    assert not (run_dir / "final.pt").exists()
    again = forkserver.run([sys.executable, str(script), str(run_dir), "0"], timeout=120)
    assert again.returncode == 0, again.stderr
    assert (run_dir / "final.pt").exists()


# -- a program that ends with 0 after its run was stopped ------------------------------------

# The README's pattern with its `raise` forgotten: the stop is caught and the program ends
# normally. The SIGTERM comes from outside the supervisor (the OS shutting down, a `kill` of
# the trainer's pid), here from the trainer's own callback at step 2.
SWALLOWS_STOPPED = r"""
import os, signal, sys, torch
import steadytrain
from steadytrain import Callback, TrainConfig, Trainer

class TermAt2(Callback):
    def on_step_end(self, state, control, info):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, micro_batch_size=8, max_steps=6,
                     device="cpu", progress="off", memory_watch=False)
loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
try:
    Trainer(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), loss, data, config,
            callbacks=[TermAt2()]).fit()
except steadytrain.Stopped as stop:
    print(f"notified: {stop.result.checkpoint}", file=sys.stderr)
"""


def supervise_script(tmp_path: Path, script: str) -> tuple[int, str, Path]:
    """`steadytrain run` (the supervisor, in this process) of `script` given its run dir:
    (exit code, what it said, the run dir)."""
    path = tmp_path / "train.py"
    path.write_text(script)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    supervisor = Supervisor(
        [sys.executable, str(path), str(run_dir)],
        SupervisorOptions(run_dir=run_dir, **FAST),
        environ=environ,
        out=out,
        oom_kill_count=lambda: None,
    )
    return supervisor.run(), out.getvalue(), run_dir


def test_a_child_that_ends_0_after_its_run_was_stopped_is_a_stop_not_a_finish(tmp_path):
    """`steadytrain run -- python train.py && deploy`: the child caught `steadytrain.Stopped`
    and exited 0 at step 2 of 6. The attempt's fit_end says the run was stopped: the supervisor
    exits 143 (not 0, which would let what follows take it for finished) and does not restart
    a run someone asked to stop."""
    code, said, run_dir = supervise_script(tmp_path, SWALLOWS_STOPPED)
    assert code == 143, said
    assert "starting attempt 2" not in said
    assert (
        "child exited 0, but its run was stopped by SIGTERM at step 2 (fit_end in events.jsonl)"
        in said
    )
    end = read_jsonl(run_dir / "events.jsonl")[-1]
    assert (end["event"], end["exit_code"], end["step"]) == ("supervisor_end", 143, 2)


# -- a resume that resume_overrides lets through trains with the new values -------------------


class _Lr(Callback):
    """The learning rate each step trained with."""

    def __init__(self):
        self.seen: list[float] = []
        self.optimizer = None

    def on_step_start(self, state, control, info):
        self.seen.append(self.optimizer.param_groups[0]["lr"])


def _fit_at(run_dir: Path, max_steps: int, lr: float, scheduled, overrides=()):
    """A tiny fit with SGD at `lr` (halved every 2 steps when `scheduled` is True; `scheduled`
    the schedule's factory otherwise, when given); the rates it trained with."""
    watch = _Lr()

    def optimizer(params):
        watch.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.5)
        return watch.optimizer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=8, micro_batch_size=8, max_steps=max_steps,
        save_every_steps=2, device="cpu", progress="off", memory_watch=False,
        resume_overrides=list(overrides),
    )  # fmt: skip
    Trainer(
        torch.nn.Linear(4, 2),
        optimizer,
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        data,
        config,
        scheduler=_halved if scheduled is True else (scheduled or None),
        callbacks=[watch],
    ).fit()
    return watch.seen


def _halved(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)


@pytest.mark.parametrize("scheduled", [False, True], ids=["constant", "step-schedule"])
def test_a_learning_rate_changed_with_resume_overrides_is_the_one_trained_with(tmp_path, scheduled):
    """The refusal of a changed lr names `resume_overrides: ['optimizer']`; given, the resumed
    run must train at the new rate, not at the one the loaded optimizer state holds (the
    schedule's steps kept: 0.1, 0.1, 0.05, 0.05 then 0.0025, 0.0025 at a tenth)."""
    assert _fit_at(tmp_path, 4, 0.1, scheduled) == (
        [0.1, 0.1, 0.05, 0.05] if scheduled else [0.1] * 4
    )
    with pytest.raises(BadInputError, match=r"optimizer: lr: 0.1 -> 0.01") as refused:
        _fit_at(tmp_path, 6, 0.01, scheduled)
    # the user's lr, not the schedule's copies of it (`_last_lr`, `base_lrs`, `initial_lr`)
    said = str(refused.value)
    assert "_last_lr" not in said and "base_lrs" not in said and "initial_lr" not in said, said
    assert said.endswith("resume_overrides: ['optimizer']"), said
    resumed = _fit_at(tmp_path, 6, 0.01, scheduled, overrides=["optimizer"])  # as the hint says
    assert resumed == pytest.approx([0.0025, 0.0025] if scheduled else [0.01, 0.01])
    change = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "resume_override"]
    assert "optimizer: lr: 0.1 -> 0.01" in [e["change"] for e in change]


def test_a_cosine_raised_to_train_longer_with_resume_overrides_goes_on_as_the_new_one(tmp_path):
    """A cosine over max_steps (T_max 4) ended at 0; raising max_steps to 8 changes T_max, which
    is refused naming it; allowed with `resume_overrides: ['schedule']`, steps 5 to 8 train at
    the rates a cosine of T_max 8 has there (not at 0, where the old one ended, nor climbing
    back up as the loaded T_max 4 would)."""

    def cosine(steps):
        return lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps)

    _fit_at(tmp_path, 4, 0.1, cosine(4))
    with pytest.raises(BadInputError, match=r"schedule: T_max: 4 -> 8"):
        _fit_at(tmp_path, 8, 0.1, cosine(8))
    resumed = _fit_at(tmp_path, 8, 0.1, cosine(8), overrides=["schedule"])
    expected = [0.1 * (1 + math.cos(math.pi * step / 8)) / 2 for step in range(4, 8)]
    assert resumed == pytest.approx(expected)


# A script that logs any error of its training and ends normally: its first attempt's loss
# function fails at step 3 (a flaky read), caught by `except Exception`.
SWALLOWS_ERRORS = r"""
import os, sys, torch
from steadytrain import TrainConfig, Trainer

first = os.environ.get("STEADYTRAIN_RESTART") == "0"
calls = []

def loss_fn(m, b):
    calls.append(1)
    if first and len(calls) == 3:
        raise OSError("flaky read of the data share")
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, micro_batch_size=8, max_steps=4,
                     save_every_steps=1, device="cpu", progress="off", memory_watch=False)
try:
    Trainer(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), loss_fn, data, config).fit()
except Exception as exc:
    print(f"training failed: {exc!r}", file=sys.stderr)
"""


def test_a_child_that_ends_0_after_its_run_failed_is_restarted_as_that_failure(tmp_path):
    """The child caught the error `fit()` raised (exit 5: an error in the user's code) and
    exited 0 at step 2 of 4. The attempt's fit_end says how the run ended: the supervisor takes
    it for that exit, restarts it (as it restarts a 5 once), and the run finishes."""
    code, said, run_dir = supervise_script(tmp_path, SWALLOWS_ERRORS)
    assert code == 0, said
    assert (
        "child exited 0, but its run ended with exit 5 after step 1 (fit_end in events.jsonl)"
        in (said)
    )
    assert "starting attempt 2" in said
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["exit_code"] for e in events if e["event"] == "restart"] == [5]
    assert [e["exit_code"] for e in events if e["event"] == "fit_end"] == [5, 0]
    assert events[-1]["event"] == "supervisor_end"


def test_a_stop_outside_the_training_steps_does_not_claim_a_checkpoint():
    """What `str(stop)` says of a Ctrl-C while fit() set up (nothing saved) and of one in the
    loop (a checkpoint committed first)."""
    from steadytrain import Stopped

    assert str(Stopped("SIGINT", saved=False)) == (
        "stopped by SIGINT outside the training steps (exit 130)"
    )
    assert str(Stopped("SIGTERM")) == "stopped by SIGTERM after saving a checkpoint (exit 143)"
