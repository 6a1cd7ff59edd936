"""Telemetry: the progress lines, the live bar, `progress: off`, the JSONL files under SIGKILL,
TensorBoard scalars, and that the displays read only steps the run files read anyway."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import random
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console

import steadytrain
from steadytrain import BadInputError, TrainConfig, Trainer
from steadytrain.events import Control, DeviceSpan, StepMetrics, TrainState
from steadytrain.telemetry.console import ConsoleLog, ProgressBar, console_callback
from steadytrain.telemetry.files import JsonlFile, RunFiles, read_jsonl
from steadytrain.telemetry.tensorboard import TensorBoardLog

SRC = Path(steadytrain.__file__).resolve().parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LINE = re.compile(
    r"^step (\d+)/(\d+)  epoch (\d+)  loss (\d+\.\d{4})  micro (\d+)×(\d+)  [\d.]+ samples/s  "
    r"mem [\d.]+ (?:B|KiB|MiB|GiB)  data [\d.]+ms fwd\+bwd [\d.]+ms opt [\d.]+ms(?: ckpt [\d.]+ms)?$"
)


def regression(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, list(zip(x, y, strict=True))


class OomAbove:
    """A loss whose forward raises a CUDA-style out-of-memory error while the micro-batch is
    larger than `limit`: the engine's OOM ladder runs as for a real one (classified by type)."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, model, batch):
        x, y = batch
        if len(x) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.nn.functional.mse_loss(model(x), y)


def fit(tmp_path, loss_fn=None, **overrides):
    model, data = regression()
    cfg = dict(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        max_steps=8,
        save_every_steps=4,
        log_every_steps=4,
        device="cpu",
    )
    cfg.update(overrides)
    trainer = Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.01),
        loss_fn or OomAbove(8),
        data,
        TrainConfig(**cfg),
    )
    return trainer.fit()


# -- lines, off ------------------------------------------------------------------------------


def test_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    """progress auto on a captured stderr: the README's lines, each ending in the step split;
    one per log step and the last; OOM and shrink lines; metrics.jsonl carries the split."""
    fit(tmp_path, max_steps=10)
    err = capsys.readouterr().err
    assert "\x1b[" not in err  # no live display, no colour codes
    step_lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [LINE.match(line) is not None for line in step_lines] == [True] * 3, step_lines
    assert [int(LINE.match(line)[1]) for line in step_lines] == [4, 8, 10]
    assert "out of memory in forward at micro-batch 16 (step 1)" in err
    assert "micro-batch 16 → 8 (out of memory in forward); effective batch stays 16" in err
    assert "checkpoint at step 4 (" in err
    assert re.fullmatch(
        r"finished at step 10 in [\d.]+s; final micro-batch 8, 1 out-of-memory event\(s\)",
        err.splitlines()[-1],
    )

    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(rows) == list(range(1, 11))
    for line in step_lines:
        match = LINE.match(line)
        row = rows[int(match[1])]
        assert match[4] == f"{row['loss']:.4f}"
        assert (int(match[5]), int(match[6])) == (row["micro_batch_size"], row["micro_steps"])
        assert (" ckpt " in line) == ("checkpoint_time" in row)
    for step, row in rows.items():
        for field in ("data_time", "compute_time", "optimizer_time", "step_time"):
            assert row[field] >= 0
        timed = step % 4 == 0 or step == 10
        assert ("device_compute_time" in row) == timed
        assert ("device_optimizer_time" in row) == timed
        assert ("checkpoint_time" in row) == (step % 4 == 0)  # the final save is after step_end


def test_progress_off_prints_no_step_output(tmp_path, capsys):
    fit(tmp_path, progress="off")
    err = capsys.readouterr().err
    assert not [line for line in err.splitlines() if line.startswith("step ")]
    assert "samples/s" not in err and "\x1b[" not in err
    first, second = err.splitlines()[:2]  # the watch's allowance, said before the set-up
    assert first.startswith("hang watch: ")
    assert second.startswith("steadytrain: 8 steps of 16 samples on cpu")
    assert "out of memory in forward" in err  # what happened to the run is still said
    assert "finished at step 8" in err
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 8


# -- the live bar ----------------------------------------------------------------------------

