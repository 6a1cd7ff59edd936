"""The estimate/plan command line is generated from the settings dataclass: every field is an
option of the commands its metadata names, with its help; the commands' earlier Python keyword
names keep working; validation names every problem of the command at once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import typer

from steadytrain.cli import app
from steadytrain.errors import BadInputError
from steadytrain.memory.plan import plan
from steadytrain.memory.settings import Settings, flag_of, from_options, options


def _command(name: str):
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_every_settings_field_is_an_option_of_its_commands(command):
    params = {p.name: p for p in _command(command).params}
    shown = options(command)
    assert set(params) == {"model", "json_output"} | {f.name for f in shown}
    for f in shown:
        assert flag_of(f.name) in params[f.name].opts
        assert params[f.name].help == f.metadata["help"]
        assert params[f.name].required == f.metadata["required"]
    hidden = {f.name for f in dataclasses.fields(Settings)} - {f.name for f in shown}
    assert hidden and not hidden & set(params)


def test_public_flags_keep_their_spelling():
    estimate = {o for p in _command("estimate").params for o in p.opts}
    plan_flags = {o for p in _command("plan").params for o in p.opts}
    assert {"--micro-batch", "--memory", "--checkpointing", "--chunk-tokens", "--json"} <= estimate
    assert {"--effective-batch", "--memory", "--margin", "--probe", "--micro-batch-sizes"} <= (
        plan_flags
    )
    assert "--micro-batch" not in plan_flags and "--margin" not in estimate


def test_earlier_keyword_names_reach_the_same_settings():
    assert from_options("estimate", {"micro_batch": 3, "memory": "1GiB"}) == from_options(
        "estimate", {"micro_batch_size": 3, "memory_budget": "1GiB"}
    )
    earlier = from_options(
        "plan", {"effective_batch": 8, "checkpointing": "on", "margin": 0.5, "probe_device": False}
    )
    assert (earlier.effective_batch_size, earlier.activation_checkpointing) == (8, "on")
    assert (earlier.plan_margin, earlier.probe) == (0.5, False)
    assert from_options("estimate", {}).device_type is None  # this machine's, resolved later
    with pytest.raises(BadInputError, match="'margin'"):
        from_options("estimate", {"margin": 0.5})


def test_check_names_every_problem_of_the_command_alone():
    bad = Settings(effective_batch_size=0, activation_checkpointing="x", seq=0)
    with pytest.raises(BadInputError) as info:
        bad.check("plan")
    message = str(info.value)
    assert message.startswith("plan: ")
    assert "--effective-batch" in message and "--checkpointing" in message and "--seq" in message
    with pytest.raises(BadInputError) as info:
        bad.check("estimate")  # the plan's own options are not the estimate's problem
    assert "--seq" in str(info.value) and "--effective-batch" not in str(info.value)


def test_plan_refuses_an_unknown_keyword_before_it_measures_anything():
    with pytest.raises(TypeError, match="bogus"):
        plan(None, None, effective_batch_size=1, bogus=True)


def test_the_command_line_reads_its_options_without_importing_torch():
    """The supervisor (`steadytrain run`) is the same program: it must stay a small process."""
    code = "import sys, steadytrain.cli; raise SystemExit('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
