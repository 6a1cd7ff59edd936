"""Stops that reach the whole process group while the DataLoader has worker processes (a
cluster's preemption, systemd's KillMode=control-group, `kill -TERM -PGID`, a terminal's Ctrl-C
or hang-up), and a SIGHUP whose terminal is already gone. Real processes and real signals:
each run is signalled while its step 5 is in progress (the step waits in a callback until the
trainer has the signal), and must end with the signal's code, its checkpoint at step 5, no
error blamed on the user, one "finishing" line, and a rerun that ends on the weights of a run
never stopped, bitwise.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch

from steadytrain.telemetry.files import read_jsonl

HELD = 5  # the step in progress when the signal comes
FINISHING = "received; finishing this optimizer step"

# A user's script: 64 samples in batches of 8 (8 steps), two DataLoader workers, a checkpoint
# every 3 steps. Step HELD waits (STEP_START, its batch read) until the run is stopping; with
# "library-handler", the dataset's code puts SIGTERM's default action back in each worker, as
# a library that installs its own handlers may (the worker then dies of the group's SIGTERM).
PROGRAM = r"""
import signal, sys, time, torch
from pathlib import Path
from steadytrain import Callback, TrainConfig, Trainer

run_dir, hold, variant = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if variant == "library-handler" and torch.utils.data.get_worker_info() is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)

class Hold(Callback):
    def on_step_start(self, state, control, info):
        if state.step + 1 != hold:
            return
        Path(run_dir, "holding").write_text(str(hold))
        deadline = time.monotonic() + 120
        while not control.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
config = TrainConfig(run_dir=run_dir, effective_batch_size=8, micro_batch_size=8, max_steps=8,
                     save_every_steps=3, num_workers=2, device="cpu", progress=sys.argv[4],
                     memory_watch=False, seed=0)
loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
Trainer(model, lambda p: torch.optim.SGD(p, lr=0.01), loss, Data(), config,
        callbacks=[Hold()]).fit()
torch.save(model.state_dict(), Path(run_dir) / "final.pt")
"""


def _command(tmp_path: Path, run_dir: Path, hold: int, variant="plain", progress="lines"):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    return [sys.executable, str(script), str(run_dir), str(hold), variant, progress]


def _wait_for(path: Path, proc, timeout: float = 120) -> None:
    """Until `path` exists (the run holds its step), or fail if the process ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended with {proc.poll()} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)


def _drain_until(fd: int, path: Path, proc, timeout: float = 120) -> None:
    """Read what the run writes to `fd` (a terminal's reader would) until `path` exists."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"ended with {proc.poll()} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        if select.select([fd], [], [], 0.02)[0]:
            with contextlib.suppress(OSError):
                os.read(fd, 65536)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final weights of the run never stopped."""
    tmp = tmp_path_factory.mktemp("through")
    done = forkserver.run(_command(tmp, tmp / "run", 0), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp / "run" / "final.pt", weights_only=True)


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _assert_stopped_at_held(run_dir: Path, name: str) -> None:
    """The checkpoint is the held step's; no error record; the signal recorded at it."""
    assert _latest(run_dir) == f"step-{HELD:08d}"
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] == "error"], events
    assert [(e["signal"], e["step"]) for e in events if e["event"] == "signal"][:1] == [
        (name, HELD)
    ]
    end = [e for e in events if e["event"] == "fit_end"][-1]
    assert "error" not in end, end


def _assert_resumes_equal(tmp_path: Path, run_dir: Path, want: dict) -> None:
    again = forkserver.run(_command(tmp_path, run_dir, 0), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed == [HELD]
    got = torch.load(run_dir / "final.pt", weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("name", "variant"),
    [("SIGTERM", "plain"), ("SIGINT", "plain"), ("SIGTERM", "library-handler")],
    ids=["term", "int", "term-worker-dies-anyway"],
)
def test_a_stop_signal_to_the_process_group_with_workers_saves_the_step_and_resumes(
    tmp_path, uninterrupted, name, variant
):
    """`kill -TERM -PGID` (or Ctrl-C to the group) while step 5 runs with num_workers=2: the
    workers must not die before the trainer has saved; it finishes step 5, commits it and exits
    143 (130), printing the stop once (not once per worker); no error in the user's code. With
    a worker that dies of the signal anyway (its SIGTERM handler put back by the dataset's
    code), the same: the death is the stop's, not the user's error."""
    run_dir = tmp_path / "run"
    proc = forkserver.start(_command(tmp_path, run_dir, HELD, variant), new_group=True)
    try:
        _wait_for(run_dir / "holding", proc)
        os.killpg(proc.pid, getattr(signal, name))
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.output()
    assert code == {"SIGTERM": 143, "SIGINT": 130}[name], err[-3000:]
    assert err.count(FINISHING) == 1, err[-3000:]
    assert "error in your code" not in err
    _assert_stopped_at_held(run_dir, name)
    _assert_resumes_equal(tmp_path, run_dir, uninterrupted)


def test_sigterm_to_steadytrain_run_with_workers_saves_the_step_and_exits_143(
    tmp_path, uninterrupted
):
    """SIGTERM to `steadytrain run` (which forwards it to the child's process group, workers
    included) while step 5 runs: the child saves step 5 and exits 143, the supervisor exits
    143 without a restart; the same command again resumes at step 5 to the uninterrupted
    weights."""
    run_dir = tmp_path / "run"
    supervised = [
        *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
        *("--backoff-initial", "0.01", "--backoff-max", "0.05", "--"),
    ]
    proc = forkserver.start([*supervised, *_command(tmp_path, run_dir, HELD)])
    try:
        _wait_for(run_dir / "holding", proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.output()
    assert code == 143, err[-3000:]
    assert "starting attempt 2" not in err
    assert err.count(FINISHING) == 1, err[-3000:]
    _assert_stopped_at_held(run_dir, "SIGTERM")
    again = forkserver.run([*supervised, *_command(tmp_path, run_dir, 0)], timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    got = torch.load(run_dir / "final.pt", weights_only=True)
    assert all(torch.equal(got[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.parametrize("terminal", ["pipe", "pty"])
def test_sighup_after_the_terminal_closed_saves_the_step_and_exits_129(
    tmp_path, uninterrupted, terminal
):
    """The terminal closed without nohup: stdout and stderr (a pipe to `tee`, or the terminal
    itself) are gone first, then SIGHUP comes to the group while step 5 runs with two workers.
    The run saves step 5 and exits 129 (128 + SIGHUP), its lines to the closed terminal
    dropped instead of ending it; a rerun resumes to the uninterrupted weights."""
    run_dir = tmp_path / "run"
    if terminal == "pipe":
        read_end, write_end = os.pipe()
    else:
        read_end, write_end = pty.openpty()  # progress "auto": the live bar on a terminal
    progress = "auto" if terminal == "pty" else "lines"
    try:
        proc = subprocess.Popen(
            _command(tmp_path, run_dir, HELD, progress=progress),
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=write_end,
            start_new_session=True,
        )
    finally:
        os.close(write_end)
    try:
        _drain_until(read_end, run_dir / "holding", proc)
        os.close(read_end)  # the terminal is gone: writes now fail (EPIPE, EIO)
        os.killpg(proc.pid, signal.SIGHUP)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 129, (run_dir / "events.jsonl").read_text()[-3000:]
    _assert_stopped_at_held(run_dir, "SIGHUP")
    end = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "fit_end"][-1]
    assert end["exit_code"] == 129
    _assert_resumes_equal(tmp_path, run_dir, uninterrupted)
