"""A tiny Llama whose logits are most of its memory, trained with `CausalLMLoss` (which has a
chunked mode) under micro_batch_size "auto" or a fixed size.

    python plan_chunked.py RUN_DIR [--micro auto|N] [--chunk T] [--room-mib M] [--steps S]
                           [--effective B] [--seq N] [--limit-mib M]

Sequences of 1,024 tokens and a 16,384-entry vocabulary: one sample's fp32 logits, their
log-probabilities and gradient are about 200 MiB in the plain loss, while the chunked loss
(1,024 tokens at a time, or --chunk) holds one chunk's worth whatever the micro-batch. --chunk
starts the loss chunked; --room-mib sets memory_budget to the resident size plus M MiB.
Rerunning on the same RUN_DIR with more --steps resumes. --limit-mib caps the address space
at its size after a warm-up pass plus M MiB (RLIMIT_AS), for a real out-of-memory. Writes RUN_DIR/result.json (micro
size, losses, the loss's chunk size at the end) and RUN_DIR/params.pt.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import psutil
import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain import TrainConfig, Trainer, entrypoint
from steadytrain.memory.chunked_loss import CausalLMLoss

VOCAB = 16384


def build(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=seq,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (16, seq), generator=g)
    return model, [{"input_ids": row, "labels": row} for row in ids]


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--micro", default="auto")
    parser.add_argument("--room-mib", type=int)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--chunk", type=int)
    parser.add_argument("--effective", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--limit-mib", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same rounding in every process of a comparison
    model, data = build(args.seq)
    if args.limit_mib:
        # Warm up thread pools and allocator arenas before the limit (started under a tight
        # limit they abort the process instead of raising), with the chunked loss's smaller pass.
        batch = {k: v[None] for k, v in data[0].items()}
        CausalLMLoss(chunk_tokens=1024)(model, batch)[0].backward()
        model.zero_grad(set_to_none=True)
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    budget = {}
    if args.room_mib:
        budget = {
            "memory_budget": f"{psutil.Process().memory_info().rss // 2**20 + args.room_mib}MiB"
        }
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.effective,
        micro_batch_size=args.micro if args.micro == "auto" else int(args.micro),
        activation_checkpointing=False,
        max_steps=args.steps,
        save_every_steps=args.save_every,
        device="cpu",
        precision="fp32",
        progress="off",
        **budget,
    )
    loss = CausalLMLoss(chunk_tokens=args.chunk)
    result = Trainer(model, lambda p: torch.optim.AdamW(p, lr=1e-3), loss, data, config).fit()
    metrics = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").open()]
    torch.save(model.state_dict(), Path(args.run_dir) / "params.pt")
    (Path(args.run_dir) / "result.json").write_text(
        json.dumps(
            {
                "micro_batch_size": result.micro_batch_size,
                "oom_count": result.oom_count,
                "losses": [m["loss"] for m in metrics],
                "chunk_tokens": loss.chunk_tokens,
            }
        )
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
