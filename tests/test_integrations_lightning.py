"""Lightning with `SteadytrainCallback` as its one added line, for real on CPU: an out-of-memory
under RLIMIT_AS across one restart, a step blocked in user code, a SIGKILL under `steadytrain run`,
and the report of what happened."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import real_oom
from integration_helpers import (
    assert_same_params,
    events,
    finish,
    kill_child,
    report,
    run_plain,
    start_supervised,
    steps_logged,
    wait_for,
)

from steadytrain.telemetry.files import read_jsonl

if importlib.util.find_spec("lightning") is None:  # imported in the workloads only
    pytest.skip("lightning is not installed", allow_module_level=True)

SCRIPT = "lightning_fit.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted fit: 3 epochs of 4 steps, Lightning's checkpoint at each epoch end."""
    run_dir = tmp_path_factory.mktemp("lightning") / "reference"
    proc = run_plain(SCRIPT, run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_oom_restarts_at_half_the_batch_and_matches_a_clean_run(tmp_path: Path):
    limited = tmp_path / "limited"
    args = ("--samples", "128", "--epochs", "2", "--limit-mib", "150")
    code, _out, err = finish(start_supervised(SCRIPT, limited, "--batch", "64", *args))
    assert code == 0, err
    ooms = events(limited, "oom")
    assert len(ooms) == 1 and real_oom(ooms[0]["error"])
    assert [r["exit_code"] for r in events(limited, "restart")] == [76]
    cap = events(limited, "micro_batch_cap")[0]
    assert (cap["old"], cap["new"], cap["accumulation"]) == (64, 32, 2)
    rows = read_jsonl(limited / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["micro_batch_size"] == 32 and r["samples"] == 64 for r in rows)

    clean = tmp_path / "clean"
    proc = run_plain(
        SCRIPT, clean, "--batch", "32", "--accum", "2", "--samples", "128", "--epochs", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_params(limited / "params.pt", clean / "params.pt")
    out = report(limited).stdout
    assert "1 out-of-memory" in out and "1 restart(s)" in out


@pytest.mark.slow
def test_a_step_blocked_in_user_code_exits_75_and_the_restart_finishes(tmp_path: Path, reference):
    run_dir = tmp_path / "hang"
    proc = start_supervised(SCRIPT, run_dir, "--hang-at", "6", "--hang-timeout", "8")
    code, _out, err = finish(proc)
    assert code == 0, err
    hangs = events(run_dir, "hang")
    assert len(hangs) == 1 and hangs[0]["step"] == 5
    dump = (run_dir / hangs[0]["file"]).read_text()
    assert "in training_step" in dump and "lightning_fit.py" in dump
    assert [r["exit_code"] for r in events(run_dir, "restart")] == [75]
    assert events(run_dir, "resume")[0]["checkpoint"].endswith("epoch=0-step=4.ckpt")
    assert json.loads((run_dir / "result.json").read_text())["global_step"] == 12
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    report(run_dir)


@pytest.mark.slow
def test_sigkill_resumes_from_a_verified_checkpoint_to_the_same_parameters(
    tmp_path: Path, reference
):
    run_dir = tmp_path / "killed"
    proc = start_supervised(SCRIPT, run_dir, "--slow", "0.3")
    wait_for(lambda: steps_logged(run_dir) >= 6, "step 6 of the first attempt")
    kill_child(run_dir)
    code, _out, err = finish(proc)
    assert code == 0, err
    restarts = events(run_dir, "restart")
    assert len(restarts) == 1 and restarts[0]["signal"] == "SIGKILL"
    (resume,) = events(run_dir, "resume")
    assert resume["checkpoint"].endswith(f"step={resume['step']}.ckpt")  # the step resumed at
    assert resume["step"] > 0
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    assert "1 restart(s)" in report(run_dir).stdout


def test_sigterm_mid_epoch_saves_exits_143_and_the_next_start_is_the_uninterrupted_run(
    tmp_path: Path, reference
):
    """Stopped at the 3rd of epoch 1's 4 batches, the save is Lightning's state of the middle of
    that epoch and the only one made (before: the epoch was ended, ModelCheckpoint saved
    `epoch=1-step=7.ckpt` as its end, and the resume skipped the epoch's last batch or, from
    `on-signal.ckpt`, trained a fresh order's first one); the next start trains the batches the
    epoch had left, in its order, and ends where the uninterrupted run ends."""
    run_dir = tmp_path / "stopped"
    stopped = run_plain(SCRIPT, run_dir, "--term-at", "7")
    assert stopped.returncode == 143, stopped.stderr
    assert events(run_dir, "signal")[0]["signal"] == "SIGTERM"
    saved = [e["checkpoint"] for e in events(run_dir, "checkpoint") if e["step"] == 7]
    assert [Path(path).name for path in saved] == ["on-signal.ckpt"]
    again = run_plain(SCRIPT, run_dir)
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[0]["checkpoint"] in saved
    assert json.loads((run_dir / "result.json").read_text())["global_step"] == 12
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in rows] == [(s, (s - 1) // 4) for s in range(1, 13)]
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
