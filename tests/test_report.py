"""`steadytrain report RUN_DIR`: the page for a real run with an out-of-memory shrink, a SIGKILL
and a resume, rendered in a real headless browser; and the page for a run that is still being
written (or was killed), for bad paths, and without matplotlib.

The runs are real child processes (tests/workloads/report_run.py): the OOM is PyTorch's own CPU
allocator error under RLIMIT_AS, the kill is SIGKILL, the resume loads the checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import numpy as np
import pytest
from conftest import MALLOC_ENV, ROOT, WORKLOADS

from steadytrain.telemetry.files import read_jsonl
from steadytrain.telemetry.plots import _event_step, plot_memory_events
from steadytrain.telemetry.report import (
    BUDGET_COLOR,
    EVENT_STYLES,
    INSTALL_HINT,
    LOSS_COLOR,
    LR_COLOR,
    load_run,
    peak_memory,
    summary_rows,
    write_report,
)
from steadytrain.telemetry.run_reading import GIB, budget

CHROMIUM = Path("/usr/bin/chromium")
KILL_AT, SAVE_EVERY = 5, 3  # checkpoint at 3, SIGKILL at the end of 5: step 4 is recorded twice


def cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "steadytrain.cli", *args]
    if code is not None:
        command = [sys.executable, "-c", code, *args]
    return forkserver.run(
        command,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "400"},  # messages on one line, unwrapped
    )


def workload(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKLOADS / "report_run.py"), str(run_dir), *args]


@pytest.fixture(scope="module")
def supervised(tmp_path_factory) -> Path:
    """Under `steadytrain run`: a real OOM shrink (32 -> 16) at step 1, SIGKILL after step 5,
    a restart by the supervisor, a resume from step 3, and the run finishes at step 10."""
    run_dir = tmp_path_factory.mktemp("supervised") / "run"
    proc = forkserver.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
            *("--backoff-initial", "0.05", "--"),
            *workload(run_dir, "--limit-mib", "130", "--kill-at", str(KILL_AT)),
            *("--save-every", str(SAVE_EVERY)),
        ],
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **MALLOC_ENV},
    )
    assert proc.returncode == 0, proc.stderr
    assert "child killed by SIGKILL" in proc.stderr
    return run_dir


@pytest.fixture(scope="module")
def by_hand(supervised: Path, tmp_path_factory) -> tuple[Path, Path]:
    """The same history without a supervisor, taken from the real run's own lines: the files as
    they were when the SIGKILL came (every line written before the supervisor's restart event),
    and the files of the run then started again by hand (every line but the supervisor's).
    Returns (finished run, killed run)."""
    events = read_jsonl(supervised / "events.jsonl")
    metrics = read_jsonl(supervised / "metrics.jsonl")
    killed_at = next(e["time"] for e in events if e["event"] == "restart")
    own = [e for e in events if e["event"] not in ("restart", "supervisor_end")]
    base = tmp_path_factory.mktemp("by_hand")
    for name, keep in (("run", lambda r: True), ("killed", lambda r: r["time"] < killed_at)):
        (base / name).mkdir()
        for file, records in (("events.jsonl", own), ("metrics.jsonl", metrics)):
            lines = "".join(json.dumps(r) + "\n" for r in records if keep(r))
            (base / name / file).write_text(lines)
    return base / "run", base / "killed"


def table_rows(page: str, table: str) -> list[str]:
    body = re.search(rf'<table id="{table}">(.*?)</table>', page, re.S)
    assert body, f"no table {table}"
    return re.findall(r"<tr.*?</tr>", body.group(1), re.S)


def summary(page: str) -> dict[str, str]:
    return {
        re.sub("<.*?>", "", th): re.sub("<.*?>", "", td)
        for th, td in (
            re.search(r"<th>(.*?)</th><td>(.*?)</td>", row, re.S).groups()
            for row in table_rows(page, "summary")
        )
    }


def events_by_kind(page: str) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for row in table_rows(page, "events"):
        match = re.search(r'data-event="([^"]+)"', row)
        if match:
            kinds.setdefault(match.group(1), []).append(row)
    return kinds


# ---- the acceptance run ----------------------------------------------------------------------


def test_report_of_an_oom_a_kill_and_a_resume(supervised: Path):
    proc = cli("report", str(supervised))
    assert proc.returncode == 0, proc.stderr
    page_path = supervised / "report.html"
    assert f"wrote {page_path}" in proc.stdout
    assert "1 out-of-memory, 1 shrink(s), 1 resume(s), 1 restart(s), 1 lost step(s)" in proc.stdout

    page = page_path.read_text()
    assert "<script" not in page  # readable without JavaScript
    rows = summary(page)
    assert rows["status"] == "finished (exit 0)"
    assert rows["steps"].startswith("10 of 10")
    assert rows["lost steps"].startswith("1 ")
    assert rows["restarts"].startswith("1 by the supervisor; 1 resume(s) from a checkpoint")
    assert rows["out of memory"] == "1 event(s), 1 shrink(s); micro-batch 32 → 16"
    # Where the supervisor cannot read the OS out-of-memory killer's counter it takes the SIGKILL
    # for a memory kill and halves the micro-batch again (a micro_batch_cap event).
    sizes = [e["new"] for e in read_jsonl(supervised / "events.jsonl") if "new" in e]
    assert rows["final micro-batch"] == str(sizes[-1])
    assert "resident set (RSS)" in rows["peak memory"] and "budget" in rows["peak memory"]
    assert "estimated vs measured peak" not in rows  # no planner estimate in this run

    kinds = events_by_kind(page)
    assert "DefaultCPUAllocator" in kinds["oom"][0]
    assert "old=32; new=16" in kinds["shrink"][0]
    assert "SIGKILL" in kinds["restart"][0]
    assert f"checkpoint=step-{SAVE_EVERY:08d}" in kinds["resume"][0]
    assert "killed" not in kinds  # the supervisor's restart already says how the attempt ended

    # The page carries its plots (self-contained) and the same PNGs lie beside it.
    embedded = [
        base64.b64decode(data)
        for data in re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
    ]
    files = sorted((supervised / "report").glob("*.png"))
    assert [f.name for f in files] == ["loss_lr.png", "memory_events.png", "step_time.png"]
    assert sorted(embedded) == sorted(f.read_bytes() for f in files)
    assert not list(supervised.rglob("*.tmp"))


def test_report_renders_in_a_headless_browser(supervised: Path, tmp_path: Path):
    """The page as a person sees it: every image decodes in Chromium, the screenshot shows the
    plots' own colours (loss, learning rate, budget, and the oom, shrink, resume, restart and
    checkpoint marks), and the rendered DOM lists the events."""
    browser = chromium()
    write_report(supervised)
    page = supervised / "report.html"

    shot = tmp_path / "report.png"
    proc = run_chromium(browser, tmp_path, f"--screenshot={shot}", page)
    assert shot.is_file(), proc.stderr
    pixels = read_png(shot)
    assert pixels.shape[:2] == (2400, 1280)
    assert (pixels.min(axis=-1) < 0.95).mean() > 0.02  # not a blank page
    for what, color, least in (
        ("loss line", LOSS_COLOR, 500),
        ("learning-rate line", LR_COLOR, 200),
        ("budget line", BUDGET_COLOR, 100),
        ("out-of-memory mark", EVENT_STYLES["oom"].color, 200),
        ("shrink mark", EVENT_STYLES["shrink"].color, 100),
        ("resume mark", EVENT_STYLES["resume"].color, 300),
        ("checkpoint mark", EVENT_STYLES["checkpoint"].color, 100),
    ):
        assert count_color(pixels, color) >= least, f"{what} ({color}) not on the screenshot"

    # Only rendered images have a natural size: a copy of the page reports them after load.
    probe = tmp_path / "probe.html"
    probe.write_text(
        page.read_text().replace(
            "</body>",
            '<script>addEventListener("load", () => { const p = document.createElement("pre");'
            ' p.id = "probe"; p.textContent = JSON.stringify([...document.images].map('
            "i => [i.complete, i.naturalWidth, i.naturalHeight])); document.body.append(p); });"
            "</script></body>",
        )
    )
    dom = run_chromium(browser, tmp_path, "--dump-dom", probe).stdout
    decoded = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom).group(1))
    assert len(decoded) == 3
    assert all(complete and width >= 800 and height >= 300 for complete, width, height in decoded)
    kinds = events_by_kind(dom)
    assert {"oom", "shrink", "restart", "resume", "checkpoint"} <= kinds.keys()
    assert "SIGKILL" in kinds["restart"][0]


# ---- a run resumed by hand, and one still being written ---------------------------------------


def test_resumed_by_hand_shows_the_kill_as_a_derived_event(by_hand):
    run_dir, _ = by_hand
    report = write_report(run_dir)
    page = report.html.read_text()
    kinds = events_by_kind(page)
    assert [len(kinds[k]) for k in ("killed", "resume", "fit_start", "fit_end")] == [1, 1, 2, 1]
    assert re.search(r'class="[^"]*\bderived\b', kinds["killed"][0])
    assert "<td>4</td>" in kinds["killed"][0]  # its last metrics line: step 5's was not written
    rows = summary(page)
    assert rows["restarts"].startswith("0 by the supervisor; 1 resume(s) from a checkpoint")
    assert "1 attempt(s) killed without fit_end" in rows["restarts"]
    assert rows["lost steps"].startswith("1 ")


def test_a_run_being_written_renders(by_hand, tmp_path: Path):
    """The killed directory is what a live run looks like: no fit_end, and here a torn last line
    in each file as a kill mid-write leaves it. The page renders from what is complete."""
    _, killed = by_hand
    run_dir = tmp_path / "live"
    shutil.copytree(killed, run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.1, "ti')
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"time": 1, "event": "hang", "st')
    proc = cli("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    page = (run_dir / "report.html").read_text()
    rows = summary(page)
    assert rows["status"] == "no fit_end after the last start: still running, or killed"
    assert rows["steps"].startswith("4 ")
    assert rows["lost steps"].startswith("0 ")
    assert "hang" not in events_by_kind(page)  # the torn line is not an event
    assert len(re.findall(r'<img src="data:image/png;base64,', page)) == 3


def test_a_run_with_no_step_yet_renders(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        json.dumps({"time": 1e9, "event": "fit_start", "step": 0, "device": "cpu"}) + "\n"
    )
    report = write_report(run_dir)
    rows = summary(report.html.read_text())
    assert rows["steps"] == "none recorded yet"
    assert [p.name for p in report.pngs] == ["loss_lr.png", "step_time.png", "memory_events.png"]


# ---- what the page reads from the run directory ----------------------------------------------


def test_estimate_row_appears_only_when_the_run_holds_an_estimate(by_hand, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(by_hand[0], run_dir)
    assert "estimated vs measured peak" not in dict(summary_rows(load_run(run_dir)))
    measured = peak_memory(load_run(run_dir))[0]

    (run_dir / "estimate.json").write_text(json.dumps({"peak": measured / 2}))
    assert dict(summary_rows(load_run(run_dir)))["estimated vs measured peak"].endswith("(+100%)")

    # On CPU the measured RSS holds the framework too: the estimate's total is set against it.
    (run_dir / "estimate.json").write_text(json.dumps({"peak": 1, "total": measured * 1.25}))
    assert dict(summary_rows(load_run(run_dir)))["estimated vs measured peak"].endswith("(-20%)")

    with open(run_dir / "events.jsonl", "a") as f:  # the event, when there is one, wins
        f.write(json.dumps({"time": 2e9, "event": "estimate", "peak": measured * 2}) + "\n")
    row = dict(summary_rows(load_run(run_dir)))["estimated vs measured peak"]
    assert row.endswith("(-50%)")


def test_unknown_and_coming_event_kinds_are_listed(by_hand, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(by_hand[0], run_dir)
    with open(run_dir / "events.jsonl", "a") as f:
        for record in (
            {"event": "hang", "step": 7, "file": "hangs/step-7.txt"},
            {"event": "leak", "step": 8, "rate": 1048576},
            {"event": "swap", "step": 8, "reason": "swap grew by 1 GiB"},
            {"event": "brand_new", "step": 9, "what": "no one knows yet"},
        ):
            f.write(json.dumps({"time": 2e9, **record}) + "\n")
    page = write_report(run_dir).html.read_text()
    kinds = events_by_kind(page)
    assert "file=hangs/step-7.txt" in kinds["hang"][0]
    assert "rate=1048576" in kinds["leak"][0]
    assert "swap grew by 1 GiB" in kinds["swap"][0]
    assert "what=no one knows yet" in kinds["brand_new"][0]


@pytest.mark.parametrize(
    ("device", "counters", "expected"),
    [
        ("cuda:0", {"mem_allocated": 3, "mem_peak": 5, "mem_reserved": 6}, (5, "peak allocated")),
        ("mps", {"mem_allocated": 3, "mem_reserved": 6}, (6, "driver memory (reserved)")),
        ("cpu", {"mem_rss": 4}, (4, "resident set (RSS)")),
    ],
)
def test_peak_memory_reads_the_devices_counter(tmp_path: Path, device, counters, expected):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gib = 2**30
    (run_dir / "events.jsonl").write_text(
        json.dumps({"time": 1e9, "event": "fit_start", "step": 0, "device": device}) + "\n"
    )
    lines = [
        {"time": 1e9 + s, "step": s, "loss": 1.0 / s, "mem_budget": 8 * gib, "mem_rss": 1}
        | {k: v * gib * s / 2 for k, v in counters.items()}
        for s in (1, 2)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(run_dir)
    assert run.device == device.split(":")[0]
    assert peak_memory(run) == (expected[0] * gib, expected[1])
    assert dict(summary_rows(run))["peak memory"].startswith(f"{expected[0]:.2f} GiB")


# ---- what a new user reads off the page (issue 19, point 6) ---------------------------------


def test_a_restart_is_drawn_where_the_attempt_died_and_the_resume_where_it_took_up(supervised):
    run = load_run(supervised)
    (restart,) = [e for e in run.events if e["event"] == "restart"]
    (resume,) = [e for e in run.events if e["event"] == "resume"]
    died = max((r for r in run.lines if r["time"] <= restart["time"]), key=lambda r: r["time"])
    assert restart["at_step"] == died["step"] == KILL_AT - 1  # step 5's line was never written
    assert _event_step(restart) == KILL_AT - 1
    assert _event_step(resume) == SAVE_EVERY
    assert restart["step"] == SAVE_EVERY  # the event itself still says where it resumes


def test_the_memory_axis_follows_the_data_and_names_a_far_budget(supervised, tmp_path):
    run = load_run(supervised)  # its budget lies just above its readings: drawn as a line
    peak, limit = peak_memory(run)[0] / GIB, budget(run) / GIB
    memory_ax = plot_memory_events(run).axes[0]
    assert memory_ax.get_ylim()[1] >= limit
    assert "budget" in memory_ax.get_legend_handles_labels()[1]
    assert not memory_ax.texts

    far = tmp_path / "far"  # the same run under a 20 GiB budget: readings 2 % of it
    shutil.copytree(supervised, far)
    lines = read_jsonl(far / "metrics.jsonl")
    for line in lines:
        line["mem_budget"] = 20 * GIB
    (far / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    memory_ax = plot_memory_events(load_run(far)).axes[0]
    assert peak <= memory_ax.get_ylim()[1] < 2 * peak  # the readings fill the plot
    labels = memory_ax.get_legend_handles_labels()[1]
    assert any(label.startswith("budget 20.00 GiB: off the scale, ") for label in labels)
    assert [t.get_text() for t in memory_ax.texts] == [
        f"budget 20.00 GiB ↑ ({peak / 20:.0%} used at most)"
    ]


LONG_REASON = "one sample adds at most 12.83 MiB; " + "x" * 600 + " END OF REASON"


def with_plan(by_hand, tmp_path: Path, budget_bytes: float | None = None) -> Path:
    """The run resumed by hand, with a plan and its probe bound recorded (and, if given, a
    different budget in every metrics line)."""
    run_dir = tmp_path / "planned"
    shutil.copytree(by_hand[0], run_dir)
    if budget_bytes is not None:
        lines = [x | {"mem_budget": budget_bytes} for x in read_jsonl(run_dir / "metrics.jsonl")]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan = {
        "time": 2e9,
        "event": "plan",
        "micro_batch_size": 16,
        "predicted_peak": 581_000_000,
        "limit": 15_000_000_000,
        "reasons": ["budget 20.65 GiB", LONG_REASON, "accumulation 1"],
        "candidates": [{"micro": 16, "peak": 581_000_000}],
    }
    estimate = {"time": 2e9, "event": "estimate", "source": "probe", "peak": 2**30, "total": 2**30}
    estimate["micro_batch_size"] = 16
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(plan) + "\n" + json.dumps(estimate) + "\n")
    return run_dir


def test_events_table_shows_bytes_in_units_and_the_plans_reasons_whole(by_hand, tmp_path):
    page = write_report(with_plan(by_hand, tmp_path)).html.read_text()
    (row,) = events_by_kind(page)["plan"]
    assert "predicted_peak=554.08 MiB" in row and "limit=13.97 GiB" in row
    assert "candidates: [micro=16, peak=554.08 MiB]" in row
    assert "581000000" not in row and "15000000000" not in row
    assert (
        "\n- budget 20.65 GiB\n- one sample adds" in row
        and "END OF REASON\n- accumulation 1" in row
    )


def test_the_plans_bound_is_not_called_an_estimate(by_hand, tmp_path):
    run = load_run(with_plan(by_hand, tmp_path))
    rows = dict(summary_rows(run))
    assert "estimated vs measured peak" not in rows
    measured = peak_memory(run)[0] / GIB
    assert rows["plan bound vs measured peak"] == (
        "plan bound 1.00 GiB at micro-batch 16 (the planner's cautious upper bound, not a "
        f"prediction), measured {measured:.2f} GiB ({measured:.0%} of the bound)"
    )


def test_the_first_hour_page_in_a_headless_browser(by_hand, tmp_path: Path):
    """What a person sees: the far budget's box in its colour on the memory plot, and in the
    rendered DOM the plan bound row and every reason, whole, each on its own line."""
    browser = chromium()
    page = write_report(with_plan(by_hand, tmp_path, budget_bytes=20 * GIB)).html
    (box,) = plot_memory_events(load_run(page.parent)).axes[0].texts
    assert box.get_text().startswith("budget 20.00 GiB ↑")
    shot = tmp_path / "page.png"
    proc = run_chromium(browser, tmp_path, f"--screenshot={shot}", page)
    assert shot.is_file(), proc.stderr
    assert count_color(read_png(shot), BUDGET_COLOR) >= 100
    dom = run_chromium(browser, tmp_path, "--dump-dom", page).stdout
    assert "plan bound vs measured peak" in dom
    (row,) = events_by_kind(dom)["plan"]
    assert LONG_REASON in row and "predicted_peak=554.08 MiB" in row


# ---- the command line ------------------------------------------------------------------------


def test_out_writes_the_page_and_its_plots_where_asked(by_hand, tmp_path: Path):
    out = tmp_path / "mail" / "run-42.html"
    proc = cli("report", str(by_hand[0]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()
    assert sorted(p.name for p in (tmp_path / "mail" / "run-42").iterdir()) == [
        "loss_lr.png",
        "memory_events.png",
        "step_time.png",
    ]
    bad = cli("report", str(by_hand[0]), "--out", str(tmp_path / "page.txt"))
    assert bad.returncode == 2
    assert "name an .html file" in bad.stderr


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_not_a_run_directory_exits_2_naming_the_path(tmp_path: Path, what: str):
    path = tmp_path / "runs" / "nope"
    if what == "empty":
        path.mkdir(parents=True)
    elif what == "file":
        path.parent.mkdir(parents=True)
        path.write_text("x")
    proc = cli("report", str(path))
    assert proc.returncode == 2
    assert str(path) in proc.stderr
    assert "metrics.jsonl" in proc.stderr and "events.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_matplotlib_exits_2_with_the_install_hint(by_hand):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from steadytrain.cli import main; main(sys.argv[1:])\n"
    )
    proc = cli("report", str(by_hand[0]), code=code)
    assert proc.returncode == 2
    assert INSTALL_HINT in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_does_not_import_torch(by_hand):
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        "from steadytrain.cli import main; main(sys.argv[1:])\n"
    )
    proc = cli("report", str(by_hand[0]), code=code)
    assert proc.returncode == 0, proc.stderr
    assert "torch imported: False" in proc.stdout


# ---- helpers: the browser and the screenshot ---------------------------------------------------


def chromium() -> Path:
    """Debian's chromium (or one on PATH). CI must run the browser test, so there a missing
    browser fails it."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    elsewhere = shutil.which("chromium")
    if elsewhere:
        return Path(elsewhere)
    message = f"{CHROMIUM} not found; install it with: sudo apt-get install chromium"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and the browser test must run: {message}")
    pytest.skip(message)


def run_chromium(browser: Path, tmp_path: Path, action: str, page: Path):
    profile = tmp_path / f"profile-{action.split('=')[0].strip('-')}"
    return subprocess.run(
        [
            str(browser),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1280,2400",
            "--hide-scrollbars",
            "--virtual-time-budget=5000",
            action,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


def read_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    return imread(path)[..., :3]


def count_color(pixels: np.ndarray, color: str, tolerance: float = 8 / 255) -> int:
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(pixels - rgb).max(axis=-1) <= tolerance).sum())
