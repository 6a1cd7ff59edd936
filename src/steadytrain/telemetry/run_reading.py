"""Reading a run directory for the report: metrics and events (with the attempts that were
killed without a word), the device, the estimate, and the summary figures. The reading rules
and why they are so are in `steadytrain.telemetry.report`'s docstring."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError
from steadytrain.run import files as run_files
from steadytrain.run import jsonl as run_jsonl
from steadytrain.run.records import EVAL, Metric, Record

GIB = 2**30

# What to plot as memory on each device, first is the one the summary calls the peak.
MEMORY_COUNTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        (Metric.MEM_PEAK, "peak allocated"),
        (Metric.MEM_ALLOCATED, "allocated"),
        (Metric.MEM_RESERVED, "reserved (allocator cache)"),
    ),
    "mps": ((Metric.MEM_RESERVED, "driver memory (reserved)"), (Metric.MEM_ALLOCATED, "allocated")),
    "cpu": ((Metric.MEM_RSS, "resident set (RSS)"),),
}


# ---- reading the run directory ---------------------------------------------------------------


@dataclass
class Run:
    """What the run directory holds, read once."""

    run_dir: Path
    lines: list[dict[str, Any]]
    """Every metrics line with a step, in file order (repeats included)."""
    steps: list[dict[str, Any]]
    """The last line of each step, by step."""
    events: list[dict[str, Any]]
    """Every event, the derived `killed` ones included, by time."""
    device: str
    estimate: dict[str, Any] | None
    start: float | None = None
    end: float | None = None
    lost_steps: int = 0
    resumes: int = 0
    """Attempts that took up from a checkpoint: `resume` events, or (a program that records
    none, such as one of its own under `RunGuard`) attempts whose first step follows one an
    earlier attempt recorded."""
    status: str = ""
    counts: Counter = field(default_factory=Counter)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The last evaluation line of each step (``kind: "eval"`` in metrics.jsonl), by step."""
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Under torchrun: every metrics line of rank N > 0 (RUN_DIR/ranks/rank-N/metrics.jsonl),
    in file order; `lines` are rank 0's. Empty for a single process."""


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a run directory; raises BadInputError when `run_dir` is not one."""
    path = Path(run_dir)
    metrics_path, events_path = path / run_files.METRICS, path / run_files.EVENTS
    if path.is_file():
        parent = path.parent
        run = (parent / run_files.METRICS).is_file() or (parent / run_files.EVENTS).is_file()
        raise BadInputError(
            f"{path} is a file, not a run directory; give "
            + (f"the folder that holds it: {parent}" if run else "the run's folder (run_dir)")
            + " (it holds metrics.jsonl and events.jsonl)"
        )
    if not path.is_dir():
        raise BadInputError(
            f"{path}: no such run directory; expected a directory holding metrics.jsonl and "
            "events.jsonl (the run_dir of a Trainer.fit run)"
        )
    if not metrics_path.is_file() and not events_path.is_file():
        raise BadInputError(
            f"{path} is not a run directory: it holds neither metrics.jsonl nor events.jsonl "
            "(they are written there by Trainer.fit once the run starts)"
        )
    rows = [r for r in _records(metrics_path) if is_int(r.get(Metric.STEP))]
    lines = [row for row in rows if row.get(Metric.KIND) != EVAL]
    evals = {row[Metric.STEP]: row for row in rows if row.get(Metric.KIND) == EVAL}
    last: dict[int, dict[str, Any]] = {}
    for line in lines:
        last[line[Metric.STEP]] = line
    events = [r for r in _records(events_path) if isinstance(r.get("event"), str)]
    events.sort(key=lambda e: as_number(e.get("time")) or 0.0)
    events = _with_kills(events, lines)
    _place_restarts(events, lines)
    times = [t for r in (*lines, *events) if (t := as_number(r.get("time"))) is not None]
    run = Run(
        run_dir=path,
        lines=lines,
        steps=[last[s] for s in sorted(last)],
        events=events,
        device=_device(events, lines),
        estimate=find_estimate(path, events),
        start=min(times) if times else None,
        end=max(times) if times else None,
        counts=Counter(e["event"] for e in events),
        evals=[evals[s] for s in sorted(evals)],
        ranks=_other_ranks(path),
    )
    redone, resumed = _attempts_redone(events, lines)
    run.lost_steps = max(len(lines) - len(last), redone)
    run.resumes = max(run.counts[Record.RESUME], resumed)
    run.status = _status(events)
    return run


def _attempts_redone(events: list[dict], lines: list[dict]) -> tuple[int, int]:
    """(steps lost, attempts that resumed), read attempt by attempt (each `fit_start` begins
    one): an attempt whose first metrics line is step s took up after step s - 1, so the steps
    earlier attempts had reached beyond it (their metrics lines, or a `checkpoint` event: a step
    whose line a kill kept from being written) were lost and computed again. Independent of
    which library wrote the run and of whether it records `resume` events (a program of its
    own under `RunGuard` need not)."""
    starts = sorted(
        t
        for e in events
        if e["event"] == Record.FIT_START
        if (t := as_number(e.get("time"))) is not None
    )

    def attempt(record: dict) -> int:
        when = as_number(record.get("time"))
        return 0 if when is None else max(0, sum(1 for t in starts if t <= when) - 1)

    firsts: dict[int, int] = {}
    reached: dict[int, int] = {}
    for line in lines:
        index = attempt(line)
        firsts.setdefault(index, line[Metric.STEP])
        reached[index] = max(reached.get(index, 0), line[Metric.STEP])
    for event in events:
        if event["event"] == Record.CHECKPOINT and is_int(event.get("step")):
            index = attempt(event)
            reached[index] = max(reached.get(index, 0), event["step"])
    lost = resumed = 0
    before = 0  # the highest step the earlier attempts reached
    for index in sorted(set(firsts) | set(reached)):
        first = firsts.get(index)
        if first is not None and index > 0:
            lost += max(0, before - (first - 1))
            resumed += first > 1
        before = max(before, reached.get(index, 0))
    return lost, resumed


def _other_ranks(path: Path) -> dict[int, list[dict[str, Any]]]:
    """The step lines of each rank N > 0 that wrote metrics under RUN_DIR/ranks/rank-N/."""
    ranks = {}
    for folder in (path / run_files.RANKS).glob("rank-*"):
        suffix = folder.name.removeprefix("rank-")
        if suffix.isdigit() and int(suffix) > 0:
            rows = _records(folder / run_files.METRICS)
            lines = [r for r in rows if is_int(r.get(Metric.STEP)) and r.get(Metric.KIND) != EVAL]
            if lines:
                ranks[int(suffix)] = lines
    return dict(sorted(ranks.items()))


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of one of the run's JSON-lines files ([] when it is missing); one that
    cannot be read (a folder in its place, no permission) is BadInputError naming it."""
    try:
        return run_jsonl.read(path)
    except OSError as exc:
        what = "is a folder" if path.is_dir() else f"cannot be read ({exc.strerror})"
        raise BadInputError(
            f"{path} {what}; the report reads it as the run's JSON-lines file; move it away "
            "(the report then shows the rest of the run) or restore the file"
        ) from None


