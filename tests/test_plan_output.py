"""`plan` and `estimate` as a new user reads them (issue 19, point 5): tables complete on every
path and whole when piped, counts in natural units, the overhead row for the device in question
only, and a hub id that cannot be looked up failing at once with the way to a local folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest

from steadytrain._units import format_count
from steadytrain.memory.model_shape import hub_unreachable

ROOT = Path(__file__).resolve().parent.parent
# The demo's tiny Llama: 436,352 parameters.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 262,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Output to a pipe, as `steadytrain plan ... > plan.txt` has it; no COLUMNS set."""
    base = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", *args],
        timeout=300,
        env={**base, **(env or {})},
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (7, "7"),
        (4363, "4.36k"),
        (436_352, "436k"),
        (999_999, "1M"),
        (1_234_567, "1.23M"),
        (124e6, "124M"),
        (3.21e9, "3.21B"),
        (70.6e9, "70.6B"),
        (405e9, "405B"),
    ],
)
def test_counts_in_natural_units(n, text):
    assert format_count(n) == text


def test_estimate_piped_is_whole_in_natural_units_with_this_devices_overhead(tiny):
    result = cli("estimate", str(tiny), "--seq", "128", "--device-type", "cpu", "--memory", "8GiB")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{tiny}: 436k params (llama, 2 layers" in out
    assert "0.00 B params" not in out
    (overhead,) = [line for line in out.splitlines() if "framework/allocator overhead" in line]
    # One line, not cut at 80 columns: the whole formula and the table's right border.
    assert overhead.rstrip().endswith("│") and len(overhead) > 120
    assert "512.00 MiB (runtime: torch's libraries and buffers in the process)" in overhead
    assert "CUDA" not in overhead and "Metal" not in overhead
    cuda = cli("estimate", str(tiny), "--seq", "128", "--device-type", "cuda", "--memory", "8GiB")
    assert "(runtime: the CUDA context and torch's buffers)" in cuda.stdout
    assert "Metal" not in cuda.stdout


def test_a_plan_on_the_quick_path_prints_its_row(tiny):
    result = cli("plan", str(tiny), "--effective-batch", "16", "--seq", "64", "--probe")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "without further probing" in out  # the quick path: one measured size
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 1
    assert "│ plain │    16 │     1 │" in rows[0]
    assert "◀ chosen (bound from one measured size, see below)" in rows[0]


def test_an_unknown_hub_id_offline_fails_at_once_naming_a_local_folder(tiny):
    started = time.monotonic()
    result = cli("estimate", "nobody-xyz/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    err = " ".join(result.stderr.split())
    assert "hub id 'nobody-xyz/no-such-model' is not in the local Hugging Face cache" in err
    assert "HF_HUB_OFFLINE is set (offline mode)" in err
    assert "Point at a local directory holding its config.json" in err
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 120  # no retries (the import alone takes seconds)


def test_an_unreachable_hub_is_named_without_waiting_for_retries(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    reason = hub_unreachable(timeout=2.0)
    assert reason is not None and reason.startswith("the hub (127.0.0.1) ")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable() == "HF_HUB_OFFLINE is set (offline mode)"
