"""Slow steps on a shared CPU (issue 19, point 4): the console says when steps slow because the
CPU is oversubscribed (threads against cores, other processes' load), and `doctor` advises a
thread count. The CPU readings are injected: the machine's real load cannot be set by a test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import steadytrain.telemetry.cpu as cpu
from steadytrain import TrainConfig, Trainer
from steadytrain.device.cpu_load import CpuLoad, CpuMeter
from steadytrain.doctor.findings import Context
from steadytrain.doctor.threads import check_threads
from steadytrain.events import Control, TrainState
from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
BUSY = CpuLoad(cores=2, threads=2, others_busy=1.7, load_average=3.9)
IDLE = CpuLoad(cores=2, threads=2, others_busy=0.1, load_average=0.4)


def test_load_says_when_threads_and_other_work_outnumber_the_cores():
    assert BUSY.oversubscribed and BUSY.advised_threads == 1
    assert not IDLE.oversubscribed and IDLE.advised_threads == 2
    own = CpuLoad(cores=2, threads=8, others_busy=0.0, load_average=None)
    assert own.oversubscribed and own.advised_threads == 2
    assert BUSY.describe() == (
        "torch runs 2 compute threads on 2 cores, other processes keep 1.7 cores busy "
        "(load average 3.9)"
    )


def test_the_meter_reads_this_machine():
    meter = CpuMeter()
    time.sleep(0.05)
    load = meter.read()
    assert load.cores >= 1 and load.threads == torch.get_num_threads()
    assert load.others_busy is not None and load.others_busy >= 0


class Metrics(dict):
    pass


def feed(watch, times):
    state = TrainState()
    for step, seconds in enumerate(times, start=1):
        state.step = step
        watch.on_step_end(state, Control(), {"metrics": Metrics(step_time=seconds)})


def test_a_slow_step_on_an_oversubscribed_cpu_is_named_once():
    seen, clock = [], [0.0]
    watch = cpu.CpuContention(lambda name, info: seen.append((name, info)), lambda: BUSY)
    watch.clock = lambda: clock[0]
    feed(watch, [1.0] * 12 + [3.0, 3.2])
    assert len(seen) == 1  # the second slow step comes within REPEAT_S
    name, info = seen[0]
    assert name == "cpu_contention"
    assert (info["step"], info["threads"], info["cores"], info["advised_threads"]) == (13, 2, 2, 1)
    assert info["message"] == (
        "step 13 took 3.00 s, 3.0× the typical 1.00 s: the CPU is oversubscribed: torch runs 2 "
        "compute threads on 2 cores, other processes keep 1.7 cores busy (load average 3.9). "
        "Use 1 thread (torch.set_num_threads(1) or OMP_NUM_THREADS=1) or stop the other work; "
        "`steadytrain doctor` shows the thread count that fits"
    )
    clock[0] = cpu.REPEAT_S + 1
    feed(watch, [3.0])
    assert len(seen) == 2


def test_a_slow_step_on_an_idle_cpu_or_a_steady_run_says_nothing():
    seen = []
    feed(cpu.CpuContention(lambda *a: seen.append(a), lambda: IDLE), [1.0] * 12 + [3.0])
    feed(cpu.CpuContention(lambda *a: seen.append(a), lambda: BUSY), [1.0] * 20)
    assert seen == []


def test_the_trainer_prints_and_records_it(tmp_path, monkeypatch, capsys):
    """Through `Trainer.fit()` on the CPU: a step made slow (the model sleeps) on a CPU the
    injected meter shows oversubscribed gives one console line and one event."""

    class BusyMeter:
        def read(self):
            return BUSY

    monkeypatch.setattr(cpu, "CpuMeter", BusyMeter)
    calls = []

    class Model(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            if len(calls) == 16:
                time.sleep(0.5)
            return super().forward(x)

    data = [(torch.randn(4), torch.randn(1)) for _ in range(32)]
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=8,
        micro_batch_size=8,
        max_steps=20,
        device="cpu",
        progress="off",
    )

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    model = Model(4, 1)
    Trainer(model, lambda p: torch.optim.SGD(p, lr=0.01), loss_fn, data, config).fit()
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    found = [e for e in events if e["event"] == "cpu_contention"]
    assert len(found) == 1 and found[0]["advised_threads"] == 1
    assert "the CPU is oversubscribed: torch runs 2 compute threads" in capsys.readouterr().err


def test_doctor_advises_a_thread_count(tmp_path):
    ctx = Context(None, {}, {}, "cpu", tmp_path)
    (finding,) = check_threads(ctx, CpuLoad(cores=2, threads=4, others_busy=0.0, load_average=1))
    assert finding.status == "warn"
    assert finding.fix == "use 2 threads (OMP_NUM_THREADS=2 or torch.set_num_threads(2))"
    (finding,) = check_threads(ctx, BUSY)
    assert finding.status == "info"
    assert "for CPU training now, 1 thread (OMP_NUM_THREADS=1" in finding.message
    (finding,) = check_threads(ctx, IDLE)
    assert (finding.status, finding.data["advised_threads"]) == ("ok", 2)


def test_cli_doctor_reports_threads():
    result = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "doctor", "--json", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    threads = findings["threads"]
    assert threads["data"]["threads"] >= 1 and threads["data"]["advised_threads"] >= 1
    assert "compute thread" in threads["message"]
