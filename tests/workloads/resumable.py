"""A small training run that draws from every RNG stream, for resume and signal tests.

    python resumable.py RUN_DIR [--workers N] [--kill-at STEP] [--kill-mid-step STEP]
                        [--signal-at STEP --signal TERM|INT] [--double-sigint] [--seed S]
                        [--perturb-data] [--override FIELD] [--async-save|--sync-save]
                        [--fill-disk-at STEP [--fill-disk-leave BYTES]] [--pid-file F] [--progress-file F]

The dataset draws from python's random, numpy and torch while loading (augmentation); the model
has dropout. Writes RUN_DIR/params.pt when training finishes.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from steadytrain import Callback, TrainConfig, Trainer, entrypoint

N, FEATURES = 40, 6  # effective batch 8 -> 5 steps an epoch; 3 epochs = 15 steps


class NoisyData(torch.utils.data.Dataset):
    def __init__(self, perturb: bool = False):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        if perturb:  # all but the samples the data fingerprint reads (first, middle, last)
            keep = {0, N // 2, N - 1}
            for i in range(N):
                if i not in keep:
                    self.x[i] += 0.5

    def __len__(self):
        return N

    def __getitem__(self, i):
        noise = random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + torch.rand(FEATURES) * 0.01 + noise, self.y[i]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(32, 1),
        )

    def forward(self, x):
        return self.net(x)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def fill_disk(path: Path) -> None:
    """Write `path` until the filesystem holding it is full (ENOSPC)."""
    block = b"\0" * 4096
    with open(path, "ab", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError:
            pass
    with open(path, "ab", buffering=0) as handle:  # the last partial block
        try:
            while True:
                handle.write(b"\0")
        except OSError:
            pass


def wait_for_commit(run_dir: Path, step: int, timeout: float = 120.0) -> None:
    """Poll until the background save of `step` is committed (checkpoints/latest names it): the
    disk must fill after that save and before the next one, however slowly a busy machine writes."""
    if step == 0:
        return
    pointer, want = run_dir / "checkpoints" / "latest", f"step-{step:08d}"
    deadline = time.monotonic() + timeout
    while not (pointer.exists() and pointer.read_text().strip() == want):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{want} was not committed in {timeout:.0f} s")
        time.sleep(0.02)


class Faults(Callback):
    def __init__(self, args):
        self.args = args
        self.steps_here = 0  # optimizer steps done by this process

    def on_step_end(self, state, control, info):
        self.steps_here += 1
        if self.args.progress_file:  # "pid steps-done-here step", replaced atomically
            tmp = f"{self.args.progress_file}.{os.getpid()}.tmp"
            Path(tmp).write_text(f"{os.getpid()} {self.steps_here} {state.step}")
            os.replace(tmp, self.args.progress_file)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        if state.step == self.args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step == self.args.fill_disk_at:
            wait_for_commit(
                Path(self.args.run_dir), state.step // self.args.save_every * self.args.save_every
            )
            filler = Path(self.args.run_dir).parent / "filler"
            fill_disk(filler)
            if self.args.fill_disk_leave:  # room for a few lines, not for a checkpoint
                os.truncate(filler, filler.stat().st_size - self.args.fill_disk_leave)
        if state.step == self.args.signal_at:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.args.signal}"))

    def on_micro_step_end(self, state, control, info):
        if state.step + 1 == self.args.kill_mid_step and info["index"] == 0:
            os.kill(os.getpid(), signal.SIGKILL)


@entrypoint
def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-mid-step", type=int)
    p.add_argument("--signal-at", type=int)
    p.add_argument("--fill-disk-at", type=int)
    p.add_argument("--fill-disk-leave", type=int, default=0)
    p.add_argument("--signal", default="TERM")
    p.add_argument("--double-sigint", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perturb-data", action="store_true")
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--sync-save", action="store_true")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pid-file")
    p.add_argument("--progress-file")
    args = p.parse_args()
    if args.pid_file:
        Path(args.pid_file).write_text(str(os.getpid()))

    if args.double_sigint:  # a second Ctrl-C arrives while the final checkpoint is written
        from steadytrain.checkpoint.store import CheckpointStore

        real_save = CheckpointStore.save

        def save(self, step, payload):
            os.kill(os.getpid(), signal.SIGINT)
            return real_save(self, step, payload)

        CheckpointStore.save = save

    torch.manual_seed(123)
    model = Model()
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=8,
        micro_batch_size=4,
        epochs=args.epochs,
        save_every_steps=args.save_every,
        keep_last=2,
        device="cpu",
        seed=args.seed,
        num_workers=args.workers,
        log_every_steps=100,
        resume_overrides=args.override,
        async_save=not args.sync_save,
    )

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-2)

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))

    result = Trainer(
        model,
        optimizer,
        loss_fn,
        NoisyData(args.perturb_data),
        config,
        scheduler=scheduler,
        callbacks=[Faults(args)],
    ).fit()
    if result.exit_code == 0:
        torch.save(model.state_dict(), Path(args.run_dir) / "params.pt")
    return result


if __name__ == "__main__":
    sys.exit(main())
