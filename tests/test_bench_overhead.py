"""bench/overhead.py runs on the CPU as it does on the GPU machine (--smoke): the plain loop sees
steadytrain's data order, and the bare arm (no hang watchdog, no memory watch) trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forkserver

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "overhead.py"


def test_the_overhead_bench_runs_every_arm_it_compares_in_smoke_mode(tmp_path):
    out, runs = tmp_path / "overhead.json", tmp_path / "runs"
    args = ["--smoke", "--arms", "plain,steadytrain,steadytrain-bare", "--rounds", "1"]
    args += ["--steps", "3", "--warmup", "1", "--seq", "16", "--effective", "4", "--micro", "2"]
    args += ["--out", str(out), "--keep-runs", str(runs)]
    done = forkserver.run([sys.executable, str(SCRIPT), *args], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"plain", "steadytrain", "steadytrain-bare"}
    events = {
        path.parent.name: [json.loads(line)["event"] for line in path.read_text().splitlines()]
        for path in runs.rglob("events.jsonl")
    }
    bare = [names for name, names in events.items() if "bare" in name]
    full = [names for name, names in events.items() if "bare" not in name]
    assert bare and full, sorted(events)
    assert all("fit_end" in names for names in bare + full)
