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
