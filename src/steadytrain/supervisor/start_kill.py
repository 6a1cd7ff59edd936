"""A kill before the first step: how the supervisor tells one, the memory savers' ladder it climbs
for it, and what it knows of the run's size for its last word (standard library only).

A model is loaded before the run records anything: its weights are the first large allocation,
and on a machine without the memory for them (fp32 weights of a 3B model are 12 GiB, on a 16 GB
Mac) the OS kills the process while they load, before `fit()` has written a line. The kernel's
counter may show it, or not (macOS has none; systemd-oomd and earlyoom leave it unchanged), and
no metrics line holds a memory reading to judge by. So a SIGKILL before the run's first recorded
step, with no new checkpoint, is taken for a memory kill at the smallest size: the next attempt
turns on the next memory saver, as after a kill at micro-batch 1, and when none is left the
supervisor stops with exit 3 and says what is known of the model's size and what would make it
load. A kill after the run recorded a step is judged as before: by the counter and the memory
reading of the last step (a plain `kill -9` then restarts unchanged, and repeated ones end in
exit 4). A wrong guess costs a saver turned on (some speed); a wrong "no" costs identical
restarts killed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadytrain.run import files as run_files
from steadytrain.run import jsonl as run_jsonl
from steadytrain.run.records import Metric, Record
from steadytrain.run.savers import SAVERS
from steadytrain.supervisor.progress import AttemptStart, Since, attempt_records, savers_record

GIB = 1024**3


def recorded_a_step(folder: Path | None) -> bool:
    """Whether RUN_DIR/metrics.jsonl holds a step's line (of any attempt)."""
    if folder is None:
        return False
    return any(Metric.STEP in line for line in run_jsonl.tail(Path(folder) / run_files.METRICS))


def wrote_nothing(folder: Path | None, since: Since) -> bool:
    """Whether the attempt started at `since` wrote no record to RUN_DIR/events.jsonl: it died
    before `fit()` began (importing, loading the model or the data)."""
    if folder is None:
        return False
    return not attempt_records(Path(folder) / run_files.EVENTS, since)


def start_ladder(folder: Path | None, asked: int | None) -> dict[str, Any]:
    """The savers in force and those left for an attempt killed before it recorded which (its
    `memory_savers` record is written once `fit()` has the model): the ladder an earlier
    attempt recorded (the savers this run can use), else the registry's, with the first
    `asked` (STEADYTRAIN_MEMORY_SAVERS of the attempt) taken as in force."""
    record = savers_record(folder, AttemptStart({})) if folder is not None else None
    if record is not None:
        ladder = [str(name) for name in (*record["in_force"], *record["left"])]
    else:
        ladder = [saver.name for saver in SAVERS]
    count = asked or 0
    return {"in_force": ladder[:count], "left": ladder[count:]}


def what_is_known(folder: Path | None, machine: int | None) -> list[str]:
    """What the run directory says of the run's size, in words: the fine-tune's model and
    precision (training_config.json), the config's precision, budget and device (config.json,
    written by an earlier attempt that got that far), the planner's estimate (an `estimate`
    event or estimate.json), and the machine's memory. Empty parts are left out."""
    known = []
    if folder is not None:
        finetune = run_json(Path(folder) / run_files.TRAINING_CONFIG)
        if finetune:
            known.append(_finetune_words(finetune))
        config = run_json(Path(folder) / run_files.CONFIG)
        if config:
            fields = [
                f"{key}: {config[key]}"
                for key in ("precision", "memory_budget", "device")
                if config.get(key) is not None
            ]
            if fields:
                known.append(f"{run_files.CONFIG}: {', '.join(fields)}")
        peak = _estimated_peak(Path(folder))
        if peak is not None:
            known.append(f"the estimated peak is {peak / GIB:.1f} GiB")
    if machine:
        known.append(f"this machine has {machine / GIB:.1f} GiB of memory")
    return known


def _finetune_words(config: dict[str, Any]) -> str:
    quantization = config.get("quantization")
    four_bit = isinstance(quantization, dict) and quantization.get("load_in_4bit") is True
    weights = (
        "4-bit base"
        if four_bit
        else "bf16 weights"
        if config.get("bf16") is True
        else "fp16 weights"
        if config.get("fp16") is True
        else "fp32 weights (bf16 and fp16 off)"
    )
    model = config.get("model_name_or_path") or "a model"
    return f"{run_files.TRAINING_CONFIG}: {model}, {weights}"


def _estimated_peak(folder: Path) -> float | None:
    for event in reversed(run_jsonl.tail(folder / run_files.EVENTS)):
        if event.get("event") == Record.ESTIMATE and _number(event.get("peak")) is not None:
            return _number(event.get("peak"))
    doc = run_json(folder / run_files.ESTIMATE)
    return _number(doc.get("peak")) if doc else None


def run_json(path: Path) -> dict[str, Any] | None:
    """A small JSON file of the run directory as a dict; None where it is missing or unreadable."""
    try:
        with run_jsonl.open_regular(path) as file:  # a pipe planted there: OSError, not a wait
            doc = json.loads(file.read(1 << 20))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