# Written by the next attempt before its own fit_start (it restores, then starts): when an attempt
# died, these belong to the one after it.
BEFORE_START = (Record.RESUME, Record.RESUME_OVERRIDE, Record.MICRO_BATCH_CAP, Record.MEMORY_SAVERS)


def _place_restarts(events: list[dict], lines: list[dict]) -> None:
    """A `restart` event's `step` is the checkpoint the next attempt resumes from; on the plots
    by step it is drawn where the attempt died: `at_step`, the last step that attempt recorded
    (the resume is drawn at the resume step by its own event)."""
    for event in events:
        when = as_number(event.get("time"))
        if event["event"] != Record.RESTART or when is None:
            continue
        before = [r for r in lines if (as_number(r.get(Metric.TIME)) or math.inf) <= when]
        if before:
            event["at_step"] = max(before, key=lambda r: r[Metric.TIME])[Metric.STEP]


def _with_kills(events: list[dict], lines: list[dict]) -> list[dict]:
    """Add a `killed` event where an attempt ended without fit_end and nothing else says why.
    It is placed at the last metrics line the attempt wrote; without one, at its last event that
    has a step (an oom in the first step), else at its fit_start."""
    starts = [i for i, e in enumerate(events) if e["event"] == Record.FIT_START]
    derived = []
    for here, following in itertools.pairwise(starts):
        between = events[here + 1 : following]
        if any(
            e["event"] in (Record.FIT_END, Record.RESTART, Record.SUPERVISOR_GAVE_UP)
            for e in between
        ):
            continue
        begin, end = as_number(events[here].get("time")), as_number(events[following].get("time"))
        if begin is None or end is None:
            continue
        stepped = [e for e in between if is_int(e.get("step")) and e["event"] not in BEFORE_START]
        written = [r for r in lines if begin <= (as_number(r.get(Metric.TIME)) or -1.0) < end]
        last = max(written or stepped or [events[here]], key=lambda r: r["time"])
        derived.append(
            {
                "time": last["time"],
                "event": Record.KILLED,
                "step": last.get("step"),
                "reason": "the attempt ended without fit_end: killed (SIGKILL, the OS "
                "out-of-memory killer) or the machine stopped; placed at its last step",
                "derived": True,
            }
        )
    return sorted([*events, *derived], key=lambda e: as_number(e.get("time")) or 0.0)


