"""Where steadytrain's own resume logic used to stop a run (issue 24, items 1, 3 and 7).

* A signal ends the program: after SIGINT / SIGTERM `fit()` commits a checkpoint and raises
  `steadytrain.Stopped` (130 / 143), so a script's lines after `fit()` do not run as if training
  had finished.
* A resume is never refused for being exact: the continuity probe computes what the resumed step
  computes, and a mismatch is recorded and shown, not a stop (unless `continuity_strict`).
* A damaged checkpoint is skipped with a reason, and the next older verified one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import events, finish, steps_logged, wait_for, workload_env

import steadytrain
from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.checkpoint.state import STATE_FILE
from steadytrain.checkpoint.store import MANIFEST
from steadytrain.errors import CheckpointError, StateNotRestoredError
from steadytrain.telemetry.run_reading import load_run, summary_rows

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


def _tiny_fit(run_dir: Path, callbacks=(), max_steps: int = 6, **settings) -> steadytrain.FitResult:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=8, micro_batch_size=8, max_steps=max_steps,
        device="cpu", progress="off", memory_watch=False,
        **{"save_every_steps": max_steps, **settings},
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
    before = signal.getsignal(signal.SIGINT)  # (ignored where the suite runs in the background)
    with pytest.raises(steadytrain.Stopped) as stop:
        _tiny_fit(tmp_path, [_SignalAt(2, signal.SIGINT)])
    assert isinstance(stop.value, SystemExit) and stop.value.code == 130
    assert stop.value.signal == "SIGINT"
    result = stop.value.result
    assert (result.steps, result.exit_code) == (2, 130)
    assert result.checkpoint is not None and result.checkpoint.endswith("step-00000002")
    assert signal.getsignal(signal.SIGINT) is before  # put back
    assert _tiny_fit(tmp_path).steps == 6  # and the next fit resumes
    assert events(tmp_path, "resume")[0]["step"] == 2


# -- a resume is never refused for being exact ----------------------------------------------


class TinyLSTM(torch.nn.Module):
    """nn.LSTM on the CPU runs another kernel under no_grad than with autograd on."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 16)
        self.lstm = torch.nn.LSTM(16, 16)
        self.head = torch.nn.Linear(16, 11)

    def forward(self, tokens, hidden):
        out, new = self.lstm(self.embed(tokens.t()), hidden)
        return self.head(out).transpose(0, 1), new


class _StopAt(Callback):
    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, state, control, info):
        if state.step in self.steps:
            control.request_stop(143, "stopped by the test")


def lstm_fit(run_dir: Path, stop_at=(), seed: int = 1, callbacks=(), **settings):
    """A word-language-model port in small: an LSTM whose hidden state is carried across steps
    and starts again each epoch; 3 steps an epoch, a checkpoint at each epoch's end."""
    torch.manual_seed(seed)
    model = TinyLSTM()
    hidden = steadytrain.CarriedState(
        init=lambda n: (torch.zeros(1, n, 16), torch.zeros(1, n, 16)),
        batch_dim=1,
        reset_each_epoch=True,
    )

    def loss_fn(model, batch):
        tokens, targets = batch
        logits, new = model(tokens, hidden.get())
        hidden.set(new)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 11, (12, 7), generator=g)
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=4, micro_batch_size=4, epochs=4,
        save_every_steps=3, shuffle=False, device="cpu", progress="off", memory_watch=False,
        **settings,
    )  # fmt: skip
    result = Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.5),
        loss_fn,
        torch.utils.data.TensorDataset(text[:, :6], text[:, 1:]),
        config,
        user_state={"hidden": hidden},
        callbacks=[_StopAt(stop_at), *callbacks],
    ).fit()
    return model, result


