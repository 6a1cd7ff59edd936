"""A short run that goes through a real out-of-memory shrink, a real SIGKILL and a resume, so
that `steadytrain report` has every kind of incident to show.

    python report_run.py RUN_DIR [--limit-mib M] [--kill-at STEP] [--steps S] [--save-every K]

With --limit-mib the address space is capped at (current size + M MiB) after a warm-up step, so
the first step at the whole batch fails with PyTorch's real CPU allocator error and the micro-batch
shrinks. With --kill-at the first attempt (STEADYTRAIN_RESTART unset or 0, as `steadytrain run`
sets it) kills itself with SIGKILL at the end of that step; the attempt after it resumes from
the last checkpoint and finishes. Activations are large (long sequences) while the weights and
the arithmetic stay small, so the whole run takes seconds on two cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain import Callback, TrainConfig, Trainer, entrypoint

FEATURES, WIDTH, TOKENS, SAMPLES, BATCH = 16, 128, 2048, 128, 32


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, FEATURES),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, TOKENS, FEATURES, generator=g)
    y = x.roll(1, dims=-1) * 0.5
    return model, list(zip(x, y, strict=True))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


class KillOnce(Callback):
    """SIGKILL (uncatchable, like the OS out-of-memory killer) at the end of one step of the
    first attempt only, so the restarted attempt runs to the end."""

    def __init__(self, step: int | None):
        self.step = step

    def on_step_end(self, state, control, info):
        first_attempt = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
        if first_attempt and state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


@entrypoint
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args()
    model, data = build()
    # Warm up thread pools and allocator arenas before any limit: started under a tight limit
    # they abort the process instead of raising.
    loss_fn(model, (data[0][0][None], data[0][1][None])).backward()
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=BATCH,
        micro_batch_size=BATCH,
        max_steps=args.steps,
        save_every_steps=args.save_every,
        async_save=False,  # the checkpoint before the kill is committed when the kill comes
        device="cpu",
        precision="fp32",
        log_every_steps=100,
    )

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))

    return Trainer(
        model,
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        loss_fn,
        data,
        config,
        scheduler=scheduler,
        callbacks=[KillOnce(args.kill_at)],
    ).fit()


if __name__ == "__main__":
    sys.exit(main())