def _device(events: list[dict], lines: list[dict]) -> str:
    """cuda, mps or cpu: from the last fit_start, else from which counters the metrics carry."""
    for event in reversed(events):
        if event["event"] == Record.FIT_START and isinstance(event.get("device"), str):
            kind = event["device"].split(":")[0]
            if kind in MEMORY_COUNTERS:
                return kind
    if any(r.get(Metric.MEM_PEAK) is not None for r in lines):
        return "cuda"
    if any(r.get(Metric.MEM_RESERVED) is not None for r in lines):
        return "mps"
    return "cpu"


def _status(events: list[dict]) -> str:
    """How the last attempt ended, from the events after its fit_start."""
    last_start = max(
        (i for i, e in enumerate(events) if e["event"] == Record.FIT_START), default=-1
    )
    ends = (Record.FIT_END, Record.SUPERVISOR_END, Record.SUPERVISOR_GAVE_UP)
    after = {e["event"]: e for e in events[last_start + 1 :] if e["event"] in ends}
    if Record.SUPERVISOR_GAVE_UP in after:
        return f"the supervisor gave up (exit {after[Record.SUPERVISOR_GAVE_UP].get('exit_code')})"
    if Record.FIT_END in after:
        end = after[Record.FIT_END]
        return f"{end.get('reason') or 'ended'} (exit {end.get('exit_code')})"
    if Record.SUPERVISOR_END in after:
        return f"supervisor: {after[Record.SUPERVISOR_END].get('reason')}"
    errors = [e for e in events[last_start + 1 :] if e["event"] == Record.ERROR]
    if errors:  # an error before fit_start (the plan, the data) or one that left no fit_end
        return _error_status(errors[-1], started=last_start >= 0)
    if last_start < 0:
        return "not started: no fit_start recorded yet"
    return "no fit_end after the last start: still running, or killed"


def _error_status(error: dict, started: bool) -> str:
    code = error.get("exit_code")
    whose = "an error"
    if code == 5 or error.get("in_your_code"):
        kind = "out of memory" if code == 3 else "an error"
        whose = f"{kind} in your code ({error.get('where')})"
    when = f"at step {error.get('step')}" if started else "before the first step"
    return f"stopped by {whose} {when}: {error.get('error')} (exit {code})"


def find_estimate(run_dir: Path, events: list[dict]) -> dict[str, Any] | None:
    """The planner's memory estimate, where the run recorded one: the last `estimate` event, else
    RUN_DIR/estimate.json. Either carries `peak` (bytes, the estimated peak of the counter the
    report plots) and may carry `micro_batch_size`. None when there is none: the summary then
    leaves the estimate row out rather than show an empty comparison."""
    for event in reversed(events):
        if event["event"] == Record.ESTIMATE and as_number(event.get("peak")) is not None:
            return event
    try:
        with run_jsonl.open_regular(run_dir / run_files.ESTIMATE) as file:  # a pipe: OSError
            doc = json.loads(file.read())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and as_number(doc.get("peak")) is not None else None


