"""The `steadytrain` command: one entry point, thin over the layers.

This module builds the command (`app`, `main`) and the commands that need no module of their own;
the others:

__main__.py           `python -m steadytrain.cli`: the `steadytrain` command
options.py            command-line options generated from dataclasses (the settings of estimate
                      and plan, the doctor's and each recipe's options)
memory_commands.py    `steadytrain estimate` and `steadytrain plan`: a table or JSON
finetune_commands.py  `steadytrain finetune --dry-run` and `steadytrain config FILE` on a
                      fine-tune config: what it would do, loading and training nothing
run_locate.py         where the command `steadytrain run` supervises writes its run
readable.py           a console whose tables stay whole when the output is piped or redirected

Errors a user can cause (`SteadytrainError`) print their message and exit with their code, never
a traceback; anything else is a bug and exits 1 with the traceback.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from steadytrain import __version__
from steadytrain.cli.memory_commands import register as register_memory_commands
from steadytrain.cli.options import options_command
from steadytrain.doctor.options import DoctorOptions
from steadytrain.errors import RunDiskFullError, SteadytrainError, is_disk_full
from steadytrain.recipes.options import (
    DemoOptions,
    EvaluateOptions,
    FinetuneOptions,
    GenerateOptions,
    MergeOptions,
    argument,
    option,
)
from steadytrain.supervisor import SupervisorOptions


def _flags_without_type(params: list) -> list:
    """A flag takes no value, so its help shows no type (typer ≥ 0.2x prints `<bool>` after
    `--json` and `--help`, as if they took one)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(TyperCommand):
    """A command's help as people read it: flags without a type, and a required argument as
    `MODEL` in the usage line (typer ≥ 0.2x writes `{MODEL}`)."""

    def get_params(self, ctx: Any) -> list:
        return _flags_without_type(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list:
        return _flags_without_type(super().get_params(ctx))


app = typer.Typer(
    name="steadytrain",
    help="Make a training run on a memory-constrained machine finish.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err_console = Console(stderr=True, soft_wrap=True)  # a path in a message stays whole


def _version(value: bool) -> None:
    if value:
        typer.echo(f"steadytrain {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Make a training run on a memory-constrained machine finish."""


def _doctor(**options: Any) -> int:
    from steadytrain.doctor import run_doctor

    return run_doctor(**options)


options_command(app, "doctor", DoctorOptions, _doctor)


@app.command("config")
def config_command(
    path: str | None = typer.Argument(None, metavar="FILE", help="A JSON or YAML config file."),
    overrides: list[str] | None = typer.Option(  # noqa: B008 (typer reads the default)
        None,
        "--set",
        metavar="FIELD=VALUE",
        help="Change one field before checking; the value is read as YAML (4, null, true, "
        "12GiB). Repeatable.",
    ),
    reference: bool = typer.Option(
        False, "--reference", help="Print the reference of every field (markdown) instead."
    ),
) -> None:
    """Check a config file and print it resolved as JSON: exit 0 valid, 2 invalid.

    A fine-tune config (model_name_or_path, train_file, ...) prints what `steadytrain finetune
    --dry-run` prints: settings, memory estimate, plan, files (exit 3: does not fit).
    """
    from steadytrain.config import TrainConfig, parse_overrides, reference_markdown
    from steadytrain.errors import BadInputError

    if reference:
        typer.echo(reference_markdown(), nl=False)
        return
    if path is None:
        raise BadInputError("give a config file to check (steadytrain config FILE), or --reference")
    from steadytrain.cli.finetune_commands import dry_run, is_finetune_file

    if is_finetune_file(path):  # what `steadytrain finetune --dry-run` says
        from steadytrain.recipes.finetune_config import FinetuneConfig

        raise typer.Exit(dry_run(FinetuneConfig.load(path, overrides or [])))
    config = TrainConfig.load(path, overrides=parse_overrides(overrides or []))
    typer.echo(config.to_json(), nl=False)


register_memory_commands(app)


@dataclass(frozen=True)
class RunCommand:
    """Supervise CMD: restart it after a crash, an OS kill or a hang, with backoff.

    Exits with the child's code (0, 2, 3, 130, 143), or 4 when it fails again and again.
    """

    command: list[str] | None = argument(  # noqa: RUF009 (a field(), its default None)
        "-- CMD", "The training command; it resumes from its checkpoint.", default=None
    )
    max_restarts: int = option(
        SupervisorOptions.max_restarts,
        "Give up (exit 4) after this many restarts in a row without a new checkpoint (one "
        "that starts smaller after a memory kill is not counted).",
    )
    run_dir: str | None = option(
        None,
        "The run directory, to see new checkpoints and write restart events (default "
        "$STEADYTRAIN_RUN_DIR, a fine-tune's output_dir, or the run_dir the child announces).",
    )
    backoff_initial: float = option(
        SupervisorOptions.backoff_initial, "Seconds before the first restart."
    )
    backoff_max: float = option(
        SupervisorOptions.backoff_max, "The delay doubles up to this many seconds."
    )
    stop_timeout: float = option(
        SupervisorOptions.stop_timeout,
        "Seconds the child has to stop after a forwarded SIGINT/SIGTERM before SIGKILL.",
    )
    first_heartbeat_timeout: float = option(
        SupervisorOptions.first_heartbeat_s,
        "Seconds an attempt of a steadytrain run may go without writing its first heartbeat "
        "before it is treated as hung, killed and restarted.",
    )


def _run(
    ctx: typer.Context,
    command: list[str] | None,
    run_dir: str | None,
    first_heartbeat_timeout: float,
    **given: Any,
) -> int:
    import os
    from pathlib import Path

    from steadytrain.cli.run_locate import finetune_run_dir
    from steadytrain.errors import BadInputError
    from steadytrain.safety.watchdog import stop_start_watch
    from steadytrain.supervisor import Supervisor, resolve_run_dir

    if not command:
        ctx.fail("give the command to supervise after --: steadytrain run [OPTIONS] -- CMD ...")
    output_dir = finetune_run_dir(command)
    same = run_dir is None or output_dir is None or Path(run_dir).resolve() == output_dir.resolve()
    if not same:
        raise BadInputError(
            f"--run-dir {run_dir} is not the fine-tune's output_dir {output_dir}: the run "
            "writes its checkpoints there, where the supervisor would not look, so every "
            "restart would count as one without progress; leave out --run-dir (the "
            "fine-tune's output_dir is used), or give the same folder"
        )
    options = SupervisorOptions(
        **given,
        first_heartbeat_s=first_heartbeat_timeout,
        run_dir=resolve_run_dir(run_dir, os.environ) or output_dir,
        advice=finetune_advice,
    )
    stop_start_watch()  # a supervisor started by another one trains nothing itself
    return Supervisor(command, options).run()


options_command(
    app,
    "run",
    RunCommand,
    _run,
    pass_context=True,
    context_settings={"allow_interspersed_args": False},
)


def finetune_advice(run_dir: Any, in_force: list[str]) -> list[str]:
    """The supervisor's last word on a fine-tune the OS killed with every saver on: the
    advisor on its own config (loaded only then: the supervisor imports nothing of training)."""
    from steadytrain.recipes.finetune_memory import run_advice

    return run_advice(run_dir, in_force)


@dataclass(frozen=True)
class FinetuneCommand(FinetuneOptions):
    dry_run: bool = option(
        False,
        "Print the resolved settings, the memory estimate, the plan and the files it would "
        "write; load and train nothing.",
    )


def _finetune(config: str, overrides: list[str] | None, dry_run: bool) -> int:
    if dry_run:
        from steadytrain.cli.finetune_commands import dry_run as print_dry_run
        from steadytrain.recipes.finetune_config import FinetuneConfig

        return print_dry_run(FinetuneConfig.load(config, overrides or []))
    from steadytrain.recipes.finetune import run_finetune

    return run_finetune(config, overrides or []).exit_code


def _demo(**options: Any) -> int:
    from steadytrain.recipes.demo import demo_command

    return demo_command(**options)


def _merge(**options: Any) -> int:
    from steadytrain.recipes.merge import merge_command

    return merge_command(**options)


def _generate(**options: Any) -> int:
    from steadytrain.recipes.generate import generate_command

    return generate_command(**options)


def _evaluate(**options: Any) -> int:
    from steadytrain.recipes.evaluate import evaluate_command

    return evaluate_command(**options)


# The recipes' commands: their arguments and options are the fields of steadytrain.recipes.options
options_command(app, "finetune", FinetuneCommand, _finetune, doc=FinetuneOptions.__doc__)
options_command(app, "demo", DemoOptions, _demo)
options_command(app, "merge", MergeOptions, _merge)
options_command(app, "generate", GenerateOptions, _generate)
options_command(app, "evaluate", EvaluateOptions, _evaluate)


@app.command("export")
def export_command(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="A fine-tune's run directory."),
    step: int | None = typer.Option(
        None, "--step", metavar="N", help="The checkpoint's step (default: the newest)."
    ),
) -> None:
    """Write a checkpoint's adapter as a peft folder (RUN_DIR/adapters/step-N/): exit 0, 2."""
    from steadytrain.recipes.checkpoint_export import export_checkpoint

    folder = export_checkpoint(run_dir, step)
    typer.echo(f"adapter: {folder}")
    typer.echo(f"next:\n  steadytrain generate {folder} 'Once upon a time'")


@app.command("report")
def report_command(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="The run directory to report on."),
    out: str | None = typer.Option(
        None,
        "--out",
        metavar="PATH",
        help="Where to write the HTML page: a .html path or a folder (DIR/report.html; default "
        "RUN_DIR/report.html); the PNGs go in the folder named after it (RUN_DIR/report/). A "
        "read-only run directory needs it.",
    ),
) -> None:
    """Write an HTML page with plots (loss, learning rate, step time, memory, events) for a run.

    Works on a finished run, a killed one, and one still being written; reads the files only.
    Exit 0; 2 when RUN_DIR is not a run or the page cannot be written there (give --out DIR).
    """
    from steadytrain.telemetry.report import write_report

    report = write_report(run_dir, out)
    typer.echo(f"wrote {report.html} (plots in {report.pngs[0].parent}/)")
    typer.echo(report.summary)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:  # a bare `steadytrain` asks what there is: the help, and no error
        args = ["--help"]
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = _Command
    try:
        code = app(args=args, prog_name="steadytrain", standalone_mode=False)
    except SteadytrainError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        full = RunDiskFullError(exc.filename, exc)  # a report, an export, the supervisor's files
        err_console.print(f"[bold red]error:[/] {escape(str(full))}", markup=True, highlight=False)
        sys.exit(full.exit_code)
    except Exception as exc:
        # Usage errors (unknown option, missing argument) come from typer's bundled click: they
        # carry their own message and exit code 2. Anything else is a bug and keeps its traceback.
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            hint = _config_file_hint(args, exc.format_message())
            if hint:
                err_console.print(escape(hint), markup=False, highlight=False)
            sys.exit(exc.exit_code)
        raise
    sys.exit(code or 0)


CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def _config_file_hint(args: list[str], message: str) -> str | None:
    """For `steadytrain finetune my.json` (the file where `--config FILE` belongs): the command
    as it should be typed."""
    if "--config" not in message or "Missing option" not in message:
        return None
    given = [a for a in args[1:] if not a.startswith("-") and a.endswith(CONFIG_SUFFIXES)]
    if not given:
        return None
    rest = " ".join(a for a in args[1:] if a != given[0])
    return f"The config file goes after --config: steadytrain {args[0]} --config {given[0]} {rest}".rstrip()


if __name__ == "__main__":
    main()
