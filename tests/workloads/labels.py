"""The most common dataset there is: TensorDataset(X, integer class labels), each label a 0-dim
tensor. Trains a small classifier; with --kill-at STEP it SIGKILLs itself after that step.

    python labels.py RUN_DIR [--kill-at STEP]

Writes RUN_DIR/params.pt when training finishes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from steadytrain import Callback, TrainConfig, Trainer, entrypoint


class KillAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, state, control, info):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def classify(model, batch):
    x, label = batch
    return torch.nn.functional.cross_entropy(model(x), label)


@entrypoint
def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--kill-at", type=int)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=g)
    labels = torch.randint(0, 3, (48,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=8,
        micro_batch_size=4,
        epochs=2,
        save_every_steps=2,
        device="cpu",
        progress="off",
    )
    result = Trainer(
        model,
        lambda params: torch.optim.Adam(params, lr=0.01),
        classify,
        TensorDataset(x, labels),
        config,
        callbacks=[KillAt(args.kill_at)] if args.kill_at else [],
    ).fit()
    torch.save(model.state_dict(), Path(args.run_dir) / "params.pt")
    return result


if __name__ == "__main__":
    sys.exit(main())
