"""The `steadytrain` command: one entry point, thin over the layers.

Errors a user can cause (`SteadytrainError`) print their message and exit with their code, never
a traceback; anything else is a bug and exits 1 with the traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from steadytrain.errors import SteadytrainError

app = typer.Typer(
    name="steadytrain",
    help="Make a training run on a memory-constrained machine finish.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


@app.command()
def doctor(
    json_output: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
    selftest: bool = typer.Option(
        False, "--selftest", help="Also run a tiny training step and a checkpoint round trip."
    ),
    device: str = typer.Option("auto", help="Device to diagnose: auto, cpu, mps, cuda, cuda:N."),
    run_dir: str = typer.Option(".", help="Where runs will be written (its free disk is checked)."),
) -> None:
    """Diagnose this machine for training: exit 0 healthy, 1 warnings, 2 broken."""
    from steadytrain.doctor import run_doctor

    raise typer.Exit(run_doctor(json_output=json_output, selftest=selftest, device=device,
                                run_dir=run_dir))


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=False)
    except SteadytrainError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code (2)
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
