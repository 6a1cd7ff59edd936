"""The report's plots (matplotlib, imported only when a report is drawn): loss and learning
rate by step, step time by step, memory against the budget with events over time."""

from __future__ import annotations

import importlib
import io
import math
from dataclasses import dataclass

from steadytrain.errors import BadInputError
from steadytrain.run.records import MEMORY_PREFIX, Metric, Record
from steadytrain.telemetry.run_reading import GIB, Run, as_number, is_int, memory_counters

INSTALL_HINT = "pip install 'steadytrain[report]'"


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
EVENT_STYLES: dict[Record, Style] = {
    Record.OOM: Style("#d62728", "X", "out of memory", True, "-"),
    Record.SHRINK: Style("#ff7f0e", "v", "micro-batch shrink", True, (0, (2, 3))),
    Record.MICRO_BATCH_CAP: Style("#fdae6b", "v", "micro-batch cap (supervisor)", True),
    Record.MEMORY_SAVER: Style("#bcbd22", "s", "memory saver on", True),
    Record.CHECKPOINT: Style("#2ca02c", "^", "checkpoint", False),
    Record.RESUME: Style("#17becf", ">", "resume", True, (0, (5, 5))),
    Record.KILLED: Style("#000000", "x", "killed (no fit_end)", True, ":"),
    Record.RESTART: Style("#000000", "D", "died here, restarted (supervisor)", True, (5, (5, 5))),
    Record.SUPERVISOR_GAVE_UP: Style("#000000", "P", "supervisor gave up", True),
    Record.SIGNAL: Style("#9467bd", "o", "signal (stop)", True),
    Record.HANG: Style("#8c564b", "h", "hang", True),
    Record.LEAK: Style("#e377c2", "*", "memory leak", True),
    Record.SWAP: Style("#7f7f7f", "p", "swapping", True),
    Record.CACHE: Style("#c7c7c7", ".", "cache released", False),
    Record.FIT_START: Style("#999999", "|", "attempt start", False),
    Record.FIT_END: Style("#999999", "|", "attempt end", False),
}
OTHER_STYLE = Style("#bbbbbb", "o", "other", False)

LOSS_COLOR = "#1f77b4"
LR_COLOR = "#6a3d9a"
STEP_TIME_COLOR = "#1f77b4"
DATA_TIME_COLOR = "#9ecae1"
MEMORY_COLORS = ("#1f77b4", "#08519c", "#6baed6")
BUDGET_COLOR = "#e7298a"
SWAP_COLOR = "#969696"

LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "frameon": False}
"""Legends sit to the right of the axes, where they cannot hide a line or a mark."""

PLOTS = (
    ("loss_lr", "Loss and learning rate by step"),
    ("step_time", "Step time by step"),
    ("memory_events", "Memory against the budget, and events, over time"),
)


# ---- plots -------------------------------------------------------------------------------------


def figure_class():
    """matplotlib's Figure, used without pyplot: no global state, no GUI backend."""
    try:
        figure = importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise BadInputError(
            f"steadytrain report draws its plots with matplotlib, which is not installed: "
            f"{INSTALL_HINT}"
        ) from exc
    return figure.Figure


def style_of(name: str) -> Style:
    return EVENT_STYLES.get(name, OTHER_STYLE)


def _mark_events(ax, events: list[dict], x_of, seen: set[str]) -> None:
    """Known kinds as vertical lines (incidents) or marks along the bottom edge (routine), one
    artist per kind however long the run; each kind is named once in the legend of a figure."""
    transform = ax.get_xaxis_transform()
    for name, style in EVENT_STYLES.items():
        if name in (Record.FIT_START, Record.FIT_END):
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
    from matplotlib.ticker import MaxNLocator

    fig = figure_class()(figsize=(12, 6), dpi=100, layout="constrained")
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.3))
    steps = [r[Metric.STEP] for r in run.steps]
    loss = [as_number(r.get(Metric.LOSS)) for r in run.steps]
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
    _plot_evaluations(loss_ax, run.evals)
    _mark_events(loss_ax, run.events, _event_step, seen)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss by step")
    loss_ax.grid(alpha=0.3)
    _legend(loss_ax)
    lr = [as_number(r.get(Metric.LR)) for r in run.steps]
    if any(v is not None for v in lr):
        lr_ax.plot(steps, [math.nan if v is None else v for v in lr], color=LR_COLOR, lw=2)
        known = {v for v in lr if v is not None}
        if len(known) == 1 and (value := known.pop()) > 0:  # constant: 0 to twice its value,
            lr_ax.set_ylim(0, 2 * value)  # not matplotlib's ±5 % that reads as a change
    else:
        _empty(lr_ax, "no learning rate recorded")
    _mark_events(lr_ax, run.events, _event_step, seen)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole; no 2.5 tick
    lr_ax.grid(alpha=0.3)
    return fig


def _plot_evaluations(ax, evals: list[dict]) -> None:
    """Each evaluation metric as a dashed curve over the steps it followed."""
    skip = (Metric.KIND, Metric.TIME, Metric.STEP, Metric.EPOCH)
    names = sorted(
        {k for r in evals for k, v in r.items() if k not in skip and as_number(v) is not None}
    )
    for name in names:
        points = [(r[Metric.STEP], v) for r in evals if (v := as_number(r.get(name))) is not None]
        ax.plot(*zip(*points, strict=True), lw=1.5, ls="--", marker="s", ms=4, label=name)


