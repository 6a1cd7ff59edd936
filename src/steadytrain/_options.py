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

SAME: Any = "<the option's own value>"
"""An alias's `value` when it takes the option's own value (`--memory 12GiB`)."""


@dataclasses.dataclass(frozen=True)
class Alias:
    """An earlier flag of an option, kept working beside the one named after its field (the
    command line generated from the dataclass takes it, hidden from --help; the Python form of a
    command takes `keyword`). Without `value` it takes the option's value (`--memory 12GiB` is
    `--memory-budget 12GiB`); with one it is a bare flag that sets it (`--offload` is
    `--activation-checkpointing offload`). `commands`: where it applies, when the option is
    shared by several commands and the earlier flag was one command's; empty: everywhere."""

    flag: str
    value: Any = SAME
    commands: tuple[str, ...] = ()

    @property
    def keyword(self) -> str:
        """The earlier name as a Python keyword: --micro-batch -> micro_batch."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def bare(self) -> bool:
        """A flag that takes no value and sets `value`."""
        return self.value is not SAME

    def applies_to(self, command: str | None) -> bool:
        return not self.commands or command is None or command in self.commands


def argument(metavar: str, help: str, default: Any = REQUIRED) -> Any:
    """A positional argument, shown as `metavar`."""
    return field(default=default, metadata={"argument": True, "metavar": metavar, "help": help})


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    aliases: tuple[Alias, ...] = (),
) -> Any:
    """An option; `flag` defaults to the field's name in kebab case (`--x/--no-x` for a pair);
    `aliases` are its earlier flags, kept working."""
    meta = {"argument": False, "flag": flag, "metavar": metavar, "help": help, "aliases": aliases}
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """The option's flag as typer takes it (both spellings of a `--x/--no-x` pair)."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def aliases_of(f: dataclasses.Field, command: str | None = None) -> tuple[Alias, ...]:
    """The earlier flags of option `f` that `command` takes (every one without a command)."""
    return tuple(a for a in f.metadata.get("aliases", ()) if a.applies_to(command))


def with_aliases(help: str, aliases: tuple[Alias, ...]) -> str:
    """An option's help with its earlier flags named, so --help shows what they became."""
    if not aliases:
        return help
    said = ", ".join(a.flag if not a.bare else f"{a.flag} (= {a.value})" for a in aliases)
    return f"{help} Earlier flag{'s' * (len(aliases) > 1)}, still taken: {said}."


__all__ = [
    "REQUIRED",
    "SAME",
    "Alias",
    "aliases_of",
    "argument",
    "flag_of",
    "option",
    "with_aliases",
]
