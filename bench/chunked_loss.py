#!/usr/bin/env python
"""What the chunked causal-LM loss saves and costs: plain against chunked cross-entropy on
Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, vocab
128,256, tied embeddings), LoRA r16 on every decoder linear (peft all-linear), fp32 weights under
bf16 autocast, seq 1024, micro-batches 4 and 8.

Each run restores the same initial adapters, then takes warm-up plus timed AdamW steps on the
same synthetic batches (prompts masked with -100), with steadytrain's `causal_lm_loss` as the
loss (`chunk_tokens=None` is the plain loss). Measured: `torch.cuda.max_memory_allocated` over
the whole run, tokens/s over the timed steps, the first step's loss and adapter-gradient norm
(same weights, so they must agree), every step's loss against the plain run's, and
`steadytrain estimate`'s peak for the same settings beside the measured one.

    python bench/chunked_loss.py --smoke                          # CPU, tiny model, seconds
    python bench/chunked_loss.py --out $OUT/chunked_loss.json     # one GPU, about a minute
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

MICROS = (4, 8)
CHUNKS = (None, 1024, 256)
SMOKE_MICROS = (2, 4)
SMOKE_CHUNKS = (None, 16, 5)


def build(spec: C.ModelSpec, device: torch.device) -> torch.nn.Module:
    """Llama with tied embeddings, random fp32 weights made on the device, LoRA r16 on every
    linear of the decoder layers (peft's all-linear leaves the output layer out)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        max_position_embeddings=max(spec.seq, 128),
        use_cache=False,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; random B gives every adapter a gradient
            torch.nn.init.normal_(p, std=0.01)
    model.train()
    return model


def batches(spec: C.ModelSpec, micro: int, steps: int, device: torch.device) -> list[dict]:
    samples = C.synthetic_tokens(micro * steps, spec.seq, spec.vocab, seed=micro)
    out = []
    for i in range(steps):
        rows = samples[i * micro : (i + 1) * micro]
        out.append(
            {k: torch.stack([r[k] for r in rows]).to(device) for k in ("input_ids", "labels")}
        )
    return out


def run(
    model: torch.nn.Module,
    initial: dict[str, torch.Tensor],
    data: list[dict],
    chunk: int | None,
    warmup: int,
    device: torch.device,
    precision: str,
) -> dict[str, Any]:
    from steadytrain.memory.chunked_loss import causal_lm_loss

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(initial[name])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    C.free_device_memory(device)
    losses, grad_norm = [], None
    error = None
    start = None
    try:
        for i, batch in enumerate(data):
            if i == warmup:
                C.synchronize(device)
                start = time.perf_counter()
            with C.autocast(device, precision):
                loss_sum, count = causal_lm_loss(model, batch, chunk_tokens=chunk)
            (loss_sum / count).backward()
            if i == 0:
                grad_norm = torch.linalg.vector_norm(
                    torch.stack(torch._foreach_norm([p.grad for p in params]))
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append((loss_sum.detach() / count).float())
        C.synchronize(device)
    except torch.OutOfMemoryError as exc:
        error = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    seconds = time.perf_counter() - start if start is not None and error is None else None
    timed = len(data) - warmup
    tokens = timed * data[0]["input_ids"].numel()
    result = {
        "chunk_tokens": chunk,
        "peak_allocated": C.peak_allocated(device),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "losses": [float(x) for x in losses],
        "first_grad_norm": float(grad_norm) if grad_norm is not None else None,
        "error": error,
    }
    del optimizer, params, losses
    gc.collect()
    C.free_device_memory(device)
    return result


def estimated_peak(spec: C.ModelSpec, micro: int, chunk: int | None, device_type: str) -> int:
    from transformers import LlamaConfig

    from steadytrain.memory.estimate import Settings, estimate

    config = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        tie_word_embeddings=True,
    )
    settings = Settings(
        micro_batch_size=micro,
        seq=spec.seq,
        precision="bf16",
        weights_dtype="fp32",
        method="lora",
        lora_r=16,
        lora_targets="all-linear",
        device_type=device_type,
        chunked_loss=chunk is not None,
        chunk_tokens=chunk or 1024,
    )
    return estimate(config, settings).peak


def rel_diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / abs(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    C.require_steadytrain()

    device = C.resolve(args.device or ("cpu" if args.smoke else "cuda"))
    spec = C.ModelSpec(**{**C.as_dict(C.SMOKE_MODEL), "seq": 32}) if args.smoke else C.LLAMA_1B
    micros, chunks = (SMOKE_MICROS, SMOKE_CHUNKS) if args.smoke else (MICROS, CHUNKS)
    steps = args.steps or (3 if args.smoke else 10)
    out = args.out or C.default_out("chunked_loss", args.smoke)
    precision = "bf16"

    started = time.perf_counter()
    model = build(spec, device)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    print(f"model built in {time.perf_counter() - started:.1f} s", file=sys.stderr)

    results = []
    for micro in micros:
        data = batches(spec, micro, args.warmup + steps, device)
        plain = None
        for chunk in chunks:
            got = run(model, initial, data, chunk, args.warmup, device, precision)
            got.update(micro=micro, estimate_peak=estimated_peak(spec, micro, chunk, device.type))
            if chunk is None:
                plain = got
            else:
                got["first_loss_rel_diff"] = (
                    rel_diff(got["losses"][0], plain["losses"][0])
                    if got["losses"] and plain["losses"]
                    else None
                )
                got["first_grad_norm_rel_diff"] = rel_diff(
                    got["first_grad_norm"], plain["first_grad_norm"]
                )
                pairs = zip(got["losses"], plain["losses"], strict=False)
                got["max_loss_rel_diff"] = max((rel_diff(a, b) for a, b in pairs), default=None)
                got["peak_saved"] = (
                    plain["peak_allocated"] - got["peak_allocated"]
                    if got["peak_allocated"] is not None and plain["peak_allocated"] is not None
                    else None
                )
                got["throughput_change_pct"] = (
                    -C.pct(got["tokens_per_s"], plain["tokens_per_s"])
                    if got["tokens_per_s"] and plain["tokens_per_s"]
                    else None
                )
            results.append(got)
            print(
                f"micro {micro} chunk {chunk}: peak {C.gib(got['peak_allocated'])}, "
                f"{C.fmt(got['tokens_per_s'], 0)} tokens/s"
                f"{' ' + got['error'] if got['error'] else ''}",
                file=sys.stderr,
            )

    C.write_json(
        out,
        {
            "benchmark": "chunked_loss",
            "smoke": args.smoke,
            "model": C.as_dict(spec),
            "tied": True,
            "lora": "r16 all-linear",
            "precision": "bf16 autocast over fp32 weights",
            "steps": steps,
            "warmup": args.warmup,
            "environment": C.environment(device),
            "seconds": time.perf_counter() - started,
            "results": results,
        },
    )
    headers = [
        "micro",
        "loss",
        "peak alloc",
        "saved",
        "est peak",
        "tokens/s",
        "vs plain",
        "step-1 loss diff",
        "step-1 grad diff",
        "max loss diff",
    ]
    rows = [
        [
            r["micro"],
            "plain" if r["chunk_tokens"] is None else f"chunked {r['chunk_tokens']}",
            C.gib(r["peak_allocated"]) + (" (OOM)" if r["error"] else ""),
            C.gib(r.get("peak_saved")),
            C.gib(r["estimate_peak"]),
            C.fmt(r["tokens_per_s"], 0),
            C.fmt(r.get("throughput_change_pct"), 1, "%"),
            _sci(r.get("first_loss_rel_diff")),
            _sci(r.get("first_grad_norm_rel_diff")),
            _sci(r.get("max_loss_rel_diff")),
        ]
        for r in results
    ]
    print(
        C.table(
            headers,
            rows,
            title=f"plain vs chunked cross-entropy, {spec.name} tied, LoRA r16 all-linear, "
            f"bf16 autocast, seq {spec.seq}, {steps} timed steps on {device}; written to {out}",
        )
    )


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


if __name__ == "__main__":
    main()