def plot_step_time(run: Run):
    fig = figure_class()(figsize=(12, 3.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    drawn = False
    for key, label, color, line in (
        (Metric.STEP_TIME, "step time", STEP_TIME_COLOR, "-"),
        (Metric.DATA_TIME, "waiting for data", DATA_TIME_COLOR, "-"),
        # only checkpoint steps carry it: points, as a line would have nothing to join
        (Metric.CHECKPOINT_TIME, "checkpoint stall", EVENT_STYLES[Record.CHECKPOINT].color, ""),
    ):
        points = [
            (r[Metric.STEP], v) for r in run.steps if (v := as_number(r.get(key))) is not None
        ]
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


RANK_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
"""Ranks 1, 2, ... under torchrun, dashed beside rank 0's lines."""


def plot_memory_events(run: Run):
    """Memory over wall-clock time, every line kept (a resumed stretch shows twice, as it ran),
    the budget as a line, and below it one row per event kind on the same time axis."""
    kinds = _strip_kinds(run.events)
    fig = figure_class()(figsize=(12, 4.5 + 0.32 * len(kinds)), dpi=100, layout="constrained")
    mem_ax, strip_ax = fig.subplots(
        2, 1, sharex=True, height_ratios=(3.2, max(0.8, 0.32 * len(kinds)))
    )
    scale, unit = _time_unit(run)

    def x_of(record: dict) -> float | None:
        t = as_number(record.get("time"))
        return None if t is None or run.start is None else (t - run.start) / scale

    starts = sorted(
        x for e in run.events if e["event"] == Record.FIT_START and (x := x_of(e)) is not None
    )

    def series(
        key: str, keep_zero: bool = True, lines: list[dict] | None = None
    ) -> tuple[list[float], list[float]]:
        """(x, GiB) of every line holding `key` (rank 0's, or `lines`), broken (NaN) where a
        new attempt started, so the line does not bridge the time a killed run was dead."""
        xs: list[float] = []
        ys: list[float] = []
        for record in run.lines if lines is None else lines:
            x, value = x_of(record), as_number(record.get(key))
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
        named = f"rank 0: {label}" if run.ranks else label
        mem_ax.plot(*series(key), color=color, lw=2, label=named, marker=marker)
    for rank, lines in run.ranks.items():  # under torchrun: each rank's main counter
        if counters:
            key, label = counters[0]
            color = RANK_COLORS[(rank - 1) % len(RANK_COLORS)]
            mem_ax.plot(
                *series(key, lines=lines),
                color=color,
                lw=1.5,
                ls="--",
                label=f"rank {rank}: {label}",
            )
    swap = series(Metric.MEM_SWAP_USED, keep_zero=False)
    if swap[0]:
        mem_ax.plot(*swap, color=SWAP_COLOR, lw=1.5, ls=":", label="swap used")
    scale_top = _draw_budget(mem_ax, series(Metric.MEM_BUDGET), run)
    if counters:  # readings taken at an oom or shrink, between the per-step lines
        key = counters[0][0].removeprefix(MEMORY_PREFIX)
        for event in run.events:
            reading, style = event.get("memory"), style_of(event["event"])
            value = as_number(reading.get(key)) if isinstance(reading, dict) else None
            if style.incident and value is not None and (x := x_of(event)) is not None:
                mem_ax.plot([x], [value / GIB], ls="", marker=style.marker, ms=9, color=style.color)
        mem_ax.set_ylim(bottom=0, top=scale_top)
    else:
        _empty(mem_ax, "no memory readings recorded yet")
    _mark_events(mem_ax, run.events, x_of, set())
    mem_ax.set_ylabel("GiB")
    mem_ax.set_title(f"memory on {run.device} against the budget")
    mem_ax.grid(alpha=0.3)
    _legend(mem_ax)

    for row, name in enumerate(kinds):
        style = style_of(name)
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


BUDGET_FAR = 3.0
"""A budget more than this many times the highest reading is not drawn to scale: the axis
follows the data (a 0.5 GiB run under a 20 GiB budget would be a flat line on the floor) and
the budget is named in a box and in the legend instead."""


def _draw_budget(ax, budget_series: tuple[list[float], list[float]], run: Run) -> float | None:
    """The budget as a line when it is near the data; else named in a box and in the legend.
    Returns the top of the y axis to use (None: matplotlib's own)."""
    xs, ys = budget_series
    if not xs:
        return None
    top = max((v for v in ys if not math.isnan(v)), default=0.0)
    high = [
        v / GIB
        for key, _ in memory_counters(run)
        for r in run.lines
        if (v := as_number(r.get(key))) is not None
    ]
    data = max(high, default=0.0)
    if not data or top <= BUDGET_FAR * data:
        ax.step(xs, ys, where="post", color=BUDGET_COLOR, lw=2.5, ls="--", label="budget")
        return None
    text = f"budget {top:.2f} GiB: off the scale, {top / data:.0f}× the highest reading"
    ax.plot([], [], color=BUDGET_COLOR, lw=2.5, ls="--", label=text)
    ax.annotate(
        f"budget {top:.2f} GiB ↑ ({data / top:.0%} used at most)",
        xy=(0.99, 0.97),
        xycoords="axes fraction",
        ha="right",
        va="top",
        color=BUDGET_COLOR,
        fontsize=10,
        fontweight="bold",
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": BUDGET_COLOR, "lw": 2},
    )
    return data * 1.25


def _strip_kinds(events: list[dict]) -> list[str]:
    present = {e["event"] for e in events}
    known = [name for name in EVENT_STYLES if name in present]
    return known + sorted(present - set(known))


def _event_step(event: dict) -> float | None:
    step = event.get("at_step", event.get("step"))
    return float(step) if is_int(step) else None


def _time_unit(run: Run) -> tuple[float, str]:
    span = (run.end or 0) - (run.start or 0)
    if span < 180:
        return 1.0, "s"
    if span < 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
