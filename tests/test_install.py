"""Installing (issue 19, point 3): `make demo` installs only what the demo needs, `make test` adds
the developer tools, and the README says how to install steadytrain into one's own environment.
The Makefile is read with `make -n` (what it would run, nothing installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEV_TOOLS = ("pytest", "ruff", "tensorboard")


def extras() -> dict[str, list[str]]:
    """The package names of each extra in pyproject.toml (tomllib is 3.11+, and Python 3.10
    is supported: the one table is read by hand)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {
        name: [re.split(r"[<>=\[ ]", r, maxsplit=1)[0] for r in re.findall(r'"([^"]+)"', body)]
        for name, body in re.findall(r"^(\w+) = \[(.*?)\]$", section, re.S | re.M)
    }


def test_the_demo_extra_has_what_the_demo_imports_and_no_developer_tools():
    demo = extras()["demo"]
    assert {"transformers", "peft", "accelerate", "matplotlib"} <= set(demo)
    assert not set(DEV_TOOLS) & set(demo)
    assert set(DEV_TOOLS) <= set(extras()["dev"])


def dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_demo_installs_the_demo_extra_only(tmp_path):
    commands = dry_run("demo", tmp_path)
    assert '-e ".[demo]"' in commands
    assert "[dev]" not in commands
    assert "--no-compile" in commands
    assert "steadytrain demo runs/demo" in commands


def test_make_test_adds_the_dev_extra(tmp_path):
    commands = dry_run("test", tmp_path)
    assert '-e ".[demo]"' in commands and '-e ".[dev]"' in commands
    assert "pytest -q" in commands


def test_readme_says_how_to_install_into_ones_own_environment():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e './steadytrain[lora,report]'" in readme
    assert "## Install it in your own project" in readme
    assert re.search(r"`make test` runs lint and\s+the test suite: about \d+ minutes", readme)
    assert "`make test-all` adds the slow repeats" in readme
