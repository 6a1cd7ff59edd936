"""`steadytrain demo`: run end to end through the command line, it builds a tiny model offline,
fine-tunes it under the supervisor, survives a real SIGKILL of the training process by resuming
from the checkpoint (the first resumed step's loss equal to the recorded one), lowers the
held-out perplexity, and leaves an adapter peft loads and a report. Mistakes in its arguments
exit 2 with the thing named and nothing deleted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch

from steadytrain.recipes.demo import MARKER, chunk_text
from steadytrain.telemetry.files import read_jsonl

STEPS = 60  # the default is 150; 60 still leaves a checkpoint (20), a kill and a resume


def steadytrain_demo(*args: str) -> subprocess.CompletedProcess:
    return forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "demo", *args],
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def message(done: subprocess.CompletedProcess) -> str:
    """stderr with the console's line wrapping undone."""
    return " ".join(done.stderr.split())


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("demo") / "runs" / "demo"
    return run_dir, steadytrain_demo(str(run_dir), "--steps", str(STEPS), "--device", "cpu")


def test_the_demo_runs_to_the_end_and_the_perplexity_falls(demo):
    run_dir, done = demo
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    summary = json.loads((run_dir / "demo_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["device"] == "cpu"
    assert summary["after"]["perplexity"] < summary["before"]["perplexity"]
    # The base scored again with the adapter switched off is the base scored before training.
    assert summary["base_rescored"]["loss"] == pytest.approx(summary["before"]["loss"], rel=1e-6)
    assert summary["train_records"] > 0 and summary["eval_records"] > 0
    # The fine-tune planned its own micro-batch (micro_batch_size auto) before its first step.
    plan = summary["plan"]
    assert plan["micro_batch_size"] * plan["accumulation"] == plan["effective_batch_size"] == 16
    config = json.loads((run_dir / "finetune.json").read_text())
    assert config["micro_batch_size"] == "auto"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert {m["micro_batch_size"] for m in metrics} == {plan["micro_batch_size"]}
    assert "plan: micro-batch" in done.stdout + done.stderr
    for step in ("1/7", "4/7  fine-tune", "5/7", "7/7"):
        assert step in done.stdout, step
    assert summary["sample"]["completion"] and summary["sample"]["completion"] in done.stdout


def test_a_real_sigkill_is_survived_by_resuming_from_the_checkpoint(demo):
    run_dir, done = demo
    assert done.returncode == 0, done.stdout + done.stderr
    killed = json.loads((run_dir / "demo_summary.json").read_text())["interruption"]
    assert killed["signal"] == "SIGKILL" and killed["restarts"] == 1
    checkpoint, at = killed["checkpoint_step"], killed["killed_at_step"]
    assert 0 < checkpoint < at < STEPS
    assert killed["resumed_at_step"] == checkpoint
    assert f"killed the training process at step {at} (SIGKILL, pid {killed['pid']})" in (
        done.stdout
    )
    assert f"it resumes from the checkpoint at step {checkpoint}" in done.stdout

    events = read_jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert names.count("restart") == 1
    kill = names.index("restart")
    assert "checkpoint" in names[:kill]
    first_checkpoint = next(e for e in events if e["event"] == "checkpoint")
    assert first_checkpoint["step"] <= checkpoint
    restart = events[kill]
    assert restart["signal"] == "SIGKILL" and restart["step"] == checkpoint
    resume = next(e for e in events[kill:] if e["event"] == "resume")
    assert resume["step"] == checkpoint
    # The first step after the resume proves the state came back: on CPU, the same loss bit
    # for bit as the one the checkpoint recorded for it.
    continuity = next(e for e in events[kill:] if e["event"] == "continuity")
    assert continuity["checked"] and continuity["equal"]
    assert continuity["loss"] == continuity["expected"] == killed["continuity"]["loss"]
    assert [e["step"] for e in events if e["event"] == "fit_end"] == [STEPS]


def test_the_adapter_loads_in_peft_and_the_report_is_written(demo):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, done = demo
    assert done.returncode == 0, done.stdout + done.stderr
    final = run_dir / "final"
    assert (final / "adapter_model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "base")
    ids = torch.tensor([tokenizer("Return the number of items.")["input_ids"]])
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base").eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, final).eval()
        after = model(input_ids=ids).logits
    assert not torch.equal(before, after)

    html = (run_dir / "report.html").read_text()
    assert html.startswith("<!") and "restart" in html
    assert f"wrote {run_dir / 'report.html'}" in done.stdout


def test_run_dir_that_is_a_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "demo"
    path.write_text("not a folder")
    done = steadytrain_demo(str(path))
    assert done.returncode == 2, done.stderr
    assert f"RUN_DIR: {path} is a file, not a folder" in message(done)
    assert "Traceback" not in done.stderr
    assert path.read_text() == "not a folder"


def test_a_folder_in_use_is_refused_and_force_deletes_only_a_demo_folder(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    done = steadytrain_demo(str(mine))
    assert done.returncode == 2 and "exists and is not empty" in message(done), done.stderr
    assert "--force" in message(done)
    done = steadytrain_demo(str(mine), "--force")
    assert done.returncode == 2 and f"no {MARKER} in it" in message(done), done.stderr
    assert (mine / "notes.txt").read_text() == "keep me"

    # An earlier demo's folder with a device this machine lacks: refused before anything is
    # deleted.
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / MARKER).write_text("")
    done = steadytrain_demo(str(earlier), "--force", "--device", "cuda:7")
    assert done.returncode == 2 and "cuda" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and (earlier / MARKER).exists()


def test_bad_settings_are_refused_before_anything_is_written(tmp_path):
    done = steadytrain_demo(str(tmp_path / "d"), "--steps", "3", "--threads", "0")
    assert done.returncode == 2
    assert "--steps: must be a whole number of at least 10" in message(done)
    assert "--threads: must be a whole number >= 1" in message(done)
    assert not (tmp_path / "d").exists()


def test_chunks_stay_within_the_byte_limit():
    text = "naïve café " * 40 + "x" * 300 + " end of the docstring text here"
    chunks = chunk_text(text, 126)
    assert all(20 <= len(c.encode()) <= 126 for c in chunks)
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")
