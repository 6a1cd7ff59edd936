#!/usr/bin/env python
"""How close `steadytrain estimate` comes to the memory a real training step takes.

For each configuration (two Llama shapes, micro-batch and sequence sizes, fp32 and bf16
autocast, full fine-tune and LoRA, activation checkpointing on and off, sdpa and eager
attention), the model is built from a LlamaConfig with random weights directly on the GPU, two
real training steps run (forward under autocast, fp32 cross-entropy summed over tokens,
backward, torch AdamW step with its default foreach implementation, zero_grad), and
`torch.cuda.max_memory_allocated` / `max_memory_reserved` over those steps are compared with
the estimate's tensor peak and its total (peak plus the framework/allocator overhead margin).
Where accelerate is importable, `accelerate estimate-memory`'s "Training using Adam" figure for
the same shape and dtype is shown beside it (full fine-tune rows only: it models weights,
gradients and Adam states of the whole model, no LoRA and no activations).

The estimate is a planning number: it should sit at or a little above the measured allocated
peak. Error % is (estimate - measured) / measured.

    python bench/estimate_accuracy.py --smoke                         # CPU, tiny model, seconds
    python bench/estimate_accuracy.py --out $OUT/estimate_accuracy.json   # GPU, ~2-4 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

LLAMA_200M = C.ModelSpec(
    hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, vocab=32000, seq=512
)
MODELS = {"200M": (LLAMA_200M, False), "1B": (C.LLAMA_1B, True)}  # name: (shape, tied embeddings)
ALL7 = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
QKVO = "q_proj,k_proj,v_proj,o_proj"


@dataclass(frozen=True)
class Case:
    model: str
    micro: int
    seq: int
    precision: str = "bf16"  # autocast dtype, or fp32 (no autocast)
    method: str = "full"
    weights: str = "fp32"  # dtype the weights (the frozen base with LoRA) are loaded in
    checkpointing: bool = False
    targets: str = QKVO
    dropout: float = 0.0
    attention: str = "sdpa"

    @property
    def label(self) -> str:
        parts = [self.model, self.method]
        if self.method == "lora":
            parts.append("all7" if self.targets == ALL7 else "qkvo")
            if self.dropout:
                parts.append(f"drop{self.dropout:g}")
        parts += [f"{self.precision}/{self.weights}", f"b{self.micro} s{self.seq}"]
        if self.checkpointing:
            parts.append("ckpt")
        if self.attention != "sdpa":
            parts.append(self.attention)
        return " ".join(parts)


CASES = [
    Case("200M", 4, 512, precision="fp32"),
    Case("200M", 4, 512),
    Case("200M", 8, 1024),
    Case("200M", 8, 1024, checkpointing=True),
    Case("200M", 2, 2048, precision="fp32", checkpointing=True),
    Case("200M", 4, 512, attention="eager"),
    Case("200M", 8, 1024, method="lora"),
    Case("200M", 4, 512, precision="fp32", method="lora", targets=ALL7),
    Case("1B", 2, 1024),
    Case("1B", 4, 2048, checkpointing=True),
    Case("1B", 4, 1024, method="lora"),
    Case("1B", 4, 2048, method="lora", weights="bf16"),
    Case("1B", 1, 2048, precision="fp32", method="lora", checkpointing=True),
    Case("1B", 8, 1024, method="lora", weights="bf16", targets=ALL7, dropout=0.05),
    Case("1B", 4, 1024, method="lora", weights="bf16", targets=ALL7, checkpointing=True),
]
SMOKE_CASES = [
    Case("smoke", 2, 32, precision="fp32"),
    Case("smoke", 2, 32, method="lora", targets=ALL7, dropout=0.05),
    Case("smoke", 2, 32, checkpointing=True, attention="eager"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_config(case: Case):
    spec, tied = (C.SMOKE_MODEL, False) if case.model == "smoke" else MODELS[case.model]
    return C.llama_config(spec, tied=tied, attention=case.attention, seq=case.seq)


def settings_for(case: Case, device_type: str):
    from steadytrain.memory.estimate import Settings

    return Settings(
        micro_batch_size=case.micro,
        seq=case.seq,
        precision=case.precision,
        weights_dtype=case.weights,
        method=case.method,
        lora_r=16,
        lora_targets=case.targets,
        lora_dropout=case.dropout,
        checkpointing=case.checkpointing,
        optimizer="adamw",
        attention="eager" if case.attention == "eager" else "sdpa",
        device_type=device_type,
    )


def accelerate_figure(config, case: Case) -> int | None:
    """`accelerate estimate-memory`'s "Training using Adam" (the largest of its model,
    gradients, optimizer and step sizes) for this shape, from a meta-device model; None when
    accelerate is missing or the row is LoRA (accelerate models full training only)."""
    if case.method != "full":
        return None
    try:
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        total, _ = calculate_maximum_sizes(model)
        dtype = "float32" if case.precision == "fp32" else "bfloat16"
        return int(max(estimate_training_usage(total, dtype).values()))
    except Exception as exc:  # noqa: BLE001 - an optional comparison; shown as "-"
        print(f"accelerate figure unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def build(config, case: Case, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(DTYPES[case.weights])
    if case.method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, target_modules=case.targets.split(","), lora_dropout=case.dropout)
        model = get_peft_model(model, lora)
    if case.checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name (transformers 5.2x)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def measure(case: Case, config, device: torch.device, steps: int) -> dict[str, Any]:
    """Peak allocated and reserved over `steps` real training steps, from a clean allocator."""
    C.free_device_memory(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    model = optimizer = batch = None
    error = None
    t0 = time.perf_counter()
    try:
        model = build(config, case, device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (case.micro, case.seq), device=device)
        batch = {"input_ids": ids, "labels": ids}
        C.synchronize(device)
        C.reset_peak(device)
        cast = (
            C.autocast(device, case.precision)
            if case.precision != "fp32"
            else contextlib.nullcontext()
        )
        for _ in range(steps):
            with cast:
                loss_sum = C.lm_loss_sum(model, batch)
            (loss_sum / C.label_tokens(batch["labels"])).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
    except torch.OutOfMemoryError as exc:
        error = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    allocated = C.peak_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    wall = time.perf_counter() - t0
    del model, optimizer, batch
    gc.collect()
    C.free_device_memory(device)
    return {
        "allocated_before": before,
        "peak_allocated": allocated,
        "peak_reserved": reserved,
        "seconds": wall,
        "error": error,
    }


def error_pct(estimate: int | None, measured: int | None) -> float | None:
    if estimate is None or not measured:
        return None
    return 100.0 * (estimate - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 cases")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default=None, help="run the cases whose label contains this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    C.require_steadytrain()
    from steadytrain.memory.estimate import estimate

    device = C.resolve(args.device or ("cpu" if args.smoke else "cuda"))
    cases = SMOKE_CASES if args.smoke else CASES
    if args.only:
        cases = [c for c in cases if args.only in c.label]
    out = args.out or C.default_out("estimate_accuracy", args.smoke)

    results = []
    started = time.perf_counter()
    for case in cases:
        config = llama_config(case)
        est = estimate(config, settings_for(case, device.type), model_name=case.model)
        got = measure(case, config, device, args.steps)
        row = {
            "case": asdict(case),
            "label": case.label,
            "params": est.params,
            "trainable": est.trainable,
            "estimate": {r.name: r.bytes for r in est.rows},
            "estimate_peak": est.peak,
            "estimate_total": est.total,
            "estimate_phase": est.phase,
            "accelerate_training_adam": accelerate_figure(config, case),
            **got,
            "error_allocated_pct": error_pct(est.peak, got["peak_allocated"]),
            "error_reserved_pct": error_pct(est.total, got["peak_reserved"]),
        }
        results.append(row)
        print(
            f"{case.label}: estimate {C.gib(est.peak)}, measured {C.gib(got['peak_allocated'])}"
            f" ({got['seconds']:.1f} s){' ' + got['error'] if got['error'] else ''}",
            file=sys.stderr,
        )

    errors = [
        abs(r["error_allocated_pct"]) for r in results if r["error_allocated_pct"] is not None
    ]
    summary = {
        "cases": len(results),
        "median_abs_error_allocated_pct": C.median(errors),
        "max_abs_error_allocated_pct": max(errors) if errors else None,
        "seconds": time.perf_counter() - started,
    }
    C.write_json(
        out,
        {
            "benchmark": "estimate_accuracy",
            "smoke": args.smoke,
            "steps": args.steps,
            "environment": C.environment(device),
            "summary": summary,
            "results": results,
        },
    )
    headers = [
        "config",
        "params",
        "est peak",
        "meas alloc",
        "err %",
        "est total",
        "meas reserved",
        "err %",
        "accelerate",
        "set by",
    ]
    rows = [
        [
            r["label"] + (" (OOM)" if r["error"] else ""),
            f"{r['params'] / 1e6:,.0f}M",
            C.gib(r["estimate_peak"]),
            C.gib(r["peak_allocated"]),
            C.fmt(r["error_allocated_pct"], 1, "%"),
            C.gib(r["estimate_total"]),
            C.gib(r["peak_reserved"]),
            C.fmt(r["error_reserved_pct"], 1, "%"),
            C.gib(r["accelerate_training_adam"]),
            r["estimate_phase"] or "-",
        ]
        for r in results
    ]
    print(
        C.table(
            headers,
            rows,
            title=f"estimate vs measured on {device} ({args.steps} training steps each; "
            f"median |error| {C.fmt(summary['median_abs_error_allocated_pct'], 1, '%')}); "
            f"written to {out}",
        )
    )


if __name__ == "__main__":
    main()