BAR_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_telemetry import fit
from pathlib import Path
fit(Path(sys.argv[1]), max_steps=24, save_every_steps=12, progress="auto")
"""


def run_under_pty(args: list[str], columns: int = 220, timeout: float = 120) -> tuple[int, str]:
    """Run a child with a pseudo-terminal as stdin, stdout and stderr; returns (rc, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTY_", "FORCE_COLOR"))}
    env.update(TERM="xterm-256color", COLUMNS=str(columns), PYTHONUNBUFFERED="1")
    env.pop("NO_COLOR", None)
    child = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return child.wait(timeout=10), out.decode("utf-8", errors="replace")


def test_bar_on_a_terminal(tmp_path):
    """progress auto on a terminal: a live bar (redrawn in place) with step, smoothed loss,
    rate, micro × accumulation, ETA, memory against the budget with peak and the step split;
    OOM, shrink and checkpoint lines printed above it; no progress lines."""
    script = tmp_path / "child.py"
    script.write_text(BAR_CHILD.format(tests=str(Path(__file__).parent)))
    rc, raw = run_under_pty([sys.executable, str(script), str(tmp_path)])
    assert rc == 0, raw
    assert "\x1b[1A" in raw or "\x1b[2K" in raw  # redrawn in place: a live display
    text = ANSI.sub("", raw).replace("\r", "\n")
    assert not LINE.search(text) and "epoch 0  loss" not in text
    final = text[text.rindex("step 24/24") :]
    assert re.search(r"step 24/24  epoch \d+ .*loss \d+\.\d{4}  [\d.]+ samples/s  micro 8×2", final)
    assert re.search(r"ETA 0:00:00", final)
    assert re.search(
        r"mem \d+\.\d\d GiB \(\d+ % of budget, peak \d+\.\d\d GiB\)  "
        r"data [\d.]+ms fwd\+bwd [\d.]+ms opt [\d.]+ms ckpt [\d.]+ms",
        final,
    )
    assert "out of memory in forward at micro-batch 16 (step 1)" in text
    assert "micro-batch 16 → 8" in text
    assert "checkpoint at step 12 (" in text
    assert "finished at step 24" in text
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 24


def test_bar_prints_events_above_itself():
    """Driven directly on a recording terminal console: an OOM, a shrink and a note appear as
    lines, and the bar's last frame holds the latest step."""
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=200, highlight=False)
    bar = console_callback(
        TrainConfig(effective_batch_size=8, progress="bar", log_every_steps=2), console=console
    )
    assert isinstance(bar, ProgressBar)
    state, control = TrainState(max_steps=3, effective_batch_size=8, micro_batch_size=8), Control()
    bar.on_fit_start(state, control, {"device": "cpu", "precision": "fp32", "budget": 2**30})
    bar.on_oom(state, control, {"phase": "backward", "micro_batch_size": 8})
    state.micro_batch_size = 4
    bar.on_shrink(state, control, {"old": 8, "new": 4, "reason": "out of memory in backward"})
    bar.note("hang", {"step": 1, "seconds": 12.5})
    for step in (1, 2, 3):
        state.step = step
        bar.on_step_end(state, control, {"metrics": metrics(step)})
    bar.on_fit_end(state, control, {"reason": "finished", "exit_code": 0})
    text = ANSI.sub("", out.getvalue()).replace("\r", "\n")
    assert "out of memory in backward at micro-batch 8 (step 1)" in text
    assert "micro-batch 8 → 4 (out of memory in backward); effective batch stays 8" in text
    assert "hang: step 1, seconds 12.5" in text
    final = text[text.rindex("step 3/3") :]
    assert "micro 4×2" in final and "ETA 0:00:00" in final
    assert "mem 0.50 GiB (50 % of budget, peak 0.75 GiB)" in final
    assert "finished at step 3" in final


def test_a_note_from_another_thread_does_not_wait_for_a_stuck_console():
    """The hang watchdog records from its own thread while the loop's thread may be stuck in a
    write to stderr, holding the console: the note must return, and print once stderr moves."""
    entered, gate = threading.Event(), threading.Event()

    class StuckStderr(StringIO):
        def write(self, text):
            entered.set()
            gate.wait()
            return super().write(text)

    out = StuckStderr()
    log = ConsoleLog(console=Console(file=out, width=200))
    stuck = threading.Thread(target=log.console.print, args=("a line of the loop",), daemon=True)
    stuck.start()
    assert entered.wait(timeout=30)
    watchdog = threading.Thread(target=log.note, args=("hang", {"step": 3, "stalled_s": 301.0}))
    watchdog.start()
    watchdog.join(timeout=30)
    assert not watchdog.is_alive()
    gate.set()
    stuck.join(timeout=30)
    for _ in range(300):
        if "hang: step 3, stalled_s 301" in out.getvalue():
            break
        time.sleep(0.01)
    assert "hang: step 3, stalled_s 301" in out.getvalue()


