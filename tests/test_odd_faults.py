"""Faults planted where a careless writer would not look: the run directory's own files damaged
or replaced between two starts (a folder where a file belongs, a file where a folder belongs),
then what a user runs next (`fit()` again, `steadytrain report`). Each ends in the documented
exit code and one message naming the path and the fix, no traceback, and what the run had
already written (its checkpoints) kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import WORKLOADS
from disks import fill, tmpfs
from script_helpers import Data, loss_fn

from steadytrain import TrainConfig, Trainer
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.cli import main as cli_main
from steadytrain.errors import BadInputError
from steadytrain.run import files as run_files
from steadytrain.telemetry.files import read_jsonl

BAD_INPUT = 2


def fit(run_dir: Path, max_steps: int):
    torch.manual_seed(0)
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=4,
        micro_batch_size=4,
        max_steps=max_steps,
        save_every_steps=2,
        device="cpu",
        log_every_steps=100,
    )
    model = torch.nn.Linear(4, 1)
    return Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn, Data(), config).fit()


def cli(capsys, *args: str) -> tuple[int, str]:
    """`steadytrain ARGS` in this process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of 2 steps with its checkpoint at step 2; each test damages a copy of it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    fit(run_dir, max_steps=2)
    return run_dir


def copy_of(finished_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, symlinks=True)
    return run_dir


@pytest.mark.parametrize(
    "name", [run_files.EVENTS, run_files.METRICS, run_files.HEARTBEAT, run_files.LOCK]
)
def test_a_folder_where_a_run_file_belongs_is_exit_2_naming_it(
    finished_run, tmp_path, capsys, name
):
    """events.jsonl, metrics.jsonl, the heartbeat or the lock replaced by a folder between two
    starts: the next fit() stops with exit 2 naming that path and the fix (not an
    IsADirectoryError, exit 1 as a bug; for the lock, not 'choose a folder this user can
    write'), and the checkpoint is kept; `steadytrain report` says the same without a
    traceback."""
    run_dir = copy_of(finished_run, tmp_path)
    target = run_dir / name
    target.unlink(missing_ok=True)
    target.mkdir()
    (target / "inside").write_bytes(b"kept")

    with pytest.raises(BadInputError) as info:
        fit(run_dir, max_steps=4)
    assert info.value.exit_code == BAD_INPUT
    assert f"{target} is a folder" in str(info.value) and "move the folder away" in str(info.value)
    assert (target / "inside").read_bytes() == b"kept"
    found = CheckpointStore(run_dir).latest()
    assert found is not None and found[0] >= 2  # metrics.jsonl is first written at the end

    if name in (run_files.EVENTS, run_files.METRICS):  # the report reads the JSON-lines files
        code, err = cli(capsys, "report", str(run_dir))
        assert code == BAD_INPUT, err
        assert f"{target} is a folder" in err and "Traceback" not in err


def test_a_file_where_the_checkpoints_folder_belongs_is_exit_2_naming_it(finished_run, tmp_path):
    """checkpoints/ replaced by a plain file: the next fit() stops with exit 2 naming it and the
    fix, not a NotADirectoryError (exit 1 as a bug); the file keeps its bytes."""
    run_dir = copy_of(finished_run, tmp_path)
    checkpoints = run_dir / run_files.CHECKPOINTS
    shutil.rmtree(checkpoints)
    checkpoints.write_bytes(b"not a folder")

    with pytest.raises(BadInputError) as info:
        fit(run_dir, max_steps=4)
    assert info.value.exit_code == BAD_INPUT
    assert f"{checkpoints} is not a folder" in str(info.value)
    assert "move it away" in str(info.value)
    assert checkpoints.read_bytes() == b"not a folder"


def announcing_child(run_dir: Path) -> str:
    """A child that announces `run_dir` as a Trainer's fit() does, writes a newer checkpoint
    pointer each attempt and fails its first two attempts."""
    return (
        "import os, pathlib, sys\n"
        "from steadytrain.safety.supervised import announce_run_dir\n"
        f"run = pathlib.Path(os.fsdecode({os.fsencode(run_dir)!r}))\n"
        "announce_run_dir(run)\n"
        "(run / 'checkpoints').mkdir(parents=True, exist_ok=True)\n"
        "attempt = int(os.environ['STEADYTRAIN_RESTART'])\n"
        "(run / 'checkpoints' / 'latest').write_text(f'step-{attempt + 1:08d}')\n"
        "sys.exit(1 if attempt < 2 else 0)\n"
    )


