"""The recipes' commands (finetune, demo, merge, generate, evaluate), `doctor` and `run` are
generated from options dataclasses (`steadytrain.recipes.options`, `steadytrain.doctor.options`,
`cli.RunCommand`): every field is an argument or option with its help and default; the command
line and the recipe's (or the doctor's) Python function start from the same defaults, and `run`
from the supervisor's; `python -m steadytrain.recipes.finetune` parses as `steadytrain finetune`
does."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
import typer

from steadytrain.cli import FinetuneCommand, RunCommand, app, main
from steadytrain.doctor.options import DoctorOptions
from steadytrain.recipes import options as recipe_options
from steadytrain.recipes.options import REQUIRED

COMMANDS = {
    "finetune": FinetuneCommand,
    "demo": recipe_options.DemoOptions,
    "merge": recipe_options.MergeOptions,
    "generate": recipe_options.GenerateOptions,
    "evaluate": recipe_options.EvaluateOptions,
    "doctor": DoctorOptions,
    "run": RunCommand,
}
FLAGS = {  # public: README and docs show them
    "finetune": {"--config", "--set", "--dry-run"},
    "demo": {"--device", "--steps", "--interrupt", "--no-interrupt", "--threads", "--force"},
    "merge": {"--out", "--base", "--dtype", "--force"},
    "generate": {"--prompts-file", "--base", "--max-new-tokens", "--temperature", "--top-p"}
    | {"--seed", "--chat", "--device", "--dtype", "--json"},
    "evaluate": {"--base", "--max-seq-length", "--batch-size", "--device", "--dtype", "--json"},
    "doctor": {"--json", "--selftest", "--device", "--run-dir"},
    "run": {"--max-restarts", "--run-dir", "--backoff-initial", "--backoff-max", "--stop-timeout"}
    | {"--first-heartbeat-timeout"},
}


def _params(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_is_an_argument_or_option_with_its_help_and_default(command):
    params = _params(command)
    fields = dataclasses.fields(COMMANDS[command])
    assert list(params) == [f.name for f in fields]
    for f in fields:
        param = params[f.name]
        assert param.help == f.metadata["help"]
        assert param.required == (f.default is REQUIRED)
        if f.default is not REQUIRED:
            assert param.default == f.default, f.name
        if f.metadata["metavar"]:
            assert param.metavar == f.metadata["metavar"]
    flags = {o for p in params.values() for o in (*p.opts, *p.secondary_opts) if o[0] == "-"}
    assert flags - {f.name for f in fields} == FLAGS[command]


class Seen(Exception):
    """Raised by the spy with the options a recipe's command built."""


CALLS = {  # command: (the command line's arguments, the Python call's), the required ones alone
    "demo": ([], (), {}),
    "merge": (["A", "--out", "O"], ("A",), {"out": "O"}),
    "generate": (["M", "P"], ("M", "P"), {}),
    "evaluate": (["E", "M"], ("E", "M"), {}),
}


@pytest.mark.parametrize("command", sorted(CALLS))
def test_the_command_line_and_the_python_function_start_from_the_same_defaults(
    command, monkeypatch
):
    module = importlib.import_module(f"steadytrain.recipes.{command}")
    name = f"{command.capitalize()}Options"
    options = getattr(recipe_options, name)

    def spy(*args, **kwargs):
        raise Seen(options(*args, **kwargs))

    monkeypatch.setattr(module, name, spy)
    argv, args, kwargs = CALLS[command]
    with pytest.raises(Seen) as from_cli:
        main([command, *argv])
    with pytest.raises(Seen) as from_python:
        getattr(module, f"{command}_command")(*args, **kwargs)
    assert from_cli.value.args[0] == from_python.value.args[0]


def test_the_doctor_command_and_run_doctor_start_from_the_same_defaults(monkeypatch, capsys):
    """What `steadytrain doctor` and `run_doctor()` hand the checks and print, the checks
    replaced by a spy that finds nothing; and `diagnose`'s own defaults are the command's."""
    from steadytrain.doctor import diagnosis

    calls, real = [], diagnosis.diagnose

    def spy(*args):
        calls.append(args)
        return []

    monkeypatch.setattr(diagnosis, "diagnose", spy)
    with pytest.raises(SystemExit) as from_cli:
        main(["doctor"])
    cli_out = capsys.readouterr().out
    from_python = diagnosis.run_doctor()
    assert calls[0] == calls[1] and len(calls) == 2
    assert (from_cli.value.code, cli_out) == (from_python, capsys.readouterr().out)
    defaults = inspect.signature(real).parameters
    cli = _params("doctor")
    for name in ("device", "run_dir", "selftest"):
        assert defaults[name].default == cli[name].default, name


def test_python_m_finetune_parses_as_steadytrain_finetune(monkeypatch, capsys):
    from steadytrain.recipes import finetune

    def spy(config, overrides):
        raise Seen(config, overrides)

    monkeypatch.setattr(finetune, "run_finetune", spy)
    for argv in (["--config", "c.json"], ["--config", "c.json", "--set", "a=1", "--set", "b=2"]):
        with pytest.raises(Seen) as from_cli:
            main(["finetune", *argv])
        with pytest.raises(Seen) as from_module:
            finetune.main(argv)
        assert from_cli.value.args == from_module.value.args
    with pytest.raises(SystemExit) as usage:
        finetune.main([])
    assert usage.value.code == 2 and "--config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(recipe_options.FinetuneOptions):
        assert " ".join(f.metadata["help"].split()) in shown


def test_run_gives_the_supervisor_its_own_defaults(monkeypatch, tmp_path):
    import steadytrain.supervisor as supervisor

    def spy(command, options):
        raise Seen(command, options)

    monkeypatch.setattr(supervisor, "Supervisor", spy)
    with pytest.raises(Seen) as seen:
        main(["run", "--run-dir", str(tmp_path), "--", "true", "--max-restarts", "9"])
    command, options = seen.value.args
    assert command == ["true", "--max-restarts", "9"]  # the child's, not the supervisor's
    assert Path(options.run_dir) == tmp_path and options.advice is not None
    given = {"run_dir": options.run_dir, "advice": options.advice}
    assert options == supervisor.SupervisorOptions(**given)
