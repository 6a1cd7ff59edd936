"""`steadytrain run` when the OS kills the run while it starts, before its first step (issue 41
item 6): a model whose weights do not fit is killed as they load (fp32 3B weights are 12 GiB, on
a 16 GB Mac), before `fit()` writes a line, so no counter or memory reading tells the
supervisor why. Such a kill is taken for a memory kill at the smallest size: each restart turns on
the next memory saver of the registry's ladder (not an identical restart, and not counted as
one), and when none is left the supervisor stops with exit 3 and says the run was killed while
starting, what it knows of its size, and what would make it load.

The children are real Trainer scripts under `python -m steadytrain.cli run` that SIGKILL
themselves after building the model and before `fit()` (the OS's kill cannot be told from this
one); each writes the STEADYTRAIN_MEMORY_SAVERS it was started with. The cheaper tests run the
supervisor in this process with the scripted child of test_supervisor.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_supervisor import CLI, ROOT, clean_environ, supervise
from test_supervisor import job as job  # the scripted child's fixture

from steadytrain.run.savers import SAVERS
from steadytrain.telemetry.files import read_jsonl

KILLED_WHILE_LOADING = r"""
import os, signal, sys
from pathlib import Path
import torch
from steadytrain import TrainConfig, Trainer

run_dir, seen, loads_from = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
asked = int(os.environ.get("STEADYTRAIN_MEMORY_SAVERS") or 0)
with open(seen, "a") as f:
    f.write(f"{asked}\n")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)  # "loading the model"
if asked < loads_from:
    os.kill(os.getpid(), signal.SIGKILL)  # as the OS kills a process whose weights do not fit
x = torch.randn(8, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
config = TrainConfig(
    run_dir=str(run_dir), effective_batch_size=2, micro_batch_size=2, max_steps=3,
    save_every_steps=1, async_save=False, device="cpu", log_every_steps=100,
)
loss = lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1])
Trainer(model, lambda p: torch.optim.SGD(p, lr=0.01), loss, data, config).fit()
"""


def run_killed_while_loading(tmp_path: Path, loads_from: int) -> tuple[int, str, list[int], Path]:
    """The script under `steadytrain run --max-restarts 1`: its exit code, stderr, the saver
    counts its attempts saw, and the run directory."""
    script, run_dir, seen = tmp_path / "train.py", tmp_path / "run", tmp_path / "seen"
    script.write_text(KILLED_WHILE_LOADING)
    result = subprocess.run(
        [
            *(*CLI, "--run-dir", str(run_dir), "--max-restarts", "1"),
            *("--backoff-initial", "0.01", "--backoff-max", "0.05", "--"),
            *(sys.executable, str(script), str(run_dir), str(seen), str(loads_from)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_environ(),
        cwd=ROOT,
    )
    asked = [int(v) for v in seen.read_text().split()]
    return result.returncode, result.stderr, asked, run_dir


def test_killed_while_loading_every_time_turns_on_each_saver_then_exits_3(tmp_path):
    """Killed as it loads on every attempt: the restarts ask for 1, 2, 3, 4 savers, in the
    registry's order, though --max-restarts is 1 (a restart with one more saver is not the same
    restart again); then exit 3, not 4, and the last line says why in words."""
    code, err, asked, run_dir = run_killed_while_loading(tmp_path, loads_from=99)
    assert code == 3, err
    assert asked == list(range(len(SAVERS) + 1))  # [0, 1, 2, 3, 4]: the child saw them grow
    events = read_jsonl(run_dir / "events.jsonl")
    escalations = [e for e in events if e["event"] == "memory_escalation"]
    assert [e["saver"] for e in escalations] == [saver.name for saver in SAVERS]
    climbed = list(range(1, len(SAVERS) + 1))  # [1, 2, 3, 4]
    assert [e["memory_savers"] for e in escalations] == climbed
    restarts = [e for e in events if e["event"] == "restart"]
    assert [(r["signal"], r["memory_savers"]) for r in restarts] == [
        ("SIGKILL", k) for k in climbed
    ]
    end = events[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_end", 3)
    assert end["tried"] == [
        "as configured (attempt 1)",
        "activation checkpointing (attempt 2)",
        "activation checkpointing with its inputs offloaded to host memory (attempt 3)",
        "the chunked loss (attempt 4)",
        "the tiled MLP (attempt 5)",
    ]
    assert "killed while it started, before it wrote any record (loading the model)" in err
    assert "the next attempt turns on activation checkpointing (STEADYTRAIN_MEMORY_SAVERS=1)" in err
    assert "gave up" not in err and "see " + str(run_dir / "events.jsonl") not in err
    last = err.strip().splitlines()[-1]
    assert (
        "the run was killed by the OS while starting (loading the model), most likely for " in last
    )
    assert "5 attempts killed before the first step" in last
    assert "not restarting (exit 3)" in last
    assert "this machine has" in last  # what the supervisor knows of the size
    for fix in ("close other programs", "16 bits", "4-bit base on CUDA", "a smaller model"):
        assert fix in last, fix


def test_a_run_that_loads_once_savers_are_on_trains_to_the_end(tmp_path):
    """Killed while loading twice, it loads at the third attempt (two savers asked for) and
    trains: exit 0; the Trainer recorded the count it was asked for."""
    code, err, asked, run_dir = run_killed_while_loading(tmp_path, loads_from=2)
    assert code == 0, err
    assert asked == [0, 1, 2]
    events = read_jsonl(run_dir / "events.jsonl")
    started = [e for e in events if e["event"] == "memory_savers"]
    assert [s["asked"] for s in started] == [2]
    assert [e["event"] for e in events].count("fit_start") == 1
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3


# ---- the supervisor in this process: what it knows, and what is not a start kill -----------


def test_the_last_line_names_the_model_and_precision_the_run_directory_holds(job):
    """An earlier attempt of a fine-tune got as far as writing its config: the last line
    names the model, its fp32 weights, the config's budget and the estimate."""
    job.run_dir.mkdir()
    finetune = {"model_name_or_path": "Qwen/Qwen2.5-3B", "bf16": False, "fp16": False}
    (job.run_dir / "training_config.json").write_text(json.dumps(finetune))
    config = {"precision": "fp32", "memory_budget": "auto", "device": "mps"}
    (job.run_dir / "config.json").write_text(json.dumps(config))
    estimate = {"time": 1.0, "event": "estimate", "step": 0, "peak": 13 * 2**30}
    (job.run_dir / "events.jsonl").write_text(json.dumps(estimate) + "\n")
    code, out = supervise(job, "kill:SIGKILL", oom_kill_count=lambda: None)
    assert code == 3, out
    assert [a["k"] for a in job.attempts()] == list(range(len(SAVERS) + 1))
    assert (
        "Known: training_config.json: Qwen/Qwen2.5-3B, fp32 weights (bf16 and fp16 off); "
        "config.json: precision: fp32, memory_budget: auto, device: mps; the estimated peak is "
        "13.0 GiB; this machine has " in out
    )


