"""Two residual blocks whose activations grow with the micro-batch, trained under torchrun (gloo,
CPU), each rank's address space capped.

    python -m torch.distributed.run --nproc_per_node 2 planned_ranks.py RUN_DIR
        [--distributed fsdp|ddp] [--micro auto|N] [--limit-mib M] [--steps S]
        [--checkpointing] [--model blocks|llama]

The model has its own activation checkpointing switch (as Hugging Face models have), so the
planner and the memory ladder can turn it on (--checkpointing: on from the start); under fsdp each block is sharded on its own.
A sample is 384 tokens of width 32, widened to 4096 inside each block: about 30 MiB of
activations a sample. With --limit-mib every rank's address space is capped at its size plus M
MiB, after a warm-up pass and a warm-up collective (thread pools and arenas started under a
tight limit abort instead of raising). Rank 0 writes RUN_DIR/result.json (steps, micro-batch,
out-of-memory count).

--model llama: a Hugging Face Llama of 8 decoder layers, 16 wide with an MLP 8192 wide, 512
tokens a sample (the 4 samples of an optimizer batch, 2 a rank): a family the estimate models,
so the plan is priced per rank. One sample's activations are about 0.5 GiB plain, under 0.1 GiB
with activation checkpointing (one layer recomputed at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch._dynamo  # AdamW's first step imports it: too big to load under a cap
import torch.distributed as dist
import torch.nn.functional as F
from _common import vm_size
from torch.utils.checkpoint import checkpoint

from steadytrain import TrainConfig, Trainer, entrypoint

TOKENS, WIDTH, INNER, SAMPLES = 384, 32, 4096, 32


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, INNER)
        self.down = torch.nn.Linear(INNER, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(torch.nn.Module):
    """Blocks with a switch for activation checkpointing, named as Hugging Face names it."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = True

    def gradient_checkpointing_disable(self):
        self.checkpointing = False

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return x


def mean_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def lm_loss(model, batch):
    return model(**batch).loss


def llama():
    """The tiny Llama and its samples (see the module's docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=LLAMA_TOKENS,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, LLAMA_TOKENS), generator=g)
    return model, [{"input_ids": row, "labels": row} for row in ids]


LLAMA_TOKENS = 512


def limit_memory(model, warm_up, mib: int, loss=mean_loss) -> None:
    loss(model, warm_up).backward()
    model.zero_grad(set_to_none=True)
    limit = vm_size() + mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--distributed", default="fsdp")
    parser.add_argument("--micro", default="auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--model", default="blocks")
    args = parser.parse_args()
    torch.manual_seed(0)
    loss = lm_loss if args.model == "llama" else mean_loss
    if args.model == "llama":
        model, data = llama()
    else:
        model = Net()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, TOKENS, WIDTH, generator=g)
        y = torch.randn(SAMPLES, TOKENS, WIDTH, generator=g)
        data = list(zip(x, y, strict=True))
    dist.init_process_group("gloo")  # before the limit; the Trainer takes this group
    dist.all_reduce(torch.zeros(4096))  # and the collectives' buffers
    if args.limit_mib:
        if args.model == "llama":  # a short sample: a whole one is about 1 GiB plain
            warm_up = {k: v[None, :64] for k, v in data[0].items()}
        else:
            warm_up = tuple(torch.stack([s[i] for s in data[:2]]) for i in range(2))
        limit_memory(model, warm_up, args.limit_mib, loss)
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.batch,
        micro_batch_size=args.micro if args.micro == "auto" else int(args.micro),
        max_steps=args.steps,
        save_every_steps=args.steps,
        device="cpu",
        precision="fp32",
        log_every_steps=1,
        distributed=args.distributed,
        activation_checkpointing=True if args.checkpointing else "auto",
    )
    optimizer = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
    result = Trainer(model, optimizer, loss, data, config).fit()
    dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        summary = {
            "steps": result.steps,
            "micro_batch_size": result.micro_batch_size,
            "oom_count": result.oom_count,
        }
        (Path(args.run_dir) / "result.json").write_text(json.dumps(summary))
    return result


if __name__ == "__main__":
    sys.exit(main())
