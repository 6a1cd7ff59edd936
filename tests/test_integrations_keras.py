"""Keras 3 (torch backend) with `SteadytrainCallback` as its one added line, for real on CPU: an
out-of-memory under RLIMIT_AS survived in the same process at the batch asked for, a step blocked
in user code, a SIGKILL under `steadytrain run` (with Dropout: every RNG stream comes back), each
metrics line's own batch, and the report of what happened. What needs TensorFlow itself is in
test_keras_tensorflow.py; here, what runs without it: the import that loads no torch off the torch
backend, and TensorFlow's and XLA's out-of-memory errors recognised by the classifier."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import real_oom
from integration_helpers import (
    assert_batch_lines_average_to_epoch_losses,
    assert_same_params,
    events,
    finish,
    kill_child,
    report,
    run_plain,
    start_supervised,
    steps_logged,
    wait_for,
    workload_env,
)

from steadytrain.device.oom import is_oom, oom_kind
from steadytrain.telemetry.files import read_jsonl

if importlib.util.find_spec("keras") is None:  # imported in the workloads only (torch backend)
    pytest.skip("keras is not installed", allow_module_level=True)

SCRIPT = "keras_fit.py"
ANY = "keras_any.py"  # any backend, two Dropout layers, 3 epochs of 5 batches (8, 8, 8, 8, 4)
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


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory) -> Path:
    """An uninterrupted fit of keras_any.py (Dropout) on the torch backend."""
    run_dir = tmp_path_factory.mktemp("keras") / "dropout"
    proc = run_plain(ANY, run_dir, env=workload_env(**ENV))
    assert proc.returncode == 0, proc.stderr
    return run_dir


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = np.load(a / "weights.npz"), np.load(b / "weights.npz")
    assert first.files == second.files
    for name in first.files:
        assert np.array_equal(first[name], second[name]), name


def test_sigkill_with_dropout_resumes_to_the_same_weights_bit_for_bit(
    tmp_path: Path, dropout_reference
):
    """The seeded Dropout draws from its Keras SeedGenerator, the other from torch's stream: both
    come back from the checkpoint, so the restarted run's masks are the uninterrupted run's."""
    run_dir = tmp_path / "killed"
    proc = start_supervised(ANY, run_dir, "--slow", "0.3", env=workload_env(**ENV))
    wait_for(lambda: steps_logged(run_dir) >= 7, "step 7 (second epoch) of the first attempt")
    kill_child(run_dir)
    code, _out, err = finish(proc)
    assert code == 0, err
    assert [r["signal"] for r in events(run_dir, "restart")] == ["SIGKILL"]
    resumed = events(run_dir, "resume")[0]["checkpoint"]
    assert resumed.endswith(("step-00000005", "step-00000010")), resumed
    assert_same_weights(run_dir, dropout_reference)


def test_sigterm_mid_epoch_saves_exits_143_and_the_next_start_is_the_uninterrupted_run(
    tmp_path: Path, dropout_reference
):
    """Stopped at the 2nd of epoch 1's 5 batches, the next start draws that epoch's order again
    and skips the batches done (before: Keras restarted the epoch from its first batch, 17 steps
    instead of 15, other weights): the same steps, epochs, losses and weights, bit for bit."""
    run_dir = tmp_path / "stopped"
    stopped = run_plain(ANY, run_dir, "--term-at", "7", env=workload_env(**ENV))
    assert stopped.returncode == 143, stopped.stderr
    assert events(run_dir, "signal")[0]["signal"] == "SIGTERM"
    assert events(run_dir, "checkpoint")[-1]["step"] == events(run_dir, "fit_end")[-1]["step"] == 7
    assert [e["epoch"] for e in events(run_dir, "epoch_end")] == [0]  # epoch 1 did not end
    again = run_plain(ANY, run_dir, env=workload_env(**ENV))
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[0]["checkpoint"].endswith("step-00000007")
    assert events(run_dir, "fit_end")[-1]["reason"] == "finished"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    expected = read_jsonl(dropout_reference / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in rows] == [(s, (s - 1) // 5) for s in range(1, 16)]
    # each line's loss is a difference of Keras's running sums, which the resume starts afresh
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert_same_weights(run_dir, dropout_reference)


def test_each_metrics_line_holds_its_own_batchs_loss_and_size(dropout_reference):
    """Not Keras's running mean of the epoch: weighted by their sizes, an epoch's lines average
    to the loss Keras reports for the epoch, and the short last batch says it is short."""
    assert_batch_lines_average_to_epoch_losses(dropout_reference)


def test_importing_the_callback_off_the_torch_backend_loads_no_torch():
    """What a TensorFlow or JAX user's program pays: steadytrain's side of the import without
    torch (here keras itself may fail to import the absent backend: the callback then says so
    when made)."""
    code = "import steadytrain.integrations.keras, sys; print('torch' in sys.modules)"
    for backend in ("tensorflow", "jax"):
        env = {**os.environ, "KERAS_BACKEND": backend}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "False", backend


class ResourceExhaustedError(Exception):
    """Stands in for tf.errors.ResourceExhaustedError where TensorFlow is not installed: an
    Exception of that name, no RuntimeError (its type is checked in test_keras_tensorflow.py)."""


def test_tensorflow_and_xla_out_of_memory_errors_are_recognised_by_message():
    tensorflow = ResourceExhaustedError(
        "{{function_node __wrapped__Fill_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
        "OOM when allocating tensor with shape[1099511627776] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu [Op:Fill] name: "
    )
    assert oom_kind(tensorflow) is not None
    try:
        try:
            raise tensorflow
        except ResourceExhaustedError as exc:
            raise ValueError("Graph execution error") from exc  # a library's own wrapper
    except ValueError as wrapped:
        assert is_oom(wrapped)
    xla = RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."
    )
    assert is_oom(xla)
    assert not is_oom(ResourceExhaustedError("Quota exceeded for the input pipeline"))
    assert not is_oom(ValueError("OOM when allocating tensor"))  # no such framework type