@pytest.mark.parametrize("name", [b"run ", b"run \xff"], ids=["trailing-space", "not-utf-8"])
def test_a_run_dir_announced_with_an_odd_name_is_where_the_supervisor_counts(tmp_path, name):
    """`steadytrain run` without --run-dir learns the run directory from the child. A name that
    ends in a space, or is not UTF-8, is the folder it counts progress in and appends its
    events to: two failures after new checkpoints do not exhaust --max-restarts 0, and no
    folder of a neighbouring name is made (before: 'run ' was counted as 'run', made there,
    and a name not in UTF-8 made fit()'s announcement raise)."""
    run_dir = Path(os.fsdecode(os.fsencode(tmp_path) + b"/" + name))
    done = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "run", "--max-restarts", "0",
         "--backoff-initial", "0.01", "--", sys.executable, "-c", announcing_child(run_dir)],
        env=os.environ.copy(),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert os.listdir(os.fsencode(tmp_path)) == [name]
    restarts = [e for e in read_jsonl(run_dir / run_files.EVENTS) if e["event"] == "restart"]
    assert [e["progressed"] for e in restarts] == [True, True], restarts


def not_utf8(folder: Path, name: bytes) -> Path:
    """`folder`/`name`, where `name` holds a byte that is not UTF-8 (Linux allows any byte)."""
    return Path(os.fsdecode(os.fsencode(folder) + b"/" + name))


def test_the_report_of_a_run_dir_whose_name_is_not_utf_8_is_written(finished_run, tmp_path):
    """A run directory named with a byte that is not UTF-8: `steadytrain report` writes its page
    (the byte shown as '?'), not a UnicodeEncodeError traceback."""
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    run_dir = not_utf8(tmp_path, b"run-\xff")
    shutil.copytree(finished_run, run_dir)
    done = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "report", str(run_dir)],
        env=os.environ.copy(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    page = (run_dir / run_files.REPORT_HTML).read_bytes()
    assert b"run-?" in page and "Traceback" not in done.stderr


def test_a_fine_tune_output_dir_not_in_utf_8_is_refused_before_anything_is_written(
    tmp_path, capsys
):
    """The tokenizer's files cannot be saved under a name that is not UTF-8 (the tokenizers
    library takes UTF-8 paths only): the fine-tune is refused at the start, exit 2 naming
    output_dir, instead of training and then failing in the final export with a traceback."""
    out = not_utf8(tmp_path, b"out-\xff")  # as a program that writes the config gets it
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps({"model_name_or_path": "tiny", "train_file": "t.jsonl", "output_dir": str(out)})
    )
    code, err = cli(capsys, "finetune", "--config", str(config))
    said = " ".join(err.split())
    assert code == BAD_INPUT, err
    assert "output_dir:" in said and "not UTF-8" in said and "Traceback" not in said
    assert sorted(os.listdir(tmp_path)) == ["c.json"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB tmpfs (skipped where mounting is not permitted)."""
    with tmpfs(tmp_path / "tiny", "2m") as point:
        yield point


def test_a_hang_on_a_disk_that_filled_meanwhile_exits_75_and_says_no_report(tiny_disk, tmp_path):
    """The disk fills while step 3 hangs: the watchdog still ends the run with exit 75, names the
    report it could not write, leaves no cut-short report in hangs/, and its last line says
    there is none (before: an empty hangs/<time>.txt, and 'stacks in None')."""
    run_dir, marker = tiny_disk / "run", tmp_path / "marker"
    child = forkserver.start(
        [sys.executable, str(WORKLOADS / "hang.py"), str(run_dir), "--block", "sleep",
         "--at", "3", "--once", str(marker), "--timeout", "2"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the block to begin
    assert marker.exists(), "the step never blocked"
    fill(tiny_disk / "filler")
    child.wait(timeout=120)
    _, err = child.output()

    assert child.returncode == 75, err
    assert f"could not write the hang report {run_dir / 'hangs'}" in err, err
    assert "No space left on device" in err
    assert "no hang report (it could not be written); exiting 75" in err
    assert "stacks in None" not in err and "Traceback" not in err
    hangs = run_dir / "hangs"
    assert not hangs.exists() or [p.name for p in hangs.iterdir()] == []


class Saves:
    """Stands for the adapter model and the tokenizer: `save_pretrained` writes one file."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, folder, **_):
        (Path(folder) / self.name).write_bytes(b"new")


def test_an_export_killed_mid_way_leaves_nothing_the_next_export_keeps(tmp_path):
    """A fine-tune killed inside its final export leaves final/'s staging folder, or the earlier
    final/ set aside (killed between the two renames). The next export removes what a process
    that no longer runs left, puts nothing of it in final/, and keeps a live process's."""
    from steadytrain.recipes.finetune import export_final
    from steadytrain.recipes.finetune_config import FinetuneConfig

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    run_dir = tmp_path / "run"
    for name in (
        f".final.staging-{gone.pid}",
        f".final.old-{gone.pid}",
        f".final.staging-{os.getppid()}",
    ):
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "adapter_model.safetensors").write_bytes(b"left")
    config = FinetuneConfig.from_dict(
        {"model_name_or_path": "tiny", "train_file": "t.jsonl", "output_dir": str(run_dir)}
    )

    export_final(Saves("adapter_model.safetensors"), Saves("tokenizer.json"), config, run_dir)

    final = run_dir / run_files.FINAL
    assert (final / "adapter_model.safetensors").read_bytes() == b"new"
    assert sorted(os.listdir(run_dir)) == [f".final.staging-{os.getppid()}", "final"]


