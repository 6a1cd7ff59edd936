"""merge, generate and evaluate on a tiny Llama and a LoRA adapter trained here on CPU.

The base is built from a config (nothing downloaded); the adapter is trained with plain PyTorch
for a few dozen AdamW steps on a repeated text, then saved the way the fine-tune exports it
(RUN_DIR/final/ in peft format, with the tokenizer and training_config.json).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import MALLOC_ENV
from rich.console import Console

from steadytrain.config import TrainConfig
from steadytrain.device import resolve_device
from steadytrain.errors import BadInputError, DoesNotFitError
from steadytrain.recipes.artifact import load_model, load_tokenizer, resolve_artifact
from steadytrain.recipes.data import Collator, byte_tokenizer, causal_lm_loss, load_datasets
from steadytrain.recipes.evaluate import Batching, evaluate, evaluate_command, token_loss
from steadytrain.recipes.generate import (
    complete,
    encode_prompt,
    generate,
    generate_command,
    read_prompts,
)
from steadytrain.recipes.merge import merge

TEXTS = [
    "the cat sat on the mat and the dog sat on the log.",
    "a small model learns a small text quickly.",
    "memory runs out, the batch shrinks, the run finishes.",
    "the cat sat on the log and the dog sat on the mat.",
]


def _tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        attn_implementation="sdpa",
        # Wider than the usual 0.02 so that the logits can grow: with weights that small, the
        # final RMSNorm caps every logit near 0.6 and no adapter can fit the text.
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """base/ (tiny Llama + tokenizer), run/final/ (a trained LoRA adapter), train.jsonl."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("after")
    tokenizer = byte_tokenizer()
    base_dir = root / "base"
    _tiny_llama(len(tokenizer)).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)

    train_file = root / "train.jsonl"
    train_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 2))
    dataset, _, _ = load_datasets(train_file, tokenizer, max_seq_length=128)
    batch = Collator(tokenizer.pad_token_id)([dataset[i] for i in range(len(dataset))])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(40):
        loss_sum, count = causal_lm_loss(model, batch)
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad()

    final = root / "run" / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "training_config.json").write_text(json.dumps({"lora": {"r": 8}}))
    # A run directory holds the engine's config.json beside final/: not a model's config.
    TrainConfig(run_dir=str(root / "run"), effective_batch_size=8).dump(
        root / "run" / "config.json"
    )
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir)
    return {
        "root": root,
        "base": base_dir,
        "run": root / "run",
        "final": final,
        "train": train_file,
    }


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[256, *b"the cat sat on"]])


# -- merge -----------------------------------------------------------------------------------


