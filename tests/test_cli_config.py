"""`steadytrain config FILE [--set field=value]` and `--reference`, run as a user runs them.

The cases in CASES are real `python -m steadytrain.cli` processes, started together because each
one spends seconds importing torch; the rest call `main()` in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steadytrain.cli import main
from steadytrain.config import reference_markdown

FILES = {
    "good.yaml": "effective_batch_size: 64\nmicro_batch_size: 8\nseed: 3\n",
    "bad.yaml": (
        "effective_batch_size: 64\n"
        "micro_batch_size: 5\n"  # does not divide 64
        "epochs: three\n"  # wrong type
        "efective: 64\n"  # unknown key
    ),
}

CASES = {
    "good": ["good.yaml"],
    "bad": ["bad.yaml"],
    "missing": ["missing.yaml"],
    "set": ["good.yaml", "--set", "micro_batch_size=4", "--set", "max_grad_norm=null"],
    "reference": ["--reference"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("cli")
    for name, text in FILES.items():
        (folder / name).write_text(text)
    started = {
        case: subprocess.Popen(
            [sys.executable, "-m", "steadytrain.cli", "config", *args],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case, args in CASES.items()
    }
    done = {}
    for case, process in started.items():
        out, err = process.communicate(timeout=120)
        err = " ".join(err.split())  # joined again where rich wrapped it
        done[case] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def assert_clean_failure(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert run.stdout == ""


def test_good_file_prints_the_resolved_config(runs):
    run = runs["good"]
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert resolved["effective_batch_size"] == 64
    assert resolved["micro_batch_size"] == 8
    assert resolved["seed"] == 3
    assert resolved["save_every_steps"] == 250  # defaults filled in
    assert resolved["max_grad_norm"] is None  # no clipping unless asked (docs/config.md)


def test_bad_file_exits_2_naming_every_field(runs):
    run = runs["bad"]
    assert_clean_failure(run)
    assert "bad.yaml" in run.stderr
    assert "3 problem(s)" in run.stderr
    for field in ("micro_batch_size", "epochs", "efective"):
        assert f"- {field}: " in run.stderr
    assert "'effective_batch_size'" in run.stderr  # the suggestion for the typo


def test_missing_file_exits_2_naming_the_path(runs):
    run = runs["missing"]
    assert_clean_failure(run)
    assert "missing.yaml" in run.stderr
    assert "does not exist" in run.stderr


def test_set_overrides_with_yaml_values(runs):
    run = runs["set"]
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert resolved["micro_batch_size"] == 4
    assert resolved["max_grad_norm"] is None


def test_reference_prints_the_markdown_reference(runs):
    run = runs["reference"]
    assert run.returncode == 0, run.stderr
    assert run.stdout == reference_markdown()


# -- in this process ------------------------------------------------------------------------------


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["config", *args])
    out, err = capsys.readouterr()
    return info.value.code, out, " ".join(err.split())  # joined again where rich wrapped it


@pytest.fixture
def good_file(tmp_path) -> str:
    path = tmp_path / "good.yaml"
    path.write_text(FILES["good.yaml"])
    return str(path)


def test_set_values_are_validated_like_the_file(capsys, good_file):
    code, out, err = run_main(
        capsys, good_file, "--set", "micro_batch_size=6", "--set", "keep_lst=3"
    )
    assert (code, out) == (2, "")
    assert "- micro_batch_size: " in err
    assert "- keep_lst: unknown field" in err
    assert "'keep_last'" in err


def test_set_without_equals_exits_2(capsys, good_file):
    code, out, err = run_main(capsys, good_file, "--set", "micro_batch_size")
    assert (code, out) == (2, "")
    assert "field=value" in err


def test_malformed_file_exits_2(capsys, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"effective_batch_size": 64,')
    code, out, err = run_main(capsys, str(path))
    assert (code, out) == (2, "")
    assert "broken.json" in err
    assert "not valid JSON" in err


def test_a_long_path_in_an_error_is_printed_whole(capsys, tmp_path):
    """Off a terminal the message is not folded at 80 columns: the path can be copied."""
    folder = tmp_path / ("a" * 40) / ("b" * 40)
    folder.mkdir(parents=True)
    path = folder / "broken.json"
    path.write_text('{"effective_batch_size": 64,')
    with pytest.raises(SystemExit) as info:
        main(["config", str(path)])
    assert info.value.code == 2
    assert str(path) in capsys.readouterr().err


def test_no_file_exits_2_with_usage(capsys):
    code, out, err = run_main(capsys)
    assert (code, out) == (2, "")
    assert "steadytrain config FILE" in err
