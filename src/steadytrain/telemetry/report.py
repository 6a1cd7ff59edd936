"""`steadytrain report RUN_DIR`: one self-contained HTML page and its PNG plots, from the files a
run leaves behind.

It reads the run directory only (metrics.jsonl, events.jsonl, optionally estimate.json) and
imports neither torch nor the training loop, so it works on a run that is still being written,
on one that was killed mid-line, and on a machine without the training stack. The page embeds its
plots as base64 PNGs, so the single file can be mailed; the same PNGs are written beside it for
slides and issues. Every file is written to a temporary name and renamed into place, so a reader
never sees half a report.

What the reading rules are, and why:

* metrics.jsonl: after a crash and a resume, the steps between the last checkpoint and the crash
  are computed twice and appear twice. Plots by step keep the last line of each step (the one
  the run continued from); plots by time keep every line, as that is what the machine did. The
  number of repeated lines is the "lost steps" figure.
* events.jsonl: every event is listed; the kinds in `EVENT_STYLES` are also marked on the plots.
  A run attempt that has a `fit_start` but no `fit_end` before the next `fit_start`, and no
  supervisor `restart` to explain it, was killed without a chance to write anything (SIGKILL,
  the OS out-of-memory killer, a power cut): the report adds a derived `killed` event at
  the last step it recorded.
* the memory counter plotted is the one that matters on the run's device: allocated, peak and
  reserved on CUDA; driver (reserved) memory on MPS; resident set size on CPU.
* the memory estimate (from the planner) is compared with the measured peak only when the run
  directory holds one: an `estimate` event or an `estimate.json` file, each with `peak` in bytes
  (see `find_estimate`).
"""

from __future__ import annotations

import base64
import html
import importlib
import io
import itertools
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain import run_files
from steadytrain._durable import write_atomic
from steadytrain.errors import BadInputError
from steadytrain.telemetry.files import read_jsonl

GIB = 2**30
INSTALL_HINT = "pip install 'steadytrain[report]'"
MAX_EVENT_ROWS = 2000
"""The events table stops here (a week-long run with a checkpoint every few minutes stays
readable); the count of the rest is shown, and events.jsonl has them all."""
MAX_DETAIL_CHARS = 400


@dataclass(frozen=True)
class Style:
    color: str
    marker: str
    label: str
    incident: bool
    """Drawn as a vertical line across the plots (something went wrong or changed); otherwise
    only a small mark along the bottom edge (routine: checkpoints, cache releases)."""
    line: str | tuple = "--"
    """Line style of the vertical line; kinds that often coincide differ so that both stay
    visible (an oom and its shrink; a restart and its resume dash in turn)."""


# Known event kinds, in the order of the events strip. Colours are kept apart from the series
# colours below so that a mark never reads as data.
EVENT_STYLES: dict[str, Style] = {
    "oom": Style("#d62728", "X", "out of memory", True, "-"),
    "shrink": Style("#ff7f0e", "v", "micro-batch shrink", True, (0, (2, 3))),
    "micro_batch_cap": Style("#fdae6b", "v", "micro-batch cap (supervisor)", True),
    "memory_saver": Style("#bcbd22", "s", "memory saver on", True),
    "checkpoint": Style("#2ca02c", "^", "checkpoint", False),
    "resume": Style("#17becf", ">", "resume", True, (0, (5, 5))),
    "killed": Style("#000000", "x", "killed (no fit_end)", True, ":"),
    "restart": Style("#000000", "D", "restart (supervisor)", True, (5, (5, 5))),
    "supervisor_gave_up": Style("#000000", "P", "supervisor gave up", True),
    "signal": Style("#9467bd", "o", "signal (stop)", True),
    "hang": Style("#8c564b", "h", "hang", True),
    "leak": Style("#e377c2", "*", "memory leak", True),
    "swap": Style("#7f7f7f", "p", "swapping", True),
    "cache": Style("#c7c7c7", ".", "cache released", False),
    "fit_start": Style("#999999", "|", "attempt start", False),
    "fit_end": Style("#999999", "|", "attempt end", False),
}
OTHER_STYLE = Style("#bbbbbb", "o", "other", False)

