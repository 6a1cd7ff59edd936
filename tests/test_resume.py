"""Exact resume (reliability matrix rows 2, 3, 4, 13, 16, 17, 24), with real child processes.

Every run is tests/workloads/resumable.py: a model with dropout, a dataset that draws from
python's random, numpy and torch while loading, AdamW and a LambdaLR schedule, 15 steps of 8
samples split 4 + 4, checkpoints every 3 steps (async). A golden run goes uninterrupted; an
interrupted one is killed or signalled, then started again on the same run directory.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
from conftest import run_workload

from steadytrain.telemetry.files import read_jsonl

STEPS = 15


def losses(run_dir) -> dict[int, float]:
    """Per-step loss; a step run twice (before a kill and after the resume) keeps its last."""
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def events(run_dir, name):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    runs = {}
    for workers in (0, 2):
        run_dir = tmp_path_factory.mktemp(f"golden{workers}")
        proc = run_workload("resumable.py", str(run_dir), "--workers", str(workers))
        assert proc.returncode == 0, proc.stderr
        runs[workers] = (losses(run_dir), torch.load(run_dir / "params.pt", weights_only=True))
    return runs


def assert_same_run(run_dir, golden_run, resumed_after: int):
    want_losses, want_params = golden_run
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(resumed_after + 1, STEPS + 1):
        assert got[step] == want_losses[step], f"step {step}"  # bit for bit
    params = torch.load(run_dir / "params.pt", weights_only=True)
    for name, value in want_params.items():
        assert torch.equal(params[name], value), name


def test_workers_do_not_change_the_run(golden):
    assert golden[0][0] == golden[2][0]


SLOW = pytest.mark.slow  # `make test-all`: the same path as a neighbouring case


@pytest.mark.parametrize(
    ("kill", "workers"),
    [
        (("--kill-at", "1"), 0),  # the first step, before any checkpoint
        pytest.param(("--kill-at", "7"), 0, marks=SLOW),  # mid-epoch
        (("--kill-at", "10"), 0),  # an epoch boundary
        pytest.param(("--kill-mid-step", "8"), 0, marks=SLOW),  # inside step 8's accumulation
        pytest.param(("--kill-at", "15"), 0, marks=SLOW),  # the last step
        (("--kill-at", "7"), 2),
        (("--kill-mid-step", "11"), 2),
    ],
)
def test_kill_9_then_resume_is_the_same_run(tmp_path, golden, kill, workers):
    first = run_workload("resumable.py", str(tmp_path), "--workers", str(workers), *kill)
    assert first.returncode == -signal.SIGKILL
    committed = [e["step"] for e in events(tmp_path, "checkpoint")]
    second = run_workload("resumable.py", str(tmp_path), "--workers", str(workers))
    assert second.returncode == 0, second.stderr
    resumes = events(tmp_path, "resume")
    resumed_at = resumes[0]["step"] if resumes else 0
    assert resumed_at >= (max(committed) - 3 if committed else 0)  # lost at most one interval
    assert_same_run(tmp_path, golden[workers], resumed_at)
    checks = events(tmp_path, "continuity")
    if resumed_at and resumed_at < STEPS:
        assert checks and checks[0]["checked"] and checks[0]["equal"]


@pytest.mark.parametrize(("name", "code"), [("TERM", 143), ("INT", 130)])
def test_a_signal_saves_and_exits_with_its_code_and_loses_nothing(tmp_path, golden, name, code):
    first = run_workload("resumable.py", str(tmp_path), "--signal-at", "5", "--signal", name)
    assert first.returncode == code, first.stderr
    assert f"SIG{name} received" in first.stderr
    assert "Traceback" not in first.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    assert events(tmp_path, "signal")[0]["signal"] == f"SIG{name}"
    second = run_workload("resumable.py", str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert events(tmp_path, "resume")[0]["step"] == 5  # lost 0 steps
    assert_same_run(tmp_path, golden[0], 5)


def test_a_second_ctrl_c_during_the_save_does_not_tear_it(tmp_path, golden):
    first = run_workload(
        "resumable.py", str(tmp_path), "--signal-at", "4", "--signal", "INT", "--double-sigint"
    )
    assert first.returncode == 130, first.stderr
    assert "already stopping" in first.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    second = run_workload("resumable.py", str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert_same_run(tmp_path, golden[0], 4)


def test_resume_with_a_changed_run_is_refused_naming_each_change(tmp_path):
    assert run_workload("resumable.py", str(tmp_path), "--kill-at", "6").returncode == -9
    proc = run_workload("resumable.py", str(tmp_path), "--seed", "1")
    assert proc.returncode == 2
    assert "seed: 0 -> 1" in proc.stderr and "resume_overrides" in proc.stderr
    assert "Traceback" not in proc.stderr
    allowed = run_workload("resumable.py", str(tmp_path), "--seed", "1", "--override", "seed")
    assert allowed.returncode == 0, allowed.stderr
    assert "seed: 0 -> 1" in events(tmp_path, "resume_override")[0]["change"]


def test_changed_data_behind_an_unchanged_fingerprint_is_caught_by_the_loss_check(tmp_path):
    """Recorded and shown, not a stop (continuity_strict: false, the default)."""
    assert run_workload("resumable.py", str(tmp_path), "--kill-at", "7").returncode == -9
    proc = run_workload("resumable.py", str(tmp_path), "--perturb-data")
    assert proc.returncode == 0, proc.stderr
    assert "has loss" in proc.stderr and "going on" in proc.stderr
    check = events(tmp_path, "continuity")[0]
    assert check["checked"] and not check["equal"]


def test_finished_run_resumes_to_nothing_left(tmp_path, golden):
    assert run_workload("resumable.py", str(tmp_path)).returncode == 0
    again = run_workload("resumable.py", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert events(tmp_path, "resume")[-1]["step"] == STEPS
    assert json.loads((tmp_path / "config.json").read_text())["epochs"] == 3