def test_a_kill_before_the_first_step_is_a_memory_kill_whatever_the_counter_says(job):
    """Linux with the kernel's counter unchanged (systemd-oomd, earlyoom, or a kill -9): with
    no step recorded there is no memory reading to judge by, so it is taken for a memory kill
    and the next attempt asks for a saver (before: an identical restart)."""
    code, out = supervise(job, "kill:SIGKILL", "exit:0", oom_kill_count=lambda: 0)
    assert code == 0, out
    restart = job.events("restart")[0]
    assert restart["memory_savers"] == 1
    assert "taken for a memory kill (a model too large for this machine is killed while it " in out


def test_kills_after_the_run_recorded_a_step_stay_plain_kills_and_end_in_exit_4(job):
    """A kill -9 after the run recorded a step, with memory plentiful at that step and the
    counter unchanged, is not a memory kill: identical restarts, then exit 4."""
    job.run_dir.mkdir()
    line = {"step": 3, "micro_batch_size": 1, "mem_system_available": 2**60}
    (job.run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    code, out = supervise(job, "kill:SIGKILL", oom_kill_count=lambda: 0, max_restarts=2)
    assert code == 4, out
    assert [e["memory_savers"] for e in job.events("restart")] == [None, None]
    assert "while starting" not in out
    assert "gave up after 2 restarts without a new checkpoint" in out


def test_kills_with_progress_are_not_start_kills(job):
    """Killed after each new checkpoint (an integration's checkpoint event, no metrics line):
    the run made progress, so no saver is asked for."""
    plan = [f"ckpt-event:{step}+kill:SIGKILL" for step in (2, 4, 6, 8)]
    code, out = supervise(job, *plan, "exit:0", oom_kill_count=lambda: 0, max_restarts=1)
    assert code == 0, out
    assert [e["memory_savers"] for e in job.events("restart")] == [None] * 4


def test_without_a_run_directory_the_give_up_line_says_a_kill_while_loading_is_likely_memory(job):
    """No --run-dir, and a child killed before it could announce its own: the supervisor cannot
    tell when the kill came (identical restarts, exit 4), but its last line says what a SIGKILL
    before `fit()` most likely is and what would help."""
    code, out = supervise(job, "kill:SIGKILL", run_dir=False, max_restarts=1)
    assert code == 4, out
    last = out.strip().splitlines()[-1]
    assert "gave up after 1 restart without a new checkpoint" in last
    assert "killed by SIGKILL before it announced a run directory (before fit() began)" in last
    assert "most likely the OS killed it for memory" in last
    assert "load the weights in 16 bits" in last
