"""Every key of a metrics.jsonl row comes from the registry (`steadytrain.run.records.Metric`), as
every record name of events.jsonl comes from `Record` (tests/test_records.py): the step that
writes ``loss`` and the report that reads it cannot drift apart.

The check reads every module of the package with `ast` and reports a registered key spelled as a
bare string where a metrics row is written or read:

* read (or set): ``row["loss"]``, ``row.get("loss")``, ``"step" in row``, where ``row`` is a
  row by its name (``metrics``, ``m``, ``row``, ``line``, ``times``; an attribute
  so named; ``info["metrics"]``) or a comprehension's variable over rows (``for r in
  run.steps``, ``lines``, ``evals``, ...);
* written: a key of a dict literal that holds a `Metric` key already, or an element of a
  tuple, list or set that does (a table of keys), and the keywords of ``RunGuard.end_step``,
  which become keys as they are (so they must be registered names);
* anywhere: a string that is only ever a metrics key (``data_time``, ``mem_peak``, ...).

It also fails on a registered key nothing writes (a `MemoryReading` field counts as written
as its ``mem_`` key, which the run files make with `Metric.of_memory`), and on docs/telemetry.md's
metrics table listing other keys than the registry. Each check is run on a small synthetic
module that breaks it, so a check that could never fail would be caught here.

The tests themselves read metrics.jsonl by the public names on disk (``m["loss"]``): they pin
what users' scripts read, which the registry must keep.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from dataclasses import dataclass

import pytest
from test_records import ROOT, _modules

from steadytrain.device.reading import MemoryReading
from steadytrain.run.records import MEMORY_PREFIX, NEVER_ON_DISK, Metric

KEYS = Metric.keys()
"""Constant name -> key on disk."""
VALUES = set(KEYS.values())
ONLY_METRICS = {v for v in VALUES if v.startswith(MEMORY_PREFIX)} | {
    Metric.GRAD_NORM,
    Metric.MICRO_STEPS,
    Metric.DATA_TIME,
    Metric.COMPUTE_TIME,
    Metric.OPTIMIZER_TIME,
    Metric.DEVICE_COMPUTE_TIME,
    Metric.DEVICE_OPTIMIZER_TIME,
    Metric.CHECKPOINT_TIME,
}
"""Keys that mean nothing else in the package (the others are also events' fields, config
fields, ...): spelled anywhere, they are a metrics key spelled bare."""

ROWS = {"metrics", "m", "row", "line", "times", "last_metrics"}
"""Names (variables or attributes) that hold a metrics row where they are read."""
ROW_SOURCES = {"steps", "lines", "evals", "rows", "written", "before"}
"""Names of lists of rows: a comprehension's variable over one is a row."""
KEYWORD_WRITERS = {"end_step"}
"""Functions whose keyword arguments become the row's keys (`RunGuard.end_step(loss=...)`)."""


@dataclass(frozen=True)
class Finding:
    line: int
    key: str
    where: str

    def __str__(self) -> str:
        return f"{self.line}: {self.key!r} {self.where}"


