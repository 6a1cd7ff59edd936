"""A Hugging Face `Trainer` run with steadytrain's callback as its one added line.

    python hf_trainer.py OUTPUT_DIR [--batch B] [--accum A] [--steps S] [--save-steps K]
                         [--limit-mib M] [--auto-find] [--hang-at N] [--hang-timeout T]
                         [--slow S] [--memory-budget SIZE]

The model is a wide MLP whose activations grow with the batch while its weights stay small, so
that under --limit-mib (address space capped at the current size + M MiB after one warm-up
forward/backward) a large batch fails with PyTorch's real CPU allocator error. --hang-at N blocks
the N-th forward of the first attempt (STEADYTRAIN_RESTART unset or 0) in a sleep: a step stuck in
user code. --slow S sleeps S seconds per forward (time for a test to send a signal).
Writes OUTPUT_DIR/params.pt and OUTPUT_DIR/result.json when train() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size
from transformers import Trainer, TrainingArguments

from steadytrain.integrations.huggingface import SteadytrainCallback

FEATURES, WIDTH, TOKENS = 64, 1024, 128


class WideMLP(torch.nn.Module):
    def __init__(self, hang_at: int | None = None, slow: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(WIDTH, FEATURES),
        )
        self.hang_at, self.slow, self.calls = hang_at, slow, 0

    def forward(self, x, labels=None):
        self.calls += 1
        if self.hang_at == self.calls and os.environ.get("STEADYTRAIN_RESTART", "0") == "0":
            while True:  # blocked in user code, as a stuck data source or lock would be
                time.sleep(0.5)
        if self.slow:
            time.sleep(self.slow)
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--auto-find", action="store_true")
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-timeout", type=float, default=300.0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--memory-budget", default="auto")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = WideMLP(args.hang_at, args.slow)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, TOKENS, FEATURES, generator=g)
    y = torch.randn(256, TOKENS, FEATURES, generator=g)
    data = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]
    # Warm up thread pools and allocator arenas before any limit (see conftest.MALLOC_ENV).
    model.net(x[:1]).sum().backward()
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        max_steps=args.steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        learning_rate=1e-3,
        auto_find_batch_size=args.auto_find,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        callbacks=[  # the one line
            SteadytrainCallback(hang_timeout=args.hang_timeout, memory_budget=args.memory_budget)
        ],
    )
    trainer.train()
    out = Path(args.output_dir)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"global_step": trainer.state.global_step}))


if __name__ == "__main__":
    main()
