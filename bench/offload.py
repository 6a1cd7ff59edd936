#!/usr/bin/env python
"""What offloaded activation checkpointing (`activation_checkpointing: "offload"`,
memory/offload.py) saves and costs against plain checkpointing, on the issue-17 workload: the
Llama-3.2-1B shape with random init and tied embeddings, bf16 base, LoRA r16 / alpha 32 /
dropout 0 on every linear of the decoder layers, seq 1024, bf16 autocast, fused AdamW.

Per micro size and mode (checkpointing switched by `MemorySavers`, as the engine does; offload
once per way of copying in `--copies`: "overlapped", the copies on a side stream with the
backward's prefetch, and "serial", `STEADYTRAIN_OFFLOAD_STREAM=0`, both on the compute stream):
the same synthetic batches, warm-up then timed optimizer steps of one micro-batch each; tokens/s
over the timed steps, `torch.cuda.max_memory_allocated` and `max_memory_reserved` over them. The first step's adapter gradients
of each run are compared with the first plain checkpointing run's (the same weights and batch:
the recomputation is the same arithmetic, so they must agree up to the floor that a second
plain checkpointing run shows, left by the GPU's nondeterministic kernels). What offload should
free: one layer input a layer a sample, hidden × seq × 2 bytes × layers (64 MiB a sample here).

    python bench/offload.py --smoke                       # CPU, tiny model: the code path only
    python bench/offload.py --out $OUT/offload.json       # one GPU, about two minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

COPIES = ("overlapped", "serial")
"""The ways offload copies (`--copies`); on the CPU both are the same plain copy."""


def adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_mode(args, model, data, device, micro: int, mode, copies: str | None = None):
    """One run of `mode`, offload copying the `copies` way (None: not offloaded)."""
    from steadytrain.memory.offload import STREAM_SWITCH

    before = os.environ.get(STREAM_SWITCH)
    os.environ[STREAM_SWITCH] = "0" if copies == "serial" else "1"
    try:
        return {**timed_run(args, model, data, device, micro, mode), "copies": copies}
    finally:
        if before is None:
            del os.environ[STREAM_SWITCH]
        else:
            os.environ[STREAM_SWITCH] = before


def timed_run(args, model, data, device, micro: int, mode) -> dict[str, Any]:
    from steadytrain.memory.chunked_loss import CausalLMLoss
    from steadytrain.memory.savers import MemorySavers

    savers = MemorySavers(model, CausalLMLoss(), discrete_memory=device.type == "cuda")
    in_force = savers.state.activation_checkpointing if savers.set_checkpointing(mode) else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = C.make_optimizer(params, device.type, lr=2e-4)
    start = [p.detach().clone() for p in params]
    loss_fn = CausalLMLoss()
    times, first_grads, losses = [], None, []
    C.free_device_memory(device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            C.synchronize(device)
            C.reset_peak(device)
        began = time.perf_counter()
        rows = [data[(step * micro + i) % len(data)] for i in range(micro)]
        batch = {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}
        with C.autocast(device, "bf16" if device.type == "cuda" else "fp32"):
            loss, count = loss_fn(model, batch)
        (loss / count).backward()
        if step == 0:
            first_grads = adapter_grads(model)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
        losses.append(float(loss.detach() / count))
        times.append(time.perf_counter() - began)
    peak = C.peak_allocated(device)
    # the side stream's copies come from its own pool of the caching allocator: reserved too
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    with torch.no_grad():  # the next run starts from the same adapters
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    savers.set_checkpointing(False)
    timed = times[args.warmup :]
    return {
        "micro": micro,
        "mode": mode,
        "in_force": in_force,
        "tokens_per_s": micro * args.seq * len(timed) / sum(timed),
        "step_s": C.median(timed),
        "peak_allocated": peak,
        "peak_reserved": reserved,
        "losses": losses,
        "_grads": first_grads,
    }


def show(results: list[dict[str, Any]], spec, per_sample: int) -> None:
    """The table: each run's speed (also as a share of the first plain checkpointing run's at
    its micro size), its peak, what it freed against that run, and its gradients' difference."""
    rows = []
    for r in results:
        ckpt = next(x for x in results if x["micro"] == r["micro"] and x["mode"] is True)
        saved = (ckpt["peak_allocated"] or 0) - (r["peak_allocated"] or 0)
        rows.append(
            [
                r["micro"],
                str(r["in_force"]) + (" (again)" if r.get("repeat") else ""),
                r["copies"] or "",
                C.fmt(r["tokens_per_s"], 0),
                f"{r['tokens_per_s'] / ckpt['tokens_per_s']:.3f}",
                C.gib(r["peak_allocated"]),
                C.gib(r["peak_reserved"]),
                C.gib(saved),
                C.gib(per_sample * r["micro"]),
                f"{r['grad_max_rel_diff']:.1e}",
            ]
        )
    headers = ["micro", "checkpointing", "copies", "tokens/s", "× ckpt", "peak GiB"]
    headers += ["reserved GiB", "saved GiB", "inputs GiB", "grad diff"]
    title = f"offloaded checkpointing, {spec.name}, seq {spec.seq}"
    print(C.table(headers, rows, title=title))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps")
    ap.add_argument("--micros", default=None, help="comma-separated (default 8,16; smoke 2)")
    ap.add_argument(
        "--copies",
        default=None,
        help="comma-separated, of " + ",".join(COPIES) + " (default both; smoke overlapped)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (8; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out (3; smoke 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    C.require_steadytrain()
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    device = torch.device("cpu") if args.smoke else C.resolve("cuda")
    micros = [int(m) for m in (args.micros or ("2" if args.smoke else "8,16")).split(",")]
    args.steps = args.steps or (2 if args.smoke else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.seq = spec.seq
    copies = (args.copies or ("overlapped" if args.smoke else ",".join(COPIES))).split(",")
    if not set(copies) <= set(COPIES):
        ap.error(f"--copies: {args.copies!r}; each of {', '.join(COPIES)}")
    base = torch.float32 if args.smoke else torch.bfloat16
    model = C.lora_llama(spec, device, base, args.seed)
    data = C.synthetic_tokens(64, spec.seq, spec.vocab, args.seed)
    results = []
    for micro in micros:
        # plain checkpointing twice: the second run's difference from the first is the floor
        # that the GPU's nondeterministic kernels (attention's backward) leave
        runs = [
            run_mode(args, model, data, device, micro, True),
            *(run_mode(args, model, data, device, micro, "offload", c) for c in copies),
            run_mode(args, model, data, device, micro, True),
        ]
        want = runs[0]["_grads"]
        for run in runs:
            got = run.pop("_grads")
            run["grad_max_rel_diff"] = max(
                (got[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
                for n, g in want.items()
            )
        runs[-1]["repeat"] = True
        results += runs
    per_sample = spec.hidden * spec.seq * 2 * spec.layers
    show(results, spec, per_sample)
    out = args.out or C.default_out("offload", args.smoke)
    C.write_json(
        out,
        {
            "environment": C.environment(device),
            "model": C.as_dict(spec),
            "layer_inputs_per_sample": per_sample,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