def _is_metric(node: ast.AST | None) -> bool:
    """``Metric.X`` (or ``records.Metric.X``)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name | ast.Attribute)
        and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "Metric"
        and node.attr in KEYS
    )


def _key(node: ast.AST) -> str | None:
    return getattr(node, "id", None) or getattr(node, "attr", None)


def _is_row(node: ast.AST, extra: set[str]) -> bool:
    if isinstance(node, ast.Name | ast.Attribute):
        return _key(node) in ROWS | extra
    return (  # info["metrics"]
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "metrics"
    )


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (and of any bare string statement)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _reads(node: ast.AST, rows: set[str]) -> list[tuple[ast.Constant, str]]:
    """(key, how) where `node` reads a row by a constant key."""
    if isinstance(node, ast.Subscript) and _is_row(node.value, rows):
        return [(node.slice, "read from a metrics row")]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("get", "pop", "setdefault")
        and _is_row(node.func.value, rows)
        and node.args
    ):
        return [(node.args[0], f"read from a metrics row by {node.func.attr}()")]
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.In | ast.NotIn)
        and _is_row(node.comparators[0], rows)
    ):
        return [(node.left, "looked for in a metrics row")]
    return []


def bare_metric_keys(source: str) -> list[Finding]:
    """Where `source` spells a registered metrics key as a bare string instead of `Metric.X`."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found: set[Finding] = set()

    def bare(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES:
            found.add(Finding(node.lineno, node.value, where))

    for node in ast.walk(tree):
        for key, how in _reads(node, set()):
            bare(key, how)
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            over = {
                target.id
                for gen in node.generators
                if _key(gen.iter) in ROW_SOURCES
                for target in ast.walk(gen.target)
                if isinstance(target, ast.Name)
            }
            for inner in ast.walk(node) if over else ():
                for key, how in _reads(inner, over):
                    bare(key, how)
        if isinstance(node, ast.Dict) and any(_is_metric(k) for k in node.keys):
            for key in node.keys:
                bare(key, "as a key of a metrics row")
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and any(map(_is_metric, node.elts)):
            for element in node.elts:
                bare(element, "beside Metric keys")
        if isinstance(node, ast.Call) and _key(node.func) in KEYWORD_WRITERS:
            for keyword in node.keywords:
                if keyword.arg is not None and keyword.arg not in VALUES:
                    found.add(
                        Finding(node.lineno, keyword.arg, "written by end_step, unregistered")
                    )
        if (
            isinstance(node, ast.Constant)
            and node.value in ONLY_METRICS
            and id(node) not in docstrings
        ):
            found.add(Finding(node.lineno, node.value, "spelled bare (a metrics key only)"))
    return sorted(found, key=lambda f: (f.line, f.key))


def written_keys(source: str) -> set[str]:
    """The keys a module writes: `Metric.X` as a dict literal's key or as the key assigned in a
    row, end_step's keywords, and every `MemoryReading` field where it makes the keys with
    `Metric.of_memory`."""
    written: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            written |= {KEYS[k.attr] for k in node.keys if _is_metric(k)}
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _is_metric(target.slice):
                    written.add(KEYS[target.slice.attr])
        elif isinstance(node, ast.Call) and _key(node.func) in KEYWORD_WRITERS:
            written |= {k.arg for k in node.keywords if k.arg in VALUES}
        elif (
            isinstance(node, ast.DictComp)
            and isinstance(node.key, ast.Call)
            and _key(node.key.func) == "of_memory"
            and _is_metric_class(node.key.func)
        ):
            written |= {Metric.of_memory(f.name) for f in dataclasses.fields(MemoryReading)}
    return written


def _is_metric_class(func: ast.AST) -> bool:
    return isinstance(func, ast.Attribute) and _key(func.value) == "Metric"


# -- the package -------------------------------------------------------------------------------


def test_every_metrics_key_comes_from_the_registry():
    problems = [
        f"{name}:{finding}"
        for name, source in _modules().items()
        for finding in bare_metric_keys(source)
        if name != "run/records.py"
    ]
    assert not problems, (
        "metrics.jsonl keys spelled as bare strings; use steadytrain.run.records.Metric "
        "(register a new key there, with what writes it):\n" + "\n".join(problems)
    )


def test_every_registered_key_is_written():
    written = set().union(*(written_keys(source) for source in _modules().values()))
    unused = [name for name, key in KEYS.items() if key not in written]
    assert not unused, f"registered but written nowhere (remove them, or write them): {unused}"


def test_every_memory_reading_field_is_a_registered_key():
    """The run files write each `MemoryReading` field as its mem_ key: a field added there is
    a key on disk, so it must be registered (and documented) too."""
    on_disk = {Metric.of_memory(f.name) for f in dataclasses.fields(MemoryReading)}
    registered = {v for v in VALUES if v.startswith(MEMORY_PREFIX)}
    assert on_disk == registered


def test_the_keys_on_disk_are_as_before():
    """Users' scripts read metrics.jsonl: the keys are plain strings with their old names."""
    assert Metric.LOSS == "loss" and type(Metric.LOSS) is str
    assert Metric.of_memory("peak") == Metric.MEM_PEAK == "mem_peak"
    assert len(VALUES) == len(KEYS), "two constants share a key"
    assert {
        "step", "epoch", "time", "loss", "lr", "grad_norm", "micro_batch_size", "micro_steps",
        "samples", "tokens", "skipped", "data_time", "compute_time", "optimizer_time",
        "step_time", "device_compute_time", "device_optimizer_time", "checkpoint_time",
        "mem_allocated", "mem_reserved", "mem_peak", "mem_rss", "mem_total", "mem_budget",
        "mem_usable", "mem_system_available", "mem_swap_used", "mem_alloc_retries",
        "mem_pressure", "kind", "eval_loss",
    } <= VALUES  # fmt: skip


def test_docs_list_the_registry_in_its_order():
    """docs/telemetry.md's metrics table names every key on disk, in the registry's order."""
    text = (ROOT / "docs" / "telemetry.md").read_text()
    table = text.split("### metrics.jsonl", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert listed == [v for v in KEYS.values() if v not in NEVER_ON_DISK]


# -- the check can fail ------------------------------------------------------------------------

BREAKING = {
    "a subscript": 'loss = metrics["loss"]',
    "a get": 'step_time = m.get("step_time")',
    "the loop's info": 'x = info["metrics"].get("step_time")',
    "an attribute": 'self.last_metrics["step"]',
    "an assignment": 'metrics["checkpoint_time"] = 0.5',
    "a membership": 'if "step" in line:\n    pass',
    "a comprehension": "losses = [r.get('loss') for r in run.steps]",
    "a mixed row": 'row = {Metric.TIME: 0, "step": 1}',
    "a mixed table": 'skip = (Metric.KIND, "time")',
    "a metrics-only key": 'COUNTERS = (("mem_peak", "peak allocated"),)',
    "an unregistered keyword": "guard.end_step(lost=1.0)",
}


@pytest.mark.parametrize("case", sorted(BREAKING))
def test_the_check_finds_a_bare_key(case):
    assert bare_metric_keys(textwrap.dedent(BREAKING[case])), case


def test_the_same_code_with_the_registry_passes():
    source = textwrap.dedent(
        """\
        '''A docstring may say data_time and mem_peak.'''
        loss = metrics[Metric.LOSS] + m.get(Metric.STEP_TIME)
        metrics[Metric.CHECKPOINT_TIME] = 0.5
        row = {Metric.TIME: 0, Metric.STEP: 1, **values}
        losses = [r.get(Metric.LOSS) for r in run.steps]
        guard.end_step(loss=1.0, lr=0.1)
        event = {"step": 1, "time": 0}  # an event's fields, not a row
        ranks = [e.get("time") for e in events]
        """
    )
    assert bare_metric_keys(source) == []
    assert written_keys(source) == {"time", "step", "checkpoint_time", "loss", "lr"}


def test_an_unwritten_key_is_found():
    source = "row = {Metric.TIME: 0}\nx = row.get(Metric.LOSS)\n"
    assert "loss" not in written_keys(source)
