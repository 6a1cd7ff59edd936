"""TrainConfig: defaults, every kind of bad value, all problems at once, loading and dumping."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from steadytrain.config import TrainConfig, load_mapping, parse_overrides, reference_markdown
from steadytrain.errors import BadInputError, ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def problems_of(**fields) -> list[str]:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields)
    assert info.value.exit_code == 2
    return info.value.problems


def test_defaults():
    config = TrainConfig(effective_batch_size=64)
    assert config.model_dump() == {
        "run_dir": "runs/default",
        "effective_batch_size": 64,
        "micro_batch_size": "auto",
        "micro_batch_sizes": "powers_of_two",
        "plan_margin": "auto",
        "precision": "auto",
        "epochs": 1,
        "max_steps": None,
        "save_every_steps": 250,
        "keep_last": 2,
        "device": "auto",
        "memory_budget": "auto",
        "hang_timeout": "auto",
        "hang_action": "exit",
        "memory_watch": True,
        "empty_cache": "auto",
        "leak_check_every_steps": "auto",
        "leak_threshold_mib": 32.0,
        "thrash_slowdown": 2.0,
        "progress": "auto",
        "tensorboard": False,
        "seed": 0,
        "max_grad_norm": None,  # no clipping unless asked (issue 11)
        "drop_last": True,
        "shuffle": True,
        "num_workers": 0,
        "activation_checkpointing": "auto",
        "tiled_mlp": "auto",
        "compile": "auto",
        "distributed": "auto",
        "fsdp_offload": False,
        "log_every_steps": 10,
        "async_save": "auto",
        "eval_every_steps": None,
        "eval_every_epochs": None,
        "eval_batch": None,
        "eval_metric": "eval_loss",
        "eval_mode": "min",
        "keep_best": False,
        "resume_overrides": [],
        "continuity_strict": False,
    }


def test_async_save_needs_two_checkpoints_kept():
    (line,) = problems_of(effective_batch_size=8, keep_last=1, async_save=True)
    assert line.startswith("keep_last: must be at least 2 with async_save true")
    assert "half-written" in line
    assert TrainConfig(effective_batch_size=8, keep_last=1).async_save == "auto"


def test_resume_overrides_names_only_run_defining_fields():
    (line,) = problems_of(effective_batch_size=8, resume_overrides=["lr"])
    assert line.startswith("resume_overrides")


def test_every_field_is_documented():
    for name, info in TrainConfig.model_fields.items():
        assert info.description and len(info.description) > 20, name


def test_good_values_are_kept():
    config = TrainConfig(
        effective_batch_size=64,
        micro_batch_size=16,
        precision="bf16",
        max_steps=500,
        save_every_steps=100,
        device="cuda:1",
        memory_budget="12GiB",
        hang_timeout=30,
        max_grad_norm=None,
        activation_checkpointing=True,
    )
    assert config.micro_batch_size == 16
    assert config.device == "cuda:1"
    assert config.hang_timeout == 30.0
    assert config.max_grad_norm is None
    assert config.activation_checkpointing is True


@pytest.mark.parametrize(
    ("fields", "field", "found", "rule"),
    [
        ({"max_grad_norm": 0}, "max_grad_norm", "found 0", "a number > 0 or null"),
        ({"max_grad_norm": -1.0}, "max_grad_norm", "found -1.0", "a number > 0 or null"),
        ({"save_every_steps": 0}, "save_every_steps", "found 0", "a whole number ≥ 1"),
        ({"keep_last": 0}, "keep_last", "found 0", "a whole number ≥ 1"),
        ({"epochs": 0}, "epochs", "found 0", "a whole number ≥ 1"),
        ({"epochs": 1.5}, "epochs", "found 1.5", "a whole number ≥ 1"),
        ({"max_steps": 0}, "max_steps", "found 0", "a whole number ≥ 1 or null"),
        ({"seed": -1}, "seed", "found -1", "a whole number ≥ 0"),
        ({"num_workers": -1}, "num_workers", "found -1", "a whole number ≥ 0"),
        ({"log_every_steps": 0}, "log_every_steps", "found 0", "a whole number ≥ 1"),
        ({"device": "gpu"}, "device", "found 'gpu'", "'cuda:N'"),
        ({"device": "cuda:x"}, "device", "found 'cuda:x'", "'cuda:N'"),
        ({"device": 3}, "device", "found 3", "'cuda:N'"),
        ({"memory_budget": "12 parsecs"}, "memory_budget", "found '12 parsecs'", "'12GiB'"),
        ({"memory_budget": 1.5}, "memory_budget", "found 1.5", "at most 1"),
        ({"memory_budget": 0}, "memory_budget", "found 0", "more than 0"),
        ({"memory_budget": "0GiB"}, "memory_budget", "found '0GiB'", "more than 0 bytes"),
        ({"memory_budget": [1]}, "memory_budget", "found [1]", "a fraction"),
        ({"hang_timeout": -1}, "hang_timeout", "found -1", "'auto' or a number > 0"),
        ({"hang_timeout": "soon"}, "hang_timeout", "found 'soon'", "'auto' or a number > 0"),
        ({"hang_timeout": float("inf")}, "hang_timeout", "found inf", "inf and nan"),
        ({"precision": "fp8"}, "precision", "found 'fp8'", "'auto', 'fp32', 'fp16' or 'bf16'"),
        ({"micro_batch_size": 0}, "micro_batch_size", "found 0", "'auto' or a whole number ≥ 1"),
        (
            {"micro_batch_size": "big"},
            "micro_batch_size",
            "found 'big'",
            "'auto' or a whole number ≥ 1",
        ),
        ({"micro_batch_size": True}, "micro_batch_size", "found true", "a whole number"),
        ({"epochs": True}, "epochs", "found true", "a whole number ≥ 1"),
        ({"max_grad_norm": False}, "max_grad_norm", "found false", "a number > 0 or null"),
        ({"drop_last": "maybe"}, "drop_last", "found 'maybe'", "true or false"),
        ({"activation_checkpointing": "x"}, "activation_checkpointing", "'x'", "'auto', true"),
        ({"run_dir": None}, "run_dir", "found null", "must be text"),
        ({"effective_batch_size": "lots"}, "effective_batch_size", "'lots'", "whole number ≥ 1"),
    ],
)
def test_bad_value_names_field_value_and_rule(fields, field, found, rule):
    problems = problems_of(**{"effective_batch_size": 64, **fields})
    assert len(problems) == 1, problems
    (line,) = problems
    assert line.startswith(f"{field}: ")
    assert found in line
    assert rule in line
    assert "Input should" not in line  # pydantic's wording is rephrased


def test_micro_batch_that_does_not_divide_lists_the_values_that_do():
    (line,) = problems_of(effective_batch_size=64, micro_batch_size=5)
    assert line.startswith("micro_batch_size: ")
    assert "found 5" in line
    assert "1, 2, 4, 8, 16, 32, 64" in line
    assert "'auto'" in line


def test_micro_batch_larger_than_effective_batch_is_refused():
    (line,) = problems_of(effective_batch_size=8, micro_batch_size=16)
    assert "found 16" in line
    assert "1, 2, 4, 8" in line


def test_divisor_hint_stays_short_for_numbers_with_many_divisors():
    (line,) = problems_of(effective_batch_size=720720, micro_batch_size=17)
    assert "15, 16, 18, 20" in line
    assert len(line) < 250


def test_save_interval_longer_than_the_run_is_refused():
    (line,) = problems_of(effective_batch_size=8, max_steps=10, save_every_steps=20)
    assert line.startswith("save_every_steps: ")
    assert "found 20" in line
    assert "max_steps 10" in line
    # Left at its default, the interval is simply longer than the run: the final checkpoint
    # written at the end covers it.
    assert TrainConfig(effective_batch_size=8, max_steps=10).save_every_steps == 250


def test_missing_required_field():
    (line,) = problems_of()
    assert line.startswith("effective_batch_size: missing")
    assert "whole number ≥ 1" in line


@pytest.mark.parametrize(
    ("key", "suggested"),
    [
        ("efective", "effective_batch_size"),
        ("effective", "effective_batch_size"),
        ("effectiveBatchSize", "effective_batch_size"),
        ("effective-batch-size", "effective_batch_size"),
        ("micro_bacth_size", "micro_batch_size"),
        ("micro", "micro_batch_size"),
        ("precission", "precision"),
        ("max_step", "max_steps"),
        ("save_steps", "save_every_steps"),
        ("eval_steps", "eval_every_steps"),
        ("num_train_epochs", "epochs"),
        ("dataloader_num_workers", "num_workers"),
        ("grad_norm", "max_grad_norm"),
        ("keep_last_k", "keep_last"),
        ("Seed", "seed"),
    ],
)
def test_unknown_key_suggests_the_closest_field(key, suggested):
    problems = problems_of(effective_batch_size=64, **{key: 1})
    (line,) = [p for p in problems if p.startswith(f"{key}: ")]
    assert f"unknown field; did you mean '{suggested}'" in line


def test_unknown_key_shared_by_two_fields_suggests_both():
    (line,) = problems_of(effective_batch_size=64, batch_size=8)
    assert "'effective_batch_size' or 'micro_batch_size'" in line


@pytest.mark.parametrize("key", ["foo", "lr", "warmup_steps"])
def test_unknown_key_with_no_close_field_lists_the_fields(key):
    (line,) = problems_of(effective_batch_size=64, **{key: 1})
    assert line.startswith(f"{key}: unknown field; the fields are: run_dir, effective_batch_size")
    assert "did you mean" not in line


def test_every_problem_is_reported_at_once():
    problems = problems_of(
        effective_batch_size=64,
        micro_batch_size=5,
        max_steps=10,
        save_every_steps=20,
        precision="fp8",
        device="gpu",
        keep_last=0,
        efective=64,
    )
    fields = sorted(line.split(":")[0] for line in problems)
    assert fields == [
        "device",
        "efective",
        "keep_last",
        "micro_batch_size",
        "precision",
        "save_every_steps",
    ]


def test_rules_between_fields_skip_fields_that_are_invalid():
    # effective_batch_size is wrong, so divisibility cannot be judged; save_every_steps still is.
    problems = problems_of(
        effective_batch_size="x", micro_batch_size=5, max_steps=10, save_every_steps=20
    )
    assert [line.split(":")[0] for line in problems] == [
        "effective_batch_size",
        "save_every_steps",
    ]


def test_error_message_lists_each_problem_on_its_own_line():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"effective_batch_size": 64, "seed": -1, "epochs": 0}, "run.yaml")
    message = str(info.value)
    assert message.startswith("invalid config in run.yaml (2 problem(s)):")
    assert "\n  - epochs: " in message
    assert "\n  - seed: " in message
    assert info.value.source == "run.yaml"


def test_from_dict_refuses_what_is_not_a_mapping():
    with pytest.raises(ConfigError, match="must be a mapping"):
        TrainConfig.from_dict([1, 2])
    with pytest.raises(ConfigError, match="not a field name"):
        TrainConfig.from_dict({1: 2, "effective_batch_size": 4})


def test_config_is_immutable():
    config = TrainConfig(effective_batch_size=64)
    with pytest.raises(ValidationError):
        config.effective_batch_size = 32
    assert config.effective_batch_size == 64


def test_self_is_an_ordinary_unknown_key():
    (line,) = problems_of(effective_batch_size=64, self=1)
    assert line.startswith("self: unknown field")


# -- loading --------------------------------------------------------------------------------------


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_json_and_yaml_load_equal(tmp_path):
    from_json = TrainConfig.load(
        write(
            tmp_path,
            "run.json",
            '{"effective_batch_size": 64, "micro_batch_size": 8, "max_grad_norm": null,'
            ' "memory_budget": 0.8, "device": "cpu"}',
        )
    )
    from_yaml = TrainConfig.load(
        write(
            tmp_path,
            "run.yaml",
            "effective_batch_size: 64\nmicro_batch_size: 8\nmax_grad_norm: null\n"
            "memory_budget: 0.8\ndevice: cpu\n",
        )
    )
    assert from_json == from_yaml
    assert from_json.max_grad_norm is None


def test_load_applies_overrides(tmp_path):
    path = write(tmp_path, "run.yaml", "effective_batch_size: 64\n")
    config = TrainConfig.load(path, overrides={"micro_batch_size": 4})
    assert config.micro_batch_size == 4


def test_load_error_names_the_file(tmp_path):
    path = write(tmp_path, "run.yaml", "effective_batch_size: 64\nmicro_batch_size: 5\n")
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "run.json",
            '{"effective_batch_size": 64,\n  "seed": }',
            "not valid JSON: .* line 2, column",
        ),
        ("run.yaml", "effective_batch_size: [64,\n", "not valid YAML: .* line 2"),
        ("run.yaml", "a: b: c\n", "not valid YAML: .* line 1, column 5"),
        ("run.yaml", "- 1\n- 2\n", "must hold a mapping of field: value, found a list"),
        ("run.json", "[1, 2]", "must hold a mapping of field: value, found a list"),
        ("run.yaml", "", "is empty"),
        ("run.yaml", "seed: 1\nseed: 2\n", "key 'seed' appears twice"),
        ("run.json", '{"seed": 1, "seed": 2}', "key 'seed' appears twice"),
    ],
)
def test_malformed_file_is_bad_input_naming_the_file(tmp_path, name, text, expected):
    path = write(tmp_path, name, text)
    with pytest.raises(BadInputError, match=expected) as info:
        TrainConfig.load(path)
    assert not isinstance(info.value, ConfigError)
    assert str(info.value).startswith(f"config file {path}")
    assert info.value.exit_code == 2


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(BadInputError, match="does not exist") as info:
        load_mapping(path)
    assert str(path) in str(info.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(BadInputError, match="cannot be read") as info:
        load_mapping(tmp_path)  # a folder
    assert str(tmp_path) in str(info.value)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(BadInputError, match="not UTF-8"):
        load_mapping(binary)


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(
        [
            "micro_batch_size=4",
            "max_grad_norm=null",
            "shuffle=false",
            "memory_budget=12GiB",
            "a=b=c",
        ]
    ) == {
        "micro_batch_size": 4,
        "max_grad_norm": None,
        "shuffle": False,
        "memory_budget": "12GiB",
        "a": "b=c",
    }
    with pytest.raises(BadInputError, match="field=value"):
        parse_overrides(["micro_batch_size"])


# -- saving ---------------------------------------------------------------------------------------


def test_dump_writes_resolved_json_that_round_trips(tmp_path):
    config = TrainConfig(effective_batch_size=64, micro_batch_size=8, memory_budget="12GiB")
    path = tmp_path / "run" / "config.json"
    config.dump(path)
    written = json.loads(path.read_text())
    assert written == config.model_dump(mode="json")
    assert set(written) == set(TrainConfig.model_fields)  # every default filled in
    assert TrainConfig.load(path) == config
    assert os.listdir(path.parent) == ["config.json"]  # no temporary file left behind


def test_dump_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    TrainConfig(effective_batch_size=8).dump(path)
    before = path.read_text()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        TrainConfig(effective_batch_size=16).dump(path)
    assert path.read_text() == before  # the old file is whole
    assert os.listdir(tmp_path) == ["config.json"]


@pytest.mark.parametrize(
    ("budget", "expected"),
    [("auto", 0.9), ("12GiB", 12 * 1024**3), ("16GB", 16 * 1000**3), (0.5, 0.5), (1, 1.0)],
)
def test_budget_bytes_or_fraction(budget, expected):
    value = TrainConfig(effective_batch_size=8, memory_budget=budget).budget_bytes_or_fraction()
    assert value == expected
    assert type(value) is type(expected)


# -- docs -----------------------------------------------------------------------------------------


def test_docs_equal_the_generated_reference():
    assert DOCS.read_text() == reference_markdown(), (
        "docs/config.md is stale: run `python -m steadytrain.config > docs/config.md`"
    )


def test_reference_lists_every_field():
    text = reference_markdown()
    for name in TrainConfig.model_fields:
        assert f"| `{name}` |" in text


def test_the_evaluation_cadence_keeps_its_earlier_names():
    """eval_every_steps and eval_every_epochs were evaluate_every_*: a config written with the
    earlier names loads as before (and reads back under both names); a config that gives one
    setting under both names is refused naming both."""
    from steadytrain.recipes.finetune_config import FinetuneConfig

    earlier = TrainConfig(effective_batch_size=4, evaluate_every_steps=3, evaluate_every_epochs=2)
    assert (earlier.eval_every_steps, earlier.eval_every_epochs) == (3, 2)
    assert (earlier.evaluate_every_steps, earlier.evaluate_every_epochs) == (3, 2)
    assert earlier == TrainConfig(effective_batch_size=4, eval_every_steps=3, eval_every_epochs=2)
    assert "evaluate_every_steps" not in earlier.model_dump()

    (problem,) = problems_of(effective_batch_size=4, evaluate_every_steps=3, eval_every_steps=3)
    assert (
        "evaluate_every_steps, eval_every_steps" in problem and "keep eval_every_steps" in problem
    )

    tuned = FinetuneConfig.from_dict(
        {"model_name_or_path": "m", "train_file": "t.jsonl", "evaluate_every_epochs": 2}
    )
    assert tuned.to_train_config().eval_every_epochs == 2
    with pytest.raises(ConfigError, match="evaluate_every_epochs, eval_every_epochs"):
        FinetuneConfig.from_dict(
            {
                "model_name_or_path": "m",
                "train_file": "t.jsonl",
                "evaluate_every_epochs": 2,
                "eval_every_epochs": 2,
            }
        )
