#!/usr/bin/env python
"""What a compiled decoder layer keeps for backward, against the eager layer, per family: the
share the plan counts a sample's growth at when the run compiles its layers after the plan
(memory/plan.py, `COMPILED_GROWTH`; the plan's passes are eager).

For Llama, Qwen3, Gemma 2, Gemma 3, Phi-3, GPT-NeoX, GPT-2 and OLMo 2 at their public shapes
scaled down (widths / 8, heads / 4, 2 layers, vocabulary 512; the ratios of the widths kept), LoRA
r16 on every linear projection, bf16 base under bf16 autocast, 3 × 128 tokens on the CPU: the
bytes of every activation autograd saves in one forward (`saved_tensors_hooks`; parameters left
out, each storage once), eager, compiled with the partitioner's default (activation memory budget
1.0), and compiled as a run compiles (`engine/compiling.py`, `RECOMPUTE_BUDGET`). The share is
compiled / eager. The Llama row's default-partition share, 0.71 here, is what an H100 measured
at full scale (docs/benchmarks.md), so the CPU stands in for the GPU in this count.

    python bench/compiled_growth.py                  # about 3 minutes on 2 cores
    python bench/compiled_growth.py --families llama,gpt2 --out $OUT/compiled_growth.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import families as F
import torch

FAMILIES = ("llama", *F.FAMILIES)
TOKENS = (3, 128)


def scaled_config(family: str):
    """The family's public shape with widths / 8 and heads / 4, two layers, vocabulary 512."""
    if family == "llama":
        spec = C.ModelSpec(
            hidden=256, intermediate=1024, layers=2, heads=8, kv_heads=2, vocab=512, seq=128
        )
        return C.llama_config(spec, tied=True)
    fields = dict(F.SHAPES[family][1])
    for key in ("hidden_size", "intermediate_size", "n_embd"):
        if key in fields:
            fields[key] //= 8
    for key in ("num_attention_heads", "num_key_value_heads", "n_head", "head_dim"):
        if key in fields:
            fields[key] = max(1, fields[key] // 4)
    if "query_pre_attn_scalar" in fields:
        fields["query_pre_attn_scalar"] //= 4
    if "sliding_window" in fields:
        fields["sliding_window"] = 64
    if "pad_token_id" in fields:
        fields.update(pad_token_id=0, eos_token_id=0)
    fields["n_layer" if family == "gpt2" else "num_hidden_layers"] = 2
    fields["vocab_size"] = 512
    config = type(F.config_of(family, True))(**fields)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return config


def saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of the activations one forward saves for backward (then runs the backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        per_token = t.dim() and t.shape[0] in (ids.shape[0], ids.numel())
        if storage.data_ptr() not in params and per_token:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with torch.autocast("cpu", torch.bfloat16), hooks:
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().sum().backward()
    return sum(seen.values())


def measure(family: str) -> dict[str, Any]:
    from steadytrain.engine import compiling

    config = scaled_config(family)
    ids = torch.randint(0, 512, TOKENS, generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    row: dict[str, Any] = {"family": family}
    row["eager"] = saved_bytes(F.build(config, "lora", False, cpu, torch.bfloat16), ids)
    for name, budget in (("default", 1.0), ("run", compiling.RECOMPUTE_BUDGET)):
        torch._dynamo.reset()
        model = F.build(config, "lora", False, cpu, torch.bfloat16)
        compiling.compile_blocks(model, "cpu", budget=budget)
        saved_bytes(model, ids)  # the first call compiles
        row[name] = saved_bytes(model, ids)
        row[f"{name}_share"] = row[name] / row["eager"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    C.require_steadytrain()
    warnings.simplefilter("ignore")  # transformers' and dynamo's notes about the tiny shapes
    started = time.perf_counter()
    rows = []
    for family in args.families.split(","):
        rows.append(measure(family))
        print(f"{family}: {rows[-1]['run_share']:.3f}", file=sys.stderr, flush=True)
    text = C.table(
        ["family", "eager saved", "compiled, default", "share", "compiled as a run", "share"],
        [
            [
                r["family"],
                f"{r['eager'] / 2**20:.2f} MiB",
                f"{r['default'] / 2**20:.2f} MiB",
                f"{r['default_share']:.3f}",
                f"{r['run'] / 2**20:.2f} MiB",
                f"{r['run_share']:.3f}",
            ]
            for r in rows
        ],
        title="activations saved for backward, compiled against eager (CPU, scaled shapes)",
    )
    out = args.out or C.default_out("compiled_growth", False)
    C.write_json(
        out,
        {
            "benchmark": "compiled_growth",
            "tokens": TOKENS,
            "seconds": time.perf_counter() - started,
            "environment": C.environment(torch.device("cpu")),
            "results": rows,
            "table": text,
        },
    )
    print(f"\nresults: {out}\n\n{text}")


if __name__ == "__main__":
    main()