LOSS_COLOR = "#1f77b4"
LR_COLOR = "#6a3d9a"
STEP_TIME_COLOR = "#1f77b4"
DATA_TIME_COLOR = "#9ecae1"
MEMORY_COLORS = ("#1f77b4", "#08519c", "#6baed6")
BUDGET_COLOR = "#e7298a"
SWAP_COLOR = "#969696"

# What to plot as memory on each device, first is the one the summary calls the peak.
MEMORY_COUNTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        ("mem_peak", "peak allocated"),
        ("mem_allocated", "allocated"),
        ("mem_reserved", "reserved (allocator cache)"),
    ),
    "mps": (("mem_reserved", "driver memory (reserved)"), ("mem_allocated", "allocated")),
    "cpu": (("mem_rss", "resident set (RSS)"),),
}

LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "frameon": False}
"""Legends sit to the right of the axes, where they cannot hide a line or a mark."""

PLOTS = (
    ("loss_lr", "Loss and learning rate by step"),
    ("step_time", "Step time by step"),
    ("memory_events", "Memory against the budget, and events, over time"),
)


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
    status: str = ""
    counts: Counter = field(default_factory=Counter)


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a run directory; raises BadInputError when `run_dir` is not one."""
    path = Path(run_dir)
    metrics_path, events_path = path / run_files.METRICS, path / run_files.EVENTS
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
    lines = [r for r in _records(metrics_path) if _is_int(r.get("step"))]
    last: dict[int, dict[str, Any]] = {}
    for record in lines:
        last[record["step"]] = record
    events = [r for r in _records(events_path) if isinstance(r.get("event"), str)]
    events.sort(key=lambda e: _number(e.get("time")) or 0.0)
    events = _with_kills(events, lines)
    times = [t for r in (*lines, *events) if (t := _number(r.get("time"))) is not None]
    run = Run(
        run_dir=path,
        lines=lines,
        steps=[last[s] for s in sorted(last)],
        events=events,
        device=_device(events, lines),
        estimate=find_estimate(path, events),
        start=min(times) if times else None,
        end=max(times) if times else None,
        lost_steps=len(lines) - len(last),
        counts=Counter(e["event"] for e in events),
    )
    run.status = _status(events)
    return run


def _records(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


# Written by the next attempt before its own fit_start (it restores, then starts): when an attempt
# died, these belong to the one after it.
BEFORE_START = ("resume", "resume_override", "micro_batch_cap")


def _with_kills(events: list[dict], lines: list[dict]) -> list[dict]:
    """Add a `killed` event where an attempt ended without fit_end and nothing else says why.
    It is placed at the last metrics line the attempt wrote; without one, at its last event that
    has a step (an oom in the first step), else at its fit_start."""
    starts = [i for i, e in enumerate(events) if e["event"] == "fit_start"]
    derived = []
    for here, following in itertools.pairwise(starts):
        between = events[here + 1 : following]
        if any(e["event"] in ("fit_end", "restart", "supervisor_gave_up") for e in between):
            continue
        begin, end = _number(events[here].get("time")), _number(events[following].get("time"))
        if begin is None or end is None:
            continue
        stepped = [e for e in between if _is_int(e.get("step")) and e["event"] not in BEFORE_START]
        written = [r for r in lines if begin <= (_number(r.get("time")) or -1.0) < end]
        last = max(written or stepped or [events[here]], key=lambda r: r["time"])
        derived.append(
            {
                "time": last["time"],
                "event": "killed",
                "step": last.get("step"),
                "reason": "the attempt ended without fit_end: killed (SIGKILL, the OS "
                "out-of-memory killer) or the machine stopped; placed at its last step",
                "derived": True,
            }
        )
    return sorted([*events, *derived], key=lambda e: _number(e.get("time")) or 0.0)


def _device(events: list[dict], lines: list[dict]) -> str:
    """cuda, mps or cpu: from the last fit_start, else from which counters the metrics carry."""
    for event in reversed(events):
        if event["event"] == "fit_start" and isinstance(event.get("device"), str):
            kind = event["device"].split(":")[0]
            if kind in MEMORY_COUNTERS:
                return kind
    if any(r.get("mem_peak") is not None for r in lines):
        return "cuda"
    if any(r.get("mem_reserved") is not None for r in lines):
        return "mps"
    return "cpu"


def _status(events: list[dict]) -> str:
    """How the last attempt ended, from the events after its fit_start."""
    last_start = max((i for i, e in enumerate(events) if e["event"] == "fit_start"), default=-1)
    ends = ("fit_end", "supervisor_end", "supervisor_gave_up")
    after = {e["event"]: e for e in events[last_start + 1 :] if e["event"] in ends}
    if "supervisor_gave_up" in after:
        return f"the supervisor gave up (exit {after['supervisor_gave_up'].get('exit_code')})"
    if "fit_end" in after:
        end = after["fit_end"]
        return f"{end.get('reason') or 'ended'} (exit {end.get('exit_code')})"
    if "supervisor_end" in after:
        return f"supervisor: {after['supervisor_end'].get('reason')}"
    if last_start < 0:
        return "not started: no fit_start recorded yet"
    return "no fit_end after the last start: still running, or killed"


def find_estimate(run_dir: Path, events: list[dict]) -> dict[str, Any] | None:
    """The planner's memory estimate, where the run recorded one: the last `estimate` event, else
    RUN_DIR/estimate.json. Either carries `peak` (bytes, the estimated peak of the counter the
    report plots) and may carry `micro_batch_size`. None when there is none: the summary then
    leaves the estimate row out rather than show an empty comparison."""
    for event in reversed(events):
        if event["event"] == "estimate" and _number(event.get("peak")) is not None:
            return event
    try:
        doc = json.loads((run_dir / run_files.ESTIMATE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and _number(doc.get("peak")) is not None else None


def _estimate_for(estimate: dict[str, Any], device: str) -> float:
    """The estimate to set against the measured counter. `peak` is tensor bytes, what CUDA's
    peak allocated measures; MPS driver memory and CPU RSS also hold the framework and the
    allocator's slack, which the estimate's `total` adds, so that is used there when given."""
    total = _number(estimate.get("total"))
    if device != "cuda" and total is not None:
        return total
    return float(estimate["peak"])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---- summary -----------------------------------------------------------------------------------


def memory_counters(run: Run) -> list[tuple[str, str]]:
    """The (metrics key, label) pairs to plot for this run's device that hold any value."""
    return [
        (key, label)
        for key, label in MEMORY_COUNTERS[run.device]
        if any(_number(r.get(key)) is not None for r in run.lines)
    ]


