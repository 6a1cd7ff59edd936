"""Shared pieces of the benchmarks: the Llama-style model, synthetic token data, the token-weighted
loss, timing and memory helpers, the plain-text table and the JSON result file.

Nothing here imports steadytrain: the plain PyTorch baseline in `overhead.py` uses only this module
and torch, so it cannot borrow the engine's code by accident.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
GiB = 2**30


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int

    @property
    def name(self) -> str:
        return (
            f"Llama h{self.hidden} i{self.intermediate} L{self.layers} "
            f"heads {self.heads}/{self.kv_heads} vocab {self.vocab}"
        )


GPU_MODEL = ModelSpec(
    hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, vocab=32000, seq=512
)
LLAMA_1B = ModelSpec(
    hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, seq=1024
)
"""The Llama-3.2-1B shape (with tied embeddings) the issues' GPU figures are measured on."""
SMOKE_MODEL = ModelSpec(
    hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256, seq=32
)


def llama_config(spec: ModelSpec, tied: bool = False, attention: str = "sdpa", seq: int = 0):
    """The transformers LlamaConfig of `spec` (positions for max(seq, spec.seq, 128) tokens)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        max_position_embeddings=max(seq, spec.seq, 128),
        use_cache=False,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = attention
    return config


def build_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """A randomly initialised Llama-style causal LM in fp32 on the CPU (same seed, same weights)."""
    from transformers import LlamaForCausalLM

    config = llama_config(spec)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.train()
    return model


def lora_llama(spec: ModelSpec, device: torch.device, base_dtype: torch.dtype, seed: int):
    """The issues' LoRA model on the device: a tied-embedding Llama of `spec` with random weights,
    the frozen base in `base_dtype`, peft LoRA r16 / alpha 32 / dropout 0 on every linear."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    config = llama_config(spec, tied=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(base_dtype)
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    model.train()
    return model


def hf_trainer(model, data, device: torch.device, out_dir: Path, seed: int, **batching):
    """A transformers.Trainer with the benchmarks' shared settings (lr 2e-4 constant, clip 1.0,
    bf16 and fused AdamW on CUDA, no logging or saving) and `batching` (max_steps, batch size
    and accumulation keys). Returns it and the list its callback fills with (global step,
    perf_counter) at each optimizer step's end, after a device synchronisation."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    marks: list[tuple[int, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            synchronize(device)
            marks.append((state.global_step, time.perf_counter()))

    training_args = TrainingArguments(
        output_dir=str(out_dir),
        learning_rate=2e-4,
        max_grad_norm=1.0,
        bf16=device.type == "cuda",
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        lr_scheduler_type="constant",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        use_cpu=device.type == "cpu",
        seed=seed,
        **batching,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        data_collator=default_data_collator,
        callbacks=[Clock()],
    )
    return trainer, marks


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(params, device_type: str, lr: float = 3e-4) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel launch for the whole update), foreach elsewhere."""
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device_type == "cuda"
    )


# -- data and loss ----------------------------------------------------------------------------


def synthetic_tokens(count: int, seq: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`count` samples of `seq` random token ids (int64), from a seeded generator. Each sample's
    first few positions (a random "prompt" of up to seq/4 tokens) are masked out of the labels with
    -100, so samples carry different numbers of label tokens and token weighting matters. No
    padding: every sequence is full length, so attention stays causal without a mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count, seq), generator=g, dtype=torch.int64)
    prompt = torch.randint(0, max(seq // 4, 1), (count,), generator=g)
    samples = []
    for i in range(count):
        labels = ids[i].clone()
        labels[: int(prompt[i])] = -100
        samples.append({"input_ids": ids[i].clone(), "labels": labels})
    return samples


def label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Label tokens that count in the loss (after the causal shift): a tensor where labels live."""
    return (labels[:, 1:] != -100).sum()


def lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy summed over label tokens, computed in fp32 like Hugging Face does."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    logits = logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def loss_with_count(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """steadytrain's token-weighted form: (loss_sum, count), count a device tensor (no sync)."""
    return lm_loss_sum(model, batch), label_tokens(batch["labels"])


def data_order(num_samples: int, seed: int, epoch: int = 0) -> list[int]:
    """The order steadytrain's sampler uses (engine/sampler.py, shuffle on), written out here so
    the plain loop sees the same batches in the same order. `overhead.py` checks the two agree."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


# -- device helpers ---------------------------------------------------------------------------


def resolve(spec: str) -> torch.device:
    """'cuda' -> cuda:N (the current device, made current), 'cpu' -> cpu; exits when CUDA is
    asked for and absent."""
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"device {spec!r}: CUDA is not available here; use --smoke (CPU)")
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device.type, dtype=dtype)


# -- environment, files -----------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_total_bytes=props.total_memory,
            cuda=torch.version.cuda,
            driver_capability=f"{props.major}.{props.minor}",
        )
    return info


def _git_commit() -> str | None:
    try:  # read-only; the GPU machine's copy of the tree may have no .git
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def default_out(name: str, smoke: bool) -> Path:
    """bench/results/<name>.json; smoke runs go to <name>-smoke.json so they never overwrite a
    real result."""
    return BENCH / "results" / f"{name}{'-smoke' if smoke else ''}.json"


@contextlib.contextmanager
def run_dirs(keep: Path | None, prefix: str):
    """A fresh folder for the runs' directories: a new timestamped folder under `keep` (kept), or
    a temporary one. Never an existing run directory: the Trainer would append to (and one day
    resume from) it."""
    if keep is not None:
        folder = keep / f"{prefix.strip('-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        folder.mkdir(parents=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        yield Path(work)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a .tmp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def require_steadytrain() -> None:
    """Fail with a clear message when steadytrain's own dependencies are missing (on the GPU
    machine steadytrain is not installed; only src/ is put on sys.path)."""
    try:
        import steadytrain.trainer.fit  # noqa: F401
    except ModuleNotFoundError as exc:
        sys.exit(
            f"cannot import steadytrain from {ROOT / 'src'}: missing module {exc.name!r}.\n"
            "Install steadytrain's dependencies (they are not bundled with torch/transformers): "
            "pip install pydantic pyyaml rich psutil safetensors numpy"
        )


# -- numbers and tables -----------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pct(new: float | None, base: float | None) -> float | None:
    """(base - new) / base in percent: the overhead of `new` when larger is better."""
    if new is None or not base:
        return None
    return 100.0 * (base - new) / base


def fmt(value: Any, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    return f"{value}{unit}"


def gib(value: int | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value / GiB:.{digits}f} GiB"


_NUMBER = re.compile(r"^[-+]?[\d,.]+(e[-+]?\d+)?( ?(%|ms|s|GiB|MiB))?$|^-$")


def _numeric(cell: str) -> bool:
    """A number, a number with a unit, '-', or several of those joined by ' / '."""
    return all(_NUMBER.match(part) for part in cell.split(" / "))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: columns of numbers right-aligned, other columns left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [i > 0 and all(_numeric(row[i]) for row in cells[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].rjust(widths[i]) if right[i] else row[i].ljust(widths[i])
            for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def as_dict(spec: ModelSpec) -> dict[str, Any]:
    return asdict(spec)
