"""Every record name of events.jsonl comes from the registry (`steadytrain.run.records.Record`), the
way composer's test pins every callback to an event: a writer and a reader cannot drift apart.

The check reads every module of the package with `ast` and reports a record name spelled as a
bare string where a record name goes:

* written: the first argument of a writer (``record``, ``event``, ``log``, ... or the function a
  factory returns), the ``"event"`` value of a dict, the name of a ``(name, info)`` pair;
* read: a comparison with an event's name (``e["event"]``, ``e.get("event")``, a variable
  called ``name`` or ``event``), the literal either in the comparison or in the module's
  constant it names; a lookup in a table keyed by events' names (a ``Counter`` or a dict built
  from them, or a module's dict literal that an event's name is looked up in), and that
  table's own keys.

It also fails on a registry member that nothing writes, and on docs/telemetry.md listing other
records than the registry. Each check is run on a small synthetic module that breaks it, so a
check that could never fail would be caught here.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from steadytrain.run.records import Record

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "steadytrain"
NAMES = {member.value for member in Record}

WRITERS = {"record", "_record", "event", "log", "_log"}
"""Functions whose first argument is the name of the record they write."""
EVENT_VARIABLES = {"name", "event"}
"""Variables that hold an event's name where they are compared (``if name == Record.PLAN``)."""

NOT_YET_CONVERTED = {
    # TEMPORARY (issue 39): these files were being rewritten by other hands while the registry
    # came in; their record names are still bare strings. The lead converts them after merging
    # and empties this set. A literal here is tolerated and counts as a use of its member.
    "integrations/guard.py",
    "integrations/huggingface.py",
    "integrations/keras.py",
    "integrations/lightning.py",
}


@dataclass(frozen=True)
class Finding:
    line: int
    name: str
    where: str

    def __str__(self) -> str:
        return f"{self.line}: {self.name!r} {self.where}"


# -- what reads and writes an event's name -------------------------------------------------------


def _is_record(node: ast.AST) -> bool:
    """``Record.X`` (or ``records.Record.X``)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name | ast.Attribute)
        and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "Record"
    )


def _reads_event_field(node: ast.AST) -> bool:
    """``x["event"]`` or ``x.get("event")``: a record's name read from the record."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        first = node.args[0] if node.args else None
        return (
            node.func.attr == "get" and isinstance(first, ast.Constant) and first.value == "event"
        )
    return False


def _reads_event_name(node: ast.AST) -> bool:
    """A record's name read from the record, or a variable called ``name`` / ``event``."""
    return _reads_event_field(node) or (isinstance(node, ast.Name) and node.id in EVENT_VARIABLES)


