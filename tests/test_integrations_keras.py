"""Keras 3 (torch backend) with `SteadytrainCallback` as its one added line, for real on CPU: an
out-of-memory under RLIMIT_AS survived in the same process at the batch asked for, a step blocked
in user code, a SIGKILL under `steadytrain run`, and the report of what happened."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import real_oom
from integration_helpers import (
    assert_same_params,
    events,
    finish,
    kill_child,
    report,
    run_plain,
    start_plain,
    start_supervised,
    steps_logged,
    stop_with_sigterm,
    wait_for,
    workload_env,
)

from steadytrain.telemetry.files import read_jsonl

if importlib.util.find_spec("keras") is None:  # imported in the workloads only (torch backend)
    pytest.skip("keras is not installed", allow_module_level=True)

SCRIPT = "keras_fit.py"
ENV = {"KERAS_BACKEND": "torch"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted fit: 3 epochs of 4 steps, a checkpoint at each epoch end."""
    run_dir = tmp_path_factory.mktemp("keras") / "reference"
    proc = run_plain(SCRIPT, run_dir, env=workload_env(**ENV))
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.mark.slow
def test_oom_is_redone_in_pieces_of_the_same_batch_and_matches_a_clean_run(tmp_path: Path):
    limited = tmp_path / "limited"
    args = ("--batch", "64", "--samples", "128", "--epochs", "2")
    proc = run_plain(SCRIPT, limited, *args, "--limit-mib", "150", env=workload_env(**ENV))
    assert proc.returncode == 0, proc.stderr
    ooms, shrinks = events(limited, "oom"), events(limited, "shrink")
    assert ooms and all(real_oom(e["error"]) for e in ooms)
    assert shrinks[0]["old"] == 64 and len(shrinks) == len(ooms)
    micro = shrinks[-1]["new"]
    rows = read_jsonl(limited / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["micro_batch_size"] == micro and r["samples"] == 64 for r in rows)

    # The same pieces from the start, without the address-space cap: no out-of-memory, the same
    # parameters up to rounding (near the cap the CPU kernels' own scratch allocations fail and
    # they take other code paths: the first step's loss already differs in its 7th digit).
    clean = tmp_path / "clean"
    env = workload_env(**ENV, STEADYTRAIN_MAX_MICRO_BATCH=str(micro))
    proc = run_plain(SCRIPT, clean, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not events(clean, "oom")
    a = torch.load(limited / "params.pt", weights_only=True)
    b = torch.load(clean / "params.pt", weights_only=True)
    for name in a:
        assert (a[name] - b[name]).norm() <= 1e-5 * b[name].norm() + 1e-8, name
    out = report(limited).stdout
    assert f"{len(ooms)} out-of-memory, {len(shrinks)} shrink(s)" in out


@pytest.mark.slow
def test_a_step_blocked_in_user_code_exits_75_and_the_restart_finishes(tmp_path: Path, reference):
    run_dir = tmp_path / "hang"
    args = ("--hang-at", "6", "--hang-timeout", "10")
    code, _out, err = finish(start_supervised(SCRIPT, run_dir, *args, env=workload_env(**ENV)))
    assert code == 0, err
    hangs = events(run_dir, "hang")
    assert len(hangs) == 1 and hangs[0]["step"] == 5
    dump = (run_dir / hangs[0]["file"]).read_text()
    assert "in call" in dump and "keras_fit.py" in dump
    assert [r["exit_code"] for r in events(run_dir, "restart")] == [75]
    assert events(run_dir, "resume")[0]["checkpoint"].endswith("step-00000004")
    assert json.loads((run_dir / "result.json").read_text())["global_step"] == 12
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    report(run_dir)


@pytest.mark.slow
def test_sigkill_resumes_from_a_verified_checkpoint_to_the_same_parameters(
    tmp_path: Path, reference
):
    run_dir = tmp_path / "killed"
    proc = start_supervised(SCRIPT, run_dir, "--slow", "0.3", env=workload_env(**ENV))
    wait_for(lambda: steps_logged(run_dir) >= 6, "step 6 of the first attempt")
    kill_child(run_dir)
    code, _out, err = finish(proc)
    assert code == 0, err
    restarts = events(run_dir, "restart")
    assert len(restarts) == 1 and restarts[0]["signal"] == "SIGKILL"
    assert events(run_dir, "resume")[0]["checkpoint"].endswith("step-00000004")
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    assert "1 restart(s)" in report(run_dir).stdout


def test_sigterm_saves_through_keras_exits_143_and_the_next_start_finishes(tmp_path: Path):
    """Keras restarts an epoch from its first batch, so a mid-epoch save repeats that epoch's
    batches (docs/integrations.md); the resumed fit runs to its last epoch."""
    run_dir = tmp_path / "stopped"
    proc = start_plain(SCRIPT, run_dir, "--slow", "0.3", env=workload_env(**ENV))
    stopped_at = stop_with_sigterm(proc, run_dir)
    saved = events(run_dir, "checkpoint")[-1]
    assert saved["step"] == stopped_at
    again = run_plain(SCRIPT, run_dir, env=workload_env(**ENV))
    assert again.returncode == 0, again.stderr
    resume = events(run_dir, "resume")[0]
    assert resume["checkpoint"].endswith(f"step-{stopped_at:08d}")
    assert events(run_dir, "fit_end")[-1]["reason"] == "finished"
