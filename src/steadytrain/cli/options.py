"""Command-line options generated from dataclasses: the settings of `estimate` and `plan`
(`steadytrain.memory.settings`: each field's `option(...)` gives the flag, the help and the
commands that show it) and the options of the doctor's and each recipe's command
(`steadytrain.doctor.options`, `steadytrain.recipes.options`),
so an option is declared once, beside its default, and never copied by hand into a signature.
An option's earlier flags (`steadytrain._options.Alias`) become hidden options of their own,
whose values reach the command under the field's name."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from steadytrain._options import REQUIRED, Alias, aliases_of, flag_of, with_aliases
from steadytrain.errors import BadInputError
from steadytrain.memory.settings import Settings, cli_default_of, options

MODEL_HELP = "A local model directory (config.json) or a Hugging Face id."


def option_parameter(
    f: dataclasses.Field, hints: dict[str, Any], command: str
) -> inspect.Parameter:
    """The typer option of one settings field in `command`."""
    meta = f.metadata
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    # A required option with an earlier flag may come under either: from_options asks for it.
    earlier = aliases_of(f, command)
    required = meta["required"] and not earlier
    default = (
        inspect.Parameter.empty
        if required
        else None
        if meta["required"]
        else cli_default_of(f, command)
    )
    help = with_aliases(meta["help"], earlier)
    return inspect.Parameter(
        f.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[hints[f.name], typer.Option(flag, help=help)],
    )


ALIAS_PREFIX = "alias_"
"""The parameter name of an earlier flag: `alias_` and its keyword (alias_memory)."""


def alias_parameters(
    f: dataclasses.Field, hints: dict[str, Any], command: str | None = None
) -> list[inspect.Parameter]:
    """A hidden option per earlier flag of field `f` in `command`: a bare flag (`--offload`)
    or an option with the field's type (`--memory 12GiB`)."""
    found = []
    for alias in aliases_of(f, command):
        kind = bool if alias.bare else hints[f.name] | None
        found.append(
            inspect.Parameter(
                ALIAS_PREFIX + alias.keyword,
                inspect.Parameter.KEYWORD_ONLY,
                default=False if alias.bare else None,
                annotation=Annotated[kind, typer.Option(alias.flag, hidden=True)],
            )
        )
    return found


def alias_table(
    fields: list[dataclasses.Field], command: str | None
) -> dict[str, tuple[str, Alias]]:
    """Parameter name of each earlier flag -> (its field, the `Alias`)."""
    return {ALIAS_PREFIX + a.keyword: (f.name, a) for f in fields for a in aliases_of(f, command)}


def typed(ctx: typer.Context, name: str) -> bool:
    """Whether parameter `name` was given on the command line (not its default)."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"


def with_fields(
    ctx: typer.Context,
    values: dict[str, Any],
    table: dict[str, tuple[str, Alias]],
    by_keyword: bool = False,
) -> dict[str, Any]:
    """The command's values by field name: an earlier flag given sets its field (to its own
    value, or a bare flag's); with `by_keyword` it stays under its earlier keyword instead (the
    settings' `from_options` takes those and names the flag as typed in its messages). One
    setting given under two of its flags is refused, exit 2; bare flags of one option together
    are one choice, the last declared winning (`--checkpointing --offload` is offload)."""
    values = {k: v for k, v in values.items() if k not in table}
    seen: dict[str, str] = {}
    for name, (field_name, alias) in table.items():
        if not typed(ctx, name) or (alias.bare and not ctx.params[name]):
            continue
        both_bare = field_name in seen and alias.bare and seen[field_name] in _bare(table)
        if typed(ctx, field_name) or (field_name in seen and not both_bare):
            first = seen.get(field_name) or next(
                p.opts[0] for p in ctx.command.params if p.name == field_name
            )
            raise BadInputError(
                f"{ctx.info_name}: {first} and {alias.flag} set the same option (the field "
                f"{field_name}); give it once"
            )
        seen[field_name] = alias.flag
        if by_keyword:  # the field's own value is its default: the earlier flag's wins
            values.pop(field_name, None)
            values[alias.keyword] = ctx.params[name]
        else:
            values[field_name] = alias.value if alias.bare else ctx.params[name]
    return values


def _bare(table: dict[str, tuple[str, Alias]]) -> set[str]:
    return {alias.flag for _, alias in table.values() if alias.bare}


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
        *(p for f in options(command) for p in alias_parameters(f, hints, command)),
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
    table = alias_table(options(command), command)
    register(
        app,
        command,
        parameters,
        doc,
        lambda ctx, **values: run(**with_fields(ctx, values, table, by_keyword=True)),
    )


def dataclass_parameter(f: dataclasses.Field, hints: dict[str, Any]) -> inspect.Parameter:
    """The typer argument or option of one field of a recipe's options dataclass."""
    meta = f.metadata
    if meta["argument"]:
        info = typer.Argument(metavar=meta["metavar"], help=meta["help"])
    else:
        help = with_aliases(meta["help"], aliases_of(f))
        info = typer.Option(flag_of(f), metavar=meta["metavar"], help=help)
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
    fields = dataclasses.fields(options)
    parameters = [
        ctx,
        *(dataclass_parameter(f, hints) for f in fields),
        *(p for f in fields if not f.metadata["argument"] for p in alias_parameters(f, hints)),
    ]
    table = alias_table([f for f in fields if not f.metadata["argument"]], None)

    def call(ctx: typer.Context, **values: Any) -> int:
        values = with_fields(ctx, values, table)
        return run(ctx, **values) if pass_context else run(**values)

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
