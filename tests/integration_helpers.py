"""What the tests of the Hugging Face, Lightning and Keras callbacks share: running a workload
under `steadytrain run`, killing its child, polling the run directory, comparing parameters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import MALLOC_ENV, WORKLOADS

from steadytrain.telemetry.files import read_jsonl

SUPERVISOR = [sys.executable, "-m", "steadytrain.cli", "run", "--backoff-initial", "0.2"]
UPPER_BOUND_S = 240.0
"""Generous upper bound for one supervised run on a loaded machine; tests poll, never sleep."""


def workload_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **MALLOC_ENV, **extra}
    env.pop("STEADYTRAIN_RESTART", None)
    env.pop("STEADYTRAIN_MAX_MICRO_BATCH", None)
    return env


def start_supervised(script: str, run_dir: Path, *args: str, env=None):
    """`steadytrain run -- python SCRIPT RUN_DIR ARGS`: the supervisor forks from the warm server
    (tests/forkserver.py); the child it starts is its own, as a user's would be."""
    command = [*SUPERVISOR, "--run-dir", str(run_dir), "--", sys.executable]
    return forkserver.start(
        [*command, str(WORKLOADS / script), str(run_dir), *args], env or workload_env()
    )


def finish(proc, timeout: float = UPPER_BOUND_S) -> tuple[int, str, str]:
    """Wait for a process of `start_plain` / `start_supervised` (or a `subprocess.Popen` with
    pipes); its exit code and output."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        out, err = _output(proc)
        raise AssertionError(f"still running after {timeout} s:\n{out}\n{err}") from None
    out, err = _output(proc)
    return code, out, err


def _output(proc) -> tuple[str, str]:
    return proc.output() if hasattr(proc, "output") else proc.communicate()


def start_plain(script: str, run_dir: Path, *args: str, env=None):
    return forkserver.start(
        [sys.executable, str(WORKLOADS / script), str(run_dir), *args], env or workload_env()
    )


def stop_with_sigterm(proc: subprocess.Popen, run_dir: Path, after_step: int = 1) -> int:
    """SIGTERM once `after_step` steps are logged; the process must save and exit 143. Returns
    the step it stopped at."""
    wait_for(lambda: steps_logged(run_dir) >= after_step, f"step {after_step}")
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc)
    assert code == 143, err
    assert events(run_dir, "signal")[0]["signal"] == "SIGTERM"
    return events(run_dir, "fit_end")[-1]["step"]


def run_plain(script: str, run_dir: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return forkserver.run(
        [sys.executable, str(WORKLOADS / script), str(run_dir), *args],
        env=env or workload_env(),
        timeout=UPPER_BOUND_S,
    )


def assert_batch_lines_average_to_epoch_losses(run_dir: Path) -> None:
    """tests/workloads/keras_any.py's run (36 samples in batches of 8, 3 epochs): each metrics
    line holds its own batch's loss and size, and weighted by the sizes an epoch's lines average
    to the loss Keras reported for the epoch (result.json), not Keras's running mean."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["samples"] for r in rows] == [8, 8, 8, 8, 4] * 3
    assert all(r["micro_batch_size"] == r["samples"] and r["micro_steps"] == 1 for r in rows)
    result = json.loads((run_dir / "result.json").read_text())
    for epoch, expected in enumerate(result["epoch_losses"]):
        lines = [r for r in rows if r["epoch"] == epoch]
        mean = sum(r["loss"] * r["samples"] for r in lines) / sum(r["samples"] for r in lines)
        assert mean == pytest.approx(expected, rel=1e-5)


def wait_for(condition: Callable[[], object], what: str, timeout: float = UPPER_BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def steps_logged(run_dir: Path) -> int:
    return max((m.get("step", 0) for m in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    found = read_jsonl(run_dir / "events.jsonl")
    return [e for e in found if kind is None or e["event"] == kind]


def kill_child(run_dir: Path) -> int:
    """SIGKILL the training process (its pid is in the heartbeat the watchdog writes)."""
    beat = json.loads((run_dir / "heartbeat").read_text())
    os.kill(beat["pid"], signal.SIGKILL)
    return beat["pid"]


def assert_same_params(a_path: Path, b_path: Path) -> None:
    a = torch.load(a_path, weights_only=True)
    b = torch.load(b_path, weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def report(run_dir: Path) -> subprocess.CompletedProcess:
    """`steadytrain report RUN_DIR`, and what every integration's report must show."""
    proc = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "report", str(run_dir)], timeout=UPPER_BOUND_S
    )
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert pngs == ["loss_lr.png", "memory_events.png", "step_time.png"]
    from steadytrain.telemetry.report import load_run, memory_counters

    run = load_run(run_dir)
    assert run.steps and all(isinstance(r.get("loss"), float) for r in run.steps)
    assert memory_counters(run)  # a memory series to draw
    return proc
