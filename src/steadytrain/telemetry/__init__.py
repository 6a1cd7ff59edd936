"""Callbacks that record and show: metrics and events files, console progress; and the report.

files.py        metrics.jsonl and events.jsonl: append-only, one JSON object a line
console.py      progress on stderr: a live bar, plain lines, or nothing
tensorboard.py  optional TensorBoard scalars, the same values as metrics.jsonl
cpu.py          why steps slow down on a shared CPU: one `cpu_contention` event
report.py       `steadytrain report RUN_DIR`: an HTML page and its plots from a run's files
run_reading.py  a run directory read for the report: metrics, events, device, estimate, summary
plots.py        the report's plots (matplotlib, imported only when a report is drawn)

It imports none of its siblings (checkpoint, safety, supervisor, memory) nor anything above
them (the layers contract in pyproject.toml, run by tests/test_layers).
"""