def metrics(step: int, on_resolve=None) -> StepMetrics:
    """One step's metrics with the loss still a tensor, as the engine hands it over."""
    return StepMetrics(
        {
            "loss": torch.tensor(1.0 / step),
            "lr": 0.1,
            "grad_norm": torch.tensor(2.0),
            "micro_batch_size": 4,
            "micro_steps": 2,
            "samples": 8,
            "tokens": 0,
            "compute_time": 0.002,
            "optimizer_time": 0.001,
            "skipped": False,
            "time": 1.0e9 + step,
            "step": step,
            "epoch": 0,
            "data_time": 0.0005,
            "step_time": 0.0035,
            "memory": {"allocated": 2**29, "peak": 3 * 2**28, "budget": 2**30, "rss": 2**28},
        },
        on_resolve,
    )


@pytest.mark.parametrize("kind", ["lines", "bar", "tensorboard"])
def test_displays_read_only_the_step_the_files_read(tmp_path, kind):
    """Reading a loss waits for the device, so at step k's end a display reads step k-1 (which
    RunFiles resolves in that same dispatch), never step k: no display adds a wait."""
    console = Console(file=StringIO(), force_terminal=kind == "bar", width=200)
    shown = {
        "lines": lambda: ConsoleLog(every=1, console=console),
        "bar": lambda: ProgressBar(every=1, console=console),
        "tensorboard": lambda: TensorBoardLog(tmp_path / "tb"),
    }[kind]()
    state, control = TrainState(max_steps=4, effective_batch_size=8, micro_batch_size=4), Control()
    shown.on_fit_start(state, control, {"device": "cpu", "precision": "fp32", "budget": None})
    steps = []
    for step in range(1, 5):
        state.step = step
        steps.append(metrics(step))
        shown.on_step_end(state, control, {"metrics": steps[-1]})
        assert not steps[-1].resolved
        assert all(m.resolved for m in steps[:-1])
    steps[-1].resolve()  # the loop resolves the last step before fit_end
    shown.on_fit_end(state, control, {"reason": "finished", "exit_code": 0})
    if kind == "lines":
        assert [line.split("  ")[0] for line in console.file.getvalue().splitlines()[1:5]] == [
            "step 1/4",
            "step 2/4",
            "step 3/4",
            "step 4/4",
        ]


def test_device_spans_resolve_after_the_tensors():
    """A timed step's device spans stay pending until the metrics resolve; then each waits on
    its end event (already passed) and reads the elapsed milliseconds as seconds."""
    calls = []

    class EventDouble:  # stands in for torch.cuda.Event: records the calls made on it
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            calls.append(("synchronize", self.name))

        def elapsed_time(self, end):
            calls.append(("elapsed", self.name, end.name))
            return {"start": 40.0, "middle": 3.0}[self.name]

    start, middle, end = EventDouble("start"), EventDouble("middle"), EventDouble("end")
    m = StepMetrics(
        {
            "loss": torch.tensor(0.5),
            "device_compute_time": DeviceSpan(start, middle),
            "device_optimizer_time": DeviceSpan(middle, end),
            "samples": 4,
        }
    )
    assert m["samples"] == 4 and not m.resolved and calls == []
    assert m["device_compute_time"] == pytest.approx(0.040)
    assert m["device_optimizer_time"] == pytest.approx(0.003)
    assert m["loss"] == 0.5 and m.resolved
    assert calls == [
        ("synchronize", "middle"),
        ("elapsed", "start", "middle"),
        ("synchronize", "end"),
        ("elapsed", "middle", "end"),
    ]


# -- the JSONL files under SIGKILL -----------------------------------------------------------

WRITER_CHILD = """
import sys, types
package = types.ModuleType("steadytrain")  # the files module alone: no torch import, fast start
package.__path__ = [{src!r}]
sys.modules["steadytrain"] = package
from steadytrain.events import TrainState
from steadytrain.telemetry.files import RunFiles

files = RunFiles(sys.argv[1])
attempt, blob = int(sys.argv[2]), "x" * int(sys.argv[3])
state = TrainState()
for seq in range(10**9):
    files.metrics.write({{"attempt": attempt, "seq": seq, "blob": blob}})
    files.event("big", state, {{"attempt": attempt, "seq": seq, "blob": blob}})
    if seq == 0:
        print("writing", flush=True)
"""


