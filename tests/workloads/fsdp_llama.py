"""A small Llama with LoRA (peft), or an MLP with dropout, run as one process or under torchrun.

    python fsdp_llama.py RUN_DIR [--model llama|dropout] [--distributed MODE] [--steps S]
                                 [--save-every N] [--kill-rank R --kill-at S] [--oom-rank R]
                                 [--micro N|auto] [--device cpu|cuda] [--fsdp-offload]
    python -m torch.distributed.run --nproc_per_node 2 fsdp_llama.py RUN_DIR ...

llama: transformers' LlamaConfig (hidden 64, 2 layers, vocab 128), built from the config (no
download), LoRA r=4 on q_proj/v_proj/lm_head, steadytrain's chunked causal-LM loss (8 tokens a
chunk: it calls the body and the output layer past the sharded root's forward). dropout: an MLP with dropout 0.5;
every rank writes the first step's dropout mask to RUN_DIR/mask-rank-R.pt. --kill-at: rank R
SIGKILLs itself at the end of step S of the first attempt (STEADYTRAIN_RESTART unset or 0). --oom-rank: rank R raises the allocator's out-of-memory
error in its second step's forward. Rank 0 writes the whole trainable state to RUN_DIR/params.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from steadytrain import TrainConfig, Trainer, entrypoint
from steadytrain.events import Callback
from steadytrain.memory.chunked_loss import CausalLMLoss

VOCAB, LENGTH, SAMPLES = 128, 12, 32


def llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    targets = ["q_proj", "v_proj", "lm_head"]  # lm_head: the root unit's own adapter trains
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(base, lora)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=g)
    return model, [{"input_ids": i, "labels": i} for i in ids], CausalLMLoss(chunk_tokens=8)


class Masked(torch.nn.Module):
    """Dropout whose first mask is kept (to compare the ranks' masks)."""

    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)
        self.first: torch.Tensor | None = None

    def forward(self, x):
        out = self.dropout(x)
        if self.first is None:
            self.first = (out == 0).detach().clone()
        return out


def dropout_mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32), torch.nn.Tanh(), Masked(), torch.nn.Linear(32, 2)]
    model = torch.nn.Sequential(*layers)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 2, generator=g)
    return model, list(zip(x, y, strict=True)), mean_loss


def mean_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


class KillAt(Callback):
    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, state, control, info) -> None:
        first = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
        if first and state.step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def fail_in_forward(model, loss_fn, rank: int):
    """loss_fn that raises the CPU allocator's out-of-memory on `rank` in its second step."""
    calls = {"n": 0}

    def loss(m, batch):
        calls["n"] += 1
        if int(os.environ.get("RANK", "0")) == rank and calls["n"] > 2:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                "1048576 bytes. Error code 12 (Cannot allocate memory)"
            )
        return loss_fn(m, batch)

    return loss


class KeepTrainable(Callback):
    """At the end of the fit, while the Trainer's process group is up: the trainable parameters,
    whole (gathered from the shards; every rank takes part)."""

    def __init__(self, model):
        self.model, self.state = model, {}

    def on_fit_end(self, state, control, info) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if info.get("exit_code") != 0:  # a failed rank: the others are not here to gather
            return

        if not dist.is_initialized():
            trainable = self.model.named_parameters()
            self.state = {n: p.detach().clone() for n, p in trainable if p.requires_grad}
            return
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
        self.state = get_model_state_dict(self.model, options=options)


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--model", default="llama", choices=["llama", "dropout"])
    parser.add_argument("--distributed", default="fsdp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--oom-rank", type=int)
    parser.add_argument("--micro", default="2")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--fsdp-offload", action="store_true")
    args = parser.parse_args()
    model, data, loss_fn = llama() if args.model == "llama" else dropout_mlp()
    if args.oom_rank is not None:
        loss_fn = fail_in_forward(model, loss_fn, args.oom_rank)
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=8,
        micro_batch_size=args.micro if args.micro == "auto" else int(args.micro),
        max_steps=args.steps,
        save_every_steps=args.save_every,
        device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if args.device == "cuda" else "cpu",
        fsdp_offload=args.fsdp_offload,
        precision="fp32",
        log_every_steps=1,
        distributed=args.distributed,
        max_grad_norm=0.2 if args.model == "llama" else None,  # below the norms: every step clips
    )
    keep = KeepTrainable(model)
    callbacks = [keep, *([KillAt(args.kill_rank, args.kill_at)] if args.kill_at else [])]
    optimizer = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
    result = Trainer(model, optimizer, loss_fn, data, config, callbacks=callbacks).fit()
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(args.run_dir)
    if args.model == "dropout":
        masked = next(m for m in model.modules() if isinstance(m, Masked))
        torch.save(masked.first, run_dir / f"mask-rank-{rank}.pt")
    if rank == 0:
        state = {k: v.detach().clone() for k, v in keep.state.items()}
        torch.save(state, run_dir / "params.pt")
        summary = {"steps": result.steps, "final_loss": result.final_loss}
        (run_dir / "result.json").write_text(json.dumps(summary))
    return result


if __name__ == "__main__":
    sys.exit(main())
