"""Nothing lost at the edges: a full disk anywhere, planted symlinks, malformed input, and a
checkpoint announced only once committed. Each test goes through the public API or the CLI.

The disk-full tests run on a real small tmpfs (the kernel itself says ENOSPC); where mounting is
not allowed they are skipped with the reason.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import WORKLOADS, run_workload
from disks import fill, tmpfs
from script_helpers import Data, loss_fn

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.checkpoint import file_io
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.cli import main as cli_main
from steadytrain.errors import BadInputError, ConfigError, RunDiskFullError
from steadytrain.recipes.data import byte_tokenizer, load_datasets
from steadytrain.telemetry.files import read_jsonl

DISK_FULL = 6

# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB tmpfs."""
    with tmpfs(tmp_path / "tiny", "2m") as point:
        yield point


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run `steadytrain ARGS` in this process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().err


def fit(run_dir: Path, callbacks=(), **overrides):
    torch.manual_seed(0)
    config = {
        "run_dir": str(run_dir),
        "effective_batch_size": 4,
        "micro_batch_size": 4,
        "max_steps": 4,
        "save_every_steps": 2,
        "device": "cpu",
        "log_every_steps": 100,
        **overrides,
    }
    model = torch.nn.Linear(4, 1)
    return Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=1e-3),
        loss_fn,
        Data(),
        TrainConfig(**config),
        callbacks=list(callbacks),
    ).fit()


# -- 1. a full disk anywhere --------------------------------------------------------------------


def test_disk_full_while_training_stops_with_exit_6_and_keeps_the_last_checkpoint(tiny_disk):
    """metrics.jsonl cannot be written: exit 6 naming the file, the space left and what was
    kept; the last committed checkpoint stays latest and verifies."""
    run_dir = tiny_disk / "run"
    done = run_workload(
        "resumable.py", str(run_dir), "--fill-disk-at", "7", "--sync-save", timeout=600
    )
    assert done.returncode == DISK_FULL, done.stderr
    assert "disk full: could not write" in done.stderr
    assert str(run_dir / "metrics.jsonl") in done.stderr or "events.jsonl" in done.stderr
    assert "free on that filesystem" in done.stderr
    assert "step-00000006" in done.stderr and "stays the latest" in done.stderr
    assert "Traceback" not in done.stderr
    found = CheckpointStore(run_dir).latest()
    assert found is not None and found[0] == 6
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000006"


def test_the_supervisor_does_not_restart_a_run_stopped_by_a_full_disk(tiny_disk):
    run_dir = tiny_disk / "run"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
            *("--max-restarts", "3", "--backoff-initial", "0.01", "--"),
            *(sys.executable, str(WORKLOADS / "resumable.py"), str(run_dir)),
            *("--fill-disk-at", "4", "--sync-save"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == DISK_FULL, done.stderr
    assert "disk full" in done.stderr and "not restarting" in done.stderr
    assert done.stderr.count("steadytrain: 15 steps") == 1  # one attempt, no restart


def test_disk_full_before_the_first_step_is_exit_6_naming_the_file(tiny_disk, capsys):
    """The lock, config.json and the first events cannot be written on a disk already full."""
    (tiny_disk / "run").mkdir()
    fill(tiny_disk / "filler")
    done = run_workload("resumable.py", str(tiny_disk / "run"), timeout=600)
    assert done.returncode == DISK_FULL, done.stderr
    assert "disk full: could not write" in done.stderr and "Traceback" not in done.stderr


# -- 2. no write follows a planted symlink ------------------------------------------------------


@pytest.mark.parametrize("name", [".lock", "events.jsonl", "metrics.jsonl", "config.json"])
def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path, name):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(target)
    with pytest.raises(BadInputError, match="symbolic link") as info:
        fit(run_dir)
    assert info.value.exit_code == 2
    assert name in str(info.value)
    assert target.read_text() == "keep me\n"


# -- 5. malformed input exits 2 with the file, field or line named ------------------------------


