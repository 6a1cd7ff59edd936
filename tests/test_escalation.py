"""`steadytrain run` after the OS kills a run for memory with no smaller micro-batch left
(issue 28): each next attempt turns on the next memory saver of the ladder, and when none is
left the supervisor stops with exit 3 and says what was tried and what would help.

The end-to-end test runs real Trainer children that SIGKILL themselves at micro-batch 1 after a
checkpoint (the kill the OS sends cannot be told from this one), under the supervisor in this
process with no readable OOM-kill counter (macOS, whose jetsam leaves none), the child's
memory readings those of the device double (`FakeSystem`: a 16 GiB Mac at critical pressure). The cheap tests use the scripted child of test_supervisor.py, which writes
what a Trainer writes at its start (its `memory_savers` record) and a metrics line whose memory
reading is high or not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from test_supervisor import supervise

from steadytrain.memory.savers import MemorySavers
from steadytrain.safety.supervised import savers_from_supervisor
from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent

TRAINER_CHILD = r"""
import os, signal, sys
import torch
from torch.utils.checkpoint import checkpoint
import steadytrain.trainer.parts
from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.device.testing import GiB, FakeSystem

# The device double: the memory readings of a 16 GiB Mac at critical memory pressure, the state
# in which jetsam kills (the trainer computes on this machine's CPU).
real_resolve = steadytrain.trainer.parts.resolve_device
steadytrain.trainer.parts.resolve_device = lambda spec, budget: real_resolve(
    spec, budget, system=FakeSystem(pressure=(4,), available=GiB // 2)
)


class Net(torch.nn.Module):
    # A model with its own activation checkpointing switch, as Hugging Face models have.
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.recompute = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.recompute = True

    def gradient_checkpointing_disable(self):
        self.recompute = False

    def forward(self, x):
        h = checkpoint(self.a, x, use_reentrant=False) if self.recompute else self.a(x)
        return self.b(torch.relu(h))


class Loss:
    # A loss with a chunked mode (the interface memory.chunked_loss.CausalLMLoss has).
    chunk_tokens = None

    def can_chunk(self, model):
        return True

    def set_chunking(self, tokens):
        self.chunk_tokens = tokens

    def __call__(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


class KilledAfterCheckpoint(Callback):
    # Each attempt dies by SIGKILL two steps after the last attempt's kill, after a checkpoint.
    def on_step_end(self, state, control, info):
        if state.step >= 2 * (int(os.environ["STEADYTRAIN_RESTART"]) + 1):
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
x = torch.randn(16, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
config = TrainConfig(
    run_dir=sys.argv[1], effective_batch_size=1, micro_batch_size=1, max_steps=12,
    save_every_steps=1, async_save=False, keep_last=1, device="cpu", log_every_steps=100,
)
optimizer = lambda params: torch.optim.SGD(params, lr=0.01)
Trainer(Net(), optimizer, Loss(), data, config, callbacks=[KilledAfterCheckpoint()]).fit()
"""


def test_os_kills_at_micro_batch_1_turn_on_each_saver_then_stop_with_exit_3(tmp_path):
    """The macOS path: no OOM-kill counter to read, the child's memory readings those of the
    device double's Mac at critical pressure. Killed at micro-batch 1, the run is restarted with
    activation checkpointing, then with the chunked loss too, then the supervisor stops with
    exit 3, naming what was tried, without a fourth attempt."""
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(TRAINER_CHILD)

    class Job:
        def command(self, *plan):
            return [sys.executable, str(script), str(run_dir)]

    Job.run_dir = run_dir
    code, out = supervise(Job(), oom_kill_count=lambda: None, max_restarts=5)
    assert code == 3, out
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert lines and {(r["micro_batch_size"], r["mem_pressure"]) for r in lines} == {(1, 4)}
    assert "macOS memory pressure (jetsam)" in out
    events = read_jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert names.count("fit_start") == 3  # three attempts, no fourth
    restarts = [e for e in events if e["event"] == "restart"]
    assert [(r["signal"], r["memory_savers"]) for r in restarts] == [("SIGKILL", 1), ("SIGKILL", 2)]
    asked = [e["saver"] for e in events if e["event"] == "memory_escalation"]
    assert asked == ["activation_checkpointing", "chunked_loss"]
    # the children turned on what was asked, and said so
    turned = [e["saver"] for e in events if e["event"] == "memory_saver"]
    assert turned == ["activation_checkpointing", "chunked_loss"]
    starts = [e for e in events if e["event"] == "memory_savers"]
    assert [s["in_force"] for s in starts] == [
        [],
        ["activation_checkpointing"],
        ["activation_checkpointing", "chunked_loss"],
    ]
    assert starts[-1]["left"] == []
    end = events[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_end", 3)
    assert end["tried"] == [
        "micro-batch 1",
        "activation checkpointing (attempt 2)",
        "the chunked loss (attempt 3)",
    ]
    assert "the next attempt turns on activation checkpointing" in out
    assert "the next attempt turns on the chunked loss" in out
    assert "no memory saver left to turn on" in out
    assert "not restarting (exit 3)" in out
    assert "What would help:" in out
    assert "gave up" not in out


# ---- the scripted child: cheap ------------------------------------------------------------

SAVERS_CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path

run_dir, left = Path(sys.argv[1]), sys.argv[2].split(",") if sys.argv[2] else []
run_dir.mkdir(parents=True, exist_ok=True)
asked = int(os.environ.get("STEADYTRAIN_MEMORY_SAVERS") or 0)
with open(run_dir.parent / "asked", "a") as f:
    f.write(f"{asked}\n")
in_force, left = left[:asked], left[asked:]
with open(run_dir / "events.jsonl", "a") as f:
    f.write(json.dumps({"time": time.time(), "event": "memory_savers", "step": 0,
                        "in_force": in_force, "left": left, "asked": asked or None}) + "\n")
if asked >= int(sys.argv[3]):
    sys.exit(0)
os.kill(os.getpid(), signal.SIGKILL)
"""


class SaversJob:
    def __init__(self, tmp_path: Path, ladder: str, finish_at: int):
        self.run_dir = tmp_path / "run"
        self.script = tmp_path / "child.py"
        self.script.write_text(SAVERS_CHILD)
        self.ladder, self.finish_at = ladder, finish_at

    def command(self, *plan):
        return [
            sys.executable,
            str(self.script),
            str(self.run_dir),
            self.ladder,
            str(self.finish_at),
        ]

    def asked(self) -> list[int]:
        return [int(v) for v in (self.run_dir.parent / "asked").read_text().split()]


def memory_high(run_dir: Path, high: bool) -> None:
    """A metrics line at micro-batch 1 whose available memory is none, or all of the machine."""
    run_dir.mkdir(parents=True, exist_ok=True)
    line = {"step": 3, "micro_batch_size": 1, "mem_system_available": 0 if high else 2**60}
    (run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")


def test_a_user_space_kill_with_memory_high_escalates(tmp_path):
    """Linux with a counter that stays unchanged (systemd-oomd, earlyoom): memory high at the
    last step is a memory kill, and at micro-batch 1 the next attempt asks for one more saver."""
    job = SaversJob(tmp_path, "activation_checkpointing,chunked_loss", finish_at=1)
    memory_high(job.run_dir, high=True)
    code, out = supervise(job, oom_kill_count=lambda: 0)
    assert code == 0, out
    assert job.asked() == [0, 1]
    assert "the next attempt turns on activation checkpointing (STEADYTRAIN_MEMORY_SAVERS=1)" in out


def test_a_plain_kill_9_with_memory_not_high_restarts_unchanged(tmp_path):
    job = SaversJob(tmp_path, "activation_checkpointing,chunked_loss", finish_at=99)
    memory_high(job.run_dir, high=False)
    code, out = supervise(job, oom_kill_count=lambda: 0, max_restarts=1)
    assert code == 4, out
    assert job.asked() == [0, 0]
    assert "memory_escalation" not in (job.run_dir / "events.jsonl").read_text()


def test_without_a_counter_a_kill_with_memory_not_high_is_restarted_unchanged(tmp_path):
    """macOS (no counter): a `kill -9` while the last reading showed memory plentiful is not
    taken for jetsam's at micro-batch 1: no saver is asked for, no exit 3."""
    job = SaversJob(tmp_path, "", finish_at=99)
    memory_high(job.run_dir, high=False)
    code, out = supervise(job, oom_kill_count=lambda: None, max_restarts=1)
    assert code == 4, out
    assert job.asked() == [0, 0]
    assert "no memory saver left" not in out


def test_with_no_saver_the_run_can_use_the_first_os_kill_stops_with_exit_3(tmp_path):
    job = SaversJob(tmp_path, "", finish_at=99)
    code, out = supervise(job, oom_kill_count=lambda: None)
    assert code == 3, out
    assert job.asked() == [0]
    assert "no memory saver left to turn on (in force: none it can use)" in out
    assert "Tried: before its first step." in out


def test_a_finetunes_exit_3_says_in_its_config_keys_what_would_fit(tmp_path):
    """The supervisor's last word for a fine-tune (its training_config.json in the run
    directory, the budget its fit_start recorded): the advisor's list on the run's own config,
    each key and value with the total it gives, not a fixed list of flag names."""
    from test_advice import seed_config

    from steadytrain.cli import finetune_advice  # what `steadytrain run` gives its supervisor

    job = SaversJob(tmp_path, "", finish_at=99)
    job.run_dir.mkdir(parents=True)
    config = seed_config(tmp_path)
    (job.run_dir / "training_config.json").write_text(json.dumps(config.resolved()))
    start = {"event": "fit_start", "step": 0, "device": "mps", "budget": 16 * 2**30}
    (job.run_dir / "events.jsonl").write_text(json.dumps(start) + "\n")
    code, out = supervise(job, oom_kill_count=lambda: None, advice=finetune_advice)
    assert code == 3, out
    assert "What would help: at micro-batch 1 the estimate is 21.11 GiB of 16.00 GiB" in out
    assert "`bf16: true` → 12.9 GiB of 16.0 GiB: fits" in out


def test_the_childs_side_climbs_to_what_is_asked_after_a_resume():
    """A resumed checkpoint's run had checkpointing on: asked for 2, only the chunked loss is
    turned on (the count is of savers in force, not of rungs to climb)."""

    class Net(torch.nn.Linear):
        def gradient_checkpointing_enable(self, **kwargs):
            pass

        def gradient_checkpointing_disable(self):
            pass

    class Loss:
        chunk_tokens = None

        def can_chunk(self, model):
            return True

        def set_chunking(self, tokens):
            self.chunk_tokens = tokens

    savers = MemorySavers(Net(2, 2), Loss())
    savers.state.activation_checkpointing = True  # as a resumed checkpoint restores it
    records = []
    env = {"STEADYTRAIN_SUPERVISED": "1", "STEADYTRAIN_MEMORY_SAVERS": "2"}
    savers_from_supervisor(savers, lambda name, info: records.append((name, info)), 7, env)
    assert [(n, i.get("saver")) for n, i in records] == [
        ("memory_saver", "chunked_loss"),
        ("memory_savers", None),
    ]
    assert records[-1][1]["in_force"] == ["activation_checkpointing", "chunked_loss"]
    assert records[-1][1]["left"] == []
    # unsupervised, nothing is asked or recorded
    records.clear()
    savers_from_supervisor(savers, lambda name, info: records.append((name, info)), 7, {})
    assert records == []


HALVING_CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path

run_dir = Path(sys.argv[1])
run_dir.mkdir(parents=True, exist_ok=True)
cap = int(os.environ.get("STEADYTRAIN_MAX_MICRO_BATCH") or 8)
events = [{"event": "memory_savers", "step": 0, "in_force": [], "left": [], "asked": None}]
micro = cap
while micro > 2:  # out of memory in the step: the Trainer halves and records it (8 -> 4 -> 2)
    events.append({"event": "shrink", "step": 0, "old": micro, "new": micro // 2})
    micro //= 2
with open(run_dir / "events.jsonl", "a") as f:
    f.writelines(json.dumps({"time": time.time(), **e}) + "\n" for e in events)
with open(run_dir / "metrics.jsonl", "a") as f:  # a step at the size that ran, memory gone
    f.write(json.dumps({"step": 1, "micro_batch_size": micro, "mem_system_available": 0}) + "\n")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_tried_names_the_halvings_in_the_process_and_the_supervisors(tmp_path):
    """An attempt halves itself 8 → 4 → 2 on out-of-memory, then the OS kills it at 2; the
    next starts at 1 and is killed there with no saver left: exit 3, and "Tried:" names both
    the in-process halvings and the supervisor's smaller start, in order."""
    script, run_dir = tmp_path / "child.py", tmp_path / "run"
    script.write_text(HALVING_CHILD)

    class Job:
        def command(self, *plan):
            return [sys.executable, str(script), str(run_dir)]

    Job.run_dir = run_dir
    code, out = supervise(Job(), oom_kill_count=lambda: None)
    assert code == 3, out
    tried = [
        "micro-batch 8 → 4 → 2 (attempt 1, halved in the process on out-of-memory)",
        "micro-batch 1 (attempt 2)",
    ]
    assert f"Tried: {'; '.join(tried)}." in out, out
    end = read_jsonl(run_dir / "events.jsonl")[-1]
    assert (end["event"], end["tried"]) == ("supervisor_end", tried)
