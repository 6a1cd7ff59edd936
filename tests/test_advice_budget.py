"""The seed-004 user's advice at the budget the run will use (issue 42, items 1 and 3): figures
that tell "fits" from "still over", a budget written as a Mac's RAM priced against the default a
run there gets, an advised change that the dry-run at the same budget confirms, bf16 on MPS with
what it needs and fp16 beside it, and a 4-bit config refused in the config's own keys.

Through the command line in this process; the Llama-3.2-3B shape is its config.json only (the
estimate is analytic: no weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_advice import steadytrain
from test_estimate import llama_3b

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent
ADVICE = re.compile(
    r"^ *((?:`[^`]+`(?:, )?)+) → ([\d.]+ [GM]iB) of ([\d.]+ [GM]iB): (fits|still over)"
)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """The seed's config file (comments and all) with the 3B shape as its model."""
    root = tmp_path_factory.mktemp("seed-004")
    llama_3b().save_pretrained(root / "llama-3b")
    (root / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    text = (ROOT / "examples" / "finetune_config.json").read_text()
    text = text.replace('"meta-llama/Llama-3.2-3B"', json.dumps(str(root / "llama-3b")))
    text = text.replace('"data/train.jsonl"', json.dumps(str(root / "train.jsonl")))
    text = text.replace('"eval_file": "data/eval.jsonl",', "")
    text = text.replace('"models/checkpoints"', json.dumps(str(root / "out")))
    (root / "seed.json").write_text(text)
    return root / "seed.json"


def dry_run(capsys, config: Path, *sets: str) -> tuple[int, str]:
    args = [arg for item in ("device=mps", *sets) for arg in ("--set", item)]
    return steadytrain(capsys, "finetune", "--dry-run", "--config", str(config), *args)


def advice_lines(out: str) -> list[re.Match]:
    return [m for line in out.splitlines() if (m := ADVICE.match(line))]


def test_at_a_16_gb_macs_default_budget_the_advice_tells_fits_from_over_and_the_run_confirms(
    capsys, seed
):
    """memory_budget 10.8GiB (0.9 of a 16 GB Mac's 12 GiB working set, what a run there gets by
    default) with bf16 and the chunked loss: 219 MiB over, exit 3. Each listed change shows its
    total and the budget at a precision that differs where they differ (no "10.8 GiB of 10.8
    GiB" beside both verdicts), and the change called "fits", applied, fits at that budget."""
    code, out = dry_run(capsys, seed, "memory_budget=10.8GiB", "bf16=true", "chunked_loss=true")
    assert code == 3, out
    found = advice_lines(out)
    assert found and any(m[4] == "still over" for m in found), out
    for m in found:
        assert m[2] != m[3], m[0]  # the figures themselves tell the verdict
    fitting = next(m for m in found if m[4] == "fits")
    changes = re.findall(r"`([\w.]+): (\w+)`", fitting[1])
    code, out = dry_run(
        capsys, seed, "memory_budget=10.8GiB", "bf16=true", "chunked_loss=true",
        *(f"{key}={value}" for key, value in changes),
    )  # fmt: skip
    assert code == 0, out
    assert re.search(r"peak: estimated [\d.]+ GiB of 10\.80 GiB: fits", out), out


def test_a_budget_written_as_a_macs_ram_is_not_called_a_fit_where_its_default_is_short(
    capsys, seed
):
    """memory_budget 16GiB on MPS, the RAM of a 16 GB Mac: `bf16: true` (12.9 GiB) is within
    16 GiB but 2.1 GiB over the 10.8 GiB a run there gets by default; the advice says both."""
    code, out = dry_run(capsys, seed, "memory_budget=16GiB")
    assert code == 3, out
    said = " ".join(out.split())
    assert re.search(
        r"`bf16: true` → 12\.9 GiB of 16\.0 GiB: fits that budget, but not a 16 GB Mac's "
        r"default of 10\.8 GiB \(2\.1 GiB over",
        said,
    ), out


def test_bf16_on_mps_says_what_it_needs_and_fp16_is_offered_beside_it(capsys, seed):
    code, out = dry_run(capsys, seed, "memory_budget=16GiB")
    assert code == 3
    text = " ".join(out.split())
    assert "`bf16: true` on MPS needs macOS 14 or later and a torch" in text, out
    assert "`fp16: true` saves the same on any macOS" in text, out


def test_estimate_on_a_4_bit_config_answers_in_its_keys(capsys, seed, tmp_path):
    """`steadytrain estimate FILE` with quantization.load_in_4bit: on MPS, exit 2 saying 4-bit
    cannot run there and the config keys that change it; on CUDA with fp32 compute, `bf16:
    true`, not the command line's --weights-dtype; with a fallback dtype, the estimate of the
    base unquantized in it."""
    text = re.sub(r"//[^\n]*", "", seed.read_text())
    config = json.loads(text)
    config["quantization"]["load_in_4bit"] = True

    def estimate(**changes) -> tuple[int, str]:
        file = tmp_path / "finetune.json"
        file.write_text(json.dumps({**config, **changes}))
        return steadytrain(capsys, "estimate", str(file))

    code, out = estimate(device="mps", memory_budget="10.8GiB")
    said = " ".join(out.split())
    assert code == 2, out
    assert "quantization.load_in_4bit: 4-bit needs CUDA" in said and "trains on mps" in said
    assert "quantization.fallback" in said and "--weights-dtype" not in said
    code, out = estimate(device="cuda", memory_budget="16GiB")
    said = " ".join(out.split())
    assert code == 2 and "set `bf16: true`" in said and "--weights-dtype" not in said, out
    quantization = {**config["quantization"], "fallback": "fp16"}
    code, out = estimate(device="mps", memory_budget="16GiB", quantization=quantization)
    assert code == 0 and "fp16 weights" in " ".join(out.split()), out


def killed_at_micro_batch_1(tmp_path: Path, budget: int, *records: dict) -> tuple[int, str]:
    """The supervisor's last word for the seed's fine-tune killed by the OS at micro-batch 1
    with every saver in force, the run's fit_start having recorded `budget` on MPS, and
    `records` after it."""
    from test_advice import seed_config
    from test_escalation import SaversJob, supervise

    from steadytrain.cli import finetune_advice

    job = SaversJob(tmp_path, "", finish_at=99)
    job.run_dir.mkdir(parents=True)
    config = seed_config(tmp_path, bf16=True)
    (job.run_dir / "training_config.json").write_text(json.dumps(config.resolved()))
    start = {"event": "fit_start", "step": 0, "device": "mps", "budget": budget}
    lines = [json.dumps(record) + "\n" for record in (start, *records)]
    (job.run_dir / "events.jsonl").write_text("".join(lines))
    return supervise(job, oom_kill_count=lambda: None, advice=finetune_advice)


def test_killed_while_the_estimate_fits_blames_memory_outside_the_run(tmp_path):
    """The OS killed the run though its estimate at micro-batch 1 is within its budget (other
    programs held the memory): the last word says so (close other programs, a lower
    memory_budget), does not say "does not fit", and calls no change "fits"."""
    code, out = killed_at_micro_batch_1(tmp_path, 64 * GiB)
    said = " ".join(out.split())
    assert code == 3, out
    assert "within the budget of 64.00 GiB, so the memory that ran short was held outside" in said
    assert "close other programs" in said and "a lower `memory_budget`" in said
    assert "does not fit" not in said and ": fits" not in said, out


def test_killed_over_the_estimate_lists_only_the_changes_that_make_it_fit(tmp_path):
    code, out = killed_at_micro_batch_1(tmp_path, 10 * GiB)
    said = " ".join(out.split())
    assert code == 3 and "at micro-batch 1 the estimate is" in said, out
    assert ": fits" in said and "still over" not in said, out


def test_the_plan_line_at_micro_batch_1_does_not_promise_a_halving(capsys, seed):
    code, out = dry_run(capsys, seed, "memory_budget=10.8GiB")
    assert code == 3
    assert "micro-batch 1 × 8 accumulation (per_device_train_batch_size; the smallest" in out
    assert "out-of-memory halves it" not in out


def test_the_start_up_estimate_is_at_the_supervisors_micro_batch_cap(tmp_path, monkeypatch):
    """After a memory kill `steadytrain run` caps the next attempt's micro-batch: its start-up
    line prices that micro-batch, not the config's."""
    from test_advice import seed_config

    from steadytrain.recipes.finetune_memory import memory_line

    config = seed_config(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    monkeypatch.setenv("STEADYTRAIN_MAX_MICRO_BATCH", "2")
    line = memory_line(config, "mps", 10 * GiB)
    assert "at micro-batch 2 (STEADYTRAIN_MAX_MICRO_BATCH=2)" in line, line
    monkeypatch.setenv("STEADYTRAIN_MAX_MICRO_BATCH", "1")
    line = memory_line(config, "mps", 10 * GiB)
    assert "at micro-batch 1" in line and "halve" not in line, line


def test_the_report_counts_an_attempt_killed_before_its_start_was_recorded(tmp_path):
    """Two restarts by the supervisor are three attempts, though the one killed while loading
    never wrote its fit_start."""
    from test_report import summary

    from steadytrain.telemetry.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"event": "fit_start", "step": 0, "time": 1.0},
        {"event": "restart", "step": 0, "time": 2.0},
        {"event": "restart", "step": 0, "time": 3.0},
        {"event": "fit_start", "step": 0, "time": 4.0},
        {"event": "fit_end", "step": 1, "time": 5.0},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    line = {"step": 1, "loss": 1.0, "lr": 0.1, "time": 4.5, "micro_batch_size": 1}
    (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    report = write_report(run)
    page = Path(getattr(report, "html", run / "report.html")).read_text()
    assert "2 by the supervisor" in summary(page)["restarts"]
    assert "; 3 attempt(s)" in summary(page)["restarts"], summary(page)["restarts"]


def test_an_estimate_answers_a_config_in_its_keys_and_flags_in_flags(capsys, seed, tmp_path):
    """`steadytrain estimate CONFIG.json`: its notes and refusals name the config's keys
    (`chunked_loss: true`, `lora.target_modules`, `device:`); the same model named on the
    command line with flags is answered in flags (`--chunked-loss`, `--lora-targets`,
    `--device-type`)."""
    config = json.loads(re.sub(r"//[^\n]*", "", seed.read_text()))
    config.update(per_device_train_batch_size=8, gradient_checkpointing=True)
    config.update(chunked_loss=False, device="auto", memory_budget="12GiB")
    model = config["model_name_or_path"]

    def estimate_file(**changes) -> str:
        file = tmp_path / "finetune.json"
        file.write_text(json.dumps({**config, **changes}))
        return " ".join(steadytrain(capsys, "estimate", str(file))[1].split())

    def estimate_flags(*flags: str) -> str:
        return " ".join(
            steadytrain(capsys, "estimate", model, "--method", "lora", *flags)[1].split()
        )

    said = estimate_file()
    assert (
        "`chunked_loss: true` (the loss 1024 tokens at a time) or a lower `max_seq_length`" in said
    )
    assert "set `device: mps` or `device: cuda` in the config when the other machine" in said
    assert not re.search(r"--[a-z]", said), said
    said = estimate_flags(
        "--micro-batch-size", "8", "--seq", "2048", "--activation-checkpointing", "on",
        "--memory-budget", "12GiB",
    )  # fmt: skip
    assert "--chunked-loss (the loss 1024 tokens at a time) or a shorter --seq" in said, said
    assert "pass --device-type mps or cuda when the other machine differs" in said, said
    lora = {**config["lora"], "target_modules": ["q_proj", "nope"]}
    said = estimate_file(lora=lora)
    assert "lora.target_modules: nope match no linear layer" in said, said
    assert "(or `lora.target_modules: all-linear`)" in said and "--lora-targets" not in said
    said = estimate_flags("--lora-targets", "q_proj,nope")
    assert "--lora-targets: nope match no linear layer" in said and "(or pass all-linear)" in said


# -- the data's real lengths ------------------------------------------------------------------


def with_data(seed: Path, tmp_path: Path, longest: int) -> Path:
    """The seed's config with its model folder given the byte tokenizer (one token a byte) and
    24 prompt + completion records, the longest about `longest` tokens."""
    import shutil

    from steadytrain.recipes.data import byte_tokenizer

    model = tmp_path / "llama-3b"
    shutil.copytree(seed.parent / "llama-3b", model)
    byte_tokenizer().save_pretrained(model)
    records = [
        {"prompt": "q" * (longest * i // 24 - 8), "completion": "answer"} for i in range(1, 25)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = json.loads(re.sub(r"//[^\n]*", "", seed.read_text()))
    config.update(model_name_or_path=str(model), train_file=str(tmp_path / "train.jsonl"))
    (tmp_path / "seed.json").write_text(json.dumps(config))
    return tmp_path / "seed.json"


def longest_said(out: str) -> int:
    found = re.search(r"data: the longest training sample is (\d+) tokens", out)
    assert found, out
    return int(found[1])


def test_the_dry_run_prices_the_datas_longest_sample_not_max_seq_length(capsys, seed, tmp_path):
    """seed-004's data: the longest sample is 86 tokens under max_seq_length 2048. A batch is
    padded to its longest sample, so the estimate prices 86 tokens and says so: at a 16 GB Mac's
    default budget with bf16 and the chunked loss the run fits (exit 0, not 3), and no
    `max_seq_length` is offered, here or under a budget that is short (a shorter one saves
    nothing above 86)."""
    config = with_data(seed, tmp_path, longest=86)
    code, out = dry_run(capsys, config, "memory_budget=10.8GiB", "bf16=true", "chunked_loss=true")
    longest = longest_said(out)
    assert 80 <= longest <= 90, out
    said = " ".join(out.split())
    assert f"the estimate prices activations at {longest} tokens" in said, out
    assert f"micro-batch 1 × seq {longest}," in said, out
    assert code == 0, out
    code, out = dry_run(capsys, config, "memory_budget=4GiB")
    assert code == 3 and advice_lines(out), out
    assert "max_seq_length:" not in out, out


def test_sequence_advice_stays_below_the_datas_longest_sample(capsys, seed, tmp_path):
    """Samples up to about 700 tokens under max_seq_length 2048: the estimate prices the
    longest, and a shorter max_seq_length is offered only below it."""
    config = with_data(seed, tmp_path, longest=700)
    code, out = dry_run(capsys, config, "memory_budget=9.5GiB", "bf16=true")
    longest = longest_said(out)
    offered = [int(n) for n in re.findall(r"`max_seq_length: (\d+)`", out)]
    assert code == 3 and offered, out
    assert all(n < longest for n in offered), (longest, offered)


def test_killed_at_micro_batch_1_prices_the_lengths_the_run_recorded(tmp_path):
    """The run recorded its data's lengths (86 tokens at most): the supervisor's last word
    prices them. At micro-batch 1 on 86 tokens the estimate is within the 10 GiB the run had
    (at max_seq_length 2048 it is over), so the memory that ran short was held outside the
    run, and no max_seq_length is offered."""
    lengths = {
        "event": "data_lengths",
        "longest": 86,
        "longest_sample": 86,
        "p95": 80,
        "samples": 24,
        "max_seq_length": 2048,
        "packing": False,
    }
    code, out = killed_at_micro_batch_1(tmp_path, 10 * GiB, lengths)
    said = " ".join(out.split())
    assert code == 3, out
    assert "within the budget of 10.00 GiB, so the memory that ran short was held outside" in said
    assert "max_seq_length" not in said, out
