"""A kill storm: random SIGKILLs of a supervised CPU training run, during steps and saves.

Every kill lands after the attempt's first optimizer step (an attempt killed while it starts
proves nothing about resuming). The run still finishes, its final parameters equal the
uninterrupted run's bit for bit, no corrupt checkpoint is ever resumed from (each resume passes
the loss check), and each kill costs at most the steps since the last committed checkpoint:
every resume starts from the newest checkpoint that was committed when the kill landed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import WORKLOADS, run_workload

from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.telemetry.files import read_jsonl

SAVE_EVERY = 3
STEP_SLEEP = 0.02


def workload_args(kills: int) -> tuple[str, ...]:
    """Long enough that `kills` kills land before the end: an attempt runs at most 10 steps
    and a few more while it is killed (5 steps an epoch)."""
    return ("--epochs", str(4 * kills), "--save-every", str(SAVE_EVERY))


def poll(condition, timeout: float = 300.0, every: float = 0.01):
    """Wait until `condition()` returns something true; return it (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"not reached within {timeout} s: {condition.__doc__}")


def read_progress(path: Path) -> tuple[int, int, int] | None:
    """(pid, steps done by that process, step) from the workload's progress file."""
    try:
        pid, done, step = map(int, path.read_text().split())
    except (OSError, ValueError):
        return None
    return pid, done, step


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for the supervisor counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in ("Z", "X")
    except (OSError, IndexError):
        return True


def committed_step(run_dir: Path) -> int | None:
    """The newest published checkpoint folder's step: a checkpoint counts once its folder is
    renamed into place, also when a kill came before `latest` was updated (reliability row 1)."""
    committed = CheckpointStore(run_dir).committed()
    return committed[-1][0] if committed else None


def storm(tmp_path: Path, kills: int, seed: int, args: tuple[str, ...]) -> tuple[Path, list]:
    """Run the workload under `steadytrain run` and SIGKILL it `kills` times, each after a
    random number (1 to 10) of the attempt's steps, at a random moment of its steps and saves. Returns the run folder and
    the committed checkpoint step at each kill (None: none committed yet)."""
    run_dir = tmp_path / "storm"
    progress = tmp_path / "progress"
    cmd = [
        *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
        *("--max-restarts", "100", "--backoff-initial", "0.01", "--backoff-max", "0.05"),
        *("--", sys.executable, str(WORKLOADS / "resumable.py"), str(run_dir), *args),
        *("--step-sleep", str(STEP_SLEEP), "--progress-file", str(progress)),
    ]
    supervisor = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    rng = random.Random(seed)
    killed: set[int] = set()
    at_kill: list[int | None] = []
    try:
        while len(at_kill) < kills:
            steps = rng.randint(1, 10)  # counted in steps, not seconds: the same under load

            def attempt_stepped(steps=steps):
                """a new attempt has done `steps` optimizer steps (at least its first)"""
                found = read_progress(progress)
                if supervisor.poll() is not None:
                    pytest.fail(f"the run ended after {len(at_kill)} kills")
                return found if found and found[0] not in killed and found[1] >= steps else None

            pid = poll(attempt_stepped)[0]
            time.sleep(rng.uniform(0.0, STEP_SLEEP * 2))  # lands in steps and saves alike
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            poll(lambda pid=pid: gone(pid), timeout=60)
            at_kill.append(committed_step(run_dir))
        _, err = supervisor.communicate(timeout=600)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == 0, err
    return run_dir, at_kill


@pytest.mark.parametrize(
    "kills",
    [pytest.param(6, id="6-kills"), pytest.param(50, id="50-kills", marks=pytest.mark.slow)],
)
def test_kill_storm_finishes_with_the_uninterrupted_result(tmp_path, kills):
    args = workload_args(kills)
    golden = tmp_path / "golden"
    assert run_workload("resumable.py", str(golden), *args, timeout=900).returncode == 0
    run_dir, at_kill = storm(tmp_path, kills, seed=kills, args=args)

    want = torch.load(golden / "params.pt", weights_only=True)
    got = torch.load(run_dir / "params.pt", weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in want.items())

    events = read_jsonl(run_dir / "events.jsonl")
    assert len([e for e in events if e["event"] == "restart"]) >= kills
    checks = [e for e in events if e["event"] == "continuity" and e["checked"]]
    assert checks and all(e["equal"] for e in checks)
    # Each attempt after a kill resumes from exactly the checkpoint committed when the kill
    # landed (afresh when none was), so a kill costs only the steps since that commit.
    resumed = [e["step"] for e in events if e["event"] == "resume"]
    assert resumed == [step for step in at_kill if step is not None]
    assert len(resumed) >= kills // 2  # kills before the first commit restart afresh
    # A "checkpoint" event means committed: no attempt announced a checkpoint newer than the
    # newest committed one when it was killed (the supervisor's "restart" ends each attempt).
    announced = [0]
    for e in events:
        if e["event"] == "restart":
            announced.append(0)
        elif e["event"] == "checkpoint":
            announced[-1] = max(announced[-1], e["step"])
    assert all(a <= (k or 0) for a, k in zip(announced[:-1], at_kill, strict=True))