def _estimate_for(estimate: dict[str, Any], device: str) -> float:
    """The estimate to set against the measured counter. `peak` is tensor bytes, what CUDA's
    peak allocated measures; MPS driver memory and CPU RSS also hold the framework and the
    allocator's slack, which the estimate's `total` adds, so that is used there when given."""
    total = as_number(estimate.get("total"))
    if device != "cuda" and total is not None:
        return total
    return float(estimate["peak"])


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---- summary -----------------------------------------------------------------------------------


def memory_counters(run: Run) -> list[tuple[str, str]]:
    """The (metrics key, label) pairs to plot for this run's device that hold any value."""
    return [
        (key, label)
        for key, label in MEMORY_COUNTERS[run.device]
        if any(as_number(r.get(key)) is not None for r in run.lines)
    ]


def peak_memory(run: Run, lines: list[dict[str, Any]] | None = None) -> tuple[float, str] | None:
    """The highest reading of the device's main counter, and its label (of rank 0's lines, or
    of `lines`)."""
    for key, label in memory_counters(run):
        found = run.lines if lines is None else lines
        values = [v for r in found if (v := as_number(r.get(key))) is not None]
        if values:
            return max(values), label
    return None


def rank_peaks(run: Run) -> list[tuple[int, tuple[float, str]]]:
    """Under torchrun: (rank, its peak and label) for every rank with a reading, rank 0 first;
    empty for a single process."""
    if not run.ranks:
        return []
    every = [(0, run.lines), *run.ranks.items()]
    return [(rank, peak) for rank, lines in every if (peak := peak_memory(run, lines))]


def budget(run: Run) -> float | None:
    values = [v for r in run.lines if (v := as_number(r.get(Metric.MEM_BUDGET))) is not None]
    if values:
        return values[-1]
    starts = [as_number(e.get("budget")) for e in run.events if e["event"] == Record.FIT_START]
    return next((b for b in reversed(starts) if b is not None), None)


def summary_rows(run: Run) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [("status", run.status), ("device", run.device)]
    last = run.steps[-1] if run.steps else None
    planned = _planned_steps(run)
    if last is None:
        rows.append(("steps", "none recorded yet"))
    else:
        of = f" of {planned}" if planned else ""
        rows.append(("steps", f"{last[Metric.STEP]}{of} (lines for {len(run.steps)} steps)"))
    if run.start is not None and run.end is not None:
        computing = sum(
            v for r in run.steps if (v := as_number(r.get(Metric.STEP_TIME))) is not None
        )
        rows.append(
            (
                "time",
                f"{duration_text(run.end - run.start)} from first to last record; "
                f"{duration_text(computing)} in the kept steps",
            )
        )
    if skipped := fp16_skipped(run):
        rows.append(("fp16 skipped steps", f"{skipped} (the grad scaler found inf/NaN gradients)"))
    rows.append(
        (
            "lost steps",
            f"{run.lost_steps} (steps recorded before a crash and computed again after resuming)",
        )
    )
    killed = run.counts[Record.KILLED]
    restarts, started = run.counts[Record.RESTART], run.counts[Record.FIT_START]
    # each restart began one more attempt, recorded or not: one killed while loading never
    # reached its fit_start, and still was an attempt
    attempts = max(started, restarts + 1) if restarts else started
    rows.append(
        (
            "restarts",
            f"{restarts} by the supervisor; {run.resumes} resume(s) from "
            f"a checkpoint; {attempts} attempt(s)"
            + (f"; {killed} attempt(s) killed without fit_end" if killed else ""),
        )
    )
    if differed := continuity_differences(run):
        rows.append(("resume check", _resume_check_text(differed)))
    rows.append(("out of memory", _oom_text(run)))
    peak, limit = peak_memory(run), budget(run)
    if peak is not None:
        share = f" ({peak[0] / limit:.0%} of the {gib(limit)} budget)" if limit else ""
        rows.append(("peak memory", f"{gib(peak[0])} {peak[1]}{share}"))
    elif limit is not None:
        rows.append(("memory budget", gib(limit)))
    for rank, (value, label) in rank_peaks(run):
        share = f" ({value / limit:.0%} of the {gib(limit)} budget)" if limit else ""
        rows.append((f"peak memory, rank {rank}", f"{gib(value)} {label}{share}"))
    if run.estimate is not None:
        rows.append(_estimate_row(run.estimate, run.device, peak))
    micro = last.get(Metric.MICRO_BATCH_SIZE) if last else None
    if micro is not None:
        rows.append(("final micro-batch", str(micro)))
    loss = as_number(last.get(Metric.LOSS)) if last else None
    if loss is not None:
        rows.append(("final loss", f"{loss:.4g}"))
    return rows


