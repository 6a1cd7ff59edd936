"""The run directory's JSON-lines files have one writer and one reader (steadytrain.run.jsonl):
the trainer's RunFiles and the supervisor's appends share events.jsonl, and whichever comes
after a torn line, every complete line reads back, through every reader."""

from __future__ import annotations

import json

from steadytrain.events import TrainState
from steadytrain.run.events import append_event
from steadytrain.run.jsonl import tail
from steadytrain.supervisor.progress import progress_step
from steadytrain.telemetry.files import RunFiles, read_jsonl

TORN = b'{"time": 1.0, "event": "checkpoint", "step": 9'  # a kill mid-write


def test_trainer_and_supervisor_appends_after_torn_lines_keep_every_line(tmp_path):
    """A torn line, then the supervisor's append and the trainer's records; a torn line again
    (the trainer killed with events.jsonl open), then the trainer's next run first and the
    supervisor after it: every complete record reads back, whole file and tail, in order."""
    events = tmp_path / "events.jsonl"
    events.write_bytes(b'{"event": "fit_start", "step": 0}\n' + TORN)
    append_event(tmp_path, {"event": "restart", "attempt": 1})
    files = RunFiles(tmp_path)
    files.event("checkpoint", TrainState(step=4), {"kept": 1})
    files.record("resume", {"step": 4})
    with open(events, "ab") as handle:
        handle.write(TORN)  # the trainer killed mid-line, its descriptor still open
    files.close()
    files = RunFiles(tmp_path)  # the restarted trainer
    files.record("resume", {"step": 4, "attempt": 2})
    files.close()
    append_event(tmp_path, {"event": "checkpoint", "step": 6})
    append_event(tmp_path, {"event": "gave_up"})

    expected = [
        ("fit_start", 0),
        ("restart", None),
        ("checkpoint", 4),
        ("resume", 4),
        ("resume", 4),
        ("checkpoint", 6),
        ("gave_up", None),
    ]
    got = [(r["event"], r.get("step")) for r in read_jsonl(events)]
    assert got == expected
    assert [(r["event"], r.get("step")) for r in tail(events)] == expected
    lines = events.read_bytes().split(b"\n")
    assert lines[-1] == b"" and sum(line == TORN for line in lines) == 2  # each torn line ended
    assert all(json.loads(line) for line in lines if line and line != TORN)
    assert progress_step(tmp_path) == 6  # the torn line's step 9 is no progress


def test_tail_starts_at_a_whole_line(tmp_path):
    """The supervisor's tail skips the line it starts in, keeps a line it starts exactly at,
    and keeps every whole line after it."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "micro_batch_size": 8}).encode() + b"\n" for i in range(5)]
    path.write_bytes(b"".join(lines))
    last_three = sum(len(line) for line in lines[2:])
    assert [r["step"] for r in tail(path, last_three)] == [2, 3, 4]
    assert [r["step"] for r in tail(path, last_three + 3)] == [2, 3, 4]
    assert [r["step"] for r in tail(path, last_three - 3)] == [3, 4]
    assert tail(tmp_path / "missing.jsonl") == []
