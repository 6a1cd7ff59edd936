"""Command-line options generated from dataclasses: the settings of `estimate` and `plan`
(`steadytrain.memory.settings`: each field's `option(...)` gives the flag, the help and the
commands that show it) and the options of the doctor's and each recipe's command
(`steadytrain.doctor.options`, `steadytrain.recipes.options`),
so an option is declared once, beside its default, and never copied by hand into a signature."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from steadytrain._options import REQUIRED, flag_of
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
    parameters = command_parameters(command, json_help)
    register(app, command, parameters, doc, lambda ctx, **values: run(**values))


def dataclass_parameter(f: dataclasses.Field, hints: dict[str, Any]) -> inspect.Parameter:
    """The typer argument or option of one field of a recipe's options dataclass."""
    meta = f.metadata
    if meta["argument"]:
        info = typer.Argument(metavar=meta["metavar"], help=meta["help"])
    else:
        info = typer.Option(flag_of(f), metavar=meta["metavar"], help=meta["help"])
    return inspect.Parameter(
        f.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=inspect.Parameter.empty if f.default is REQUIRED else f.default,
        annotation=Annotated[hints[f.name], info],
    )


def options_command(
    app: typer.Typer,
    command: str,
    options: type,
    run: Callable[..., int],
    doc: str | None = None,
    pass_context: bool = False,
    **settings: Any,
) -> None:
    """Register `command` on `app` with the fields of the dataclass `options` as its arguments
    and options (`steadytrain.recipes.options`); `run(**values)` (`run(ctx, **values)` with
    `pass_context`) returns the exit code; `doc` (default: the docstring of `options`) is the
    command's help; `settings` go to `app.command`."""
    hints = typing.get_type_hints(options)
    ctx = inspect.Parameter(
        "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
    )
    parameters = [ctx, *(dataclass_parameter(f, hints) for f in dataclasses.fields(options))]
    call = run if pass_context else lambda ctx, **values: run(**values)
    register(app, command, parameters, doc or options.__doc__, call, **settings)


def register(
    app: typer.Typer,
    command: str,
    parameters: list[inspect.Parameter],
    doc: str | None,
    run: Callable[..., int],
    **settings: Any,
) -> None:
    """Register a handler with these parameters (ctx first): typer reads its signature, and
    `run(ctx, **values)` returns the exit code."""

    def handler(ctx: typer.Context, **_: Any) -> None:
        raise typer.Exit(run(ctx, **ctx.params))

    handler.__signature__ = inspect.Signature(parameters)  # typer reads the signature
    handler.__annotations__ = {p.name: p.annotation for p in parameters}
    handler.__doc__ = doc
    handler.__name__ = f"{command}_command"
    app.command(command, **settings)(handler)
