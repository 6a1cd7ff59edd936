"""The shared contracts on the ground floor: one atomic write, one folder commit, one home for
the error classes and their exit codes, one name for the supervisor's variable, one version."""

from __future__ import annotations

import inspect
import os

import pytest

import steadytrain
from steadytrain import errors
from steadytrain.entry import entrypoint
from steadytrain.errors import BadInputError, OptimizerStateTouched, SteadytrainError
from steadytrain.run import durable as _durable
from steadytrain.run import files as run_files
from steadytrain.run.durable import replace_dir, sync_tree, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "config.json"
    write_atomic(path, "old\n")
    write_atomic(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    write_atomic(path, "beat", durable=False)
    assert path.read_text() == "beat"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "report.html"
    write_atomic(path, "old")

    def refuse(src, dst, **dir_fds):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_durable.os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_replace_dir_puts_the_new_folder_in_place_of_the_old(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staging = tmp_path / ".final.staging"
    staging.mkdir()
    (staging / "adapter.safetensors").write_bytes(b"weights")
    sync_tree(staging)
    replace_dir(staging, target)
    assert [p.name for p in target.iterdir()] == ["adapter.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_replace_dir_brings_the_old_folder_back_when_the_rename_fails(tmp_path):
    target = tmp_path / "merged"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    missing = tmp_path / ".merged.staging"  # never created: the rename fails
    with pytest.raises(OSError):
        replace_dir(missing, target)
    assert (target / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_every_error_class_lives_in_errors_and_none_exits_1():
    """Exit 1 means a bug (a traceback is kept); an error raised on purpose says what it is."""
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, SteadytrainError) and c.__module__ == errors.__name__
    ]
    assert len(classes) >= 10
    assert {c.__name__: c.exit_code for c in classes if c.exit_code == 1} == {}
    assert OptimizerStateTouched.exit_code == errors.RESTARTABLE_EXIT == 75
    assert issubclass(OptimizerStateTouched, errors.RestartableError)


def test_a_restartable_error_exits_75_from_a_training_script(capsys):
    @entrypoint
    def main():
        raise OptimizerStateTouched("out of memory inside optimizer.step after it changed state")

    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 75
    assert "optimizer.step" in capsys.readouterr().err


def test_the_supervisor_and_the_trainer_read_one_variable(monkeypatch):
    from steadytrain.supervisor import child_process  # sets it in the child's environment
    from steadytrain.trainer import checkpointing  # the Trainer's resume reads it

    assert child_process.ENV_MAX_MICRO_BATCH == run_files.ENV_MAX_MICRO_BATCH
    monkeypatch.setenv(run_files.ENV_MAX_MICRO_BATCH, "4")
    assert checkpointing.micro_cap_from_supervisor() == 4  # from safety/supervised.py
    monkeypatch.setenv(run_files.ENV_MAX_MICRO_BATCH, "four")
    with pytest.raises(BadInputError, match=run_files.ENV_MAX_MICRO_BATCH):
        checkpointing.micro_cap_from_supervisor()


def test_one_version_read_by_the_package_and_the_checkpoint_manifest():
    from steadytrain._version import __version__
    from steadytrain.checkpoint import store as checkpoint

    assert steadytrain.__version__ == checkpoint.__version__ == __version__


def test_the_run_directory_names_are_plain_relative_names():
    names = [getattr(run_files, n) for n in run_files.__all__ if not n.startswith("ENV_")]
    assert len(set(names)) == len(names)
    assert all(n and os.sep not in n for n in names)