def peak_memory(run: Run) -> tuple[float, str] | None:
    """The highest reading of the device's main counter, and its label."""
    for key, label in memory_counters(run):
        values = [v for r in run.lines if (v := _number(r.get(key))) is not None]
        if values:
            return max(values), label
    return None


def budget(run: Run) -> float | None:
    values = [v for r in run.lines if (v := _number(r.get("mem_budget"))) is not None]
    if values:
        return values[-1]
    starts = [_number(e.get("budget")) for e in run.events if e["event"] == "fit_start"]
    return next((b for b in reversed(starts) if b is not None), None)


def summary_rows(run: Run) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [("status", run.status), ("device", run.device)]
    last = run.steps[-1] if run.steps else None
    planned = _planned_steps(run)
    if last is None:
        rows.append(("steps", "none recorded yet"))
    else:
        of = f" of {planned}" if planned else ""
        rows.append(("steps", f"{last['step']}{of} (lines for {len(run.steps)} steps)"))
    if run.start is not None and run.end is not None:
        computing = sum(v for r in run.steps if (v := _number(r.get("step_time"))) is not None)
        rows.append(
            (
                "time",
                f"{_duration(run.end - run.start)} from first to last record; "
                f"{_duration(computing)} in the kept steps",
            )
        )
    rows.append(
        (
            "lost steps",
            f"{run.lost_steps} (steps recorded before a crash and computed again after resuming)",
        )
    )
    killed = run.counts["killed"]
    rows.append(
        (
            "restarts",
            f"{run.counts['restart']} by the supervisor; {run.counts['resume']} resume(s) from "
            f"a checkpoint; {run.counts['fit_start']} attempt(s)"
            + (f"; {killed} attempt(s) killed without fit_end" if killed else ""),
        )
    )
    rows.append(("out of memory", _oom_text(run)))
    peak, limit = peak_memory(run), budget(run)
    if peak is not None:
        share = f" ({peak[0] / limit:.0%} of the {_gib(limit)} budget)" if limit else ""
        rows.append(("peak memory", f"{_gib(peak[0])} {peak[1]}{share}"))
    elif limit is not None:
        rows.append(("memory budget", _gib(limit)))
    if run.estimate is not None:
        estimated = _estimate_for(run.estimate, run.device)
        measured = f"measured {_gib(peak[0])}" if peak else "no measurement yet"
        off = f" ({(peak[0] - estimated) / estimated:+.0%})" if peak and estimated else ""
        rows.append(("estimated vs measured peak", f"estimated {_gib(estimated)}, {measured}{off}"))
    micro = last.get("micro_batch_size") if last else None
    if micro is not None:
        rows.append(("final micro-batch", str(micro)))
    loss = _number(last.get("loss")) if last else None
    if loss is not None:
        rows.append(("final loss", f"{loss:.4g}"))
    return rows


