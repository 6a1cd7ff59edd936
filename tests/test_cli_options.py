"""The estimate/plan command line is generated from the settings dataclass: every field is an
option of the commands its metadata names, with its help; the commands' earlier Python keyword
names keep working; validation names every problem of the command at once."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import typer

from steadytrain._options import aliases_of, with_aliases
from steadytrain.cli import app
from steadytrain.cli import main as cli_main
from steadytrain.cli.options import ALIAS_PREFIX
from steadytrain.config import TrainConfig
from steadytrain.device import resolve_device
from steadytrain.errors import BadInputError, ConfigError
from steadytrain.memory.plan import plan
from steadytrain.memory.settings import Settings, flag_of, from_options, options


def _command(name: str):
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_every_settings_field_is_an_option_of_its_commands(command):
    params = {p.name: p for p in _command(command).params}
    shown = options(command)
    earlier = {ALIAS_PREFIX + a.keyword: a for f in shown for a in aliases_of(f, command)}
    assert set(params) == {"model", "json_output"} | {f.name for f in shown} | set(earlier)
    for f in shown:
        assert flag_of(f.name) in params[f.name].opts
        assert flag_of(f.name) == "--" + f.name.replace("_", "-") or f.name in ("compiled",)
        assert params[f.name].help == with_aliases(f.metadata["help"], aliases_of(f, command))
        required = f.metadata["required"] and not aliases_of(f, command)  # else from_options
        assert params[f.name].required == required
    for name, alias in earlier.items():  # an earlier flag: hidden from --help, still taken
        assert params[name].opts == [alias.flag] and params[name].hidden
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
    assert "--effective-batch" in message and "--activation-checkpointing" in message
    assert "--seq" in message
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


# -- one grammar of a memory budget, flags named after their fields ------------------------------

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
}


@pytest.fixture
def tiny_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`steadytrain ARGS` in this process: (exit code, stdout, stderr with its lines joined)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    said = capsys.readouterr()
    return info.value.code, said.out, " ".join(said.err.split())


@pytest.mark.parametrize("budget", ["0.8", "auto", "12GiB"])
def test_estimate_takes_every_memory_budget_a_config_takes_and_resolves_it_as_a_run(
    tiny_model, capsys, budget
):
    """`--memory 0.8` and `--memory auto` exited 2 while `memory_budget: 0.8` and `auto` were
    valid in a config. Now each is the budget a TrainConfig with the same memory_budget
    resolves to on this machine (CPU: usable memory moves with the free RAM, so within 5 %)."""
    for flag in ("--memory", "--memory-budget"):
        args = ("estimate", tiny_model, "--seq", "64", "--device-type", "cpu", "--json")
        code, out, err = run_cli(capsys, *args, flag, budget)
        assert code == 0, err
        said = json.loads(out)
        spec = TrainConfig(effective_batch_size=1, memory_budget=budget).budget_bytes_or_fraction()
        expected = resolve_device("cpu", spec).budget
        if isinstance(spec, int):
            assert said["budget_bytes"] == expected == 12 * 2**30
            assert said["budget_source"] == "--memory-budget 12GiB"
        else:
            assert abs(said["budget_bytes"] - expected) < 0.05 * expected
            assert said["budget_source"].startswith(
                f"--memory-budget {budget}: {spec:g} of usable memory ("
            )


@pytest.mark.parametrize("budget", ["12", "1.5", "abc", "0", "0GiB", "12 parsecs"])
def test_a_bad_memory_budget_exits_2_with_the_configs_own_words(tiny_model, capsys, budget):
    with pytest.raises(ConfigError) as refused:
        TrainConfig(effective_batch_size=1, memory_budget=budget)
    config_says = " ".join(str(refused.value).split("memory_budget: ", 1)[1].split())
    config_says = config_says.rsplit(" (found ", 1)[0]
    for command, extra in (("estimate", ()), ("plan", ("--effective-batch-size", "4"))):
        code, _, err = run_cli(capsys, command, tiny_model, *extra, "--memory", budget)
        assert code == 2, err
        assert f"{command}: --memory: {config_says}" in err, err
    code, _, err = run_cli(capsys, "estimate", tiny_model, "--memory-budget", budget)
    assert code == 2 and f"--memory-budget: {config_says}" in err, err
    assert "GiB'" in config_says and "0.8" in config_says and "'auto'" in config_says


def test_a_fraction_for_a_device_this_machine_lacks_asks_for_a_size(tiny_model, capsys):
    absent = next(t for t in ("cuda", "mps") if t not in _device_types_here())
    code, _, err = run_cli(
        capsys, "estimate", tiny_model, "--device-type", absent, "--memory-budget", "0.8"
    )
    assert code == 2, err
    assert f"--memory-budget 0.8: a fraction of usable memory is taken of the {absent}" in err
    assert "--memory-budget 12GiB" in err


def _device_types_here() -> set[str]:
    import torch

    found = {"cpu"}
    if torch.cuda.is_available():
        found.add("cuda")
    if torch.backends.mps.is_available():
        found.add("mps")
    return found


def test_activation_checkpointing_is_one_flag_and_the_earlier_ones_still_work(tiny_model, capsys):
    """`--checkpointing` was a bare flag on estimate (and `--offload` another) but a four-value
    option on plan; both now take `--activation-checkpointing`, the config's field."""
    base = ("estimate", tiny_model, "--seq", "64", "--device-type", "cuda", "--json")
    base += ("--memory-budget", "8GiB")

    def estimate_of(*flags: str) -> dict:
        code, out, err = run_cli(capsys, *base, *flags)
        assert code == 0, err
        return json.loads(out)

    on, old_on = estimate_of("--activation-checkpointing", "on"), estimate_of("--checkpointing")
    assert on == old_on and on["settings"]["checkpointing"] and not on["settings"]["offload"]
    offload = estimate_of("--activation-checkpointing", "offload")
    assert offload == estimate_of("--offload") == estimate_of("--checkpointing", "--offload")
    assert offload["settings"]["offload"]
    off = estimate_of()
    assert not off["settings"]["checkpointing"] and off != on
    code, _, err = run_cli(capsys, *base, "--checkpointing", "--activation-checkpointing", "on")
    assert code == 2 and "--activation-checkpointing and --checkpointing" in err, err

    plan = ("plan", tiny_model, "--seq", "64", "--memory-budget", "8GiB", "--json")

    def plan_of(*flags: str) -> tuple:
        """What the plan chose (the room it had moves with this machine's free memory)."""
        code, out, err = run_cli(capsys, *plan, *flags)
        assert code == 0, err
        said = json.loads(out)
        return said["activation_checkpointing"], said["effective_batch_size"]

    new = plan_of("--effective-batch-size", "4", "--activation-checkpointing", "on")
    old = plan_of("--effective-batch", "4", "--checkpointing", "on", "--margin", "0.5")
    assert old == new == (True, 4)
    assert (
        plan_of(
            "--effective-batch-size",
            "4",
            "--activation-checkpointing",
            "on",
            "--plan-margin",
            "0.5",
        )
        == old
    )
    assert plan_of("--effective-batch-size", "4", "--activation-checkpointing", "off")[0] is False


def test_help_shows_the_field_named_flags_and_names_the_earlier_ones(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for command, flags in (
        ("estimate", ("--memory-budget", "--activation-checkpointing", "--micro-batch-size")),
        ("plan", ("--memory-budget", "--activation-checkpointing", "--plan-margin")),
    ):
        code, out, _ = run_cli(capsys, command, "--help")
        text = " ".join(out.split())
        assert code == 0 and all(flag in text for flag in flags), text
        assert "Earlier flag, still taken: --memory." in text