def test_a_named_pipe_at_events_jsonl_is_exit_2_and_blocks_no_reader(finished_run, tmp_path):
    """A named pipe planted at events.jsonl: fit() stops with exit 2 naming it (it wrote into the
    pipe, where the records were lost); `steadytrain report` and `steadytrain run` stop with
    exit 2 naming it instead of blocking for good in opening it for reading."""
    run_dir = copy_of(finished_run, tmp_path)
    events = run_dir / run_files.EVENTS
    events.unlink()
    os.mkfifo(events)

    with pytest.raises(BadInputError) as info:
        fit(run_dir, max_steps=4)
    assert f"{events} is not a regular file" in str(info.value)
    for command in (
        ["report", str(run_dir)],
        ["run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", sys.executable, "-c", ""],
    ):
        done = forkserver.run(
            [sys.executable, "-m", "steadytrain.cli", *command], env=os.environ.copy(), timeout=60
        )
        assert done.returncode == BAD_INPUT, done.stderr
        assert str(events) in done.stderr and "not a regular file" in done.stderr
        assert "Traceback" not in done.stderr


def test_named_pipes_at_the_files_the_supervisor_and_report_read_block_neither(
    finished_run, tmp_path
):
    """A named pipe at checkpoints/latest, and one at estimate.json: `steadytrain run` counts
    no progress from the pointer (it gives up on a child that fails, exit 4) and `steadytrain
    report` writes the page without the estimate, instead of each blocking for good in opening
    the pipe."""
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    run_dir = copy_of(finished_run, tmp_path)
    latest = run_dir / run_files.CHECKPOINTS / run_files.LATEST
    latest.unlink()
    os.mkfifo(latest)
    os.mkfifo(run_dir / run_files.ESTIMATE)
    for command, code in (
        (["run", "--run-dir", str(run_dir), "--max-restarts", "0", "--",
          sys.executable, "-c", "raise SystemExit(1)"], 4),
        (["report", str(run_dir)], 0),
    ):  # fmt: skip
        done = forkserver.run(
            [sys.executable, "-m", "steadytrain.cli", *command], env=os.environ.copy(), timeout=60
        )
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr
    assert (run_dir / run_files.REPORT_HTML).is_file()


def test_an_event_line_with_a_time_no_clock_reads_does_not_stop_the_report(
    finished_run, tmp_path, capsys
):
    """A damaged events.jsonl line that still parses, its time 1e300: `steadytrain report`
    writes the page, that event's time shown as '?', instead of an OverflowError traceback."""
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    run_dir = copy_of(finished_run, tmp_path)
    with open(run_dir / run_files.EVENTS, "ab") as events:
        events.write(b'{"event": "oom", "time": 1e300, "step": 1}\n')
    code, err = cli(capsys, "report", str(run_dir))
    assert code == 0, err
    assert '<td class="time">?</td>' in (run_dir / run_files.REPORT_HTML).read_text()