@pytest.mark.parametrize(
    "name,text,words",
    [
        ("deep.json", '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("big.json", '{"effective_batch_size": ' + "9" * 5000 + "}", "4300 digits"),
        ("surrogate.json", '{"\\ud800x": 1, "effective_batch_size": 2}', "lone surrogate"),
        ("eight.json", '{"effective_batch_size": "8"}', "effective_batch_size: must be a whole"),
        ("yes.json", '{"effective_batch_size": 8, "async_save": "yes"}', "async_save: must be"),
        ("empty.json", '{"effective_batch_size": 8, "run_dir": ""}', "run_dir: must name"),
        ("nul.json", '{"effective_batch_size": 8, "run_dir": "a\\u0000b"}', "NUL"),
        (
            "huge.json",
            '{"effective_batch_size": 1000000000000000000000000000000}',
            "effective_batch_size: must be at most",
        ),
        (
            "steps.json",
            '{"effective_batch_size": 8, "max_steps": 100000000000000000000}',
            "max_steps: must be at most",
        ),
        (
            "every.json",
            '{"effective_batch_size": 8, "save_every_steps": 10000000000000000000}',
            "save_every_steps: must be at most 2,147,483,647",
        ),
        (
            "budget.json",
            '{"effective_batch_size": 8, "memory_budget": "9999999TiB"}',
            "memory_budget: '9999999TiB' is more memory than any machine has: a size must be at most 1024TiB",
        ),
    ],
)
def test_a_malformed_config_exits_2_naming_the_file_and_problem(
    tmp_path, capsys, name, text, words
):
    path = tmp_path / name
    path.write_text(text)
    code, err = cli(capsys, "config", str(path))
    assert code == 2
    compact = "".join(err.split())  # the console wraps long lines anywhere
    assert name in compact and words.replace(" ", "") in compact
    assert "Traceback" not in err


def test_text_is_not_coerced_into_numbers_or_booleans():
    with pytest.raises(ConfigError) as info:
        TrainConfig(effective_batch_size="8", shuffle="yes", seed="1")
    text = str(info.value)
    assert "effective_batch_size: must be a whole number" in text
    assert "shuffle: must be true or false" in text and "seed:" in text
    assert TrainConfig(effective_batch_size=8, run_dir=Path("runs/x")).run_dir == "runs/x"


def test_a_run_dir_that_cannot_be_created_is_exit_2_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(BadInputError, match="run_dir") as info:
        fit(blocker / "run")
    assert str(blocker / "run") in str(info.value)


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ('{"text": "a", "n": ' + "7" * 5000 + "}", "4300 digits"),
        ('{"text": "abc \\udc80 def"}', "lone surrogate"),
    ],
)
def test_malformed_fine_tune_data_exits_2_naming_the_line(tmp_path, line, words):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(BadInputError) as info:
        load_datasets(path, byte_tokenizer(), max_seq_length=16)
    assert "line 2" in str(info.value) and words in str(info.value)


def _tamper_newest(run_dir: Path, manifest_text: str, keep_files: bool) -> Path:
    newest = CheckpointStore(run_dir).committed()[-1][1]
    for file in newest.iterdir():
        if file.name != "MANIFEST.json" and not keep_files:
            file.unlink()
    (newest / "MANIFEST.json").write_text(manifest_text)
    return newest


@pytest.mark.parametrize("kind", ["empty file list", "nested 100k deep"])
def test_a_bad_manifest_is_skipped_and_the_resume_falls_back(tmp_path, kind):
    run_dir = tmp_path / "run"
    assert fit(run_dir, max_steps=4).exit_code == 0
    manifest = json.loads((run_dir / "checkpoints" / "step-00000004" / "MANIFEST.json").read_text())
    if kind == "empty file list":
        text, keep = json.dumps({**manifest, "files": {}}), False
    else:
        text, keep = '{"files": ' + "[" * 100_000 + "]" * 100_000 + "}", True
    newest = _tamper_newest(run_dir, text, keep)

    result = fit(run_dir, max_steps=6)

    assert result.exit_code == 0 and result.steps == 6
    events = read_jsonl(run_dir / "events.jsonl")
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and skipped[0]["checkpoint"] == newest.name
    assert [e["step"] for e in events if e["event"] == "resume"] == [2]


# -- 6. a checkpoint is announced when committed; a background failure surfaces at once -----------


class WaitForTheWriter(Callback):
    """Step 5 starts only once the background writer of step 4's save has failed: the test is
    about what the next step does with that failure, whatever the machine's load."""

    def __init__(self, failed: threading.Event):
        self.failed = failed

    def on_step_start(self, state, control, info):
        if state.step == 4:
            assert self.failed.wait(timeout=120), "the background save of step 4 never failed"
            for thread in threading.enumerate():
                if thread.name == "steadytrain-checkpoint-4":
                    thread.join(timeout=120)  # its error is recorded when the thread ends