def test_merge_gives_the_logits_of_base_plus_adapter(made, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    result = merge(made["run"], out)

    assert result.out_dir == out and result.adapter == made["final"]
    assert not any(n.startswith("adapter_") for n in result.files)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(result.files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no staging left behind

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with_adapter = load_model(resolve_artifact(made["final"]), torch.float32)
    base = AutoModelForCausalLM.from_pretrained(made["base"]).eval()
    expected = _logits(with_adapter, IDS)
    # fp32 tolerance relative to the logits' scale (they reach ~13 here): the merged weight
    # W + BA rounds once where base + adapter rounds W x and B(A x) separately.
    scale = expected.abs().max().item()
    assert (_logits(merged, IDS) - expected).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (_logits(base, IDS) - expected).abs().max() > 1e-2  # the adapter changed the model


def test_merge_in_bf16_writes_bf16_weights_close_to_fp32(made, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    result = merge(made["final"], tmp_path / "bf16", dtype="bf16")
    assert result.dtype == torch.bfloat16
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as weights:
        names = weights.keys()
        assert {weights.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").float().eval()
    expected = _logits(load_model(resolve_artifact(made["final"]), torch.float32), IDS)
    error = (_logits(merged, IDS) - expected).abs().max().item()
    assert 1e-5 < error / expected.abs().max().item() < 5e-2  # bf16 rounding, not fp32's


@pytest.mark.slow  # the merge's logits are checked by test_merge_gives_the_logits_...
def test_merged_folder_loads_with_transformers_alone(made, tmp_path):
    out = tmp_path / "merged"
    merge(made["final"], out)
    script = (
        "import sys; sys.modules['peft'] = None; sys.modules['steadytrain'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(out)!r})\n"
        "print(type(m).__name__, t.decode(t('hi')['input_ids'], skip_special_tokens=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["LlamaForCausalLM", "hi"]


def test_merge_refuses_a_non_empty_out_unless_forced(made, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BadInputError, match=r"--out: .*merged exists and is not empty.*--force"):
        merge(made["final"], out)
    assert (out / "keep.txt").read_text() == "mine"

    merge(made["final"], out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_merge_errors_name_the_file_and_the_fix(made, tmp_path):
    with pytest.raises(BadInputError, match=r"ADAPTER: .*nowhere does not exist") as err:
        merge(tmp_path / "nowhere", tmp_path / "out")
    assert err.value.exit_code == 2

    moved = tmp_path / "adapter"
    shutil.copytree(made["final"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    gone = str(tmp_path / "models" / "gone")
    config["base_model_name_or_path"] = gone
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError) as err:
        merge(moved, tmp_path / "out")
    message = str(err.value)
    assert f"adapter_config.json says base_model_name_or_path {gone!r}" in message
    assert "--base PATH" in message
    merge(moved, tmp_path / "out", base=str(made["base"]))  # --base fixes it
    assert (tmp_path / "out" / "model.safetensors").is_file()

    with pytest.raises(BadInputError, match=r"--out: .* is or contains the input"):
        merge(moved, tmp_path, base=str(made["base"]), force=True)
    assert (moved / "adapter_config.json").is_file()

    (moved / "adapter_model.safetensors").unlink()
    with pytest.raises(BadInputError, match=r"has adapter_config.json but no adapter_model"):
        merge(moved, tmp_path / "out2")

    with pytest.raises(BadInputError, match=r"is a complete model .* nothing to merge"):
        merge(made["base"], tmp_path / "out3")


def test_merge_refuses_a_4bit_base_with_the_alternative(made, tmp_path):
    quantized = tmp_path / "base-4bit"
    shutil.copytree(made["base"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError) as err:
        merge(made["final"], tmp_path / "out", base=str(quantized))
    assert err.value.exit_code == 2
    assert "stored quantized (bitsandbytes 4-bit)" in str(err.value)
    assert "original bf16/fp32 model folder" in str(err.value)
    with pytest.raises(BadInputError, match=r"--dtype: '4bit' is a quantized format"):
        merge(made["final"], tmp_path / "out", dtype="4bit")
    assert not (tmp_path / "out").exists()


# -- generate --------------------------------------------------------------------------------


def _argmax_decode(model, ids: list[int], steps: int, eos: int) -> list[int]:
    ids = list(ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            new.append(token)
            if token == eos:
                break
    return new


@pytest.mark.slow  # generation is also run by test_sampling_is_repeatable_with_a_seed
def test_greedy_generation_is_argmax_decoding(made):
    tokenizer = load_tokenizer(resolve_artifact(made["run"]))
    model = load_model(resolve_artifact(made["run"]), torch.float32)
    prompt = "the cat sat"
    [result] = complete(model, tokenizer, [prompt], max_new_tokens=24, temperature=0.0)
    expected = _argmax_decode(model, tokenizer(prompt)["input_ids"], 24, tokenizer.eos_token_id)
    assert result.new_tokens == len(expected)
    assert result.completion == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.stopped == ("eos" if expected[-1] == tokenizer.eos_token_id else "length")
    # Trained on "the cat sat on the mat/log ...": greedy continues the training text.
    assert result.completion.startswith(" on the ")


def test_sampling_is_repeatable_with_a_seed(made):
    tokenizer = load_tokenizer(resolve_artifact(made["run"]))
    model = load_model(resolve_artifact(made["run"]), torch.float32)
    prompts = ["a small", "memory"]

    def sample(seed: int, which: list[str]) -> list[str]:
        settings = {"max_new_tokens": 16, "temperature": 1.5, "top_p": 0.95, "seed": seed}
        return [r.completion for r in complete(model, tokenizer, which, **settings)]

    first = sample(7, prompts)
    assert sample(7, prompts) == first
    assert sample(7, prompts[1:]) == first[1:]  # independent of the prompt's place in the file
    assert sample(8, prompts) != first


def test_generate_command_prints_prompts_and_completions(made, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the cat"}\n\n{"prompt": "the dog"}\n')
    out, err = io.StringIO(), io.StringIO()
    code = generate_command(
        str(made["run"]),
        prompts_file=str(prompts),
        max_new_tokens=8,
        device="cpu",
        json_output=True,
        console=Console(file=out),
        err_console=Console(file=err),
    )
    assert code == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["prompt"] for line in lines] == ["the cat", "the dog"]
    assert all(line["new_tokens"] >= 1 for line in lines)
    assert (
        f"adapter {made['final']}" in err.getvalue()
        and "temperature 0.7, top_p 0.9" in err.getvalue()
    )
    one = generate(made["run"], ["the dog"], max_new_tokens=8, device="cpu")
    assert one[0].completion == lines[1]["completion"]

    with pytest.raises(BadInputError, match=r"PROMPT and --prompts-file: give exactly one"):
        generate_command(str(made["run"]), prompt="x", prompts_file=str(prompts))
    with pytest.raises(BadInputError, match=r"--temperature: must be >= 0"):
        generate_command(str(made["run"]), prompt="x", temperature=-1.0)


def test_prompts_files(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("first prompt\n\nsecond {prompt}\r\n")
    assert read_prompts(plain) == ["first prompt", "second {prompt}"]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "two\\nlines"}\n{"text": "x"}\nnot json\n')
    with pytest.raises(BadInputError) as err:
        read_prompts(lines)
    assert 'line 2: expected an object with a "prompt" string' in str(err.value)
    assert "line 3: invalid JSON" in str(err.value)
    lines.write_text('{"prompt": "two\\nlines"}\n')
    assert read_prompts(lines) == ["two\nlines"]
    with pytest.raises(BadInputError, match=r"--prompts-file: .*missing.txt does not exist"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(BadInputError, match=r"holds no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_chat_prompt_uses_the_template_only_when_asked():
    tokenizer = byte_tokenizer()
    chat = encode_prompt(tokenizer, "hi", chat=True)
    assert tokenizer.decode(chat) == "<bos><|user|>\nhi\n<|assistant|>\n"
    assert encode_prompt(tokenizer, "hi", chat=False) == [256, *b"hi"]
    with pytest.raises(BadInputError, match=r"--chat: the tokenizer has no chat template"):
        encode_prompt(byte_tokenizer(chat_template=None), "hi", chat=True)


# -- evaluate --------------------------------------------------------------------------------


def test_evaluate_shows_lower_perplexity_after_training(made, tmp_path):
    report = evaluate(made["train"], made["run"], max_seq_length=128, batch_size=3, device="cpu")
    base, tuned = report.results
    assert (base.model, tuned.model) == ("base", "base + adapter")
    assert base.path == str(made["base"]) and tuned.path == str(made["final"])
    assert base.tokens == tuned.tokens == sum(len(t.encode()) + 1 for t in TEXTS * 2)
    assert tuned.perplexity < 0.5 * base.perplexity
    assert tuned.perplexity == pytest.approx(torch.tensor(tuned.loss).exp().item())

    merged = tmp_path / "merged"
    merge(made["final"], merged)
    [alone] = evaluate(made["train"], merged, max_seq_length=128, device="cpu").results
    assert alone.model == "model"
    assert alone.loss == pytest.approx(tuned.loss, abs=1e-5)


def test_evaluate_is_token_weighted_whatever_the_batch_size(made):
    one = evaluate(made["train"], made["final"], max_seq_length=128, batch_size=1, device="cpu")
    eight = evaluate(made["train"], made["final"], max_seq_length=128, batch_size=8, device="cpu")
    for a, b in zip(one.results, eight.results, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)


def test_evaluate_command_table_and_json(made):
    out, err = io.StringIO(), io.StringIO()
    code = evaluate_command(
        str(made["train"]),
        str(made["run"]),
        max_seq_length=128,
        device="cpu",
        console=Console(file=out, width=200),
        err_console=Console(file=err),
    )
    text = out.getvalue()
    assert code == 0
    assert "base + adapter" in text and "perplexity" in text and "adapter vs base: loss -" in text
    assert 'eval: 8 "text" records' in err.getvalue()

    out = io.StringIO()
    evaluate_command(
        str(made["train"]),
        str(made["run"]),
        max_seq_length=128,
        device="cpu",
        json_output=True,
        console=Console(file=out),
        err_console=Console(file=io.StringIO()),
    )
    report = json.loads(out.getvalue())
    assert [r["model"] for r in report["results"]] == ["base", "base + adapter"]
    assert report["samples"] == 8 and report["final_batch_size"] == 8


def test_evaluate_errors_exit_2_naming_the_file(made, tmp_path, monkeypatch):
    import steadytrain.recipes.artifact as artifact_module

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the eval file was checked")

    monkeypatch.setattr(artifact_module, "load_model", no_weights)
    with pytest.raises(BadInputError, match=r"EVAL_FILE: .*missing.jsonl does not exist"):
        evaluate(tmp_path / "missing.jsonl", made["run"], device="cpu")
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(BadInputError, match=r"(?s)eval.jsonl: 1 problem.*line 2") as err:
        evaluate(bad, made["run"], device="cpu")
    assert err.value.exit_code == 2
    with pytest.raises(BadInputError, match=r"MODEL: .*holds neither adapter_config.json"):
        evaluate(made["train"], tmp_path, device="cpu")
    with pytest.raises(BadInputError, match=r"--batch-size: must be a whole number >= 1"):
        evaluate(made["train"], made["run"], batch_size=0)


# -- eval out-of-memory fallback -------------------------------------------------------------


class OOMAboveDouble:
    """Test double of a device that runs out of memory on batches of more than `limit` samples:
    raises torch.OutOfMemoryError, the type CUDA's allocator raises. The real path classifies
    with `steadytrain.device.is_oom`, which also knows the MPS and CPU allocators' messages."""

    def __init__(self, limit: int):
        self.limit = limit
        self.sizes: list[int] = []

    def __call__(self, model, batch):
        size = batch["input_ids"].shape[0]
        self.sizes.append(size)
        if size > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (double: batch of {size})"
            )
        return causal_lm_loss(model, batch)


@pytest.fixture(scope="module")
def eval_setup(made):
    artifact = resolve_artifact(made["final"])
    tokenizer = load_tokenizer(artifact)
    dataset, _, _ = load_datasets(made["train"], tokenizer, max_seq_length=128)
    model = load_model(artifact, torch.float32)
    return model, dataset, Collator(tokenizer.pad_token_id), resolve_device("cpu")


def test_eval_out_of_memory_halves_the_batch_and_gives_the_same_loss(eval_setup):
    model, dataset, collate, device = eval_setup
    expected = token_loss(model, dataset, collate, device, Batching(8))

    double = OOMAboveDouble(limit=2)
    batching = Batching(8)
    shrinks = []
    got = token_loss(
        model, dataset, collate, device, batching, double, lambda a, b: shrinks.append((a, b))
    )
    assert got[1] == expected[1]
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert batching.size == 2 and batching.shrinks == shrinks == [(8, 4), (4, 2)]
    assert double.sizes == [8, 4, 2, 2, 2, 2]


def test_eval_out_of_memory_at_one_sample_does_not_fit(eval_setup):
    model, dataset, collate, device = eval_setup
    with pytest.raises(DoesNotFitError, match=r"one sample of \d+ tokens does not fit") as err:
        token_loss(model, dataset, collate, device, Batching(2), OOMAboveDouble(limit=0))
    assert err.value.exit_code == 3


def test_eval_errors_other_than_out_of_memory_propagate(eval_setup):
    model, dataset, collate, device = eval_setup

    def broken(model, batch):
        raise RuntimeError("shape mismatch")

    batching = Batching(4)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        token_loss(model, dataset, collate, device, batching, broken)
    assert batching.size == 4


REAL_OOM_CHILD = """
import json, resource, sys
from steadytrain.recipes.evaluate import evaluate

def vm_size():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

model, data, limit_mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Batch 1 first: the reference loss, and thread pools started before the cap (see DESIGN.md).
reference = evaluate(data, model, batch_size=1, device="cpu")
limit = vm_size() + limit_mib * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
capped = evaluate(data, model, batch_size=8, device="cpu")
print(json.dumps({"reference": reference.results[0].loss, "capped": capped.results[0].loss,
                  "final": capped.final_batch_size, "shrinks": capped.shrinks}))
"""


def test_evaluate_survives_a_real_out_of_memory(tmp_path):
    """The CPU allocator's own error under RLIMIT_AS: a 32k vocabulary makes a batch of eight
    512-token samples need ~1 GiB of logits, one sample ~130 MiB, and the cap allows 300 MiB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "wide")
    byte_tokenizer().save_pretrained(tmp_path / "wide")
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 50}) + "\n" for i in range(8)))

    env = {**os.environ, **MALLOC_ENV, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", REAL_OOM_CHILD, str(tmp_path / "wide"), str(data), "300"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["shrinks"][0] == [8, 4] and result["final"] < 8
    assert result["capped"] == pytest.approx(result["reference"], rel=1e-6)
