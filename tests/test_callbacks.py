"""Callbacks: every ``on_*`` method of steadytrain's own callbacks is an event the loop calls, and
a user's callback with an ``on_*`` method no event calls (``on_train_end``, from another
library) is refused before anything runs: exit 5, naming the method and the event meant."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import steadytrain.checkpoint
import steadytrain.safety
import steadytrain.telemetry
from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.entry import entrypoint
from steadytrain.errors import UserCodeError
from steadytrain.events import Event
from steadytrain.user_state import CarriedState

EVENTS = {event.method for event in Event}


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_on_method_of_the_packages_callbacks_is_an_event():
    """The loop's callbacks come from the packages the Trainer and RunGuard put together (the
    checkpoint, safety, telemetry, user_state): each Callback subclass defined there, its on_*
    methods, own and inherited."""
    for package in (steadytrain.checkpoint, steadytrain.safety, steadytrain.telemetry):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
    importlib.import_module("steadytrain.integrations.guard")
    ours = [c for c in _subclasses(Callback) if c.__module__.startswith("steadytrain.")]
    assert len(ours) >= 10, ours  # the watchdog, memory watch, checkpoint, telemetry, ...
    for cls in ours:
        methods = {
            name
            for name, value in inspect.getmembers(cls)
            if name.startswith("on_") and callable(value)
        }
        assert methods <= EVENTS, (cls, methods - EVENTS)


class OnTrainEnd(Callback):
    """Written for Hugging Face's or Keras's names: `on_train_end` would never be called."""

    def on_train_end(self, state, control, info):
        raise AssertionError("never called")


class Misspelt:
    """A duck-typed callback (no base class) with one method misspelt."""

    def on_step_end(self, state, control, info): ...
    def on_epoch_ending(self, state, control, info): ...


class CarriedWithAnUnknownMethod(CarriedState):
    def on_batch_end(self, state, control, info): ...


def _trainer(tmp_path, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(2), torch.randn(1)) for _ in range(8)]
    config = TrainConfig(run_dir=str(tmp_path / "run"), effective_batch_size=4, max_steps=1)
    return Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        data,
        config,
        **kwargs,
    )


def test_an_on_method_no_event_calls_exits_5_naming_the_event_meant(tmp_path, capsys):
    @entrypoint
    def main():
        return _trainer(tmp_path, callbacks=[OnTrainEnd()]).fit()

    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 5
    err = capsys.readouterr().err
    assert "OnTrainEnd has a method on_train_end, which no event calls" in err
    assert "did you mean on_fit_end?" in err and "on_step_end" in err  # the events listed
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


@pytest.mark.parametrize(
    ("where", "method", "meant"),
    [
        ("callbacks", "on_epoch_ending", "on_epoch_end"),  # the closest name (difflib)
        ("user_state", "on_batch_end", "on_step_end"),  # another library's name for it
    ],
)
def test_the_closest_event_is_named(tmp_path, where, method, meant):
    kwargs = (
        {"callbacks": [Misspelt()]}
        if where == "callbacks"
        else {"user_state": {"hidden": CarriedWithAnUnknownMethod()}}
    )
    with pytest.raises(UserCodeError) as refused:
        _trainer(tmp_path, **kwargs)
    assert refused.value.exit_code == 5
    assert f"a method {method}, which no event calls" in str(refused.value)
    assert f"did you mean {meant}?" in str(refused.value)


class StepCounter(Callback):
    """A user's callback that keeps state: the steps it has seen end."""

    def __init__(self):
        self.count, self.at_start = 0, None

    def on_fit_start(self, state, control, info):
        self.at_start = self.count

    def on_step_end(self, state, control, info):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, saved):
        self.count = saved["count"]


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, state, control, info):
        if state.step == self.step:
            control.request_stop(0, f"stopped at step {self.step}")


def _small_run(run_dir, **fields) -> TrainConfig:
    """Two samples a step on the CPU, a checkpoint every 3 steps written synchronously."""
    return TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=2,
        micro_batch_size=2,
        save_every_steps=3,
        async_save=False,
        device="cpu",
        progress="off",
        **fields,
    )


