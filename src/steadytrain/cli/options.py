"""Command-line options generated from the settings dataclass (`steadytrain.memory.settings`):
each field's `option(...)` gives the flag, the help and the commands that show it, so an option
is declared once, beside its default, and never copied by hand into a signature."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from steadytrain.memory.settings import Settings, cli_default_of, options

MODEL_HELP = "A local model directory (config.json) or a Hugging Face id."


def option_parameter(
    f: dataclasses.Field, hints: dict[str, Any], command: str
) -> inspect.Parameter:
    """The typer option of one settings field in `command`."""
    meta = f.metadata
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    default = inspect.Parameter.empty if meta["required"] else cli_default_of(f, command)
    return inspect.Parameter(
        f.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[hints[f.name], typer.Option(flag, help=meta["help"])],
    )


def command_parameters(command: str, json_help: str) -> list[inspect.Parameter]:
    """ctx, MODEL, every option `command` shows, and --json."""
    hints = typing.get_type_hints(Settings)
    model = Annotated[str, typer.Argument(metavar="MODEL", help=MODEL_HELP)]
    json_output = Annotated[bool, typer.Option("--json", help=json_help)]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return [
        inspect.Parameter("ctx", kind, annotation=typer.Context),
        inspect.Parameter("model", kind, annotation=model),
        *(option_parameter(f, hints, command) for f in options(command)),
        inspect.Parameter(
            "json_output", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=json_output
        ),
    ]


def settings_command(
    app: typer.Typer, command: str, doc: str, json_help: str, run: Callable[..., int]
) -> None:
    """Register `command` on `app`: its options are the settings fields it shows; the parsed
    values go to `run(**values)`, whose return is the exit code."""

    def handler(ctx: typer.Context, **_: Any) -> None:
        raise typer.Exit(run(**ctx.params))

    parameters = command_parameters(command, json_help)
    handler.__signature__ = inspect.Signature(parameters)  # typer reads the signature
    handler.__annotations__ = {p.name: p.annotation for p in parameters}
    handler.__doc__ = doc
    handler.__name__ = f"{command}_command"
    app.command(command)(handler)