def _callee(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _is_writer(node: ast.Call) -> bool:
    """A call of a writer, or of the writer a factory returns (``_record_event(run_dir)(...)``)."""
    return _callee(node) in WRITERS or isinstance(node.func, ast.Call)


def _key(node: ast.AST) -> str | None:
    """The name a table is known by: ``counts`` for ``counts`` and ``run.counts``."""
    return getattr(node, "id", None) or getattr(node, "attr", None)


def _strings(node: ast.AST) -> list[ast.Constant]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


class _Module:
    """One module's constants and tables keyed by events' names, and what it writes and reads."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.constants: dict[str, ast.AST] = {}  # module- and class-level NAME = value
        for scope in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
            for node in scope.body:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            self.constants[target.id] = node.value
        self.tables = self._tables()

    def _tables(self) -> set[str]:
        """Names of mappings keyed by events' names: built from them (a ``Counter`` of, or a
        dict comprehension keyed by, an event's name), or a module's dict literal in which an
        event's name is looked up (``STYLES.get(name)``, ``STYLES[e["event"]]``)."""
        tables = set()
        for node in ast.walk(self.tree):
            value, names = None, []
            if isinstance(node, ast.Assign):
                value, names = node.value, [_key(t) for t in node.targets]
            elif isinstance(node, ast.keyword) and node.arg:
                value, names = node.value, [node.arg]
            if _built_from_event_names(value):
                tables.update(names)
            looked_up = None
            if isinstance(node, ast.Subscript) and _reads_event_field(node.slice):
                looked_up = node.value
            elif (
                isinstance(node, ast.Call)
                and _callee(node) == "get"
                and isinstance(node.func, ast.Attribute)
                and node.args
                and _reads_event_field(node.args[0])
            ):
                looked_up = node.func.value
            elif isinstance(node, ast.For) and self._loop_compares_its_key(node):
                looked_up = node.iter.func.value if isinstance(node.iter, ast.Call) else node.iter
            if looked_up is not None and isinstance(self.constants.get(_key(looked_up)), ast.Dict):
                tables.add(_key(looked_up))
        return tables

    @staticmethod
    def _loop_compares_its_key(loop: ast.For) -> bool:
        """``for name, style in STYLES.items(): ... e["event"] == name``: the keys of STYLES
        are events' names."""
        target = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) else loop.target
        if not isinstance(target, ast.Name):
            return False
        for node in ast.walk(loop):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Name) and s.id == target.id for s in sides)
                if named and any(_reads_event_field(s) for s in sides):
                    return True
        return False

    def _through_constants(self, node: ast.AST) -> list[ast.Constant]:
        """The strings in `node`, and in the module's constants it names (``ENDS + RECOVERED``,
        ``self.SHOWN``)."""
        found = _strings(node)
        for part in ast.walk(node):
            name = _key(part) if isinstance(part, ast.Name | ast.Attribute) else None
            if name in self.constants and not isinstance(self.constants[name], ast.Dict):
                found += _strings(self.constants[name])
        return found

    def findings(self) -> list[Finding]:
        found: list[Finding] = []

        def bare(node: ast.Constant, where: str, any_name: bool = False) -> None:
            if isinstance(node.value, str) and (any_name or node.value in NAMES):
                found.append(Finding(node.lineno, node.value, where))

        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and _is_writer(node) and node.args:
                first, writer = node.args[0], f"written by {_callee(node) or 'a writer'}()"
                if isinstance(first, ast.Constant):
                    bare(first, writer, any_name=True)
                elif isinstance(first, ast.Name | ast.Attribute):
                    for constant in self._through_constants(first):
                        bare(constant, writer + " through a constant")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "event":
                        if isinstance(value, ast.Constant):
                            bare(value, 'as the "event" of a record', any_name=True)
                        elif isinstance(value, ast.Name):
                            for constant in self._through_constants(value):
                                bare(constant, 'as the "event" of a record, through a constant')
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                name, info = node.elts
                if isinstance(name, ast.Constant) and not isinstance(info, ast.Constant):
                    bare(name, "as the name of a (name, info) pair")
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_reads_event_name(side) for side in sides):
                    for side in sides:
                        for constant in self._through_constants(side):
                            bare(constant, "compared with an event's name")
                for side in sides:
                    if _key(side) in self.tables:
                        for other in sides:
                            if isinstance(other, ast.Constant):
                                bare(other, f"looked up in {_key(side)}, keyed by event names")
            elif isinstance(node, ast.Subscript) and _key(node.value) in self.tables:
                if isinstance(node.slice, ast.Constant):
                    bare(node.slice, f"looked up in {_key(node.value)}, keyed by event names")
            elif (
                isinstance(node, ast.Call)
                and _callee(node) == "get"
                and isinstance(node.func, ast.Attribute)
                and _key(node.func.value) in self.tables
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                bare(node.args[0], f"looked up in {_key(node.func.value)}, keyed by event names")
        for table in self.tables:
            value = self.constants.get(table)
            if isinstance(value, ast.Dict):
                for key in value.keys:
                    if isinstance(key, ast.Constant):
                        bare(key, f"as a key of {table}, keyed by event names")
        return sorted(set(found), key=lambda f: (f.line, f.name))

    def written(self) -> set[str]:
        """The members this module writes: ``Record.X`` in a writer's first argument, in the
        ``"event"`` of a dict, or as the name of a ``(name, info)`` pair."""
        names = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and _is_writer(node) and node.args:
                names.append(node.args[0])
            elif isinstance(node, ast.Dict):
                names += [v for k, v in zip(node.keys, node.values, strict=True) if _is_event(k)]
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                name, info = node.elts
                if not isinstance(info, ast.Constant) and not _is_record(info):
                    names.append(name)
        return {n.attr for n in names if _is_record(n)}


def _built_from_event_names(value: ast.AST | None) -> bool:
    """``{e["event"]: e for e in events}`` or ``Counter(e["event"] for e in events)``."""
    if isinstance(value, ast.DictComp):
        return _reads_event_field(value.key)
    return (
        isinstance(value, ast.Call)
        and _callee(value) == "Counter"
        and bool(value.args)
        and isinstance(value.args[0], ast.GeneratorExp)
        and _reads_event_field(value.args[0].elt)
    )


def _is_event(key: ast.AST | None) -> bool:
    return isinstance(key, ast.Constant) and key.value == "event"


def bare_record_names(source: str) -> list[Finding]:
    """Where `source` spells a record name as a bare string instead of a `Record` member."""
    return _Module(ast.parse(source)).findings()


def _modules() -> dict[str, str]:
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


# -- the package -------------------------------------------------------------------------------


def test_every_record_name_comes_from_the_registry():
    problems = []
    for name, source in _modules().items():
        if name in NOT_YET_CONVERTED:
            continue
        problems += [f"{name}:{finding}" for finding in bare_record_names(source)]
    assert not problems, (
        "record names spelled as bare strings; use steadytrain.run.records.Record (register a new "
        "one there, with what writes it and its fields):\n" + "\n".join(problems)
    )


def test_every_registered_record_is_written():
    written = set()
    for name, source in _modules().items():
        written |= _Module(ast.parse(source)).written()
        if name in NOT_YET_CONVERTED:  # their literals count until the lead converts them
            written |= {Record(f.name).name for f in bare_record_names(source) if f.name in NAMES}
    unused = [member.name for member in Record if member.name not in written]
    assert not unused, f"registered but written nowhere (remove them, or write them): {unused}"


def test_the_files_not_yet_converted_exist_and_still_need_it():
    """The temporary allow-list only shrinks: a file that was converted (or moved) leaves it."""
    modules = _modules()
    stale = [
        name for name in sorted(NOT_YET_CONVERTED) if not bare_record_names(modules.get(name, ""))
    ]
    assert not stale, f"take these off NOT_YET_CONVERTED (converted, or moved): {stale}"


def test_the_registry_writes_the_same_strings_as_before():
    """The files on disk do not change: a member is its string in JSON, f-strings and dicts."""
    import json

    assert Record.OOM == "oom" and f"{Record.OOM}" == "oom" and str(Record.OOM) == "oom"
    assert json.dumps({"event": Record.OOM, Record.SHRINK: 1}) == '{"event": "oom", "shrink": 1}'
    assert {"oom": 1}[Record.OOM] == 1 and Record("oom") is Record.OOM
    assert len(NAMES) == len(Record), "two members share a name"


def test_docs_list_the_registry_in_its_order():
    """docs/telemetry.md's events table names every record, in the registry's order."""
    text = (ROOT / "docs" / "telemetry.md").read_text()
    table = text.split("### events.jsonl", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert listed == [member.value for member in Record]


# -- the check can fail ------------------------------------------------------------------------

BREAKING = {
    "a writer's name": 'files.record("checkpoint", {"step": 1})',
    "a factory's writer": '_record_event(run_dir)("hang", info)',
    "an unregistered name": 'self.record("my_new_event", info)',
    "a named constant": 'SAVERS = "memory_savers"\nrecord(SAVERS, {"left": []})',
    "a named constant's record": 'ERROR = "error"\nline = {"event": ERROR, "step": 1}',
    "a record dict": 'append_event(run_dir, {"time": 0, "event": "error", "step": 1})',
    "a (name, info) pair": 'events.append(("plan", chosen.to_event()))',
    "a comparison": 'found = [e for e in events if e["event"] == "fit_start"]',
    "a get comparison": 'if record.get("event") in ("oom", "hang"):\n    pass',
    "a compared name": 'if name == "resume":\n    pass',
    "a module constant": 'ENDS = ("oom", "exit")\nlast = [r for r in rs if r.get("event") in ENDS]',
    "a class constant": (
        'class C:\n    SHOWN = ("hang",)\n    def note(self, name):\n'
        "        return name in self.SHOWN"
    ),
    "a counter": 'counts = Counter(e["event"] for e in events)\nn = counts["restart"]',
    "a keyword counter": 'run = Run(counts=Counter(e["event"] for e in es))\nn = run.counts["oom"]',
    "a dict of events": 'after = {e["event"]: e for e in es}\nif "fit_end" in after:\n    pass',
    "a table's keys": 'STYLES = {"oom": 1}\ndef style(e):\n    return STYLES.get(e["event"])',
    "a looped table": (
        'STYLES = {"oom": 1}\nfor name, style in STYLES.items():\n'
        '    xs = [e for e in es if e["event"] == name]'
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKING))
def test_the_check_finds_a_bare_record_name(case):
    assert bare_record_names(textwrap.dedent(BREAKING[case])), case


def test_the_same_code_with_the_registry_passes():
    source = textwrap.dedent(
        """\
        files.record(Record.CHECKPOINT, {"step": 1, "checkpoint": "step-1"})
        append_event(run_dir, {"time": 0, "event": Record.ERROR, "error": "boom"})
        events.append((Record.PLAN, chosen.to_event()))
        ENDS = (Record.OOM, Record.EXIT)
        last = [r for r in rs if r.get("event") in ENDS]
        counts = Counter(e["event"] for e in events)
        n = counts[Record.RESTART] + len(info["checkpoint"])
        STYLES = {Record.OOM: 1}
        ALIASES = {"compile": "torch_compile", "plan": "auto"}
        field = ALIASES.get(name, name)  # a table looked up by a name that is not an event's
        if command == "plan" and self.action == "exit":  # not an event's name
            pass
        """
    )
    assert bare_record_names(source) == []
    assert _Module(ast.parse(source)).written() == {"CHECKPOINT", "ERROR", "PLAN"}


def test_an_unwritten_member_is_found():
    source = "files.record(Record.CHECKPOINT, {})\nif name == Record.HANG:\n    pass\n"
    assert "HANG" not in _Module(ast.parse(source)).written()
