#!/usr/bin/env python
"""LoRA fine-tune speed: steadytrain against Hugging Face Trainer + peft and a plain PyTorch loop,
on the same model, data and settings, each arm in its own process.

Model: the Llama-3.2-1B shape with random init (hidden 2048, intermediate 8192, 16 layers, 32
heads, 8 KV heads, vocab 128256, tied embeddings), frozen base in bf16, LoRA r16 (alpha 32,
dropout 0) on every linear projection through peft, bf16 autocast, sequence 1024, effective batch
32 as micro-batch 8 × accumulation 4, AdamW (fused) lr 2e-4, gradient clipping 1.0. Data:
synthetic token sequences (bench/_common.py), the same for every arm. No memory cap.

Arms:

* plain: a hand-written loop: the model's forward, fp32 cross-entropy summed over label tokens
  and divided by the batch's label count, backward per micro-batch, clip, step, zero_grad.
* plain-compile: the same loop with each decoder layer compiled (`layer.compile()`).
* hf: transformers.Trainer, per_device_train_batch_size 8, gradient_accumulation_steps 4, bf16,
  optim adamw_torch_fused.
* steadytrain: Trainer with micro_batch_size 8, effective_batch_size 32, CausalLMLoss (plain).
* steadytrain-compile: the same with compile: true (the decoder layers compiled in place).

Per arm: tokens/s over the steady steps (the first `--warmup` steps left out: they include
compilation and allocator growth), peak allocated memory, and MFU: model FLOPs per token
6 × N + 12 × layers × hidden × seq (N = every parameter whose matmul runs: 1.236 B here, the tied
embedding counted once, as the output layer; the second term is attention's scores and values,
PaLM's formula) times tokens/s, over the GPU's dense bf16 peak (H100/H200 SXM: 989.4 TFLOPS). The
formula counts a full fine-tune's work; LoRA skips the frozen weights' gradients (about a third
of it), so the same figure is what the issue's anchors used, not the arithmetic really done.

    python bench/finetune_speed.py --smoke                      # CPU, tiny model, seconds
    python bench/finetune_speed.py --out $OUT/finetune_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

from steadytrain.run.records import Metric

ARMS = ("plain", "plain-compile", "hf", "steadytrain", "steadytrain-compile")
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
"""Dense bf16 peak FLOP/s by GPU name (SXM figures; NVIDIA's data sheets)."""


def flops_per_token(model: torch.nn.Module, spec: C.ModelSpec) -> float:
    """PaLM's model FLOPs per token: 6 N + 12 L d s (N counts each parameter once, so a tied
    embedding once: as the output layer, whose matmul runs; the embedding lookup is free)."""
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * spec.layers * spec.hidden * spec.seq


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_properties(device).name
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def compile_layers(model: torch.nn.Module) -> int:
    layers = model.get_base_model().model.layers
    for layer in layers:
        layer.compile()
    return len(layers)


# -- the arms ---------------------------------------------------------------------------------


def run_plain(args, spec, device, data, compiled: bool) -> dict[str, Any]:
    model = args.model
    if compiled:
        compile_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda")
    precision = "bf16" if device.type == "cuda" else "fp32"
    order = C.data_order(len(data), args.seed)
    marks = []
    for step in range(args.steps):
        batch = [data[i] for i in order[step * args.effective : (step + 1) * args.effective]]
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        if device.type == "cuda":
            ids, labels = ids.pin_memory(), labels.pin_memory()
        count = int((labels[:, 1:] != -100).sum())
        for start in range(0, args.effective, args.micro):
            piece = {
                "input_ids": ids[start : start + args.micro].to(device, non_blocking=True),
                "labels": labels[start : start + args.micro].to(device, non_blocking=True),
            }
            with C.autocast(device, precision):
                loss = C.lm_loss_sum(model, piece) / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
        marks.append(time.perf_counter())
    return {"arm": "plain-compile" if compiled else "plain", "marks": marks}


def run_hf(args, spec, device, data, work: Path) -> dict[str, Any]:
    trainer, marks = C.hf_trainer(
        args.model,
        data,
        device,
        work / "hf",
        args.seed,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.effective // args.micro,
        max_steps=args.steps,
    )
    trainer.train()
    return {"arm": "hf", "marks": [t for _, t in marks]}


def run_steadytrain(args, spec, device, data, work: Path, compiled: bool) -> dict[str, Any]:
    from steadytrain import TrainConfig, Trainer
    from steadytrain.memory.chunked_loss import CausalLMLoss

    run_dir = work / "steadytrain"
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=args.effective,
        micro_batch_size=args.micro,
        precision="bf16" if device.type == "cuda" else "fp32",
        device=str(device),
        max_steps=args.steps,
        save_every_steps=args.steps,
        seed=args.seed,
        progress="lines",
        log_every_steps=10,
        compile=compiled,
    )
    Trainer(
        args.model,
        lambda params: torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda"),
        CausalLMLoss(),
        data,
        config=config,
    ).fit()
    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    events = C.read_jsonl(run_dir / "events.jsonl")
    # metrics' "time" is wall-clock at each step's end (after the step's host sync); the loop
    # and the plain arm are timed the same way, from one step's end to another's.
    offset = time.perf_counter() - time.time()
    return {
        "arm": "steadytrain-compile" if compiled else "steadytrain",
        "marks": [m[Metric.TIME] + offset for m in metrics],
        "micro_batch_size": metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None,
        "compile": next((e for e in events if e["event"] == "compile"), None),
    }


