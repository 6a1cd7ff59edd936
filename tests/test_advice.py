"""The advisor (issue 28): what would make a run fit, worked out with the estimator on the run's
own model and settings, said in the config's keys or the command line's flags with the total
each gives; the fine-tune config's saver keys; `--dry-run`'s budget; `--memory` meaning one
thing to `estimate` and `plan`; and fp16 on MPS refused where the GradScaler cannot step.

In-process and cheap: the Llama-3.2-3B shape is built on the meta device (no weights)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_estimate import ALL7, llama_3b, tiny
from tiny_models import save_byte_llama

from steadytrain.cli.memory_commands import estimate_command, plan_command
from steadytrain.device import resolve_device
from steadytrain.device.testing import SCALER_CANNOT_STEP, FakeCUDABackend, FakeMPSBackend
from steadytrain.engine import resolve_precision
from steadytrain.errors import BadInputError
from steadytrain.memory.advice import CONFIG, FLAGS, LEAST_SAVING, advise, lines
from steadytrain.memory.estimate import Settings, estimate
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.telemetry.files import read_jsonl

GiB = 2**30
# The seed-004 config's settings as the estimator reads them: LoRA r16 on all seven projections,
# fp32 weights and compute, micro-batch 1 × 2,048 tokens, checkpointing on, AdamW, on MPS.
SEED = Settings(
    method="lora",
    lora_targets=ALL7,
    lora_dropout=0.05,
    seq=2048,
    checkpointing=True,
    device_type="mps",
)
SEED_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "finetune_config.json"


def seed_config(tmp_path: Path, **changes) -> FinetuneConfig:
    """The seed's config file with the 3B shape's config.json as its model (no weights)."""
    llama_3b().save_pretrained(tmp_path / "llama-3b")
    return FinetuneConfig.load(
        SEED_CONFIG, {"model_name_or_path": str(tmp_path / "llama-3b"), **changes}
    )


def test_the_seed_on_16_gib_is_told_bf16_with_its_size():
    result = estimate(llama_3b(), SEED)
    assert result.total > 16 * GiB  # 21.1 GiB: does not fit
    advice = advise(llama_3b(), SEED, 16 * GiB, CONFIG, accumulation=8)
    first = advice[0]
    assert first.fits and first.keys(CONFIG) == "`bf16: true`"
    bf16 = dataclasses.replace(SEED, precision="bf16", weights_dtype="bf16")
    assert first.total == estimate(llama_3b(), bf16).total  # the size is the estimator's
    assert lines(advice)[0].startswith(
        f"`bf16: true` → {first.total / GiB:.1f} GiB of 16.0 GiB: fits"
    )
    # the rest lower the total but leave it over, and say so with their sizes
    rest = {a.keys(CONFIG): a for a in advice[1:]}
    assert "`max_seq_length: 1024`" in rest and not rest["`max_seq_length: 1024`"].fits
    assert all(a.total < result.total for a in advice)
    assert all(
        re.search(r"→ \d+\.\d GiB of 16\.0 GiB: still over$", a.describe()) for a in advice[1:]
    )
    # never what is set already: checkpointing is on, so it is not advised
    assert not any("gradient_checkpointing" in a.keys(CONFIG) for a in advice)
    # the command line's words for the same knob
    flags = advise(llama_3b(), SEED, 16 * GiB, FLAGS)
    assert flags[0].keys(FLAGS) == "`--precision bf16 --weights-dtype bf16`"
    assert not any("--checkpointing" in a.keys(FLAGS) for a in flags)


def test_where_no_knob_fits_alone_the_combination_that_fits_leads():
    """A 16 GB Mac's Metal working set, 12 GiB: bf16 alone leaves 12.9 GiB; with the chunked
    loss (which changes nothing trained) it is 11.0 GiB, ahead of a shorter sequence."""
    advice = advise(llama_3b(), SEED, 12 * GiB, CONFIG, accumulation=8)
    assert advice[0].keys(CONFIG) == "`bf16: true`, `chunked_loss: true`"
    both = dataclasses.replace(SEED, precision="bf16", weights_dtype="bf16", chunked_loss=True)
    assert advice[0].fits and advice[0].total == estimate(llama_3b(), both).total
    assert advice[1].keys(CONFIG) == "`bf16: true`" and not advice[1].fits


def test_a_knob_that_saves_under_one_percent_of_the_need_is_not_listed():
    """A toy model's total is mostly the runtime's fixed overhead: checkpointing, compiling,
    LoRA and the 8-bit optimizer each lower it, by under 1 %, and are not advised; bf16 saves
    more and is."""
    settings = Settings(seq=256, device_type="cuda")
    total = estimate(tiny(), settings).total
    said = {a.keys(FLAGS): total - a.total for a in advise(tiny(), settings, 2**20, FLAGS)}
    assert list(said) == ["`--precision bf16`"], said
    assert said["`--precision bf16`"] >= LEAST_SAVING * total
    for changes in (
        {"checkpointing": True},
        {"compiled": True},
        {"method": "lora"},
        {"optimizer": "adamw8bit"},
    ):
        lower = estimate(tiny(), dataclasses.replace(settings, **changes)).total
        assert 0 < total - lower < LEAST_SAVING * total, changes  # saves, too little to say


def test_the_shorter_sequence_advised_is_the_longest_that_fits_not_a_halving():
    """A long-context run a little over its budget is told the longest sequence that fits, in
    whole steps of 1,024 tokens, not half its length (36,864 tokens told 18,432 where about
    32,768 fit); where nothing shorter fits, half of it, said as still over."""
    from test_estimate import mid

    from steadytrain.memory.advice import SEQ_STEP

    long = Settings(
        method="lora",
        seq=36864,
        checkpointing=True,
        chunked_loss=True,
        precision="bf16",
        weights_dtype="bf16",
        device_type="cuda",
    )
    budget = estimate(mid(), dataclasses.replace(long, seq=32768)).total
    assert estimate(mid(), long).total > budget

    def advised(budget: int) -> tuple[int, object]:
        advice = {a.knobs[0].changes.get("seq"): a for a in advise(mid(), long, budget, FLAGS)}
        seq = next(n for n in advice if n is not None)
        return seq, advice[seq]

    seq, advice = advised(budget)
    assert seq % SEQ_STEP == 0 and 30720 <= seq < 36864 and advice.fits, seq
    assert advice.total == estimate(mid(), dataclasses.replace(long, seq=seq)).total <= budget
    seq, advice = advised(2**30)  # under the weights: no length fits
    assert seq == 18432 and not advice.fits


def test_what_a_run_has_set_is_never_advised():
    done = dataclasses.replace(SEED, precision="bf16", weights_dtype="bf16", chunked_loss=True)
    said = " ".join(a.keys(CONFIG) for a in advise(llama_3b(), done, 4 * GiB, CONFIG))
    assert (
        "bf16" not in said and "chunked_loss" not in said and "gradient_checkpointing" not in said
    )


def test_a_micro_batch_knob_keeps_the_effective_batch_in_the_configs_words():
    many = dataclasses.replace(SEED, micro_batch_size=8, precision="bf16", weights_dtype="bf16")
    advice = advise(llama_3b(), many, 16 * GiB, CONFIG, accumulation=1)
    (micro,) = [a for a in advice if "per_device_train_batch_size" in a.keys(CONFIG)]
    size = int(re.search(r"per_device_train_batch_size: (\d+)", micro.keys(CONFIG))[1])
    assert size < 8 and f"`gradient_accumulation_steps: {8 // size}`" in micro.keys(CONFIG)


# -- the fine-tune: its keys, its start-up line, its dry-run --------------------------------


def test_the_finetune_start_up_line_names_bf16_with_its_size(tmp_path):
    from steadytrain.recipes.finetune_memory import memory_line

    line = memory_line(seed_config(tmp_path), "mps", 16 * GiB)
    assert "does not fit" in line
    assert re.search(r"`bf16: true` → 12\.\d GiB of 16\.0 GiB: fits", line), line
    assert "lower per_device_train_batch_size" not in line  # it is 1 already


def test_the_chunked_loss_has_a_config_key_the_loss_and_the_estimate_follow(tmp_path):
    from steadytrain.recipes.finetune_memory import estimate_finetune, loss_for

    assert loss_for(seed_config(tmp_path)).chunk_tokens is None  # auto: off at the start
    assert loss_for(seed_config(tmp_path, chunked_loss=True)).chunk_tokens == 1024
    assert loss_for(seed_config(tmp_path, chunked_loss=512)).chunk_tokens == 512
    never = loss_for(seed_config(tmp_path, chunked_loss=False))
    assert never.chunk_tokens is None and never.can_chunk(torch.nn.Linear(1, 1)) is False
    plain = estimate_finetune(seed_config(tmp_path), "mps", 16 * GiB)
    chunked = estimate_finetune(seed_config(tmp_path, chunked_loss=True), "mps", 16 * GiB)
    assert chunked.settings.chunked_loss and chunked.total < plain.total
    with pytest.raises(Exception, match="chunked_loss"):
        seed_config(tmp_path, chunked_loss="sometimes")


def test_the_dry_run_honours_memory_budget_and_shows_what_the_run_will_do(tmp_path, capsys):
    """300 MiB on this machine's device: the run says "does not fit", so must the dry-run; with
    micro_batch_size: auto it shows the planned micro-batch and savers."""
    from rich.console import Console

    from steadytrain.cli.finetune_commands import dry_run

    config = seed_config(tmp_path, memory_budget="300MiB", micro_batch_size="auto", bf16=True)
    console = Console(record=True, width=300)
    assert dry_run(config, console) == 3
    out = capsys.readouterr().out
    assert "budget from memory_budget: 300MiB" in out
    assert "micro-batch 1 × 8 accumulation (micro_batch_size: auto" in out
    assert "savers: activation checkpointing on; chunked loss on (1024 tokens a chunk)" in out
    assert re.search(r"peak: estimated [\d.]+ GiB of 300\.00 MiB: does not fit", out), out
    assert "over 300.00 MiB (memory_budget: 300MiB)" in console.export_text()


def test_the_dry_run_says_a_missing_data_file_as_the_run_would(tmp_path, capsys):
    """The run stops on a missing train_file (exit 2); its dry-run says so, naming the key."""
    from steadytrain.cli.finetune_commands import dry_run

    missing = tmp_path / "nope.jsonl"
    dry_run(seed_config(tmp_path, train_file=str(missing), bf16=True))
    out = capsys.readouterr().out
    assert f"data: train_file: data file {missing} does not exist; check the path" in out, out


def steadytrain(capsys, *args: str) -> tuple[int, str]:
    """`steadytrain ARGS` in this process: the exit code and what it printed (out and err)."""
    from steadytrain.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    out = capsys.readouterr()
    return code, out.out + out.err


def tiny_finetune(tmp_path: Path) -> Path:
    """A tiny Llama saved with the byte tokenizer, 16 records and a one-step config file."""
    save_byte_llama(tmp_path / "tiny")
    records = [json.dumps({"prompt": f"{i}+1=", "completion": f"{i + 1}"}) for i in range(16)]
    (tmp_path / "train.jsonl").write_text("\n".join(records) + "\n")
    config = {
        "model_name_or_path": str(tmp_path / "tiny"),
        "train_file": str(tmp_path / "train.jsonl"),
        "max_seq_length": 32,
        "max_steps": 1,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "gradient_checkpointing": True,
        "device": "cpu",
        "lora": {"r": 4},
    }
    (tmp_path / "finetune.json").write_text(json.dumps(config))
    return tmp_path / "finetune.json"


def test_the_dry_run_and_the_run_give_one_answer_at_a_budget_near_the_need(tmp_path, capsys):
    """memory_budget is what the process may use in total. Just under the estimate at
    micro-batch 1 with every saver the config allows, the dry-run says exit 3 and the run
    stops with exit 3 before loading anything, naming memory_budget (it trained over its
    budget before); just over it, both say exit 0, and the run trains at the micro-batch the
    dry-run showed."""
    from steadytrain.recipes.finetune_memory import last_rung

    file = tiny_finetune(tmp_path)
    need = last_rung(FinetuneConfig.load(file), "cpu", None).total
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for budget, code in ((need - 2**20, 3), (need + 2**20, 0)):
            given = ("--config", str(file), "--set", f"memory_budget={budget}B")
            out = f"output_dir={tmp_path / str(code)}"
            dry, said = steadytrain(capsys, "finetune", "--dry-run", *given, "--set", out)
            assert dry == code, said
            assert "micro-batch 1 × 4 accumulation (per_device_train_batch_size" in said, said
            ran, told = steadytrain(capsys, "finetune", *given, "--set", out)
            assert ran == code, told
            if code == 3:
                told = " ".join(told.split())
                assert "memory_budget: the estimate at micro-batch 1 with every memory" in told
                assert "or a larger `memory_budget`" in told, told
                assert not (tmp_path / "3").exists()  # stopped before anything was written
            else:
                steps = read_jsonl(tmp_path / "0" / "metrics.jsonl")
                assert {s["micro_batch_size"] for s in steps} == {1}, steps
                # the run records its data's lengths, as the dry-run found them
                events = read_jsonl(tmp_path / "0" / "events.jsonl")
                (lengths,) = [e for e in events if e["event"] == "data_lengths"]
                longest = re.search(r"the longest training sample is (\d+) tokens", said)
                assert longest and lengths["longest_sample"] == int(longest[1]), said
                assert lengths["max_seq_length"] == 32 and lengths["samples"] == 16
    finally:
        torch.set_num_threads(threads)


# -- the supervisor's last word --------------------------------------------------------------


def test_the_supervisors_advice_reads_the_runs_config_and_budget(tmp_path):
    from steadytrain.recipes.finetune_memory import run_advice

    config = seed_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_config.json").write_text(json.dumps(config.resolved()))
    start = {"event": "fit_start", "step": 0, "device": "mps", "budget": 16 * GiB}
    (run / "events.jsonl").write_text(json.dumps(start) + "\n")
    said = run_advice(run, ["activation_checkpointing"])
    assert said[0].startswith("at micro-batch 1 the estimate is 21.11 GiB of 16.00 GiB")
    assert re.match(r"`bf16: true` → 12\.\d GiB of 16\.0 GiB: fits", said[1]), said
    assert run_advice(tmp_path / "no-such-run", []) == []


# -- --memory X: one meaning ------------------------------------------------------------------


def test_estimate_and_plan_take_the_same_budget_from_memory(tmp_path, capsys):
    """A budget 2 % above the estimate's total at micro-batch 1: estimate says it fits, and the
    plan (from the estimate, on MPS) takes that micro-batch against the same budget, not 75 %
    of it."""
    tiny(layers=4).save_pretrained(tmp_path)
    options = {"seq": 256, "device_type": "mps", "precision": "fp32"}
    total = estimate(tiny(layers=4), Settings(**options)).total
    memory = f"{int(total * 1.02)}B"
    assert estimate_command(str(tmp_path), memory=memory, json_output=True, **options) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["fits"] and said["total_bytes"] == total
    done = plan_command(
        str(tmp_path), 1, memory=memory, checkpointing="off", json_output=True, **options
    )
    plan = json.loads(capsys.readouterr().out)
    assert done == 0, plan["reasons"]
    assert plan["limit"] == int(total * 1.02) and plan["predicted_peak"] == total


# -- fp16 on MPS ------------------------------------------------------------------------------


def test_fp16_on_mps_whose_grad_scaler_cannot_step_is_refused_with_the_alternative():
    mps = FakeMPSBackend(scaler_steps=False)
    device = resolve_device("mps", backends={"mps": mps, "cuda": FakeCUDABackend([], built=False)})
    with pytest.raises(BadInputError) as refused:
        resolve_precision("fp16", device)
    said = str(refused.value)
    assert "GradScaler" in said and "use one of: bf16, fp32" in said
    assert resolve_precision("bf16", device).name == "bf16"


def test_the_mps_backends_fp16_probe_steps_a_grad_scaler(monkeypatch):
    """The real backend's probe: for fp16 it steps a GradScaler on the device (here a stand-in
    that fails as a torch without the MPS unscale kernel does); bf16 needs none."""
    from steadytrain.device import mps
    from steadytrain.device.autocast import check_autocast

    stepped, real_step = [], mps.step_grad_scaler

    def cannot_step(device):
        stepped.append(device.type)
        raise NotImplementedError(SCALER_CANNOT_STEP)

    monkeypatch.setattr(mps, "run_autocast_matmul", lambda device, dtype: dtype)
    monkeypatch.setattr(mps, "step_grad_scaler", cannot_step)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    backend = mps.MPSBackend()
    assert not check_autocast(torch.float16, lambda d: backend.autocast_probe(0, d)).works
    assert check_autocast(torch.bfloat16, lambda d: backend.autocast_probe(0, d)).works
    assert stepped == ["mps"]
    real_step(torch.device("cpu"))  # the step itself, where the scaler can run


def test_estimate_of_a_config_file_takes_its_budget_and_advises_in_its_keys(tmp_path, capsys):
    config = seed_config(tmp_path, memory_budget="16GiB", device="mps")
    file = tmp_path / "finetune.json"
    file.write_text(json.dumps(config.resolved()))
    assert estimate_command(str(file), json_output=True) == 3
    said = json.loads(capsys.readouterr().out)
    assert said["budget_bytes"] == 16 * GiB and said["budget_source"] == "memory_budget: 16GiB"
    assert said["settings"]["device_type"] == "mps"
    assert re.match(r"`bf16: true` → 12\.\d GiB of 16\.0 GiB: fits", said["advice"][0])


def test_a_plan_where_nothing_fits_ends_with_the_advice_in_flags(tmp_path, capsys):
    llama_3b().save_pretrained(tmp_path)
    options = {"seq": 2048, "method": "lora", "lora_targets": ALL7, "device_type": "mps"}
    assert plan_command(str(tmp_path), 8, memory="16GiB", json_output=True, **options) == 3
    advice = json.loads(capsys.readouterr().out)["advice"]
    assert re.match(
        r"`--precision bf16 --weights-dtype bf16` → \d+\.\d GiB of 16\.0 GiB: fits", advice[0]
    )
    assert not any("--checkpointing" in line or "--chunked-loss" in line for line in advice)


def test_the_dry_run_says_the_longest_max_seq_length_the_run_does_not_refuse(tmp_path, capsys):
    """The dry-run says the longest max_seq_length one sample of which fits the budget with every
    saver the config allows: the run starts at that length and refuses 1,024 tokens more (the
    same estimate, `finetune_memory.refusal`), before a long-document user loads anything."""
    from steadytrain.cli.finetune_commands import dry_run
    from steadytrain.recipes.finetune_memory import refusal, target

    config = seed_config(tmp_path, memory_budget="16GiB", micro_batch_size="auto", bf16=True)
    dry_run(config)
    found = re.search(
        r"longest max_seq_length for this budget: ([\d,]+) tokens", capsys.readouterr().out
    )
    assert found, "no longest max_seq_length line"
    longest = int(found.group(1).replace(",", ""))
    assert longest % 1024 == 0 and longest > config.max_seq_length

    def refused(length: int) -> bool:
        changed = seed_config(
            tmp_path,
            memory_budget="16GiB",
            micro_batch_size="auto",
            bf16=True,
            max_seq_length=length,
        )
        where = target(changed)
        return refusal(changed, where.device_type, where.budget) is not None

    assert not refused(longest) and refused(longest + 1024)