def test_an_lstm_stopped_at_each_epoch_end_resumes_to_the_uninterrupted_run(tmp_path: Path):
    """Seed 1: the checkpoint at step 3 is one whose loss computed under no_grad is an ulp off
    the step's (measured: a probe without autograd records another loss there)."""
    whole, _ = lstm_fit(tmp_path / "whole")
    run_dir = tmp_path / "resumed"
    for stop in (3, 6):  # right after an epoch-end checkpoint, then resumed
        _, stopped = lstm_fit(run_dir, stop_at=[stop])
        assert stopped.steps == stop
    resumed, result = lstm_fit(run_dir)
    assert result.exit_code == 0 and result.steps == 12
    checks = [e for e in events(run_dir, "continuity")]
    assert [c["step"] for c in checks] == [4, 7]
    assert all(c["checked"] and c["equal"] for c in checks), checks
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


KILL_AFTER_EPOCH_END_SAVE = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from steadytrain import Callback
from test_resume_seams import lstm_fit

class Kill(Callback):  # after the checkpoint callback: step 3's save is committed (synchronous)
    def on_step_end(self, state, control, info):
        if state.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

lstm_fit(sys.argv[1], callbacks=[Kill()], async_save=False)
"""


def test_an_lstm_killed_right_after_an_epoch_end_save_finishes_as_the_uninterrupted_run(
    tmp_path: Path,
):
    run_dir = tmp_path / "killed"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_EPOCH_END_SAVE, str(run_dir), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=240,
        env=workload_env(),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed, result = lstm_fit(run_dir, async_save=False)
    assert (result.exit_code, result.steps) == (0, 12)
    assert events(run_dir, "resume")[0]["step"] == 3
    (check,) = events(run_dir, "continuity")
    assert check["step"] == 4 and check["equal"], check
    whole, _ = lstm_fit(tmp_path / "whole", async_save=False)
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def resign(folder: Path) -> None:
    """Make the manifest match the folder's files again, as a bug or a hand edit could."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"] = {
        f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
        for f in folder.iterdir()
        if f.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))


def edit_state(folder: Path, edit) -> None:
    """Change the checkpoint's trainer_state.json with `edit(doc)` and re-sign the folder."""
    doc = json.loads((folder / STATE_FILE).read_text())
    edit(doc)
    (folder / STATE_FILE).write_text(json.dumps(doc))
    resign(folder)


def test_a_resume_whose_first_loss_differs_goes_on_and_says_so(tmp_path: Path, capsys):
    _tiny_fit(tmp_path, [_StopAt([2])])
    folder = tmp_path / "checkpoints" / "step-00000002"
    edit_state(folder, lambda doc: doc.update(next_loss=doc["next_loss"] + 0.5))
    strict = tmp_path.parent / f"{tmp_path.name}-strict"
    shutil.copytree(tmp_path, strict)
    capsys.readouterr()

    result = _tiny_fit(tmp_path)
    assert (result.exit_code, result.steps) == (0, 6)  # went on to the end
    (check,) = events(tmp_path, "continuity")
    assert check["step"] == 3 and check["checked"] and not check["equal"]
    assert check["expected"] == check["loss"] + 0.5
    assert "going on" in check["message"]
    assert "has loss" in capsys.readouterr().err  # on the console
    rows = dict(summary_rows(load_run(tmp_path)))
    assert rows["resume check"].startswith("1 resume(s) whose first step's loss differed")

    with pytest.raises(StateNotRestoredError, match="continuity_strict"):
        _tiny_fit(strict, continuity_strict=True)
    assert not events(strict, "continuity")[0]["equal"]


# -- a damaged checkpoint is a checkpoint error, never an internal one --------------------------