def summary_line(run: Run) -> str:
    """One line for the terminal."""
    last = run.steps[-1]["step"] if run.steps else 0
    parts = [
        f"{last} steps",
        f"{run.counts['oom']} out-of-memory",
        f"{run.counts['shrink']} shrink(s)",
        f"{run.counts['resume']} resume(s)",
        f"{run.counts['restart']} restart(s)",
        f"{run.lost_steps} lost step(s)",
    ]
    peak = peak_memory(run)
    if peak is not None:
        parts.append(f"peak {_gib(peak[0])}")
    return ", ".join(parts) + f"; {run.status}"


def _planned_steps(run: Run) -> int | None:
    for event in reversed(run.events):
        if event["event"] == "fit_start" and isinstance(event.get("config"), dict):
            value = event["config"].get("max_steps")
            return value if _is_int(value) else None
    return None


def _oom_text(run: Run) -> str:
    shrinks = [e for e in run.events if e["event"] == "shrink"]
    path = ""
    if shrinks:
        sizes = [shrinks[0].get("old"), *(e.get("new") for e in shrinks)]
        path = "; micro-batch " + " → ".join(str(s) for s in sizes)
    return f"{run.counts['oom']} event(s), {len(shrinks)} shrink(s){path}"


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


# ---- plots -------------------------------------------------------------------------------------


def _figure_class():
    """matplotlib's Figure, used without pyplot: no global state, no GUI backend."""
    try:
        figure = importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise BadInputError(
            f"steadytrain report draws its plots with matplotlib, which is not installed: "
            f"{INSTALL_HINT}"
        ) from exc
    return figure.Figure


def _style(name: str) -> Style:
    return EVENT_STYLES.get(name, OTHER_STYLE)


def _mark_events(ax, events: list[dict], x_of, seen: set[str]) -> None:
    """Known kinds as vertical lines (incidents) or marks along the bottom edge (routine), one
    artist per kind however long the run; each kind is named once in the legend of a figure."""
    transform = ax.get_xaxis_transform()
    for name, style in EVENT_STYLES.items():
        if name in ("fit_start", "fit_end"):
            continue
        xs = [x for e in events if e["event"] == name and (x := x_of(e)) is not None]
        if not xs:
            continue
        label = None if name in seen else style.label
        seen.add(name)
        if style.incident:
            ax.vlines(
                xs,
                0,
                1,
                transform=transform,
                colors=style.color,
                lw=1.6,
                linestyles=[style.line],
                label=label,
            )
        else:
            ax.plot(
                xs,
                [0.03] * len(xs),
                transform=transform,
                ls="",
                marker=style.marker,
                ms=6,
                color=style.color,
                label=label,
                clip_on=False,
            )


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**LEGEND)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555555")
    ax.set_yticks([])


