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
* under torchrun, rank N > 0 writes its own metrics under ranks/rank-N/: the summary gives each
  rank's peak and the memory plot draws each rank's main counter (dashed); everything else is
  rank 0's, as the ranks train in lockstep on the same global batch.
* the memory estimate (from the planner) is compared with the measured peak only when the run
  directory holds one: an `estimate` event or an `estimate.json` file, each with `peak` in bytes
  (see `find_estimate`).
"""

from __future__ import annotations

import base64
import errno
import html
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.errors import BadInputError, RunDiskFullError, free_space, is_disk_full
from steadytrain.run import files as run_files
from steadytrain.run.durable import write_atomic
from steadytrain.telemetry.plots import (
    BUDGET_COLOR,
    EVENT_STYLES,
    INSTALL_HINT,
    LOSS_COLOR,
    LR_COLOR,
    PLOTS,
    figure_class,
    plot_loss_lr,
    plot_memory_events,
    plot_step_time,
    png_bytes,
    style_of,
)
from steadytrain.telemetry.run_reading import (
    Run,
    as_number,
    budget,
    duration_text,
    find_estimate,
    load_run,
    memory_counters,
    peak_memory,
    summary_line,
    summary_rows,
)

MAX_EVENT_ROWS = 2000
"""The events table stops here (a week-long run with a checkpoint every few minutes stays
readable); the count of the rest is shown, and events.jsonl has them all."""
MAX_DETAIL_CHARS = 4000
"""An event's details are cut only past this (a plan's reasons and candidates stay whole)."""


# ---- the page ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    html: Path
    pngs: list[Path]
    summary: str


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Report:
    """Read RUN_DIR and write the page (default RUN_DIR/report.html) and its PNGs (in a folder
    named after the page: RUN_DIR/report/)."""
    figure_class()  # a missing matplotlib is reported before anything is read
    run = load_run(run_dir)
    html_path = Path(out) if out is not None else run.run_dir / run_files.REPORT_HTML
    if out is not None and html_path.is_dir():  # --out DIR: DIR/report.html and DIR/report/
        html_path = html_path / run_files.REPORT_HTML
    if html_path.suffix.lower() not in (".html", ".htm"):
        raise BadInputError(
            f"--out {html_path}: name an .html file or a folder (the PNGs go beside it)"
        )
    png_dir = html_path.with_suffix("")
    root = html_path.parent  # the run directory, or the folder --out names
    try:
        return _write(run, html_path, png_dir, root)
    except OSError as exc:
        if is_disk_full(exc):  # the run itself is untouched: a report needs no resume
            path = getattr(exc, "path", None) or exc.filename
            free = free_space(path or root)
            raise RunDiskFullError(
                path,
                exc,
                detail=f"disk full: could not write {path or root} ({exc.strerror})"
                + (f"; {free} free on that filesystem" if free else "")
                + ". A page or plot written before is kept as it was.\nThe report only reads "
                "the run: free some space and run it again, or write it elsewhere: steadytrain "
                "report RUN_DIR --out DIR (a folder on another disk, or DIR/name.html)",
            ) from None
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        where = "--out" if out is not None else "the run directory"
        raise BadInputError(
            f"cannot write the report in {root} ({exc.strerror}): {where} is not writable here "
            "(a read-only disk or another user's folder); the report only reads the run, so "
            "write it elsewhere: steadytrain report RUN_DIR --out DIR (a folder you can write "
            "to, or DIR/name.html)"
        ) from None


def _write(run: Run, html_path: Path, png_dir: Path, root: Path) -> Report:
    drawn = {
        "loss_lr": plot_loss_lr(run),
        "step_time": plot_step_time(run),
        "memory_events": plot_memory_events(run),
    }
    images: dict[str, bytes] = {}
    pngs = []
    for name, _ in PLOTS:
        images[name] = png_bytes(drawn[name])
        pngs.append(png_dir / f"{name}.png")
        write_atomic(pngs[-1], images[name], root=root)
    page = render_html(run, images)  # a path not in UTF-8 shows its stray byte as ?
    write_atomic(html_path, page.encode(errors="replace"), root=root)
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
td.details {{ font-family: ui-monospace, monospace; font-size: 12px; word-break: break-word;
              white-space: pre-line; }}
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
<li><b>peak memory, rank N</b> (under torchrun): the same counter in each rank's own
metrics (rank N &gt; 0 writes <code>ranks/rank-N/metrics.jsonl</code>); the memory plot draws
each rank's line.</li>
</ul>
</body>
</html>
"""


def _clock(stamp: float) -> str:
    """The UTC time of `stamp`; a time no clock reads (a damaged line's 1e300) shows as '?'."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stamp))
    except (OverflowError, ValueError, OSError):
        return "?"


def _event_row(event: dict, start: float | None) -> str:
    e = html.escape
    t = as_number(event.get("time"))
    when = _clock(t) if t is not None else ""
    elapsed = duration_text(t - start) if t is not None and start is not None else ""
    step = event.get("step")
    details = _details(event)
    classes = " ".join(
        name
        for name, on in (
            ("incident", style_of(event["event"]).incident),
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
    "predicted_peak",
    "limit",
    "in_use",
    "analytic_peak",
    "analytic_total",
    "probe_peak",
    "baseline",
    "bytes",
}
"""Fields that hold bytes: shown in the same units as the rest of the page, never raw."""


def _details(event: dict) -> str:
    parts = []
    for key, value in event.items():
        if key in ("time", "event", "step", "derived", "at_step") or value is None or value == []:
            continue
        if key == "config":
            parts.append("config: see config.json")
        elif key == "reasons" and isinstance(value, list):  # a plan's: one per line, whole
            parts.append("reasons:" + "".join(f"\n- {reason}" for reason in value) + "\n")
        elif isinstance(value, (dict, list)):
            parts.append(f"{key}: {_value(key, value)}")
        else:
            parts.append(f"{key}={_value(key, value)}")
    text = "; ".join(parts).replace("\n; ", "\n")
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


def _value(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(
            f"{k}={_value(k, v)}" for k, v in value.items() if v is not None and v != []
        )
    if isinstance(value, list):
        return "[" + "; ".join(_value(key, item) for item in value) + "]"
    number = as_number(value)
    if key in BYTE_FIELDS and number is not None:
        return format_bytes(number)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# What the report's callers and tests import from here; reading and plotting live beside it.
__all__ = [
    "BUDGET_COLOR",
    "EVENT_STYLES",
    "INSTALL_HINT",
    "LOSS_COLOR",
    "LR_COLOR",
    "Report",
    "Run",
    "budget",
    "find_estimate",
    "load_run",
    "memory_counters",
    "peak_memory",
    "render_html",
    "summary_line",
    "summary_rows",
    "write_report",
]