class _Touch:
    """A pickle that runs a command when loaded without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _damage(folder: Path, how: str) -> None:
    if how == "rng stream missing":  # a KeyError in rng_from_files before
        edit_state(folder, lambda doc: doc["rng"].pop("numpy"))
    elif how == "rng stream malformed":  # random.setstate's own error
        edit_state(folder, lambda doc: doc["rng"]["python"].__setitem__(1, [1, 2, 3]))
    elif how == "step of another folder":  # accepted as step 4 before
        edit_state(folder, lambda doc: doc["state"].update(step=3))
    elif how == "pickle weights_only refuses":  # stopped the run before
        torch.save({"state": _Touch(folder.parent.parent / "marker")}, folder / "optimizer.pt")
        resign(folder)


DAMAGES = [
    ("rng stream missing", "rng"),
    ("rng stream malformed", "RNG streams"),
    ("step of another folder", "the folder is step 4"),
    ("pickle weights_only refuses", "optimizer.pt"),
]


@pytest.mark.parametrize(("how", "reason"), DAMAGES)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path: Path, how, reason):
    _tiny_fit(tmp_path, [_StopAt([4])], save_every_steps=2)
    _damage(tmp_path / "checkpoints" / "step-00000004", how)

    result = _tiny_fit(tmp_path, save_every_steps=2)

    assert (result.exit_code, result.steps) == (0, 6)
    (skipped,) = events(tmp_path, "checkpoint_skipped")
    assert skipped["checkpoint"] == "step-00000004"
    assert reason in skipped["problems"][0]
    (resume,) = events(tmp_path, "resume")
    assert resume["step"] == 2  # the next older verified checkpoint
    assert not (tmp_path / "marker").exists()


def test_damaged_checkpoints_with_none_left_are_exit_2_naming_each(tmp_path: Path):
    _tiny_fit(tmp_path, [_StopAt([4])], save_every_steps=2)
    _damage(tmp_path / "checkpoints" / "step-00000004", "rng stream missing")
    _damage(tmp_path / "checkpoints" / "step-00000002", "step of another folder")

    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies") as info:
        _tiny_fit(tmp_path, save_every_steps=2)

    assert info.value.exit_code == 2
    assert "step-00000004" in str(info.value) and "step-00000002" in str(info.value)
    assert len(events(tmp_path, "checkpoint_skipped")) == 2


# -- the loss check after an epoch-end save, with a DataLoader that shuffles ---------------------


class _ShuffledInPlace(torch.utils.data.Sampler):
    """A sampler that keeps its order and shuffles it in place each epoch (python's stream):
    drawing its next order ahead must not touch it."""

    def __init__(self, size: int):
        self.items = list(range(size))

    def __iter__(self):
        import random

        random.shuffle(self.items)
        return iter(list(self.items))

    def __len__(self):
        return len(self.items)


def _loader_fit(run_dir: Path, sampler: str, stop_at=(), save_every: int = 4):
    """A DataLoader whose order is drawn as each epoch starts: 4 steps an epoch, 3 epochs."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    if sampler == "shuffle":
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=_ShuffledInPlace(32))
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=8, micro_batch_size=8, epochs=3,
        save_every_steps=save_every, device="cpu", progress="off", memory_watch=False,
    )  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        loader,
        config,
        callbacks=[_StopAt(stop_at)],
    ).fit()
    losses = {r["step"]: r["loss"] for r in read_losses(run_dir)}
    return model, losses


def read_losses(run_dir: Path) -> list[dict]:
    from steadytrain.telemetry.files import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("sampler", ["shuffle", "in place"])
def test_drawing_the_next_epoch_s_order_ahead_at_a_save_changes_nothing(tmp_path, sampler):
    """The checkpoint at an epoch's end draws the next epoch's order ahead, on copies of the
    sampler and its generator (a sampler that shuffles its own list in place included): the
    run's losses are those of a run that saves nothing."""
    _, unsaved = _loader_fit(tmp_path / "unsaved", sampler, save_every=1000)
    _, saved = _loader_fit(tmp_path / "saved", sampler)
    assert len(saved) == 12 and saved == unsaved


def test_the_loss_check_is_made_after_an_epoch_end_save_of_a_shuffling_dataloader(tmp_path):
    """The next epoch's order is drawn when it starts; the checkpoint at the epoch's end draws
    it ahead, so a resume from it is checked (docs/resume.md) and finds the loss it expects."""
    whole, _ = _loader_fit(tmp_path / "whole", "shuffle")
    run_dir = tmp_path / "resumed"
    for stop in (4, 8):  # stopped right after each epoch-end checkpoint, then resumed
        _loader_fit(run_dir, "shuffle", stop_at=[stop])
    resumed, _ = _loader_fit(run_dir, "shuffle")
    checks = events(run_dir, "continuity")
    assert [(c["step"], c["checked"], c["equal"]) for c in checks] == [
        (5, True, True),
        (9, True, True),
    ], checks
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
