"""A model whose state is large beside its activations, under a memory cap set at fit_start
(threads started, model built) that leaves room for training (the gradients) but not for a
second full copy of the state beside them.

    python big_state.py RUN_DIR --cap-mib M

Writes RUN_DIR/result.json (steps, micro_batch_size, oom_count).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap

from steadytrain import Callback, TrainConfig, Trainer, entrypoint

WIDTH = 2048  # two 2048×4096 layers: 64 MiB of weights, 64 MiB of gradients


class Cap(Callback):
    def __init__(self, mib: int):
        self.mib = mib

    def on_fit_start(self, state, control, info):
        size = next(
            int(line.split()[1]) * 1024
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmSize:")
        )
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (size + self.mib * 2**20, hard))


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@entrypoint
def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--cap-mib", type=int, required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
    )
    mse(model, (torch.randn(2, WIDTH), torch.randn(2, WIDTH))).backward()  # thread pools, first
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    data = list(
        zip(torch.randn(32, WIDTH, generator=g), torch.randn(32, WIDTH, generator=g), strict=True)
    )
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=8,
        micro_batch_size=8,
        max_steps=6,
        save_every_steps=2,
        keep_last=2,
        async_save=True,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    result = Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.01),
        mse,
        data,
        config,
        callbacks=[Cap(args.cap_mib)],
    ).fit()
    (Path(args.run_dir) / "result.json").write_text(
        json.dumps(
            {
                "steps": result.steps,
                "micro_batch_size": result.micro_batch_size,
                "oom_count": result.oom_count,
            }
        )
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
