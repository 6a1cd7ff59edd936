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

from steadytrain._units import format_bytes, format_count
from steadytrain.memory.estimate import cpu_runtime_bytes
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
    # 100 columns when piped (issue 25: ~190 at the natural width), the cells wrapped, not cut:
    # the whole formula, read down its cell, and every row's right border.
    assert max(len(line) for line in out.splitlines()) <= 100 and "…" not in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "framework/allocator overhead" in line)
    cell = []
    for line in lines[start:]:
        if cell and not line.startswith("│" + " " * 10):
            break
        assert line.rstrip().endswith("│")
        cell.append(line.rstrip().rstrip("│").split("│")[-1].strip())
    overhead = " ".join(cell)
    runtime = format_bytes(cpu_runtime_bytes())  # this machine's torch build's
    assert f"{runtime} (runtime: torch's libraries and buffers in the process)" in overhead
    assert "CUDA" not in overhead and "Metal" not in overhead
    cuda = cli("estimate", str(tiny), "--seq", "128", "--device-type", "cuda", "--memory", "8GiB")
    assert "(runtime: the CUDA context and torch's buffers)" in " ".join(
        line.rstrip().rstrip("│").split("│")[-1].strip() for line in cuda.stdout.splitlines()
    )
    assert "Metal" not in cuda.stdout


def test_a_plan_on_the_quick_path_prints_its_row(tiny):
    result = cli("plan", str(tiny), "--effective-batch", "16", "--seq", "64", "--probe")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "without further probing" in out  # the quick path: one measured size
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert "│ plain │    16 │     1 │" in rows[0]
    assert len([row for row in rows if "│ plain │" in row]) == 1  # one row, its cells wrapped
    last_cells = " ".join(row.rstrip().rstrip("│").split("│")[-1].strip() for row in rows)
    assert "◀ chosen (bound from one measured size, see below)" in last_cells


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


# -- issue 28: the seed-004 config on a 16 GB budget ---------------------------------------------

LLAMA_3B = {  # Llama-3.2-3B's published shape: the estimate reads it, nothing is loaded
    **TINY,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}


def test_the_seed_config_dry_run_says_bf16_fits_with_its_size_and_then_fits(tmp_path):
    """The seed's own config file (fp32 on a Mac, checkpointing on, seq 2048) with a 16 GiB
    memory_budget for an MPS device: `finetune --dry-run` says it does not fit and that `bf16:
    true` does, with the total it gives; with bf16 the dry-run says it fits."""
    model = tmp_path / "llama-3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_3B))
    text = (ROOT / "examples" / "finetune_config.json").read_text()
    text = text.replace('"meta-llama/Llama-3.2-3B"', json.dumps(str(model)))
    text = text.replace(
        '"bf16": false,', '"bf16": false, "memory_budget": "16GiB", "device": "mps",'
    )
    config = tmp_path / "config.json"
    config.write_text(text)
    over = cli("finetune", "--dry-run", "--config", str(config))
    assert over.returncode == 3, over.stderr
    said = " ".join(over.stdout.split())  # the console may wrap a long line
    assert "does not fit: needs 21.11 GiB, 5.11 GiB over 16.00 GiB (memory_budget: 16GiB" in said
    assert "`bf16: true` → 12.9 GiB of 16.0 GiB: fits" in said
    assert "`max_seq_length: 1024` → 18.8 GiB of 16.0 GiB: still over" in said
    assert "peak: estimated 21.11 GiB of 16.00 GiB: does not fit" in said
    fits = cli("finetune", "--dry-run", "--config", str(config), "--set", "bf16=true")
    assert fits.returncode == 0, fits.stderr
    assert "peak: estimated 12.91 GiB of 16.00 GiB: fits" in " ".join(fits.stdout.split())
    assert "does not fit" not in fits.stdout
