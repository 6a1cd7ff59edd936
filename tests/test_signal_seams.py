"""Signals, the supervisor and the resume check where a user meets them, past the cases the
other files test: restarts that each try something smaller are not "the same failure again".
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
from pathlib import Path

import forkserver

from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.telemetry.files import read_jsonl

FAST = {"backoff_initial": 0.01, "backoff_max": 0.02}

# A trainer's stand-in: each attempt writes the metrics line of a step at the micro-batch it may
# start with (STEADYTRAIN_MAX_MICRO_BATCH, 64 without a cap), then is killed for memory (its own
# SIGKILL, the counter below rising as the kernel's would) unless that micro-batch is at most
# FITS; it records the cap each attempt saw.
KILLED_UNTIL_SMALL = r"""
import json, os, signal, sys
from pathlib import Path

run_dir, fits = Path(sys.argv[1]), int(sys.argv[2])
cap = os.environ.get("STEADYTRAIN_MAX_MICRO_BATCH")
micro = int(cap) if cap else 64
run_dir.mkdir(parents=True, exist_ok=True)
with open(run_dir / "attempts.txt", "a") as f:
    f.write(f"{cap}\n")
with open(run_dir / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 3, "micro_batch_size": micro}) + "\n")
if micro > fits:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _supervise_kills(tmp_path: Path, fits: int, max_restarts: int) -> tuple[int, str, list]:
    script = tmp_path / "train.py"
    script.write_text(KILLED_UNTIL_SMALL)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    counter = itertools.count()  # the cgroup's oom_kill count: +1 at each kill
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    supervisor = Supervisor(
        [sys.executable, str(script), str(run_dir), str(fits)],
        SupervisorOptions(run_dir=run_dir, max_restarts=max_restarts, **FAST),
        environ=environ,
        out=out,
        oom_kill_count=lambda: next(counter),
    )
    code = supervisor.run()
    caps = (run_dir / "attempts.txt").read_text().split()
    return code, out.getvalue(), caps


def test_memory_kills_that_each_halve_the_micro_batch_do_not_use_up_max_restarts(tmp_path):
    """Killed by the OS at micro-batch 64, 32, 16 and 8 without a checkpoint in between, under
    --max-restarts 1: each restart starts smaller, so none is the same failure again; the run
    that fits at 4 finishes instead of being given up at 32."""
    code, out, caps = _supervise_kills(tmp_path, fits=4, max_restarts=1)
    assert code == 0, out
    assert caps == ["None", "32", "16", "8", "4"]
    assert "gave up" not in out
    restarts = read_jsonl(tmp_path / "run" / "events.jsonl")
    restarts = [e for e in restarts if e["event"] == "restart"]
    assert [e["max_micro_batch"] for e in restarts] == [32, 16, 8, 4]
    assert [e["restarts_without_progress"] for e in restarts] == [0, 0, 0, 0]
    assert "it starts smaller, so it is not counted as the same failure again (0 of 1" in out


def test_memory_kills_at_micro_batch_1_still_give_up_after_max_restarts(tmp_path):
    """Nothing smaller to try: the kills at micro-batch 1 are the same failure again, counted, and
    the supervisor gives up (exit 4) instead of retrying forever."""
    code, out, caps = _supervise_kills(tmp_path, fits=0, max_restarts=1)
    assert code == 4, out
    assert caps == ["None", "32", "16", "8", "4", "2", "1", "1"]
    assert "gave up after 1 restart without a new checkpoint" in out
    end = read_jsonl(tmp_path / "run" / "events.jsonl")[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_gave_up", 4)
    assert json.dumps(end)  # a complete record


# -- Ctrl-C before the loop takes SIGINT over ------------------------------------------------

# A user's script in the plain-PyTorch habit: Ctrl-C is caught, and the model saved as final.
# The first loss call (the planner's probe of `micro_batch_size: auto`) gets a Ctrl-C.
CATCHES_CTRL_C = r"""
import os, signal, sys, torch
from steadytrain import TrainConfig, Trainer

run_dir, interrupt = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
calls = []

def loss_fn(m, b):
    calls.append(1)
    if interrupt and len(calls) == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])

config = TrainConfig(run_dir=run_dir, effective_batch_size=8, micro_batch_size="auto", max_steps=3,
                     device="cpu", progress="off", memory_watch=False)
try:
    Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn, data, config).fit()
except KeyboardInterrupt:
    print("interrupted: saving the model", file=sys.stderr)
torch.save(model.state_dict(), run_dir + "/final.pt")
"""


def test_ctrl_c_while_auto_plans_ends_the_script_with_130_not_as_finished(tmp_path):
    """Ctrl-C during `micro_batch_size: auto`'s probes (before the loop installs its handler)
    ends `fit()` as a Ctrl-C in the loop does: `steadytrain.Stopped` (130), which a script's
    `except KeyboardInterrupt` does not take for its own, so its final save does not run; one
    line says so, no traceback; the next start trains to the end."""
    script = tmp_path / "train.py"
    script.write_text(CATCHES_CTRL_C)
    run_dir = tmp_path / "run"
    stopped = forkserver.run([sys.executable, str(script), str(run_dir), "1"], timeout=120)
    assert stopped.returncode == 130, stopped.stderr
    assert "interrupted: saving the model" not in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (
        "SIGINT before the first step: nothing new to save; the next start begins at step 0;"
        in (stopped.stderr)
    )
    assert not (run_dir / "final.pt").exists()
    again = forkserver.run([sys.executable, str(script), str(run_dir), "0"], timeout=120)
    assert again.returncode == 0, again.stderr
    assert (run_dir / "final.pt").exists()


# -- a program that ends with 0 after its run was stopped ------------------------------------

# The README's pattern with its `raise` forgotten: the stop is caught and the program ends
# normally. The SIGTERM comes from outside the supervisor (the OS shutting down, a `kill` of
# the trainer's pid), here from the trainer's own callback at step 2.
SWALLOWS_STOPPED = r"""
import os, signal, sys, torch
import steadytrain
from steadytrain import Callback, TrainConfig, Trainer

class TermAt2(Callback):
    def on_step_end(self, state, control, info):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, micro_batch_size=8, max_steps=6,
                     device="cpu", progress="off", memory_watch=False)
loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
try:
    Trainer(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), loss, data, config,
            callbacks=[TermAt2()]).fit()
except steadytrain.Stopped as stop:
    print(f"notified: {stop.result.checkpoint}", file=sys.stderr)
"""


def test_a_child_that_ends_0_after_its_run_was_stopped_is_a_stop_not_a_finish(tmp_path):
    """`steadytrain run -- python train.py && deploy`: the child caught `steadytrain.Stopped`
    and exited 0 at step 2 of 6. The attempt's fit_end says the run was stopped: the supervisor
    exits 143 (not 0, which would let what follows take it for finished) and does not restart
    a run someone asked to stop."""
    script = tmp_path / "train.py"
    script.write_text(SWALLOWS_STOPPED)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    supervisor = Supervisor(
        [sys.executable, str(script), str(run_dir)],
        SupervisorOptions(run_dir=run_dir, **FAST),
        environ=environ,
        out=out,
        oom_kill_count=lambda: None,
    )
    assert supervisor.run() == 143, out.getvalue()
    said = out.getvalue()
    assert "starting attempt 2" not in said
    assert (
        "child exited 0, but its run was stopped by SIGTERM at step 2 (fit_end in events.jsonl)"
        in said
    )
    end = read_jsonl(run_dir / "events.jsonl")[-1]
    assert (end["event"], end["exit_code"], end["step"]) == ("supervisor_end", 143, 2)
