"""The public Trainer: inputs it accepts and refuses, events, precision, the OOM ladder's logic."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from steadytrain import (
    BadInputError,
    Callback,
    DoesNotFitError,
    Event,
    TrainConfig,
    Trainer,
)
from steadytrain.engine import resolve_precision
from steadytrain.engine.step import OptimizerStateTouched
from steadytrain.telemetry.files import read_jsonl

CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)"
)


def regression(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, list(zip(x, y, strict=True))


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def config(tmp_path, **overrides):
    base = dict(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        max_steps=8,
        save_every_steps=8,
        device="cpu",
        log_every_steps=100,
    )
    return TrainConfig(**{**base, **overrides})


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


class Recorder(Callback):
    def __init__(self):
        self.seen = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda state, control, info: object.__getattribute__(self, "seen").append(
                (name[3:], state.step, dict(info))
            )
        return object.__getattribute__(self, name)


def test_every_callback_method_is_an_event():
    methods = {
        n for n, _ in inspect.getmembers(Callback, inspect.isfunction) if n.startswith("on_")
    }
    assert methods == {e.method for e in Event}


def test_events_fire_in_loop_order(tmp_path):
    model, data = regression(32)
    rec = Recorder()
    Trainer(
        model,
        sgd,
        mse,
        data,
        config(tmp_path, micro_batch_size=8, max_steps=3, save_every_steps=3),
        callbacks=[rec],
    ).fit()
    names = [n for n, _, _ in rec.seen]
    one_step = ["step_start", "micro_step_end", "micro_step_end", "step_end"]
    assert names[0] == "fit_start"
    assert names[1:9] == one_step * 2
    assert names.count("epoch_end") == 1  # 32 samples / 16 = 2 steps an epoch
    assert names[-1] == "fit_end"
    step_ends = [info["metrics"] for n, _, info in rec.seen if n == "step_end"]
    assert [m["step"] for m in step_ends] == [1, 2, 3]
    assert all(m["samples"] == 16 and m["micro_steps"] == 2 for m in step_ends)


def test_run_dir_holds_resolved_config_metrics_and_events(tmp_path):
    model, data = regression()
    result = Trainer(model, sgd, mse, data, config(tmp_path)).fit()
    run = tmp_path / "run"
    resolved = json.loads((run / "config.json").read_text())
    assert resolved["effective_batch_size"] == 16 and resolved["micro_batch_size"] == "auto"
    assert resolved["precision"] == "auto"
    assert len(read_jsonl(run / "metrics.jsonl")) == 8
    events = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert events[0] == "fit_start" and events[-1] == "fit_end"
    assert result.steps == 8 and result.exit_code == 0 and result.reason == "finished"
    assert not (run / "hangs").exists()  # no hang: no empty hangs/ folder left behind


def test_the_trainer_gives_its_model_back_trained(tmp_path):
    model, data = regression()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, sgd, mse, data, config(tmp_path))
    trainer.fit()
    assert trainer.model is model
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_loss_falls(tmp_path):
    model, data = regression(256)
    Trainer(
        model,
        lambda p: torch.optim.Adam(p, lr=1e-2),
        mse,
        data,
        config(tmp_path, epochs=4, max_steps=None, save_every_steps=64),
    ).fit()
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 64
    assert sum(losses[-8:]) < 0.2 * sum(losses[:8])


def test_a_dataloader_is_accepted_and_batched_by_steadytrain(tmp_path):
    model, data = regression()
    loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True)
    Trainer(model, sgd, mse, loader, config(tmp_path, max_steps=2, save_every_steps=2)).fit()
    assert [m["samples"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [16, 16]


def test_same_seed_same_run(tmp_path):
    finals = []
    for i in range(2):
        model, data = regression()
        Trainer(model, sgd, mse, data, config(tmp_path / str(i), num_workers=0)).fit()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1])


def test_workers_do_not_change_the_run(tmp_path):
    finals = []
    for workers in (0, 2):
        model, data = regression()
        Trainer(
            model,
            sgd,
            mse,
            data,
            config(tmp_path / str(workers), num_workers=workers, max_steps=4, save_every_steps=4),
        ).fit()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "empty"),
        ([(torch.zeros(4), torch.zeros(1))] * 5, "fewer than one optimizer batch"),
        (torch.utils.data.TensorDataset(torch.zeros(0, 4)), "empty"),
    ],
)
def test_bad_data_is_refused_before_training(tmp_path, data, message):
    model, _ = regression()
    with pytest.raises(BadInputError, match=message):
        Trainer(model, sgd, mse, data, config(tmp_path)).fit()


def test_an_iterable_dataset_is_refused_with_the_reason(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()

    model, _ = regression()
    with pytest.raises(BadInputError, match="map-style"):
        Trainer(model, sgd, mse, Stream(), config(tmp_path))


def test_optimizer_must_be_an_optimizer_or_factory(tmp_path):
    model, data = regression()
    with pytest.raises(BadInputError, match="optimizer"):
        Trainer(model, "adam", mse, data, config(tmp_path)).fit()


def test_fp16_on_cpu_uses_a_grad_scaler_and_trains(tmp_path):
    model, data = regression(256)
    Trainer(
        model,
        lambda p: torch.optim.Adam(p, lr=1e-2),
        mse,
        data,
        config(tmp_path, precision="fp16", max_steps=30, save_every_steps=30),
    ).fit()
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses[-1] < losses[0]


def test_an_unsupported_precision_is_refused_with_the_alternative():
    class NoAutocast:
        type = "mps"
        torch_device = torch.device("cpu")
        autocast_dtypes = (torch.float16,)
        autocast_results = ()  # (why each dtype failed: nothing probed here)

    with pytest.raises(BadInputError, match=r"bf16 autocast does not run.*fp16, fp32"):
        resolve_precision("bf16", NoAutocast())


# -- the OOM ladder, with injected errors (the real OOM is in test_engine_oom.py) ------------


class OOMAt:
    """loss_fn wrapper raising the CPU allocator's error while a condition holds."""

    def __init__(self, when):
        self.when, self.calls = when, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.when(len(batch[0]), model):
            raise RuntimeError(CPU_OOM)
        return mse(model, batch)


