"""The same training script run as one process or under torchrun (gloo, CPU).

    python ranks.py RUN_DIR [--loss mean|tokens|wide] [--micro N] [--steps S] [--batch B]
                            [--limit-mib M --limit-rank R] [--save-every N]
                            [--kill-rank R --kill-at S] [--block-rank R --block-at S]
                            [--hang-timeout T] [--hang-action A] [--block-seconds S]
                            [--micro-at M1,M2,...] [--optimizer-mib N]
    python -m torch.distributed.run --nproc_per_node 2 ranks.py RUN_DIR ...

--loss mean: a sample-mean loss; tokens: a token-weighted loss over padded sequences of uneven
length, returned as (loss_sum, count); wide: a wide MLP whose activations grow with the
micro-batch (for the out-of-memory test). With --limit-mib, rank R's address space is capped at
(current size + M MiB) after a warm-up pass and a warm-up collective. With --kill-at, rank R
SIGKILLs itself at the end of step S of the first attempt (STEADYTRAIN_RESTART and
TORCHELASTIC_RESTART_COUNT unset or 0).
With --block-at, rank R sleeps forever after its first micro-batch of step S of the first
attempt (the other ranks then wait for it in the step's agreement); --block-at 0 blocks rank R
at the start of the first step instead, before its first collective, in
blocked_before_first_collective (the other ranks then wait in the first step's first
collective); --block-seconds ends the block after S seconds. --hang-timeout sets the watchdog's limit (seconds), --hang-action its action.
--optimizer-mib N: rank --limit-rank's optimizer factory first takes N MiB at once (an optimizer
that allocates its state when built), out of memory under a smaller --limit-mib.
--micro-at runs step i at micro-batch Mi, as a run that shrank
at those steps did (a shrink redoes the whole step at the smaller size).
Rank 0 writes RUN_DIR/params.pt and RUN_DIR/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch._dynamo  # AdamW's first step imports it: too big to load under a cap
import torch.distributed as dist
import torch.nn.functional as F
from _common import vm_size

from steadytrain import TrainConfig, Trainer, entrypoint
from steadytrain.events import Callback

VOCAB, LENGTH = 23, 7


def build(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mean":
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        x, y = torch.randn(96, 6, generator=g), torch.randn(96, 3, generator=g)
        return model, list(zip(x, y, strict=True)), mean_loss
    if kind == "tokens":
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 12), torch.nn.Linear(12, VOCAB))
        ids = torch.randint(0, VOCAB, (96, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (96,), generator=g)
        labels = torch.where(torch.arange(LENGTH) < lengths[:, None], ids, -100)
        return model, list(zip(ids, labels, strict=True)), token_loss
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 32)
    )
    x, y = torch.randn(128, 64, 32, generator=g), torch.randn(128, 64, 32, generator=g)
    return model, list(zip(x, y, strict=True)), mean_loss


def mean_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def token_loss(model, batch):
    ids, labels = batch
    logits = model(ids)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss_sum, (labels != -100).sum()


def limit_memory(model, data, loss_fn, mib: int) -> None:
    """Warm thread pools and allocator arenas first: started under a tight limit they abort the
    process instead of raising."""
    out = loss_fn(model, tuple(torch.stack([s[i] for s in data[:2]]) for i in range(2)))
    (out[0] if isinstance(out, tuple) else out).backward()
    model.zero_grad(set_to_none=True)
    limit = vm_size() + mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def first_attempt() -> bool:
    """Neither `steadytrain run` nor torchrun's own --max-restarts has restarted this process."""
    restarts = ("STEADYTRAIN_RESTART", "TORCHELASTIC_RESTART_COUNT")
    return all(os.environ.get(name, "0") == "0" for name in restarts)


class KillAt(Callback):
    """SIGKILL this rank at the end of step `step` of the first attempt."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, state, control, info) -> None:
        if first_attempt() and state.step == self.step and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class BlockAt(Callback):
    """Sleep forever after the first micro-batch of step `step` of the first attempt, on `rank`."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_micro_step_end(self, state, control, info) -> None:
        first = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
        if first and state.step + 1 == self.step and dist.get_rank() == self.rank:
            while True:
                time.sleep(3600)


def blocked_before_first_collective(seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 3600.0))


class BlockFirstStep(Callback):
    """Block `seconds` at the start of the first step of the first attempt, on `rank`."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def on_step_start(self, state, control, info) -> None:
        first = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
        if first and state.step == 0 and dist.get_rank() == self.rank:
            blocked_before_first_collective(self.seconds)


def eager_state(factory, mib: int):
    """`factory`, whose optimizer takes `mib` MiB of state when it is built."""

    def build(params):
        state = torch.ones(mib * 2**20 // 4)  # written: the pages are taken, not only reserved
        optimizer = factory(params)
        optimizer.eager_state = state
        return optimizer

    return build


class MicroAt(Callback):
    """Run step i at micro-batch sizes[i - 1]: the schedule a shrinking run took, replayed."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def on_step_start(self, state, control, info) -> None:
        state.micro_batch_size = self.sizes[state.step]


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--loss", default="mean", choices=["mean", "tokens", "wide"])
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--limit-rank", type=int, default=1)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--block-rank", type=int, default=1)
    parser.add_argument("--block-at", type=int)
    parser.add_argument("--hang-timeout", type=float)
    parser.add_argument("--hang-action", choices=["exit", "report"])
    parser.add_argument("--block-seconds", type=float, default=float("inf"))
    parser.add_argument("--optimizer-mib", type=int)
    parser.add_argument("--micro-at", type=lambda s: [int(m) for m in s.split(",")])
    args = parser.parse_args()
    model, data, loss_fn = build(args.loss)
    if args.limit_mib:
        dist.init_process_group("gloo")  # before the limit; the Trainer takes this group
        dist.all_reduce(torch.zeros(4096))  # and the collectives' buffers
        if dist.get_rank() == args.limit_rank:
            limit_memory(model, data, loss_fn, args.limit_mib)
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.batch,
        micro_batch_size=args.micro,
        max_steps=args.steps,
        save_every_steps=args.save_every or args.steps,
        device="cpu",
        precision="fp32",
        log_every_steps=1,
        **({"hang_timeout": args.hang_timeout} if args.hang_timeout else {}),
        **({"hang_action": args.hang_action} if args.hang_action else {}),
    )
    callbacks = [KillAt(args.kill_rank, args.kill_at)] if args.kill_at else []
    if args.block_at:
        callbacks.append(BlockAt(args.block_rank, args.block_at))
    if args.block_at == 0:
        callbacks.append(BlockFirstStep(args.block_rank, args.block_seconds))
    optimizer = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
    if args.optimizer_mib and dist.get_rank() == args.limit_rank:
        optimizer = eager_state(optimizer, args.optimizer_mib)
    if args.micro_at:
        callbacks.append(MicroAt(args.micro_at))
    result = Trainer(model, optimizer, loss_fn, data, config, callbacks=callbacks).fit()
    if dist.is_initialized():  # the script's own group (--limit-mib); the Trainer's is closed
        dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        run_dir = Path(args.run_dir)
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "params.pt"
        )
        summary = {
            "steps": result.steps,
            "micro_batch_size": result.micro_batch_size,
            "final_loss": result.final_loss,
            "oom_count": result.oom_count,
        }
        (run_dir / "result.json").write_text(json.dumps(summary))
    return result


if __name__ == "__main__":
    sys.exit(main())