def _resume_check_text(differed: list[dict[str, Any]]) -> str:
    first = differed[0]
    return (
        f"{len(differed)} resume(s) whose first step's loss differed from what its "
        f"checkpoint recorded (first at step {first.get('step')}: "
        f"{first.get('loss')!r}, recorded {first.get('expected')!r}): the data, code or "
        "random state differ from the run that wrote it; see the continuity events"
    )


def continuity_differences(run: Run) -> list[dict[str, Any]]:
    """The `continuity` events of resumes whose first loss was not the one recorded."""
    return [
        e
        for e in run.events
        if e.get("event") == Record.CONTINUITY and e.get("checked") and not e.get("equal")
    ]


def fp16_skipped(run: Run) -> int:
    """Steps fp16's grad scaler skipped (inf/NaN gradients), from the kept metrics lines."""
    return sum(1 for row in run.steps if row.get(Metric.SKIPPED) is True)


def _estimate_row(
    estimate: dict[str, Any], device: str, peak: tuple[float, str] | None
) -> tuple[str, str]:
    """The planner's figure against the measured peak, named for what it is: an analytic
    estimate is a prediction; the probe's figure is the plan's cautious upper bound (the
    measured passes extrapolated with a margin), which a run is meant to stay under."""
    figure = _estimate_for(estimate, device)
    measured = f"measured {gib(peak[0])}" if peak else "no measurement yet"
    if estimate.get("source") == "probe":
        micro = estimate.get("micro_batch_size")
        at = f" at micro-batch {micro}" if micro is not None else ""
        share = f" ({peak[0] / figure:.0%} of the bound)" if peak and figure else ""
        return (
            "plan bound vs measured peak",
            f"plan bound {gib(figure)}{at} (the planner's cautious upper bound, not a "
            f"prediction), {measured}{share}",
        )
    off = f" ({(peak[0] - figure) / figure:+.0%})" if peak and figure else ""
    return "estimated vs measured peak", f"estimated {gib(figure)}, {measured}{off}"


def summary_line(run: Run) -> str:
    """One line for the terminal."""
    last = run.steps[-1][Metric.STEP] if run.steps else 0
    parts = [
        f"{last} steps",
        f"{run.counts[Record.OOM]} out-of-memory",
        f"{run.counts[Record.SHRINK]} shrink(s)",
        f"{run.resumes} resume(s)",
        f"{run.counts[Record.RESTART]} restart(s)",
        f"{run.lost_steps} lost step(s)",
    ]
    if skipped := fp16_skipped(run):
        parts.append(f"{skipped} fp16-skipped step(s)")
    peak = peak_memory(run)
    if peak is not None:
        parts.append(f"peak {gib(peak[0])}")
    return ", ".join(parts) + f"; {run.status}"


def _planned_steps(run: Run) -> int | None:
    for event in reversed(run.events):
        if event["event"] == Record.FIT_START and isinstance(event.get("config"), dict):
            value = event["config"].get("max_steps")
            return value if is_int(value) else None
    return None


def _oom_text(run: Run) -> str:
    shrinks = [e for e in run.events if e["event"] == Record.SHRINK]
    path = ""
    if shrinks:
        sizes = [shrinks[0].get("old"), *(e.get("new") for e in shrinks)]
        path = "; micro-batch " + " → ".join(str(s) for s in sizes)
    return f"{run.counts[Record.OOM]} event(s), {len(shrinks)} shrink(s){path}"


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def duration_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