def test_oom_halves_until_it_fits_and_keeps_the_size(tmp_path):
    model, data = regression()
    rec = Recorder()
    result = Trainer(
        model, sgd, OOMAt(lambda n, m: n > 4), data, config(tmp_path), callbacks=[rec]
    ).fit()
    assert result.micro_batch_size == 4 and result.oom_count == 2
    shrinks = [(i["old"], i["new"]) for n, _, i in rec.seen if n == "shrink"]
    assert shrinks == [(16, 8), (8, 4)]


class Checkpointable(torch.nn.Sequential):
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = True


def test_at_micro_1_activation_checkpointing_is_tried_before_giving_up(tmp_path):
    _, data = regression()
    torch.manual_seed(0)
    model = Checkpointable(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fails = OOMAt(lambda n, m: not getattr(m, "checkpointing", False))
    rec = Recorder()
    result = Trainer(model, sgd, fails, data, config(tmp_path), callbacks=[rec]).fit()
    assert result.micro_batch_size == 1 and result.steps == 8
    savers = [i for n, _, i in rec.seen if n == "memory_saver"]
    assert len(savers) == 1 and savers[0]["saver"] == "activation_checkpointing"


def test_does_not_fit_names_the_numbers(tmp_path):
    model, data = regression()
    with pytest.raises(DoesNotFitError) as err:
        Trainer(model, sgd, OOMAt(lambda n, m: True), data, config(tmp_path)).fit()
    text = str(err.value)
    assert "one sample per micro-batch" in text and "1.00 MiB more" in text
    assert "budget" in text and "shorter sequences" in text
    assert err.value.exit_code == 3


def test_a_bug_is_not_mistaken_for_oom(tmp_path):
    def broken(model, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x4 and 5x16)")

    model, data = regression()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        Trainer(model, sgd, broken, data, config(tmp_path)).fit()
    assert list((tmp_path / "run" / "errors").glob("*.txt")), "a bug keeps its traceback"


class TouchingAdam(torch.optim.Adam):
    """Adam whose first step updates every parameter and then runs out of memory."""

    failed = False

    def step(self, closure=None):
        result = super().step(closure)
        if not self.failed:
            self.failed = True
            raise RuntimeError(CPU_OOM)
        return result


class LazyStateAdam(torch.optim.Adam):
    """Adam whose first step allocates state, changes no parameter, then runs out of memory."""

    failed = False

    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["scratch"] = torch.zeros_like(p)
            raise RuntimeError(CPU_OOM)
        return super().step(closure)


def test_oom_in_the_first_optimizer_step_discards_lazy_state_and_redoes(tmp_path):
    model, data = regression()
    reference, _ = regression()
    Trainer(model, lambda p: LazyStateAdam(p, lr=1e-2), mse, data, config(tmp_path / "a")).fit()
    Trainer(
        reference,
        lambda p: torch.optim.Adam(p, lr=1e-2),
        mse,
        data,
        config(tmp_path / "b", micro_batch_size=8),
    ).fit()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_oom_after_the_optimizer_changed_parameters_stops_instead_of_double_applying(tmp_path):
    model, data = regression()
    with pytest.raises(OptimizerStateTouched, match="cannot be redone exactly"):
        Trainer(model, lambda p: TouchingAdam(p, lr=1e-2), mse, data, config(tmp_path)).fit()


def test_batchnorm_models_get_a_warning_that_splitting_changes_them(tmp_path):
    from steadytrain.trainer import BatchDependentModelWarning

    _, data = regression()
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    with pytest.warns(BatchDependentModelWarning, match="BatchNorm"):
        Trainer(model, sgd, mse, data, config(tmp_path, micro_batch_size=8)).fit()


def test_step_metrics_wait_for_the_device_only_when_read():
    from steadytrain.events import StepMetrics

    seen = []
    m = StepMetrics({"loss": torch.tensor(2.5), "tokens": torch.tensor(7), "lr": 0.1}, seen.append)
    assert not m.resolved and seen == []
    assert m["lr"] == 0.1 and not m.resolved  # host values do not resolve
    assert m["loss"] == 2.5 and m.resolved
    assert isinstance(dict.__getitem__(m, "tokens"), int)
    assert seen == [m]
    m.resolve()
    assert len(seen) == 1


def test_state_counts_tokens_and_last_loss_after_lazy_metrics(tmp_path):
    def token_loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y, reduction="sum"), torch.tensor(len(x))

    model, data = regression()
    rec = Recorder()
    result = Trainer(model, sgd, token_loss, data, config(tmp_path), callbacks=[rec]).fit()
    fit_end_state = [step for n, step, _ in rec.seen if n == "fit_end"]
    assert fit_end_state == [8]
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["tokens"] for m in lines] == [16] * 8
    assert result.final_loss == lines[-1]["loss"]


