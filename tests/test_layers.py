"""The structure DESIGN.md promises, enforced: the layer order of imports and the forbidden
arrows (import-linter's contracts in pyproject.toml), and each package's docstring naming its
modules. Each check is also run on a small synthetic case that breaks it, so a check that could
never fail would be caught here. There is no line-count rule: a module is as long as its one
concern needs (STYLE.md, "Size is not structure")."""

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


# -- each package says what is in it ---------------------------------------------------------


def package_listing_problems(package: Path, name: str) -> list[str]:
    """A package whose `__init__` docstring does not name each of its modules and subpackages
    (by name, as a word: `store`, `store.py`), or names a `.py` file it does not have: its
    docstring is where a newcomer learns what is where, and it must not drift."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    problems = []
    members = sorted(
        [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
        + [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    )
    missing = [m for m in members if not re.search(rf"(?<![\w.]){re.escape(m)}\b", doc)]
    if missing:
        problems.append(f"{name}: its docstring does not name {', '.join(missing)}")
    gone = [f for f in re.findall(r"\b(\w+)\.py\b", doc) if f not in members]
    if gone:
        problems.append(f"{name}: its docstring names {', '.join(gone)}.py, which it does not have")
    return problems


def test_each_package_docstring_lists_its_modules():
    problems = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        problems += package_listing_problems(init.parent, str(init.parent.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_the_listing_check_fails_on_a_module_left_out_or_one_named_that_is_gone(tmp_path):
    package = tmp_path / "toy"
    package.mkdir()
    (package / "store.py").write_text("")
    (package / "writer.py").write_text("")
    (package / "__init__.py").write_text(
        '"""A toy.\n\nstore.py  the store\nwriter    the writer\n"""\n'
    )
    assert package_listing_problems(package, "toy") == []
    (package / "reader.py").write_text("")
    assert package_listing_problems(package, "toy") == ["toy: its docstring does not name reader"]
    (package / "reader.py").unlink()
    (package / "__init__.py").write_text('"""store.py, writer, resume.py"""\n')
    assert package_listing_problems(package, "toy") == [
        "toy: its docstring names resume.py, which it does not have"
    ]
