"""An out-of-memory at micro-batch 1, with every memory saver tried, in a process that shrank
earlier: no proof the run does not fit. What the larger micro-batches freed may still be held in
the process (oneDNN's kernels and caches, malloc's arenas; under an address-space limit that
counts), while a fresh process at micro-batch 1 trains. Under `steadytrain run` such a process
exits 76 and the supervisor restarts it fresh at micro-batch 1; only a process that has not
shrunk says "does not fit" (exit 3). The advice of exit 3 names what fits the model it has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKLOADS, real_oom

from steadytrain import TrainConfig, Trainer
from steadytrain.errors import DoesNotFitError, FreshProcessOutOfMemory
from steadytrain.run.env import ENV_SUPERVISED
from steadytrain.telemetry.files import read_jsonl

ONEDNN_OOM = "could not create a primitive"  # oneDNN's words when a kernel cannot get memory


def regression(n: int = 32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, list(zip(x, x.sum(1, keepdim=True), strict=True))


def fit(tmp_path: Path, loss, micro: int, model=None, data=None):
    if model is None:
        model, data = regression()
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        micro_batch_size=micro,
        max_steps=2,
        save_every_steps=1,
        device="cpu",
        log_every_steps=100,
    )
    return Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), loss, data, config).fit()


def shrinking_then_held(at_one_fails):
    """A loss that fits only micro-batch 1 (larger ones run out), and whose micro-batch 1 runs
    out when `at_one_fails(process_ran_larger)` says so."""
    ran_larger = {"yes": False}

    def loss(model, batch):
        x, y = batch
        if len(x) > 1:
            ran_larger["yes"] = True
            raise RuntimeError(ONEDNN_OOM)
        if at_one_fails(ran_larger["yes"]):
            raise RuntimeError(ONEDNN_OOM)
        return torch.nn.functional.mse_loss(model(x), y)

    return loss


def test_a_supervised_process_that_shrank_then_fails_at_1_hands_over_exit_76(tmp_path, monkeypatch):
    """Shrunk 16 → 1 in this process, then out of memory at micro-batch 1: exit 76 (a fresh
    process at micro-batch 1 decides), not exit 3."""
    monkeypatch.setenv(ENV_SUPERVISED, "1")
    loss = shrinking_then_held(lambda ran_larger: ran_larger)
    with pytest.raises(FreshProcessOutOfMemory) as err:
        fit(tmp_path, loss, micro=16)
    assert err.value.exit_code == 76
    text = str(err.value)
    assert "shrank from micro-batch 16" in text and "fresh process" in text
    assert "Exiting 76" in text and not text.startswith("does not fit")
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [(e["old"], e["new"]) for e in events if e["event"] == "shrink"] == [
        (16, 8),
        (8, 4),
        (4, 2),
        (2, 1),
    ]


def test_a_process_that_did_not_shrink_and_fails_at_1_does_not_fit_exit_3(tmp_path, monkeypatch):
    """A fresh process at micro-batch 1 (the supervisor's cap after that exit 76) that runs out
    has not shrunk: its failure is the proof, exit 3, even with an earlier attempt's shrinks in
    the state it resumed (`shrink_count` counts those; they left nothing in this process)."""
    monkeypatch.setenv(ENV_SUPERVISED, "1")
    with pytest.raises(DoesNotFitError) as err:
        fit(tmp_path, shrinking_then_held(lambda ran_larger: True), micro=1)
    assert err.value.exit_code == 3
    assert "shrank" not in str(err.value)


def test_the_fresh_process_resumed_after_a_shrink_says_exit_3_not_76_again(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SUPERVISED, "1")
    first = shrinking_then_held(lambda ran_larger: False)
    fit_one = fit(tmp_path, first, micro=16)  # shrinks to 1 and trains both steps
    assert fit_one.micro_batch_size == 1 and fit_one.steps == 2
    model, data = regression()
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        micro_batch_size=1,
        max_steps=3,  # one step more than the checkpoint: resumed, shrink_count 4
        save_every_steps=1,
        device="cpu",
        log_every_steps=100,
    )
    with pytest.raises(DoesNotFitError) as err:
        Trainer(
            model,
            lambda p: torch.optim.SGD(p, lr=0.05),
            shrinking_then_held(lambda ran_larger: True),
            data,
            config,
        ).fit()
    assert err.value.exit_code == 3


def test_unsupervised_a_process_that_shrank_says_exit_3_and_that_a_fresh_one_may_fit(
    tmp_path, monkeypatch
):
    """Nothing restarts an unsupervised process: it says exit 3, and that a fresh process at
    micro-batch 1 (or `steadytrain run`) may fit where this one, which shrank, did not."""
    monkeypatch.delenv(ENV_SUPERVISED, raising=False)
    with pytest.raises(DoesNotFitError) as err:
        fit(tmp_path, shrinking_then_held(lambda ran_larger: ran_larger), micro=16)
    text = str(err.value)
    assert err.value.exit_code == 3
    assert "this process shrank from micro-batch 16" in text
    assert "micro_batch_size 1" in text and "steadytrain run" in text


class Convolutional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def test_does_not_fit_advice_names_what_fits_a_vision_model(tmp_path):
    """A convolutional model is told of its image size, not of sequence length, LoRA rank or a
    4-bit base; a precision in use is not offered."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(16, 3, 8, 8, generator=g)
    data = list(zip(images, torch.randn(16, 1, generator=g), strict=True))
    torch.manual_seed(0)
    with pytest.raises(DoesNotFitError) as err:
        fit(tmp_path, shrinking_then_held(lambda ran: True), 1, Convolutional(), data)
    helps = str(err.value).split("what helps:")[1]
    assert "smaller images" in helps and "input size" in helps
    assert "sequence" not in helps and "LoRA" not in helps and "4-bit" not in helps
    assert "precision 'bf16' or 'fp16'" in helps  # the run is in fp32
    assert "smaller model" in helps and "closing other programs" in helps


def test_does_not_fit_advice_offers_no_precision_already_in_use(tmp_path):
    from steadytrain.engine.step import what_helps

    model = Convolutional()
    assert "bf16" not in what_helps(model, "bf16", "cpu")
    assert "fp16" not in what_helps(model, "fp16", "cuda")
    lora = torch.nn.ModuleDict({"embed": torch.nn.Embedding(8, 4), "lora_A": torch.nn.Linear(4, 2)})
    words = what_helps(lora, "bf16", "cuda")
    assert "max_seq_length" in words and "LoRA rank" in words and "4-bit" in words
    assert "4-bit" not in what_helps(lora, "fp32", "cpu")  # bitsandbytes' 4-bit needs CUDA


@pytest.mark.slow
def test_a_resnet_under_an_address_space_cap_trains_to_its_last_step_under_steadytrain_run(
    tmp_path: Path,
):
    """A small ResNet (convolutions, BatchNorm2d, residual blocks) started at micro-batch 16
    under an address-space cap a little above its size, with glibc's default malloc, under
    `steadytrain run`: the out-of-memory errors (the allocator's and oneDNN's) shrink it or hand
    it to fresh processes (exit 76), and it reaches its last step instead of exit 3."""
    run_dir = tmp_path / "run"
    proc = supervised_resnet(
        run_dir, "--image", "64", "--steps", "2", "--limit-mib", "40", timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    assert "does not fit" not in proc.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    assert any(e["event"] == "oom" for e in events)  # the cap was felt
    assert all(r["exit_code"] == 76 for r in events if r["event"] == "restart")
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 2


def supervised_resnet(run_dir: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """`steadytrain run` of tests/workloads/tiny_resnet.py, with glibc's default malloc."""
    workload = [sys.executable, str(WORKLOADS / "tiny_resnet.py"), str(run_dir), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "STEADYTRAIN_"))}
    return subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
            *("--backoff-initial", "0.05", "--", *workload),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )


def test_a_resnet_that_shrank_to_1_and_still_fails_is_restarted_fresh_and_finishes(
    tmp_path: Path,
):
    """The pattern measured on resnet18 under a cap (`HeldAfterShrink`): the first process halves
    16 → 1 and still runs out at 1; it exits 76 (not 3), and the fresh process the supervisor
    starts at micro-batch 1 trains every step."""
    run_dir = tmp_path / "run"
    proc = supervised_resnet(
        run_dir, "--image", "16", "--steps", "2", "--held-after-shrink", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "does not fit:" not in proc.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    shrinks = [(e["old"], e["new"]) for e in events if e["event"] == "shrink"]
    assert shrinks == [(16, 8), (8, 4), (4, 2), (2, 1)]
    restarts = [e for e in events if e["event"] == "restart"]
    assert [(r["exit_code"], r["max_micro_batch"]) for r in restarts] == [(76, 1)]
    assert all(real_oom(e["error"]) for e in events if e["event"] == "oom")
    assert json.loads((run_dir / "result.json").read_text()) == {"steps": 2, "micro_batch_size": 1}