def _counted(run_dir, max_steps, stop_at=None) -> StepCounter:
    torch.manual_seed(0)
    counter = StepCounter()
    config = _small_run(run_dir, max_steps=max_steps)
    Trainer(
        torch.nn.Linear(2, 1),
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        [(torch.randn(2), torch.randn(1)) for _ in range(16)],
        config,
        callbacks=[counter] if stop_at is None else [counter, StopAt(stop_at)],
    ).fit()
    return counter


def test_a_callback_that_keeps_state_is_saved_and_restored(tmp_path):
    """A callback with state_dict() / load_state_dict() is saved with the checkpoint, its state
    taken after it saw the step the checkpoint saves (step 3: save_every_steps), and restored on
    resume: after a stop at step 3 the new Trainer's counter starts at 3, and ends where an
    uninterrupted run's does."""
    whole = _counted(tmp_path / "whole", 6)
    assert whole.count == 6
    stopped = _counted(tmp_path / "cut", 6, stop_at=3)
    assert stopped.count == 3
    resumed = _counted(tmp_path / "cut", 6)
    assert resumed.at_start == 3
    assert resumed.count == whole.count


class Curriculum(Callback):
    """Program state in `user_state` that the loss reads and that advances at each step's end
    (a curriculum's counter): the loss of step k is scaled by the steps done before it."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, state, control, info):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, saved):
        self.steps = saved["steps"]


def _curriculum(run_dir, max_steps, stop_at=None) -> tuple[Curriculum, torch.nn.Module]:
    torch.manual_seed(0)
    curriculum, model = Curriculum(), torch.nn.Linear(2, 1)
    config = _small_run(run_dir, max_steps=max_steps)

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1]) * (1 + curriculum.steps)

    Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn,
        [(torch.randn(2), torch.randn(1)) for _ in range(16)],
        config,
        callbacks=[] if stop_at is None else [StopAt(stop_at)],
        user_state={"curriculum": curriculum},
    ).fit()
    return curriculum, model


def test_program_state_that_changes_at_step_end_is_saved_with_the_step(tmp_path):
    """A `user_state` object that is a callback runs before the checkpoint writer, as a stateful
    callback of `callbacks=` does: the checkpoint of step 3 holds its state after step 3's end,
    so the resumed run equals the uninterrupted one, weights bit for bit."""
    whole, whole_model = _curriculum(tmp_path / "whole", 6)
    assert whole.steps == 6
    _curriculum(tmp_path / "cut", 6, stop_at=3)
    resumed, resumed_model = _curriculum(tmp_path / "cut", 6)
    assert resumed.steps == 6
    for mine, theirs in zip(resumed_model.parameters(), whole_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


class EvalSeen(Callback):
    """Both names of the evaluation's end: eval_end, and evaluation_end as it was called."""

    def __init__(self):
        self.seen = []

    def on_eval_end(self, state, control, info):
        self.seen.append(("eval_end", state.step, info["metrics"]["eval_loss"]))

    def on_evaluation_end(self, state, control, info):
        self.seen.append(("evaluation_end", state.step, info["metrics"]["eval_loss"]))


class EarlierNameOnly:
    """A duck-typed callback written when the event was called evaluation_end."""

    def __init__(self):
        self.steps = []

    def on_evaluation_end(self, state, control, info):
        self.steps.append(state.step)


def test_the_evaluation_end_is_eval_end_and_its_earlier_name_still_runs(tmp_path):
    """Every evaluation name a user writes begins with eval_ (eval_step_end, eval_end): a
    callback's on_eval_end runs at each evaluation's end, and one written with the earlier
    on_evaluation_end is neither refused nor skipped."""
    assert Event.EVALUATION_END is Event.EVAL_END and Event.EVAL_END.value == "eval_end"
    seen, earlier = EvalSeen(), EarlierNameOnly()
    torch.manual_seed(0)
    data = [(torch.randn(2), torch.randn(1)) for _ in range(8)]
    config = _small_run(tmp_path / "run", max_steps=3, eval_every_steps=1)
    Trainer(
        torch.nn.Linear(2, 1),
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        data,
        config,
        eval_data=data[:4],
        callbacks=[seen, earlier],
    ).fit()
    assert [(name, step) for name, step, _ in seen.seen] == [
        (name, step) for step in (1, 2, 3) for name in ("eval_end", "evaluation_end")
    ]
    assert seen.seen[0][2] == seen.seen[1][2]  # the same info
    assert earlier.steps == [1, 2, 3]