def test_nan_in_the_data_stops_with_the_step_named(tmp_path):
    model, data = regression()
    data[5] = (torch.full((4,), float("nan")), data[5][1])
    with pytest.raises(BadInputError, match=r"loss is nan at step \d+ .*NaN or Inf") as raised:
        Trainer(model, sgd, mse, data, config(tmp_path)).fit()
    assert read_jsonl(tmp_path / "run" / "events.jsonl")[-1]["exit_code"] == 2
    # one step number: the stop line's (fit_end's error_step) is the message's (issue 27)
    step = int(str(raised.value).split(" at step ")[1].split()[0])
    (end,) = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "fit_end"]
    assert end["error_step"] == step


def test_the_stop_line_after_a_nan_counts_the_steps_before_it(tmp_path, capsys):
    """A NaN loss is read while the next step runs: the last line counted that step as done
    ('stopped at step 5 ... 6 step(s) done' where 4 were)."""
    model, data = regression()
    data[5] = (torch.full((4,), float("nan")), data[5][1])
    with pytest.raises(BadInputError) as raised:
        Trainer(model, sgd, mse, data, config(tmp_path, micro_batch_size=4)).fit()
    step = int(str(raised.value).split(" at step ")[1].split()[0])
    err = " ".join(capsys.readouterr().err.split())
    assert f"stopped at step {step} by BadInputError (exit 2; " in err, err
    done = f"{step - 1} step(s) done" if step > 1 else "no step done"
    assert f"exit 2; {done}; the error follows" in err, err


def test_a_second_trainer_on_a_run_directory_in_use_is_refused(tmp_path):
    from steadytrain.safety.lock import RunLock

    model, data = regression()
    (tmp_path / "run").mkdir()
    with RunLock(tmp_path / "run"), pytest.raises(BadInputError, match=r"in use by PID \d+"):
        Trainer(model, sgd, mse, data, config(tmp_path)).fit()
