#!/usr/bin/env python
"""steadytrain's planned micro-batch against Hugging Face Trainer's auto_find_batch_size, under a
16 GiB cap, on the same model, data and settings.

The question users ask: "my GPU (or Mac) has 16 GB; what batch runs, how fast, and is it still the
batch I asked for?" Each arm runs in its own child process, capped with
torch.cuda.set_per_process_memory_fraction so that 16 GiB of the GPU is usable:

* hf: transformers.Trainer with auto_find_batch_size=True, per_device_train_batch_size=64,
  gradient_accumulation_steps=1: on out-of-memory it retries with a smaller batch (accelerate's
  find_executable_batch_size) and keeps the accumulation, so the effective batch shrinks with it.
* steadytrain: Trainer with effective_batch_size=64 and micro_batch_size "auto" (the planner
  chooses micro size and accumulation; the OOM shrink stays as the safety net).
* steadytrain-compile (not run by default): the same with compile: true (the decoder layers
  compiled after the plan; the first step includes the compile).

Model: the Llama-3.2-1B shape with random init (hidden 2048, intermediate 8192, 16 layers, 32 heads,
8 KV heads, vocab 128256, tied embeddings), frozen base in bf16, LoRA r16 (alpha 32) on every
linear projection through peft, bf16 autocast, sequence 1024, AdamW lr 2e-4, clip 1.0. Data:
synthetic token sequences (bench/_common.py), the same for both arms.

Reported per arm: tokens/s over the steady steps (input tokens; each arm's first step left out),
the micro size and the effective batch each optimizer step really used, seconds from the end of
model load to the end of the first optimizer step, the peak allocated memory, and the OOM count.

    python bench/plan_vs_autofind.py --smoke                        # CPU, tiny model, no cap
    python bench/plan_vs_autofind.py --out $OUT/plan_vs_autofind.json
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

GiB = 2**30


def cap_memory(device: torch.device, cap_gib: float | None) -> int | None:
    if device.type != "cuda" or not cap_gib:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total), device)
    return int(cap_gib * GiB)


# -- the arms ---------------------------------------------------------------------------------


def run_hf(args, spec, device, data, loaded_at: float, work: Path) -> dict[str, Any]:
    sizes: list[int] = []
    trainer, marks = C.hf_trainer(
        args.model,
        data,
        device,
        work / "hf",
        args.seed,
        per_device_train_batch_size=args.effective,
        gradient_accumulation_steps=1,
        auto_find_batch_size=True,
        max_steps=args.hf_steps,
    )
    real_inner = trainer._inner_training_loop

    def inner(batch_size=None, *a, **k):  # every attempt auto_find_batch_size makes
        sizes.append(batch_size)
        return real_inner(batch_size, *a, **k)

    trainer._inner_training_loop = inner
    trainer.train()
    micro = trainer._train_batch_size
    steady = marks[1:]
    window = steady[-1][1] - marks[0][1] if len(marks) > 1 else None
    tokens = micro * spec.seq * (len(marks) - 1)
    return {
        "arm": "hf",
        "attempted_batch_sizes": sizes,
        "micro_batch_size": micro,
        "accumulation": 1,
        "effective_batch_size": micro,
        "steps": len(marks),
        "tokens_per_s": tokens / window if window else None,
        "first_step_s": marks[0][1] - loaded_at if marks else None,
        "oom_count": max(len(sizes) - 1, 0),
    }


def run_steadytrain(
    args, spec, device, data, loaded_at: float, work: Path, compiled: bool = False
) -> dict[str, Any]:
    from steadytrain import TrainConfig, Trainer
    from steadytrain.memory.chunked_loss import CausalLMLoss

    run_dir = work / "steadytrain"
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=args.effective,
        micro_batch_size="auto",
        precision="bf16" if device.type == "cuda" else "fp32",
        device=str(device),
        max_steps=args.st_steps,
        save_every_steps=args.st_steps,
        seed=args.seed,
        progress="lines",
        log_every_steps=1,
        compile=compiled,
    )
    wall_loaded = time.time() - (time.perf_counter() - loaded_at)
    result = Trainer(
        args.model,
        lambda params: torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda"),
        CausalLMLoss(),  # steadytrain's causal-LM loss, whose chunked mode the plan may choose
        data,
        config=config,
    ).fit()
    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    events = C.read_jsonl(run_dir / "events.jsonl")
    times = [m[Metric.TIME] for m in metrics]
    window = times[-1] - times[0] if len(times) > 1 else None
    tokens = sum(m[Metric.SAMPLES] for m in metrics[1:]) * spec.seq
    peaks = [m.get(Metric.MEM_PEAK) for m in metrics if m.get(Metric.MEM_PEAK) is not None]
    plan = next((e for e in events if e["event"] == "plan"), None)
    return {
        "arm": "steadytrain-compile" if compiled else "steadytrain",
        "micro_batch_size": metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None,
        "accumulation": metrics[-1][Metric.MICRO_STEPS] if metrics else None,
        "effective_batch_size": sorted({m[Metric.SAMPLES] for m in metrics}),
        "steps": len(metrics),
        "tokens_per_s": tokens / window if window else None,
        "first_step_s": times[0] - wall_loaded if times else None,
        "oom_count": result.oom_count,
        "peak_allocated_metrics": max(peaks) if peaks else None,
        "plan": plan,
        "savers": ", ".join(
            name
            for name, on in (
                ("checkpointing", plan and plan["activation_checkpointing"]),
                ("chunked loss", plan and plan["chunked_loss"]),
            )
            if on
        )
        or "none",
        "plan_seconds": plan["probe"]["seconds"] if plan and plan.get("probe") else None,
        "events": [e for e in events if e["event"] in ("oom", "shrink", "memory_saver", "plan")],
    }


def child(args) -> None:
    """One arm in this process: cap, build, train, write the result JSON."""
    device = C.resolve(args.device)
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    cap = cap_memory(device, None if args.smoke else args.cap_gib)
    data = C.synthetic_tokens(
        args.effective * max(args.hf_steps, args.st_steps), spec.seq, spec.vocab, args.seed + 1
    )
    C.reset_peak(device)
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.model = C.lora_llama(spec, device, base_dtype, args.seed)
    args.loss_fn = C.loss_with_count
    C.synchronize(device)
    loaded_at = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plan-vs-autofind-") as work:
        if args.arm == "hf":
            result = run_hf(args, spec, device, data, loaded_at, Path(work))
        else:
            compiled = args.arm == "steadytrain-compile"
            result = run_steadytrain(args, spec, device, data, loaded_at, Path(work), compiled)
    result["peak_allocated"] = C.peak_allocated(device)
    result["cap_bytes"] = cap
    result["environment"] = C.environment(device)
    Path(args.result).write_text(json.dumps(result, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, no cap, a few steps")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--effective", type=int, default=64)
    ap.add_argument("--hf-steps", type=int, default=None, help="HF optimizer steps (40; smoke 3)")
    ap.add_argument("--st-steps", type=int, default=None, help="steadytrain steps (8; smoke 3)")
    ap.add_argument("--arms", default="hf,steadytrain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.hf_steps = args.hf_steps or (3 if args.smoke else 40)
    args.st_steps = args.st_steps or (3 if args.smoke else 8)
    if args.arm:
        child(args)
        return
    C.require_steadytrain()

    results = {}
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        passed = sys.argv[1:]
        if "--out" in passed:  # the parent writes the results; the child writes one arm's
            i = passed.index("--out")
            passed = passed[:i] + passed[i + 2 :]
        cmd = [sys.executable, __file__, "--arm", arm, "--result", path, *passed]
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
    rows = [
        ["tokens/s, steady steps", *[cell(a, "tokens_per_s", lambda v: f"{v:,.0f}") for a in arms]],
        ["micro-batch", *[cell(a, "micro_batch_size", str) for a in arms]],
        ["accumulation", *[cell(a, "accumulation", str) for a in arms]],
        ["memory savers (plan)", *[cell(a, "savers", str) for a in arms]],
        ["effective batch per step", *[cell(a, "effective_batch_size", str) for a in arms]],
        [
            "first step after model load (s)",
            *[cell(a, "first_step_s", lambda v: f"{v:.1f}") for a in arms],
        ],
        ["out-of-memory events", *[cell(a, "oom_count", str) for a in arms]],
        ["peak allocated", *[cell(a, "peak_allocated", C.gib) for a in arms]],
    ]
    hf = results.get("hf", {}).get("tokens_per_s")
    if hf:
        rows.append(
            [
                "tokens/s vs hf",
                *[cell(a, "tokens_per_s", lambda v, hf=hf: f"{v / hf:.2f} x") for a in arms],
            ]
        )
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    title = (
        f"{spec.name}, LoRA r16 all linear, seq {spec.seq}, effective batch {args.effective}, "
        f"{'no cap (smoke)' if args.smoke else f'{args.cap_gib:g} GiB cap'}"
    )
    text = C.table(["", *arms], rows, title)
    out = args.out or C.default_out("plan_vs_autofind", args.smoke)
    C.write_json(
        out,
        {
            "benchmark": "plan_vs_autofind",
            "settings": vars(args) | {"model": None, "loss_fn": None},
            "results": results,
            "table": text,
        },
    )
    print(f"\nresults: {out}\n")
    print(text)


if __name__ == "__main__":
    main()