def test_a_failed_background_save_is_never_announced_and_stops_the_next_step(tmp_path, monkeypatch):
    real_write = file_io._write
    failed = threading.Event()

    def write(handle, data):
        if "step-00000004" in getattr(handle, "name", ""):
            failed.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(handle, data)

    monkeypatch.setattr(file_io, "_write", write)
    run_dir = tmp_path / "run"
    with pytest.raises(RunDiskFullError) as info:
        fit(run_dir, [WaitForTheWriter(failed)], max_steps=20, async_save=True, keep_last=2)
    assert info.value.exit_code == DISK_FULL
    assert "step-00000004" in str(info.value) and "step-00000002 is untouched" in str(info.value)
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2]
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(steps) <= 5  # the step after the failed save ends the run
    assert CheckpointStore(run_dir).latest()[0] == 2


# -- 7. fine-tune text is cut before it is tokenized --------------------------------------------


class CountingTokenizer:
    """byte_tokenizer(), remembering the longest text it was asked to tokenize."""

    def __init__(self):
        self.inner = byte_tokenizer()
        self.longest = 0

    def __call__(self, text, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        self.longest = max(self.longest, *(len(t) for t in texts))
        return self.inner(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def records(fmt: str, body: str) -> str:
    record = {
        "text": {"text": body},
        "completion": {"prompt": "Q: ", "completion": body},
        "prompt": {"prompt": body, "completion": "yes"},
    }[fmt]
    other = {"text": "short"} if fmt == "text" else {"prompt": "a", "completion": "b"}
    return json.dumps(record) + "\n" + json.dumps(other) + "\n"


@pytest.mark.parametrize("fmt", ["text", "completion", "prompt"])
def test_a_huge_line_is_tokenized_only_up_to_max_seq_length(tmp_path, fmt):
    huge = "word " * 2_000_000  # 10 MB
    path = tmp_path / "train.jsonl"
    path.write_text(records(fmt, huge))
    tok = CountingTokenizer()

    train, _, stats = load_datasets(path, tok, max_seq_length=64)

    assert tok.longest <= 64 * 100  # memory per record follows max_seq_length
    assert stats.train.truncated == 1
    assert stats.train.tokens_cut > 9_000_000  # the rest of the line counts, estimated
    if fmt == "prompt":
        assert stats.train.dropped == 1  # the prompt alone fills max_seq_length
        return
    # The kept tokens are those of the whole line: the same as a shorter line cut the old way.
    short = tmp_path / "short.jsonl"
    short.write_text(records(fmt, huge[:2000]))
    reference, _, _ = load_datasets(short, byte_tokenizer(), max_seq_length=64)
    assert torch.equal(train[0]["input_ids"], reference[0]["input_ids"])
    assert torch.equal(train[0]["labels"], reference[0]["labels"])


# -- 3. a hang before the first step is caught ----------------------------------------------


def test_a_read_that_blocks_before_the_first_step_is_a_hang_named_by_its_phase(tmp_path):
    """The data fingerprint reads a sample that never comes: the watchdog, running since fit()
    began, names the phase, dumps the stacks and exits 75; restarted, the run finishes. The
    explicit hang_timeout (3 s) bounds the start-up phase (it had 600 s whatever hang_timeout
    said), and the console said so before the read."""
    marker = tmp_path / "marker"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(tmp_path)),
            *("--backoff-initial", "0.01", "--"),
            *(sys.executable, str(WORKLOADS / "hang.py"), str(tmp_path), "--block", "startup"),
            *("--timeout", "3", "--once", str(marker)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "3 s without progress is a hang, in start-up, the first step" in done.stderr
    (hang,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["phase"] == "data fingerprint" and hang["limit_s"] == 3.0
    reports = [p for p in (tmp_path / "hangs").glob("*.txt") if "backstop" not in p.name]
    assert len(reports) == 1 and "in blocked_in_sleep" in reports[0].read_text()
    assert json.loads((tmp_path / "done.json").read_text()) == {"steps": 6, "exit_code": 0}


def test_a_hang_before_fit_in_a_new_run_dir_is_caught_from_the_process_start(tmp_path):
    """Issue 27: an attempt hangs before fit() (model set-up, data loading) in a run directory
    with nothing in it yet. Started by `steadytrain run`, the process watches itself from its
    import of steadytrain: past --first-heartbeat-timeout (15 s: the supervisor counts it from
    the process start, before torch is imported) its watchdog writes a report
    with the stacks, records a hang before fit(), exits 75, and the supervisor's line says the
    watchdog caught it; restarted, the run finishes. Before, nothing caught it at all."""
    marker = tmp_path / "marker"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(tmp_path)),
            *("--backoff-initial", "0.01", "--first-heartbeat-timeout", "15", "--"),
            *(sys.executable, str(WORKLOADS / "hang.py"), str(tmp_path), "--block", "before"),
            *("--steps", "4", "--once", str(marker)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "hang detected by the watchdog (exit 75)" in done.stderr
    (hang,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["detected_by"] == "watchdog" and hang["phase"].startswith("before fit()")
    assert 15.0 <= hang["stalled_s"] < 15.0 + 2 * 15.0 / 8 + 1.0 and hang["exit_code"] == 75
    report = (tmp_path / hang["file"]).read_text()
    assert "in blocked_in_sleep" in report and "--first-heartbeat-timeout" in report
    assert not list((tmp_path / "hangs").glob("backstop-*.txt"))
    assert json.loads((tmp_path / "done.json").read_text()) == {"steps": 4, "exit_code": 0}


# -- reliability rows 1, 7 and 20 through a real Trainer.fit() ------------------------------------


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> dict:
    """The uninterrupted run's final parameters (tests/workloads/resumable.py, 15 steps)."""
    run_dir = tmp_path_factory.mktemp("golden") / "run"
    done = run_workload("resumable.py", str(run_dir), timeout=600)
    assert done.returncode == 0, done.stderr
    return torch.load(run_dir / "params.pt", weights_only=True)


def assert_same_params(run_dir: Path, want: dict) -> None:
    got = torch.load(run_dir / "params.pt", weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_row7_disk_full_during_a_save_in_fit_keeps_the_last_checkpoint_then_resumes(
    tiny_disk, golden
):
    """The disk fills before the step-9 save (an async one): the run stops at the next step
    with exit 6, step 6 stays latest and verifies, nothing is staged; with space freed the
    same command resumes from step 6 and ends with the uninterrupted run's parameters."""
    run_dir = tiny_disk / "run"
    args = ("resumable.py", str(run_dir))
    done = run_workload(*args, "--fill-disk-at", "7", "--fill-disk-leave", "12288", timeout=600)
    assert done.returncode == DISK_FULL, done.stderr
    assert "disk full while writing checkpoint" in done.stderr and "step-00000009" in done.stderr
    assert "step-00000006 is untouched" in done.stderr and "Traceback" not in done.stderr
    assert CheckpointStore(run_dir).latest()[0] == 6
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000006",
    ]
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3, 6]
    assert max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")) <= 10

    (tiny_disk / "filler").unlink()
    again = run_workload(*args, timeout=600)
    assert again.returncode == 0, again.stderr
    resumed = [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed == [6]
    assert_same_params(run_dir, golden)


@pytest.mark.parametrize(
    "fault,resumed",
    [
        ("mid-write:2", 3),
        pytest.param("before-manifest:2", 3, marks=pytest.mark.slow),
        pytest.param("after-manifest:2", 3, marks=pytest.mark.slow),
        ("after-publish:2", 6),  # published: it counts, though 'latest' still names step 3
        ("during-retention:1", 9),  # the step-9 save deletes step 3 after its commit
    ],
)
def test_row1_kill_9_inside_a_save_of_fit_resumes_from_the_newest_committed(
    tmp_path, golden, fault, resumed
):
    run_dir = tmp_path / "run"
    killed = run_workload(
        "resumable.py", str(run_dir), env={"STEADYTRAIN_FAULT_INJECT": fault}, timeout=600
    )
    assert killed.returncode == -9, killed.stderr
    assert CheckpointStore(run_dir).latest()[0] == resumed

    done = run_workload("resumable.py", str(run_dir), timeout=600)
    assert done.returncode == 0, done.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [resumed]
    checks = [e for e in events if e["event"] == "continuity" and e["checked"]]
    assert checks and all(e["equal"] for e in checks)
    assert_same_params(run_dir, golden)
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_row20_a_normal_exit_waits_for_the_async_save_in_flight(tmp_path, monkeypatch):
    """The last step's save runs in the background, slowed down: fit() returns only once it
    has committed, and it is announced then."""
    real_write = file_io._write

    def slow_write(handle, data):
        if "step-00000004" in getattr(handle, "name", ""):
            time.sleep(0.3)
        return real_write(handle, data)

    monkeypatch.setattr(file_io, "_write", slow_write)
    run_dir = tmp_path / "run"
    result = fit(run_dir, max_steps=4, async_save=True, keep_last=2)

    assert result.exit_code == 0 and result.checkpoint.endswith("step-00000004")
    assert CheckpointStore(run_dir).latest()[0] == 4
    events = read_jsonl(run_dir / "events.jsonl")
    announced = [(e["step"], e["mode"]) for e in events if e["event"] == "checkpoint"]
    assert announced == [(2, "async"), (4, "async")]
