"""The structure DESIGN.md promises, enforced: the layer order of imports (import-linter's layers
contract in pyproject.toml) and the size rule (no function over 60 lines, no module over 500
lines, unless the code says why in one line). Each check is also run on a small synthetic case
that breaks it, so a check that could never fail would be caught here."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "steadytrain"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
LONG_FUNCTION = re.compile(r"^\s*# long: \S")
LONG_MODULE = re.compile(r"^# long-module: \S")


# -- layers -----------------------------------------------------------------------------------


def run_contracts(config: Path) -> tuple[bool, str]:
    """import-linter on `config` (no cache, nothing written): (every contract kept, its report)."""
    configuration.configure()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kept = lint_imports(config_filename=str(config), cache_dir=None, no_logo=True)
    return kept, out.getvalue()


def test_imports_follow_the_layer_order_of_design_md():
    kept, report = run_contracts(ROOT / "pyproject.toml")
    assert kept, report


def test_the_layer_contract_fails_on_an_import_against_the_order(tmp_path, monkeypatch):
    package = tmp_path / "toylayers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def helper():\n    from toylayers import high\n")
    (package / "high.py").write_text("from toylayers import low\n")
    config = tmp_path / "setup.cfg"
    config.write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_package = toylayers

            [importlinter:contract:order]
            name = toy order
            type = layers
            layers =
                toylayers.high
                toylayers.low
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kept, report = run_contracts(config)
    assert not kept
    assert "toylayers.low -> toylayers.high" in report  # the import inside a function counts

    (package / "low.py").write_text("def helper():\n    return 1\n")
    kept, report = run_contracts(config)
    assert kept, report


def _toy_of_the_real_layers(tmp_path: Path, monkeypatch, imports: dict[str, str]) -> Path:
    """A package `toyreal` with one package per name in pyproject.toml's layers (same order,
    same siblings), `imports` its only imports (module -> module it imports: a name of the
    layers or one of their modules, "supervisor.progress"; or an external package such as
    torch), and a copy of the real contracts (layers and forbidden) with the package renamed:
    what the real contract says about an import. A module named in `imports` or in a forbidden
    contract ("engine.batching") exists in its package; "x.*" gets one, "x.inner"."""
    import tomllib

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    package = tmp_path / "toyreal"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    lines = ["[importlinter]", "root_package = toyreal"]
    if settings.get("include_external_packages"):
        lines.append("include_external_packages = True")
    names = {
        name.strip()
        for contract in settings["contracts"]
        for layer in contract.get("layers", [])
        for name in layer.replace(":", "|").split("|")
    }
    named = {
        _toy_name(m).removeprefix("toyreal.").replace("*", "inner")
        for contract in settings["contracts"]
        for key in ("source_modules", "forbidden_modules")
        for m in contract.get(key, [])
    }
    modules = names | {m for m in [*named, *imports, *imports.values()] if "." in m}
    for name in sorted(m for m in modules if m.partition(".")[0] in names):
        target = imports.get(name)
        inner = "" if target is None or target.partition(".")[0] not in names else "toyreal."
        folder = package.joinpath(*name.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("" if target is None else f"import {inner}{target}\n")
    for i, contract in enumerate(settings["contracts"]):
        lines += [f"[importlinter:contract:c{i}]", f"name = {contract['name']}"]
        if contract["type"] == "forbidden":
            lines += ["type = forbidden"]
            for key in ("source_modules", "forbidden_modules"):
                lines += [f"{key} =", *(f"    {_toy_name(m)}" for m in contract[key])]
            if contract.get("allow_indirect_imports"):
                lines.append("allow_indirect_imports = True")
            continue
        lines += [
            "type = layers",
            "containers = toyreal",
            "layers =",
            *(f"    {layer}" for layer in contract["layers"]),
        ]
    config = tmp_path / "setup.cfg"
    config.write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return config


def _toy_name(module: str) -> str:
    """steadytrain.x is toyreal.x; an external package keeps its name."""
    head, _, rest = module.partition(".")
    return f"toyreal.{rest}" if head == "steadytrain" else module


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("engine", "checkpoint"),  # the loop knows events, not checkpoints
        ("safety", "checkpoint"),  # siblings: none imports another
        ("checkpoint", "telemetry"),
        ("memory", "checkpoint"),
    ],
)
def test_the_real_contract_fails_on_the_engine_or_a_sibling_importing_checkpoint(
    tmp_path, monkeypatch, importer, imported
):
    kept, report = run_contracts(_toy_of_the_real_layers(tmp_path, monkeypatch, {}))
    assert kept, report
    config = _toy_of_the_real_layers(tmp_path, monkeypatch, {importer: imported})
    kept, report = run_contracts(config)
    assert not kept
    assert f"toyreal.{importer} -> toyreal.{imported}" in report


@pytest.mark.parametrize(
    "imported, shown",
    [
        ("safety", "toyreal.safety"),  # a sibling: the layers contract
        ("engine", "toyreal.engine"),  # below it in the layers, forbidden by its own contract
        ("trainer", "toyreal.trainer"),
        ("torch", "torch"),  # an external package: `steadytrain run` never loads torch
    ],
)
def test_the_real_contract_fails_on_the_supervisor_importing_training(
    tmp_path, monkeypatch, imported, shown
):
    kept, report = run_contracts(_toy_of_the_real_layers(tmp_path, monkeypatch, {}))
    assert kept, report
    config = _toy_of_the_real_layers(tmp_path, monkeypatch, {"supervisor": imported})
    kept, report = run_contracts(config)
    assert not kept
    assert f"toyreal.supervisor -> {shown}" in report


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("checkpoint", "engine.batching"),  # moving a batch is the device's (device.batches)
        ("memory", "engine.accumulation"),  # the planner measures the passes it is given
        ("memory", "engine"),
    ],
)
def test_the_real_contract_fails_on_checkpoint_or_memory_reaching_into_the_engine(
    tmp_path, monkeypatch, importer, imported
):
    kept, report = run_contracts(_toy_of_the_real_layers(tmp_path, monkeypatch, {}))
    assert kept, report
    config = _toy_of_the_real_layers(tmp_path, monkeypatch, {importer: imported})
    kept, report = run_contracts(config)
    assert not kept
    assert f"toyreal.{importer} -> toyreal.{imported}" in report


def test_the_real_contract_fails_on_recipes_reading_the_supervisor_s_internals(
    tmp_path, monkeypatch
):
    """The supervisor's public names (its package, whose __init__ imports its modules) may be
    used by the recipes; one of its modules may not."""
    public = {"recipes": "supervisor", "supervisor": "supervisor.progress"}
    kept, report = run_contracts(_toy_of_the_real_layers(tmp_path, monkeypatch, public))
    assert kept, report
    config = _toy_of_the_real_layers(tmp_path, monkeypatch, {"recipes": "supervisor.progress"})
    kept, report = run_contracts(config)
    assert not kept
    assert "toyreal.recipes -> toyreal.supervisor.progress" in report


# -- sizes ------------------------------------------------------------------------------------


def size_problems(source: str, name: str) -> list[str]:
    """Functions over MAX_FUNCTION_LINES without `# long: <reason>` on the line directly above
    their `def` (or above their first decorator), and a module over MAX_MODULE_LINES without
    `# long-module: <reason>` in its first 5 lines."""
    lines = source.splitlines()
    problems = []
    if len(lines) > MAX_MODULE_LINES and not any(LONG_MODULE.match(x) for x in lines[:5]):
        problems.append(
            f"{name}: {len(lines)} lines (over {MAX_MODULE_LINES}); split it, or say why in "
            "a '# long-module: <reason>' line within the first 5 lines"
        )
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        starts = {node.lineno, *(d.lineno for d in node.decorator_list)}
        above = [lines[start - 2] for start in starts if start >= 2]
        if not any(LONG_FUNCTION.match(line) for line in above):
            problems.append(
                f"{name}:{node.lineno} {node.name}: {length} lines (over {MAX_FUNCTION_LINES}); "
                "split it, or say why in a '# long: <reason>' line directly above the def"
            )
    return problems


def test_functions_and_modules_are_short_or_say_why():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += size_problems(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def _function(lines: int, above: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return f"{above}def f():\n{body}"


def test_the_size_rule_fails_on_a_long_function_or_module_without_a_reason():
    assert size_problems(_function(MAX_FUNCTION_LINES), "ok.py") == []
    assert size_problems(_function(MAX_FUNCTION_LINES + 1), "long.py") == [
        "long.py:1 f: 61 lines (over 60); split it, or say why in a '# long: <reason>' line "
        "directly above the def"
    ]
    marked = _function(MAX_FUNCTION_LINES + 1, "# long: one table, read top to bottom\n")
    assert size_problems(marked, "marked.py") == []
    assert size_problems(_function(MAX_FUNCTION_LINES + 1, "# long:\n"), "empty.py") != []
    far = _function(MAX_FUNCTION_LINES + 1, "# long: a reason\n\n")
    assert size_problems(far, "far.py") != [], "the reason must be directly above the def"
    decorated = _function(MAX_FUNCTION_LINES + 1, "# long: a reason\n@staticmethod\n")
    assert size_problems(decorated, "decorated.py") == []
    method = "class C:\n" + textwrap.indent(_function(MAX_FUNCTION_LINES + 1), "    ")
    assert len(size_problems(method, "method.py")) == 1

    module = "".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES + 1))
    assert len(size_problems(module, "big.py")) == 1
    assert size_problems('"""Doc."""\n# long-module: one table\n' + module, "big.py") == []
    late = "\n" * 5 + "# long-module: too late\n" + module
    assert len(size_problems(late, "late.py")) == 1


@pytest.mark.parametrize("mark", ["# long: a reason", "    # long: a reason"])
def test_the_reason_line_may_be_indented_with_its_def(mark):
    source = "class C:\n" + textwrap.indent(_function(MAX_FUNCTION_LINES + 1), "    ")
    source = source.replace("    def f", f"{mark}\n    def f")
    assert size_problems(source, "c.py") == []
