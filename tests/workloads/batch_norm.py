"""A BatchNorm1d model (one vector of features per sample, as a tabular model or an MLP head has
them) whose activations grow with the micro-batch while its weights stay small.

    python batch_norm.py RUN_DIR [--limit-mib M] [--batch B] [--steps S]

The micro-batch starts at the whole batch. With --limit-mib the address space is capped at
(current size + M MiB) after one warm-up pass, so a micro-batch too large fails with PyTorch's
real CPU allocator error, and the out-of-memory ladder halves it; at one sample BatchNorm1d
refuses to train (one value per channel). Writes RUN_DIR/result.json when the run finishes.
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

FEATURES, WIDTH, SPREAD = 64, 1024, 4096  # SPREAD × WIDTH fp32: 16 MiB a sample a tensor


class Spread(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)
        self.out = torch.nn.Linear(WIDTH, FEATURES)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, SPREAD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))  # (N, WIDTH): one value per channel at N = 1
        wide = torch.nn.functional.gelu(h[:, None, :] * self.scale[None, :, None])
        return self.out(wide.mean(1))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Spread()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * args.batch, FEATURES, generator=g)
    data = list(zip(x, torch.randn(4 * args.batch, FEATURES, generator=g), strict=True))
    # Warm up thread pools and allocator arenas before any limit (evaluation mode: one sample).
    model.eval()
    loss_fn(model, (x[:1], x[:1])).backward()
    model.zero_grad(set_to_none=True)
    model.train()
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.batch,
        micro_batch_size=args.batch,
        max_steps=args.steps,
        save_every_steps=args.steps,
        device="cpu",
        precision="fp32",
    )
    result = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), loss_fn, data, config).fit()
    (Path(args.run_dir) / "result.json").write_text(
        json.dumps({"steps": result.steps, "micro_batch_size": result.micro_batch_size})
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