def plot_loss_lr(run: Run):
    fig = _figure_class()(figsize=(12, 6), dpi=100, layout="constrained")
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.3))
    steps = [r["step"] for r in run.steps]
    loss = [_number(r.get("loss")) for r in run.steps]
    seen: set[str] = set()
    if any(v is not None for v in loss):
        loss_ax.plot(
            steps,
            [math.nan if v is None else v for v in loss],
            color=LOSS_COLOR,
            lw=2,
            marker="o" if len(steps) <= 60 else None,
            ms=3,
            label="loss",
        )
        known = [v for v in loss if v is not None]
        if min(known) > 0 and max(known) / min(known) > 50:
            loss_ax.set_yscale("log")  # a loss falling by orders of magnitude
    else:
        _empty(loss_ax, "no loss recorded yet")
    _mark_events(loss_ax, run.events, _event_step, seen)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss by step")
    loss_ax.grid(alpha=0.3)
    _legend(loss_ax)
    lr = [_number(r.get("lr")) for r in run.steps]
    if any(v is not None for v in lr):
        lr_ax.plot(steps, [math.nan if v is None else v for v in lr], color=LR_COLOR, lw=2)
    else:
        _empty(lr_ax, "no learning rate recorded")
    _mark_events(lr_ax, run.events, _event_step, seen)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.grid(alpha=0.3)
    return fig