def child(args) -> None:
    """One arm in this process: build, train, write the result JSON."""
    device = C.resolve(args.device)
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    data = C.synthetic_tokens(args.effective * args.steps, spec.seq, spec.vocab, args.seed + 1)
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.model = C.lora_llama(spec, device, base_dtype, args.seed)
    C.synchronize(device)
    C.reset_peak(device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune-speed-") as work:
        if args.arm in ("plain", "plain-compile"):
            result = run_plain(args, spec, device, data, args.arm == "plain-compile")
        elif args.arm == "hf":
            result = run_hf(args, spec, device, data, Path(work))
        else:
            compiled = args.arm == "steadytrain-compile"
            result = run_steadytrain(args, spec, device, data, Path(work), compiled)
    marks = result.pop("marks")
    steady = marks[args.warmup :]
    tokens = args.effective * spec.seq * (len(steady) - 1)
    rate = tokens / (steady[-1] - steady[0]) if len(steady) > 1 else None
    per_token = flops_per_token(args.model, spec)
    peak = peak_flops(device)
    result.update(
        steps=len(marks),
        timed_steps=max(len(steady) - 1, 0),
        tokens_per_s=rate,
        first_steps_s=marks[args.warmup - 1] - started if len(marks) >= args.warmup else None,
        flops_per_token=per_token,
        peak_flops=peak,
        mfu=rate * per_token / peak if rate and peak else None,
        peak_allocated=C.peak_allocated(device),
        environment=C.environment(device),
    )
    Path(args.result).write_text(json.dumps(result, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--effective", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (25; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out (5; smoke 1)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.steps = args.steps or (4 if args.smoke else 25)
    args.warmup = args.warmup or (1 if args.smoke else 5)
    if args.arm:
        child(args)
        return
    C.require_steadytrain()
    results: dict[str, Any] = {}
    for arm in args.arms.split(","):
        if arm not in ARMS:
            sys.exit(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [sys.executable, __file__, "--arm", arm, "--result", path]
        cmd += ["--device", args.device, "--effective", str(args.effective)]
        cmd += ["--micro", str(args.micro), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--seed", str(args.seed)]
        cmd += ["--smoke"] if args.smoke else []
        print(f"running arm {arm}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        results[arm] = (
            json.loads(Path(path).read_text())
            if proc.returncode == 0
            else {"arm": arm, "error": f"exit {proc.returncode}"}
        )
        Path(path).unlink(missing_ok=True)

    def cell(arm, key, show):
        value = results.get(arm, {}).get(key)
        return "-" if value is None else show(value)

    arms = list(results)
    plain = results.get("plain", {}).get("tokens_per_s")
    rows = [
        ["tokens/s, steady steps", *[cell(a, "tokens_per_s", lambda v: f"{v:,.0f}") for a in arms]],
        [
            "vs plain loop",
            *[
                cell(a, "tokens_per_s", lambda v: f"{v / plain:.2f} x" if plain else "-")
                for a in arms
            ],
        ],
        ["MFU", *[cell(a, "mfu", lambda v: f"{v:.1%}") for a in arms]],
        ["peak allocated", *[cell(a, "peak_allocated", C.gib) for a in arms]],
        [
            f"first {args.warmup} steps (s)",
            *[cell(a, "first_steps_s", lambda v: f"{v:.1f}") for a in arms],
        ],
    ]
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    title = (
        f"{spec.name}, LoRA r16 all linear, bf16, seq {spec.seq}, micro {args.micro} × "
        f"{args.effective // args.micro} = {args.effective}, {args.steps - args.warmup} timed steps"
    )
    text = C.table(["", *arms], rows, title)
    out = args.out or C.default_out("finetune_speed", args.smoke)
    C.write_json(
        out,
        {
            "benchmark": "finetune_speed",
            "settings": vars(args),
            "results": results,
            "table": text,
        },
    )
    print(f"\nresults: {out}\n")
    print(text)


if __name__ == "__main__":
    main()