def check_file(path: Path, attempts: int) -> bool:
    """Every complete line parses and read_jsonl returns exactly those, each attempt's records
    numbered 0, 1, 2, ... without a gap. Returns whether the file ends in a torn line."""
    data = path.read_bytes()
    *complete, tail = data.split(b"\n")
    parsed, torn_inside = [], 0
    for line in complete:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            torn_inside += 1  # a torn line that a later open ended with a newline
            assert line.startswith(b'{"') and len(line) < len(complete[0]) + 50
    assert read_jsonl(path) == parsed
    for attempt in range(attempts):
        seqs = [r["seq"] for r in parsed if r["attempt"] == attempt]
        assert seqs == list(range(len(seqs))) and seqs, (path.name, attempt)
    if tail:
        with pytest.raises(json.JSONDecodeError):
            json.loads(tail)
    return bool(tail)


def test_sigkill_mid_write_leaves_every_complete_line_readable(tmp_path):
    """A real child appending multi-megabyte lines to metrics.jsonl and events.jsonl is killed
    with SIGKILL at a random moment, again and again in the same run directory. After each kill
    every complete line reads back; the next writer ends a torn tail and appends cleanly. The
    loop goes on until kills have torn a line (at least once) or 100 attempts."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER_CHILD.format(src=str(SRC)))
    run_dir = tmp_path / "run"
    rng = random.Random(0)
    torn, attempt = 0, 0
    while attempt < 100 and (torn == 0 or attempt < 5):
        child = subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(attempt), str(2_000_000)],
            stdout=subprocess.PIPE,
        )
        assert child.stdout.readline() == b"writing\n"
        time.sleep(rng.uniform(0, 0.03))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        attempt += 1
        for name in ("metrics.jsonl", "events.jsonl"):
            torn += check_file(run_dir / name, attempt)
    assert torn >= 1, f"no kill out of {attempt} tore a line"

    before = {n: read_jsonl(run_dir / n) for n in ("metrics.jsonl", "events.jsonl")}
    files = RunFiles(run_dir)  # the next run
    files.metrics.write({"attempt": "next", "seq": 0})
    files.record("resume", {"attempt": "next", "seq": 0})
    files.metrics.close()
    files.events.close()
    for name, records in before.items():
        after = read_jsonl(run_dir / name)
        assert after[:-1] == records
        assert after[-1]["attempt"] == "next"
        assert (run_dir / name).read_bytes().endswith(b'"seq": 0}\n')


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl"])
def test_reopen_ends_a_torn_tail(tmp_path, name):
    """Whatever byte a write was cut at, the next JsonlFile starts its record on a fresh line
    and read_jsonl skips only the torn one."""
    path = tmp_path / name
    first = json.dumps({"step": 1, "loss": 0.5}) + "\n"
    full = first + json.dumps({"step": 2, "loss": 0.25})
    for cut in range(len(first), len(full)):
        path.write_text(full[:cut])
        writer = JsonlFile(path)
        writer.write({"step": 3})
        writer.close()
        assert read_jsonl(path) == [{"step": 1, "loss": 0.5}, {"step": 3}]
        assert path.read_text().endswith('\n{"step": 3}\n')


# -- TensorBoard -----------------------------------------------------------------------------


def test_tensorboard_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # clipping on: grad_norm is measured only when it clips (no clipping unless asked)
    fit(tmp_path, tensorboard=True, progress="off", max_grad_norm=1.0)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "time/step",
        "time/data",
        "time/forward_backward_device",
        "throughput/samples_per_s",
        "memory/used_gib",
        "memory/budget_pct",
    } <= tags
    losses = [(e.step, e.value) for e in board.Scalars("train/loss")]
    assert [s for s, _ in losses] == [r["step"] for r in rows] == list(range(1, 9))
    assert [v for _, v in losses] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.step for e in board.Scalars("time/forward_backward_device")] == [4, 8]
    assert [e.step for e in board.Scalars("time/checkpoint")] == [4, 8]


def test_tensorboard_without_the_package_is_refused_before_training(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "tensorboard" else real(name, *a, **k),
    )
    with pytest.raises(BadInputError) as caught:
        fit(tmp_path, tensorboard=True)
    assert "tensorboard" in str(caught.value)
    assert "pip install tensorboard" in str(caught.value)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == []
    assert not (tmp_path / "run" / "tensorboard").exists()
