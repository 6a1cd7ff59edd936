"""How a command's options are declared: one frozen dataclass per command, whose fields are its
arguments and options, each written once with its default, its flag and its help
(`argument(...)`, `option(...)`). The command line is generated from them (cli/options.py) and the
command's Python function takes its defaults from the same fields. Nothing here imports torch, so
any layer (the doctor's, the recipes') can declare its command's options without loading it."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

REQUIRED: Any = dataclasses.MISSING
"""The default of an argument or option that has none: the command refuses to run without it."""


def argument(metavar: str, help: str, default: Any = REQUIRED) -> Any:
    """A positional argument, shown as `metavar`."""
    return field(default=default, metadata={"argument": True, "metavar": metavar, "help": help})


def option(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None) -> Any:
    """An option; `flag` defaults to the field's name in kebab case (`--x/--no-x` for a pair)."""
    meta = {"argument": False, "flag": flag, "metavar": metavar, "help": help}
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """The option's flag as typer takes it (both spellings of a `--x/--no-x` pair)."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


__all__ = ["REQUIRED", "argument", "flag_of", "option"]