def plot_step_time(run: Run):
    fig = _figure_class()(figsize=(12, 3.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    drawn = False
    for key, label, color, line in (
        ("step_time", "step time", STEP_TIME_COLOR, "-"),
        ("data_time", "waiting for data", DATA_TIME_COLOR, "-"),
        # only checkpoint steps carry it: points, as a line would have nothing to join
        ("checkpoint_time", "checkpoint stall", EVENT_STYLES["checkpoint"].color, ""),
    ):
        points = [(r["step"], v) for r in run.steps if (v := _number(r.get(key))) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs, ys, color=color, lw=2, ls=line, marker="s" if not line else None, label=label
            )
            drawn = True
    if not drawn:
        _empty(ax, "no steps recorded yet")
    _mark_events(ax, run.events, _event_step, set())
    ax.set_ylabel("seconds")
    ax.set_xlabel("optimizer step")
    ax.set_title("time per optimizer step")
    ax.grid(alpha=0.3)
    _legend(ax)
    return fig


def plot_memory_events(run: Run):
    """Memory over wall-clock time, every line kept (a resumed stretch shows twice, as it ran),
    the budget as a line, and below it one row per event kind on the same time axis."""
    kinds = _strip_kinds(run.events)
    fig = _figure_class()(figsize=(12, 4.5 + 0.32 * len(kinds)), dpi=100, layout="constrained")
    mem_ax, strip_ax = fig.subplots(
        2, 1, sharex=True, height_ratios=(3.2, max(0.8, 0.32 * len(kinds)))
    )
    scale, unit = _time_unit(run)

    def x_of(record: dict) -> float | None:
        t = _number(record.get("time"))
        return None if t is None or run.start is None else (t - run.start) / scale

    starts = sorted(
        x for e in run.events if e["event"] == "fit_start" and (x := x_of(e)) is not None
    )

    def series(key: str, keep_zero: bool = True) -> tuple[list[float], list[float]]:
        """(x, GiB) of every line holding `key`, broken (NaN) where a new attempt started, so
        the line does not bridge the time a killed run was dead."""
        xs: list[float] = []
        ys: list[float] = []
        for record in run.lines:
            x, value = x_of(record), _number(record.get(key))
            if x is None or value is None or (value == 0 and not keep_zero):
                continue
            if xs and any(xs[-1] < begin <= x for begin in starts):
                xs.append(math.nan)
                ys.append(math.nan)
            xs.append(x)
            ys.append(value / GIB)
        return xs, ys

    counters = memory_counters(run)
    for (key, label), color in zip(counters, MEMORY_COLORS, strict=False):
        marker = "." if len(run.lines) <= 200 else None
        mem_ax.plot(*series(key), color=color, lw=2, label=label, marker=marker)
    swap = series("mem_swap_used", keep_zero=False)
    if swap[0]:
        mem_ax.plot(*swap, color=SWAP_COLOR, lw=1.5, ls=":", label="swap used")
    limit = series("mem_budget")
    if limit[0]:
        mem_ax.step(*limit, where="post", color=BUDGET_COLOR, lw=2.5, ls="--", label="budget")
    if counters:  # readings taken at an oom or shrink, between the per-step lines
        key = counters[0][0].removeprefix("mem_")
        for event in run.events:
            reading, style = event.get("memory"), _style(event["event"])
            value = _number(reading.get(key)) if isinstance(reading, dict) else None
            if style.incident and value is not None and (x := x_of(event)) is not None:
                mem_ax.plot([x], [value / GIB], ls="", marker=style.marker, ms=9, color=style.color)
        mem_ax.set_ylim(bottom=0)
    else:
        _empty(mem_ax, "no memory readings recorded yet")
    _mark_events(mem_ax, run.events, x_of, set())
    mem_ax.set_ylabel("GiB")
    mem_ax.set_title(f"memory on {run.device} against the budget")
    mem_ax.grid(alpha=0.3)
    _legend(mem_ax)

    for row, name in enumerate(kinds):
        style = _style(name)
        xs = [x for e in run.events if e["event"] == name and (x := x_of(e)) is not None]
        strip_ax.plot(
            xs,
            [row] * len(xs),
            ls="",
            marker=style.marker,
            ms=9,
            color=style.color,
            markeredgecolor=style.color,
        )
    strip_ax.set_yticks(range(len(kinds)), kinds, fontsize=9)
    strip_ax.set_ylim(len(kinds) - 0.5, -0.5)
    if not kinds:
        _empty(strip_ax, "no events recorded yet")
    strip_ax.set_xlabel(f"time since the first record ({unit})")
    strip_ax.grid(axis="x", alpha=0.3)
    return fig


def _strip_kinds(events: list[dict]) -> list[str]:
    present = {e["event"] for e in events}
    known = [name for name in EVENT_STYLES if name in present]
    return known + sorted(present - set(known))


def _event_step(event: dict) -> float | None:
    step = event.get("step")
    return float(step) if _is_int(step) else None


def _time_unit(run: Run) -> tuple[float, str]:
    span = (run.end or 0) - (run.start or 0)
    if span < 180:
        return 1.0, "s"
    if span < 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# ---- the page ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    html: Path
    pngs: list[Path]
    summary: str


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Report:
    """Read RUN_DIR and write the page (default RUN_DIR/report.html) and its PNGs (in a folder
    named after the page: RUN_DIR/report/)."""
    _figure_class()  # a missing matplotlib is reported before anything is read
    run = load_run(run_dir)
    html_path = Path(out) if out is not None else run.run_dir / run_files.REPORT_HTML
    if html_path.suffix.lower() not in (".html", ".htm"):
        raise BadInputError(f"--out {html_path}: name an .html file (the PNGs go beside it)")
    png_dir = html_path.with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    drawn = {
        "loss_lr": plot_loss_lr(run),
        "step_time": plot_step_time(run),
        "memory_events": plot_memory_events(run),
    }
    images: dict[str, bytes] = {}
    pngs = []
    for name, _ in PLOTS:
        images[name] = _png(drawn[name])
        pngs.append(png_dir / f"{name}.png")
        write_atomic(pngs[-1], images[name])
    write_atomic(html_path, render_html(run, images).encode())
    return Report(html=html_path, pngs=pngs, summary=summary_line(run))


def render_html(run: Run, images: dict[str, bytes]) -> str:
    e = html.escape
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    summary = "\n".join(
        f"<tr><th>{e(name)}</th><td>{e(value)}</td></tr>" for name, value in summary_rows(run)
    )
    figures = "\n".join(
        f'<figure id="plot-{name}"><img src="data:image/png;base64,'
        f'{base64.b64encode(images[name]).decode()}" alt="{e(title)}">'
        f"<figcaption>{e(title)}</figcaption></figure>"
        for name, title in PLOTS
    )
    shown = run.events[:MAX_EVENT_ROWS]
    rows = "\n".join(_event_row(event, run.start) for event in shown)
    more = (
        f"<p>{len(run.events) - len(shown)} more events are in events.jsonl.</p>"
        if len(run.events) > len(shown)
        else ""
    )
    counts = ", ".join(f"{e(name)} {n}" for name, n in sorted(run.counts.items()))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>steadytrain report: {e(run.run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1240px;
       color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left;
          vertical-align: top; font-size: 14px; }}
th {{ background: #f4f4f4; }}
#summary th {{ width: 14em; }}
figure {{ margin: 0 0 1.5em; }}
figure img {{ max-width: 100%; height: auto; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 13px; }}
td.details {{ font-family: ui-monospace, monospace; font-size: 12px; word-break: break-word; }}
td.time {{ white-space: nowrap; }}
tr.incident td.event {{ font-weight: bold; }}
tr.derived td {{ font-style: italic; }}
</style>
</head>
<body>
<h1>steadytrain report: {e(str(run.run_dir))}</h1>
<p>Generated {e(generated)} from metrics.jsonl and events.jsonl. A run still being written shows
what was on disk at that moment; run <code>steadytrain report</code> again to refresh.</p>
<h2>Summary</h2>
<table id="summary">
{summary}
</table>
<h2>Plots</h2>
{figures}
<h2>Events</h2>
<p>{counts or "no events recorded yet"}. Rows in italics are derived by the report, not
written by the run.</p>
<table id="events">
<thead><tr><th>time (UTC)</th><th>elapsed</th><th>step</th><th>event</th><th>details</th></tr>
</thead>
<tbody>
{rows}
</tbody>
</table>
{more}
<h2>How the figures are counted</h2>
<ul>
<li><b>lost steps</b>: metrics lines for a step that was recorded again later. After a crash the
run resumes from its last checkpoint, so the steps after that checkpoint are computed twice; the
plots by step keep the last line of each step. Not counted: the last step computed before the
process died (its line is written when the next step ends) and the step in progress.</li>
<li><b>restarts</b>: <code>restart</code> events written by <code>steadytrain run</code>; a run
resumed by hand shows a <code>resume</code> without a restart, and the attempt before it as
<code>killed</code> when it ended without <code>fit_end</code>.</li>
<li><b>peak memory</b>: the highest reading of the device's main counter in metrics.jsonl
(CUDA peak allocated, MPS driver memory, CPU resident set); the budget is <code>mem_budget</code>.</li>
</ul>
</body>
</html>
"""


def _event_row(event: dict, start: float | None) -> str:
    e = html.escape
    t = _number(event.get("time"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t is not None else ""
    elapsed = _duration(t - start) if t is not None and start is not None else ""
    step = event.get("step")
    details = _details(event)
    classes = " ".join(
        name
        for name, on in (
            ("incident", _style(event["event"]).incident),
            ("derived", event.get("derived") is True),
        )
        if on
    )
    css = f' class="{classes}"' if classes else ""
    return (
        f'<tr{css} data-event="{e(event["event"])}"><td class="time">{e(when)}</td>'
        f"<td>{e(elapsed)}</td><td>{'' if step is None else e(str(step))}</td>"
        f'<td class="event">{e(event["event"])}</td>'
        f'<td class="details">{e(details)}</td></tr>'
    )


BYTE_FIELDS = {
    "budget",
    "allocated",
    "reserved",
    "peak",
    "total",
    "rss",
    "system_available",
    "swap_used",
    "usable",
    "requested",
}


def _details(event: dict) -> str:
    parts = []
    for key, value in event.items():
        if key in ("time", "event", "step", "derived") or value is None or value == []:
            continue
        if key == "config":
            parts.append("config: see config.json")
        elif isinstance(value, dict):
            inner = ", ".join(
                f"{k}={_value(k, v)}" for k, v in value.items() if v is not None and v != []
            )
            parts.append(f"{key}: {inner}")
        else:
            parts.append(f"{key}={_value(key, value)}")
    text = "; ".join(parts)
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


def _value(key: str, value: Any) -> str:
    number = _number(value)
    if key in BYTE_FIELDS and number is not None:
        return _gib(number)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
