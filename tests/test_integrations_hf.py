"""Hugging Face `Trainer` with `SteadytrainCallback` as its one added line, for real on CPU: an
out-of-memory under RLIMIT_AS, a step blocked in user code, a SIGKILL under `steadytrain run`,
a checkpoint cut short, and the report of what happened."""

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
    start_plain,
    start_supervised,
    steps_logged,
    stop_with_sigterm,
    wait_for,
)

from steadytrain.telemetry.files import read_jsonl

for _library in ("transformers", "accelerate"):  # imported in the workloads only
    if importlib.util.find_spec(_library) is None:
        pytest.skip(f"{_library} is not installed", allow_module_level=True)

SCRIPT = "hf_trainer.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of 6 steps at batch 16, checkpoints every 2."""
    run_dir = tmp_path_factory.mktemp("hf") / "reference"
    proc = run_plain(SCRIPT, run_dir, "--steps", "6")
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_oom_keeps_the_effective_batch_and_matches_a_clean_run(tmp_path: Path):
    limited = tmp_path / "limited"
    proc = run_plain(
        SCRIPT, limited, "--batch", "64", "--auto-find", "--limit-mib", "150", "--steps", "3"
    )
    assert proc.returncode == 0, proc.stderr
    ooms, shrinks = events(limited, "oom"), events(limited, "shrink")
    assert ooms and all(real_oom(e["error"]) for e in ooms)
    assert shrinks[0]["old"] == 64
    micro = shrinks[-1]["new"]
    assert micro < 64 and 64 % micro == 0
    rows = read_jsonl(limited / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Hugging Face alone would have gone on at 57 samples a step; the optimizer saw 64.
    assert all(r["micro_batch_size"] * r["accumulation"] == 64 for r in rows)
    assert all(r["samples"] == 64 for r in rows)

    clean = tmp_path / "clean"
    proc = run_plain(
        SCRIPT, clean, "--batch", str(micro), "--accum", str(64 // micro), "--steps", "3"
    )
    assert proc.returncode == 0, proc.stderr
    assert not events(clean, "oom")
    assert_same_params(limited / "params.pt", clean / "params.pt")

    out = report(limited).stdout
    assert f"{len(ooms)} out-of-memory, {len(shrinks)} shrink(s)" in out


@pytest.mark.slow
def test_a_step_blocked_in_user_code_exits_75_and_the_restart_finishes(tmp_path: Path, reference):
    run_dir = tmp_path / "hang"
    proc = start_supervised(
        SCRIPT, run_dir, "--steps", "6", "--hang-at", "4", "--hang-timeout", "8"
    )
    code, _out, err = finish(proc)
    assert code == 0, err
    hangs = events(run_dir, "hang")
    assert len(hangs) == 1 and hangs[0]["step"] == 3
    dump = (run_dir / hangs[0]["file"]).read_text()
    assert "in forward" in dump and "hf_trainer.py" in dump  # the stack of the blocked step
    restarts = events(run_dir, "restart")
    assert [r["exit_code"] for r in restarts] == [75]
    assert events(run_dir, "resume")[0]["checkpoint"].endswith("checkpoint-2")
    assert json.loads((run_dir / "result.json").read_text())["global_step"] == 6
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    report(run_dir)


def test_sigkill_resumes_from_a_verified_checkpoint_to_the_same_parameters(
    tmp_path: Path, reference
):
    run_dir = tmp_path / "killed"
    proc = start_supervised(SCRIPT, run_dir, "--steps", "6", "--slow", "0.3")
    wait_for(lambda: steps_logged(run_dir) >= 3, "step 3 of the first attempt")
    kill_child(run_dir)
    code, _out, err = finish(proc)
    assert code == 0, err
    restarts = events(run_dir, "restart")
    assert len(restarts) == 1 and restarts[0]["signal"] == "SIGKILL"
    (resume,) = events(run_dir, "resume")
    assert resume["checkpoint"].endswith(("checkpoint-2", "checkpoint-4"))
    assert resume["step"] == int(resume["checkpoint"].rsplit("-", 1)[1])  # the step resumed at
    assert_same_params(run_dir / "params.pt", reference / "params.pt")
    assert "1 restart(s)" in report(run_dir).stdout


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_is_never_resumed_from(tmp_path: Path, reference):
    run_dir = tmp_path / "cut"
    proc = run_plain(SCRIPT, run_dir, "--steps", "6")
    assert proc.returncode == 0, proc.stderr
    # A kill between Hugging Face's save and the manifest leaves this; a torn file, that:
    (run_dir / "checkpoint-6" / "steadytrain-manifest.json").unlink()
    with open(run_dir / "checkpoint-4" / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    (run_dir / "params.pt").unlink()
    proc = run_plain(SCRIPT, run_dir, "--steps", "6")
    assert proc.returncode == 0, proc.stderr
    skipped = {e["step"]: e["problems"] for e in events(run_dir, "checkpoint_skipped")}
    assert set(skipped) == {4, 6}
    assert "missing or unreadable" in skipped[6][0] and "model.safetensors" in skipped[4][0]
    (resume,) = events(run_dir, "resume")
    assert resume["checkpoint"].endswith("checkpoint-2") and resume["step"] == 2
    assert_same_params(run_dir / "params.pt", reference / "params.pt")


@pytest.mark.slow
def test_sigterm_saves_through_hugging_face_exits_143_and_resumes_exactly(
    tmp_path: Path, reference
):
    run_dir = tmp_path / "stopped"
    stopped_at = stop_with_sigterm(
        start_plain(SCRIPT, run_dir, "--steps", "6", "--slow", "0.3"), run_dir
    )
    assert 1 <= stopped_at < 6
    assert (run_dir / f"checkpoint-{stopped_at}" / "steadytrain-manifest.json").is_file()
    again = run_plain(SCRIPT, run_dir, "--steps", "6")
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[0]["checkpoint"].endswith(f"checkpoint-{stopped_at}")
    assert_same_params(run_dir / "params.pt", reference / "params.pt")


def test_preflight_prints_once_and_exits_3_when_the_model_cannot_fit(tmp_path: Path):
    run_dir = tmp_path / "tiny-budget"
    proc = run_plain(SCRIPT, run_dir, "--steps", "2", "--memory-budget", "4MiB")
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("steadytrain: before the start:") == 1
    assert "does not fit" in proc.stderr and "Traceback" not in proc.stderr
    preflight = events(run_dir, "preflight")[0]
    assert preflight["parameters"] == 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 64 + 64
    assert preflight["weights"] == 4 * preflight["parameters"]
    assert preflight["before_activations"] == 4 * preflight["weights"]  # + grads + AdamW's 2
    assert events(run_dir, "fit_end")[-1]["exit_code"] == 3
    assert not list(run_dir.glob("checkpoint-*")) and not (run_dir / "metrics.jsonl").exists()
