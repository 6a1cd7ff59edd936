"""Keras 3 on TensorFlow with `SteadytrainCallback`, for real: the training processes run under a
Python that has TensorFlow and no torch (`STEADYTRAIN_TF_PYTHON`; `make test-tensorflow` builds
.venv-tf and sets it), driven from this suite's own environment (`steadytrain run`, the report).

What they show: the callback imports and runs without torch; a SIGKILL with Dropout resumes to
the uninterrupted run's weights bit for bit; each metrics line holds its batch's own loss and size;
TensorFlow's real out-of-memory (`ResourceExhaustedError`, recognised by type) ends the attempt
with exit 76 and `steadytrain run` restarts it with half the batch, which then finishes; the same
for one outside the train step (fit's validation, a callback's predict), and for a crash of
TensorFlow's native code near the address-space cap (judged by the supervisor).

Without such a Python every test here is skipped (CI has no TensorFlow: its install is ~600 MB)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import WORKLOADS, real_oom
from integration_helpers import (
    SUPERVISOR,
    assert_batch_lines_average_to_epoch_losses,
    events,
    finish,
    kill_child,
    report,
    steps_logged,
    wait_for,
    workload_env,
)


def tensorflow_python() -> str | None:
    python = os.environ.get("STEADYTRAIN_TF_PYTHON")
    return python if python and Path(python).is_file() else None


TF_PYTHON = tensorflow_python()
pytestmark = [
    pytest.mark.tensorflow,
    pytest.mark.skipif(
        TF_PYTHON is None,
        reason="TensorFlow is not installed here: `make test-tensorflow` builds .venv-tf "
        "(tensorflow-cpu, keras, no torch) and runs these with STEADYTRAIN_TF_PYTHON set",
    ),
]

ANY = "keras_any.py"  # two Dropout layers, 3 epochs of 5 batches (8, 8, 8, 8, 4)


def tf_env(**extra: str) -> dict[str, str]:
    return workload_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", **extra)


def tf_command(run_dir: Path, *args: str) -> list[str]:
    return [TF_PYTHON, str(WORKLOADS / ANY), str(run_dir), *args]


def run_tf(run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        tf_command(run_dir, *args), capture_output=True, text=True, timeout=300, env=tf_env(**env)
    )


def start_tf_supervised(run_dir: Path, *args: str, **env: str) -> subprocess.Popen:
    """`steadytrain run` (this suite's Python) over the TensorFlow Python's training process."""
    return subprocess.Popen(
        [*SUPERVISOR, "--run-dir", str(run_dir), "--", *tf_command(run_dir, *args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=tf_env(**env),
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted fit on TensorFlow: 3 epochs, a checkpoint at each epoch end."""
    run_dir = tmp_path_factory.mktemp("keras-tf") / "reference"
    proc = run_tf(run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def weights(run_dir: Path) -> dict[str, np.ndarray]:
    with np.load(run_dir / "weights.npz") as saved:
        return {name: saved[name] for name in saved.files}


def test_importing_and_running_the_callback_loads_no_torch(reference):
    code = (
        "import sys, steadytrain.integrations.keras as k, keras; "
        "print('torch' in sys.modules, issubclass(k.SteadytrainCallback, keras.callbacks.Callback))"
    )
    proc = subprocess.run(
        [TF_PYTHON, "-c", code], capture_output=True, text=True, timeout=300, env=tf_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]
    result = json.loads((reference / "result.json").read_text())
    assert result["torch_loaded"] is False  # after a whole fit with checkpoints
    start = events(reference, "fit_start")[0]
    assert start["config"]["backend"] == "tensorflow" and start["device"] == "cpu"


def test_sigkill_with_dropout_resumes_to_the_same_weights_bit_for_bit(tmp_path: Path, reference):
    """Both Dropout layers draw from Keras SeedGenerators on TensorFlow: without their states in
    the checkpoint the restarted run's masks (and weights) differ."""
    run_dir = tmp_path / "killed"
    proc = start_tf_supervised(run_dir, "--slow", "0.3")
    wait_for(lambda: steps_logged(run_dir) >= 7, "step 7 (second epoch) of the first attempt")
    kill_child(run_dir)
    code, _out, err = finish(proc)
    assert code == 0, err
    assert [r["signal"] for r in events(run_dir, "restart")] == ["SIGKILL"]
    resumed = events(run_dir, "resume")[0]["checkpoint"]
    assert resumed.endswith(("step-00000005", "step-00000010")), resumed
    mine, uninterrupted = weights(run_dir), weights(reference)
    assert mine.keys() == uninterrupted.keys()
    for name in mine:
        assert np.array_equal(mine[name], uninterrupted[name]), name


def test_each_metrics_line_holds_its_own_batchs_loss_and_size(reference):
    """Keras on TensorFlow reports the epoch's running mean per batch; the lines hold each
    batch's own loss, which, weighted by the sizes, averages to the epoch's loss."""
    assert_batch_lines_average_to_epoch_losses(reference)


def test_a_real_out_of_memory_exits_76_and_the_restart_at_half_the_batch_finishes(
    tmp_path: Path,
):
    """A first layer 65536 wide: a batch of 256 needs more than the address-space cap leaves,
    128 fits. oneDNN is off: its kernels fail under the cap with their own error ("could not
    execute a primitive") before TensorFlow's allocator says out of memory."""
    run_dir = tmp_path / "oom"
    args = ("--width", "65536", "--samples", "512", "--batch", "256", "--epochs", "2")
    proc = start_tf_supervised(run_dir, *args, "--limit-mib", "300", TF_ENABLE_ONEDNN_OPTS="0")
    code, _out, err = finish(proc)
    assert code == 0, err
    ooms = events(run_dir, "oom")
    assert len(ooms) == 1 and real_oom(ooms[0]["error"]), ooms
    assert ooms[0]["kind"] == "tf.errors.ResourceExhaustedError"  # by type: TensorFlow loaded
    assert ooms[0]["micro_batch_size"] == 256
    assert [r["exit_code"] for r in events(run_dir, "restart")] == [76]
    assert json.loads((run_dir / "result.json").read_text())["batch"] == 128
    assert "1 out-of-memory" in report(run_dir).stdout


@pytest.mark.parametrize(
    ("where", "phase", "words"),
    [
        pytest.param("--val-batch", "evaluation", "fit's validation", id="validation"),
        pytest.param(
            "--callback-batch",
            "callback EpochEndPredict.on_epoch_end",
            "the callback EpochEndPredict.on_epoch_end",
            id="callback",
        ),
    ],
)
def test_an_out_of_memory_outside_the_train_step_exits_76_and_the_restart_finishes(
    tmp_path: Path, where: str, phase: str, words: str
):
    """Training at batch 128 fits the address-space cap; fit's validation (or the user's own
    epoch-end callback, a predict) in one batch of 2048 does not. Keras lets that error leave
    fit without calling a callback: before, the process ended with exit 1, no `oom` record, and
    each restart failed at the same batch until exit 4. Now it is one out-of-memory: the record
    names where, exit 76, and the restart at the cap of 64 (which the program passes to
    validation_batch_size and its callback too) finishes."""
    run_dir = tmp_path / "oom-outside"
    args = ("--width", "65536", "--samples", "512", "--batch", "128", where, "2048")
    proc = start_tf_supervised(
        run_dir, *args, "--epochs", "2", "--limit-mib", "300", TF_ENABLE_ONEDNN_OPTS="0"
    )
    code, _out, err = finish(proc, timeout=480)
    assert code == 0, err
    ooms = events(run_dir, "oom")
    assert len(ooms) == 1 and real_oom(ooms[0]["error"]), ooms
    assert ooms[0]["kind"] == "tf.errors.ResourceExhaustedError"
    assert ooms[0]["phase"] == phase
    assert [r["exit_code"] for r in events(run_dir, "restart")] == [76]
    assert json.loads((run_dir / "result.json").read_text())["batch"] == 64
    assert f"out of memory in {words} (tensorflow" in err


def test_a_native_crash_under_the_address_space_cap_restarts_smaller_and_finishes(
    tmp_path: Path,
):
    """oneDNN on (TensorFlow's default) and the cap 100 MiB above the process's size: from a
    batch of 256 down, some attempts end in no Python error but a crash of native code
    (tensorflow-cpu 2.21: SIGABRT, a thread that cannot get its stack; issue 41 saw SIGSEGV in a
    oneDNN kernel, judged the same way), others in TensorFlow's own out-of-memory (exit 76);
    which, varies from run to run. Before, `steadytrain run` restarted a crash at the same batch
    until it gave up (exit 4). It reads the child's address space near its cap, takes the crash
    for an out-of-memory too, and each restart starts smaller until one finishes."""
    run_dir = tmp_path / "crash"
    args = ("--width", "65536", "--samples", "512", "--batch", "256", "--epochs", "1")
    proc = start_tf_supervised(run_dir, *args, "--limit-mib", "100")
    code, _out, err = finish(proc, timeout=560)
    assert code == 0, err
    restarts = events(run_dir, "restart")
    crashes = [r for r in restarts if r["signal"] in ("SIGABRT", "SIGSEGV")]
    assert crashes, restarts  # the cap made native code crash at some size
    for crash in crashes:
        assert "cap (RLIMIT_AS): taken for an allocation that failed there" in crash["reason"]
    caps = [r["max_micro_batch"] for r in restarts]
    assert all(b < a for a, b in zip([256, *caps], caps, strict=False)), caps  # each smaller
    assert json.loads((run_dir / "result.json").read_text())["batch"] == caps[-1]
