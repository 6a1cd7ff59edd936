"""A training script whose activations grow with the micro-batch while its weights stay small.

    python wide_mlp.py RUN_DIR [--micro whole|auto|N] [--limit-mib M] [--tokens T] [--steps S]
                       [--batch B] [--samples N]

--micro whole (the default) starts at the whole batch, so the out-of-memory ladder is what finds
the size; auto lets the planner choose it. With --limit-mib, the address space is capped at
(current size + M MiB) after one warm-up forward/backward, so too large a micro-batch fails with
PyTorch's real CPU allocator error.
Writes RUN_DIR/result.json and RUN_DIR/params.pt.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain import TrainConfig, Trainer, entrypoint

FEATURES, WIDTH = 64, 2048


def build(tokens: int, samples: int = 256):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, FEATURES),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, tokens, FEATURES, generator=g)
    y = torch.randn(samples, tokens, FEATURES, generator=g)
    return model, list(zip(x, y, strict=True))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--micro", default="whole")
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    model, data = build(args.tokens, args.samples)
    # Warm up thread pools and allocator arenas before any limit: started under a tight limit
    # they abort the process instead of raising.
    loss_fn(model, (data[0][0][None], data[0][1][None])).backward()
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.batch,
        micro_batch_size={"whole": args.batch, "auto": "auto"}.get(args.micro) or int(args.micro),
        max_steps=args.steps,
        save_every_steps=args.steps,
        device="cpu",
        precision="fp32",
        log_every_steps=1,
    )
    result = Trainer(
        model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), loss_fn, data, config
    ).fit()
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        Path(args.run_dir) / "params.pt",
    )
    (Path(args.run_dir) / "result.json").write_text(
        json.dumps(
            {
                "steps": result.steps,
                "micro_batch_size": result.micro_batch_size,
                "final_loss": result.final_loss,
                "oom_count": result.oom_count,
            }
        )
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
