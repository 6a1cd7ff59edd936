"""The core promise on a real out-of-memory: shrink the micro-batch, redo the same batch, finish.

The OOM is PyTorch's own CPU allocator error, raised because the child process's address space
is capped (RLIMIT_AS) a little above its size after a warm-up step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import MALLOC_ENV, WORKLOADS, real_oom, run_workload

from steadytrain.telemetry.files import read_jsonl


def test_real_oom_is_survived_and_matches_a_run_at_the_final_micro_size(tmp_path: Path):
    limited = run_workload(
        "wide_mlp.py",
        str(tmp_path / "limited"),
        "--limit-mib",
        "200",
        "--steps",
        "4",
        env=MALLOC_ENV,
    )
    assert limited.returncode == 0, limited.stderr
    result = json.loads((tmp_path / "limited" / "result.json").read_text())
    assert result["steps"] == 4
    assert result["oom_count"] >= 1
    final_micro = result["micro_batch_size"]
    assert final_micro < 64

    events = read_jsonl(tmp_path / "limited" / "events.jsonl")
    ooms = [e for e in events if e["event"] == "oom"]
    shrinks = [e for e in events if e["event"] == "shrink"]
    assert ooms and all(real_oom(e["error"]) for e in ooms)
    assert next((s["old"], s["new"]) for s in shrinks)[0] == 64
    assert shrinks[-1]["new"] == final_micro
    assert all(s["memory"]["rss"] > 0 for s in shrinks)
    metrics = read_jsonl(tmp_path / "limited" / "metrics.jsonl")
    assert [m["samples"] for m in metrics] == [64] * 4  # the optimizer saw the whole batch

    fixed = run_workload(
        "wide_mlp.py", str(tmp_path / "fixed"), "--micro", str(final_micro), "--steps", "4"
    )
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads((tmp_path / "fixed" / "result.json").read_text())["oom_count"] == 0
    a = torch.load(tmp_path / "limited" / "params.pt", weights_only=True)
    b = torch.load(tmp_path / "fixed" / "params.pt", weights_only=True)
    for name in a:
        rel = (a[name] - b[name]).norm() / b[name].norm()
        assert rel <= 1e-5, name


def test_one_sample_that_does_not_fit_exits_3_with_numbers(tmp_path: Path):
    proc = run_workload(
        "wide_mlp.py",
        str(tmp_path / "run"),
        "--limit-mib",
        "150",
        "--tokens",
        "8192",
        "--steps",
        "1",
        "--batch",
        "4",
        "--samples",
        "8",
        env=MALLOC_ENV,
    )
    assert proc.returncode == 3, proc.stderr
    err = proc.stderr
    assert "does not fit" in err
    assert "Traceback" not in err
    assert "MiB in use" in err and "asked for" in err and "budget" in err
    assert "shorter sequences" in err
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["new"] for e in events if e["event"] == "shrink"][-1] == 1
    assert not (tmp_path / "run" / "result.json").exists()


def test_a_batch_norm_model_shrunk_to_one_sample_exits_3_naming_batch_norm(tmp_path: Path):
    """BatchNorm1d cannot train on one sample (one value per channel). When micro-batch 2 runs
    out of memory, the ladder's last halving cannot help: the run ends as one that does not fit
    (exit 3, what helps, no traceback), not with torch's ValueError as an internal error. With
    room, the same program trains at the whole batch."""
    roomy = run_workload(
        "batch_norm.py", str(tmp_path / "roomy"), "--limit-mib", "400", env=MALLOC_ENV
    )
    assert roomy.returncode == 0, roomy.stderr
    assert json.loads((tmp_path / "roomy" / "result.json").read_text())["micro_batch_size"] == 4

    proc = run_workload("batch_norm.py", str(tmp_path / "run"), "--limit-mib", "80", env=MALLOC_ENV)
    assert proc.returncode == 3, proc.stderr
    assert "does not fit: micro-batch 2 ran out of memory" in proc.stderr
    assert "BatchNorm" in proc.stderr and "GroupNorm/LayerNorm" in proc.stderr
    assert "Traceback" not in proc.stderr
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    shrinks = [(e["old"], e["new"]) for e in events if e["event"] == "shrink"]
    assert shrinks == [(4, 2), (2, 1)]
    assert all(real_oom(e["error"]) for e in events if e["event"] == "oom")
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("limit", [pytest.param("160", marks=pytest.mark.slow), "300"])
def test_surviving_leaves_no_growing_memory(tmp_path: Path, limit: str):
    """After recovery the process holds no more than before the failed attempt (nothing leaks
    through the exception's frames), so later steps at the smaller size keep fitting."""
    proc = run_workload(
        "wide_mlp.py", str(tmp_path / "run"), "--limit-mib", limit, "--steps", "6", env=MALLOC_ENV
    )
    assert proc.returncode == 0, proc.stderr
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 6
    rss = [m["mem_rss"] for m in metrics[1:]]
    assert max(rss) - min(rss) < 64 * 2**20


def glibc_defaults(script: str, *args: str, timeout: float = 300):
    """Run a workload as a user who sets no MALLOC_* variable would (glibc's default malloc)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "STEADYTRAIN_"))}
    return forkserver.run(
        [sys.executable, str(WORKLOADS / script), *args],
        timeout=timeout,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )


def test_under_ulimit_v_a_shrink_that_does_not_help_exits_76_not_does_not_fit(tmp_path: Path):
    """Under RLIMIT_AS with glibc's default malloc, the memory a failed attempt freed stays in
    the address space: the in-process ladder used to fall to micro-batch 1 and call the run
    "does not fit" (exit 3) where a fresh process trains. Now the second out-of-memory of a
    step, after a shrink, exits 76 (a fresh process restarts smaller), naming why."""
    proc = glibc_defaults(
        "wide_mlp.py", str(tmp_path / "run"), "--limit-mib", "200", "--steps", "2"
    )
    assert proc.returncode == 76, proc.stderr
    assert "does not fit" not in proc.stderr and "Traceback" not in proc.stderr
    assert "ulimit -v" in proc.stderr and "steadytrain run" in proc.stderr
    assert "MALLOC_ARENA_MAX=1" in proc.stderr
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    ooms = [e for e in events if e["event"] == "oom"]
    shrinks = [(e["old"], e["new"]) for e in events if e["event"] == "shrink"]
    assert len(ooms) == len(shrinks) + 1 and all(real_oom(e["error"]) for e in ooms)
    assert ooms[-1]["micro_batch_size"] == shrinks[-1][1] >= 2  # stopped before micro-batch 1


@pytest.mark.slow
def test_under_ulimit_v_steadytrain_run_finishes_where_the_ladder_said_does_not_fit(
    tmp_path: Path,
):
    """Under `steadytrain run`, an exit 76 restarts a fresh process at half the micro-batch
    that failed, and the run finishes. (Under 200 MiB the chain may end at micro-batch 1 that
    does not fit even fresh, a true exit 3; 300 leaves room for micro-batch 8.)"""
    run_dir = tmp_path / "run"
    workload = [sys.executable, str(WORKLOADS / "wide_mlp.py"), str(run_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "STEADYTRAIN_"))}
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
            *("--backoff-initial", "0.05", "--", *workload, "--limit-mib", "300", "--steps", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "does not fit" not in proc.stderr
    restarts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert restarts and all(r["exit_code"] == 76 for r in restarts), restarts
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 2
