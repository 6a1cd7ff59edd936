"""What `steadytrain run` tells its child through the environment means one thing wherever it is
read (`steadytrain.run.env`): the micro-batch cap under the Trainer, under a loop of the user's
own (`RunGuard` with `max_micro_batch()`), under the Hugging Face callback and in the supervisor;
and the manifest of an integration's checkpoint is checked by the checkpoint package's rules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import events, run_plain, workload_env
from script_helpers import Data, exit_as_script, loss_fn
from test_checkpoint_store import make_payload

from steadytrain import TrainConfig, Trainer
from steadytrain.checkpoint.manifest import library_problems, verify
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.cli import main as cli_main
from steadytrain.integrations import RunGuard, max_micro_batch
from steadytrain.run.files import ENV_MAX_MICRO_BATCH
from steadytrain.telemetry.files import read_jsonl

BAD = ("0", "abc", "-1")


def trainer(run_dir: Path):
    """A Trainer at micro-batch 8 of 16, for `exit_as_script`."""

    def build() -> Trainer:
        torch.manual_seed(0)
        config = TrainConfig(
            run_dir=str(run_dir),
            effective_batch_size=16,
            micro_batch_size=8,
            max_steps=1,
            save_every_steps=1,
            device="cpu",
        )
        model = torch.nn.Linear(4, 1)
        return Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn, Data(), config)

    return build


def error_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.parametrize("value", BAD)
def test_a_cap_set_by_hand_that_is_no_micro_batch_is_exit_2_everywhere(
    tmp_path, capsys, monkeypatch, value
):
    """ "0", "abc", "-1": the Trainer and a loop of the user's own both exit 2 with the same line,
    naming the variable, what it holds and the fix (the integrations used to ignore them, and
    the Trainer took "0" and "-1" for a cap of 1)."""
    monkeypatch.setenv(ENV_MAX_MICRO_BATCH, value)
    code, err = exit_as_script(capsys, trainer(tmp_path / "trainer"))
    assert code == 2, err
    line = error_line(err)
    assert f"{ENV_MAX_MICRO_BATCH}={value!r}" in line and f"unset {ENV_MAX_MICRO_BATCH}" in line

    with pytest.raises(SystemExit) as own_loop:  # docs/integrations.md: min(B, cap or B)
        max_micro_batch()
    assert own_loop.value.code == 2
    assert error_line(capsys.readouterr().err) == line

    with pytest.raises(SystemExit) as supervisor:  # refused before the first attempt starts
        cli_main(["run", "--run-dir", str(tmp_path / "supervised"), "--", sys.executable, "-V"])
    assert supervisor.value.code == 2
    assert line.removeprefix("error: ") in capsys.readouterr().err


def test_a_cap_of_4_starts_the_trainer_and_a_loop_of_its_own_at_4(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV_MAX_MICRO_BATCH, "4")
    run_dir = tmp_path / "trainer"
    code, err = exit_as_script(capsys, trainer(run_dir))
    assert code == 0, err
    (cap,) = events(run_dir, "micro_batch_cap")
    assert (cap["old"], cap["new"]) == (8, 4)
    assert [row["micro_batch_size"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [4]
    assert max_micro_batch() == 4
    monkeypatch.delenv(ENV_MAX_MICRO_BATCH)
    assert max_micro_batch() is None


@pytest.mark.parametrize("value", [*BAD, "4"])
def test_the_hugging_face_callback_reads_the_cap_as_the_trainer_does(tmp_path, value):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    run_dir = tmp_path / "hf"
    env = {**workload_env(), ENV_MAX_MICRO_BATCH: value}  # workload_env clears it
    proc = run_plain("hf_trainer.py", run_dir, "--batch", "16", "--steps", "1", env=env)
    if value != "4":
        assert proc.returncode == 2, proc.stderr
        assert f"error: {ENV_MAX_MICRO_BATCH}={value!r}" in error_line(proc.stderr)
        return
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(run_dir / "metrics.jsonl")
    assert (row["micro_batch_size"], row["accumulation"], row["samples"]) == (4, 4, 16)


def test_an_integration_s_checkpoint_is_checked_by_the_checkpoint_package_s_rules(tmp_path):
    """A checkpoint the store wrote and the same files saved by a program under `RunGuard`:
    the same damage is found in both, in the same words, and the guard resumes from neither."""
    store = CheckpointStore(tmp_path / "store", keep_last=1)
    store.save(1, make_payload(1))
    (committed,) = [path for _, path in store.committed()]
    run_dir = tmp_path / "run"
    with RunGuard(run_dir, device="cpu", memory_watch=False, handle_signals=False) as guard:
        own = run_dir / "checkpoints" / "step-1"
        shutil.copytree(committed, own, ignore=shutil.ignore_patterns("MANIFEST.json"))
        guard.checkpoint_saved(own, 1)
        assert library_problems(own) == [] and guard.newest_checkpoint() == own
        name = sorted(p.name for p in own.iterdir() if p.suffix == ".safetensors")[0]
        for folder in (committed, own):
            with open(folder / name, "r+b") as handle:
                handle.truncate(10)
        _, found = verify(committed, store.root, required=())
        assert found == library_problems(own) != []
        assert guard.newest_checkpoint() is None
    (skipped,) = events(run_dir, "checkpoint_skipped")
    assert skipped["problems"] == found


def test_the_integrations_core_and_the_manifest_import_no_torch():
    """A Keras run on TensorFlow has no torch: what the integrations share must not need it."""
    code = (
        "import sys, steadytrain.integrations, steadytrain.integrations.core, "
        "steadytrain.checkpoint.manifest, steadytrain.run.env; print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]
