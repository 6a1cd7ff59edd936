"""A checkpoint's files tied to each other (issue 41, item 8): a tensor file copied from an older
checkpoint into a newer one, its manifest line re-signed, verified and loaded (the run resumed
at step 4 with step 2's weights). Each file now carries its checkpoint's step and id, so the
mixed checkpoint is skipped for the older verified one; a checkpoint written before the tie
still resumes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from integration_helpers import events
from safetensors.torch import load_file, save_file

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.checkpoint.store import MANIFEST, CheckpointStore, Payload
from steadytrain.errors import CheckpointError

TIE_KEY = "steadytrain_checkpoint"


class _StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, control, info):
        if state.step == self.step:
            control.request_stop(143, "stopped by the test")


def fit(run_dir: Path, stop_at: int | None = None) -> torch.nn.Module:
    """6 steps of a small model with Adam (an optimizer state that changes each step), a
    checkpoint every 2; stopped after `stop_at` as a preemption would."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g)
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = TrainConfig(
        run_dir=str(run_dir), effective_batch_size=8, micro_batch_size=8, max_steps=6,
        save_every_steps=2, keep_last=3, device="cpu", progress="off", memory_watch=False,
    )  # fmt: skip
    Trainer(
        model,
        lambda p: torch.optim.Adam(p, lr=0.05),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        data,
        config,
        callbacks=[] if stop_at is None else [_StopAt(stop_at)],
    ).fit()
    return model


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return fit(tmp_path_factory.mktemp("whole")).state_dict()


def assert_bitwise(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def resign(folder: Path, name: str) -> None:
    """Rewrite the manifest's line for `name` to the file's new sha256 and size."""
    manifest = json.loads((folder / MANIFEST).read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def test_a_weights_file_copied_from_an_older_checkpoint_is_refused_for_the_older_one(
    tmp_path: Path, uninterrupted
):
    fit(tmp_path, stop_at=4)
    older, newer = checkpoint(tmp_path, 2), checkpoint(tmp_path, 4)
    shutil.copyfile(older / "model.safetensors", newer / "model.safetensors")
    resign(newer, "model.safetensors")

    model = fit(tmp_path)

    (skipped,) = events(tmp_path, "checkpoint_skipped")
    assert skipped["checkpoint"] == "step-00000004"
    (problem,) = skipped["problems"]
    assert "model.safetensors" in problem, problem
    assert "step 2 " in problem and "step 4 " in problem, problem
    (resume,) = events(tmp_path, "resume")
    assert resume["step"] == 2  # the older verified checkpoint
    assert_bitwise(model, uninterrupted)
    # the mixed folder was not kept as the step's checkpoint: the resumed run's save replaced it
    (replaced,) = events(tmp_path, "checkpoint_replaced")
    assert replaced["checkpoint"] == "step-00000004"
    CheckpointStore(tmp_path).load(newer)  # whole again


def test_an_untouched_run_resumes_bitwise(tmp_path: Path, uninterrupted):
    fit(tmp_path, stop_at=4)
    model = fit(tmp_path)
    assert events(tmp_path, "checkpoint_skipped") == []
    assert events(tmp_path, "resume")[0]["step"] == 4
    assert_bitwise(model, uninterrupted)


def strip_tie(folder: Path) -> None:
    """Make the checkpoint one written before its files were tied: no tie in any file or in
    the manifest, every line re-signed."""
    for file in folder.iterdir():
        if file.name.endswith(".safetensors"):
            save_file(load_file(file), file, metadata={"format": "pt"})
        elif file.name.endswith(".json") and file.name != MANIFEST:
            doc = json.loads(file.read_text())
            doc.pop(TIE_KEY)
            file.write_text(json.dumps(doc))
        elif file.name.endswith(".pt"):
            value = torch.load(file, weights_only=True)
            value.pop(TIE_KEY)
            torch.save(value, file)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.pop("checkpoint")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    for file in folder.iterdir():
        if file.name != MANIFEST:
            resign(folder, file.name)


def test_a_checkpoint_written_before_the_tie_still_resumes(tmp_path: Path, uninterrupted):
    fit(tmp_path, stop_at=4)
    for step in (2, 4):
        strip_tie(checkpoint(tmp_path, step))

    model = fit(tmp_path)

    assert events(tmp_path, "checkpoint_skipped") == []
    assert events(tmp_path, "resume")[0]["step"] == 4
    assert_bitwise(model, uninterrupted)


def tied_payload(step: int) -> Payload:
    return Payload(
        tensors={"model.safetensors": {"w": torch.full((3,), float(step))}},
        objects={"optimizer.pt": {"state": {}, "lr": 0.1 * step}},
        json={"trainer_state.json": {"step": step}},
    )


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_any_file_of_another_checkpoint_is_named_with_both_steps(tmp_path: Path, name):
    """Each kind of file carries the tie: a copied one is refused on load, naming it."""
    store = CheckpointStore(tmp_path, keep_last=3)
    older, newer = store.save(1, tied_payload(1)), store.save(2, tied_payload(2))
    assert store.load(newer).objects["optimizer.pt"] == {"state": {}, "lr": 0.2}  # tie taken out
    shutil.copyfile(older / name, newer / name)
    resign(newer, name)

    with pytest.raises(CheckpointError, match="mixes files") as refused:
        store.load(newer)

    first = str(refused.value).splitlines()[0]
    assert f"{name}: was written for the checkpoint of step 1 " in first
    assert "this one of step 2 " in first


def test_a_file_without_a_tie_in_a_tied_checkpoint_is_refused(tmp_path: Path):
    """A file of a checkpoint written before the tie, copied into a tied one."""
    store = CheckpointStore(tmp_path)
    folder = store.save(2, tied_payload(2))
    save_file({"w": torch.zeros(3)}, folder / "model.safetensors", metadata={"format": "pt"})
    resign(folder, "model.safetensors")

    with pytest.raises(CheckpointError, match=r"model\.safetensors: carries no checkpoint tie"):
        store.load(folder)
