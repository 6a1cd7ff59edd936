"""A training loop of the user's own, guarded by `RunGuard` (the docs' example, runnable).

    python own_loop.py RUN_DIR [--batch B] [--steps S] [--save-every K] [--limit-mib M]
                       [--hang-at N] [--hang-timeout T] [--slow S]

Checkpoints are the program's own torch.save files (RUN_DIR/checkpoints/step-N.pt), each handed
to `guard.checkpoint_saved`; a start resumes from `guard.newest_checkpoint()`. The batch is split
into micro-batches of at most `max_micro_batch()` samples (the cap `steadytrain run` sets after an
out-of-memory exit 76), so every optimizer step sees the whole batch.
Writes RUN_DIR/params.pt at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain.integrations import RunGuard, max_micro_batch

FEATURES, WIDTH, TOKENS = 64, 1024, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-timeout", type=float, default=300.0)
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(WIDTH, FEATURES),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * args.batch, TOKENS, FEATURES, generator=g)
    y = torch.randn(args.steps * args.batch, TOKENS, FEATURES, generator=g)
    model(x[:1]).sum().backward()  # warm up before any limit (see conftest.MALLOC_ENV)
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    run_dir = Path(args.run_dir)
    micro = min(args.batch, max_micro_batch() or args.batch)
    guarded = RunGuard(
        run_dir, config=vars(args), hang_timeout=args.hang_timeout, micro_batch_size=micro
    )
    with guarded as guard:
        start = 0
        found = guard.newest_checkpoint()
        if found is not None:
            saved = torch.load(found, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            start = saved["step"]
            guard.record("resume", {"checkpoint": str(found), "step": start})
        for step in range(start + 1, args.steps + 1):
            batch = slice((step - 1) * args.batch, step * args.batch)
            with guard.step(step) as row:
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for part in range(batch.start, batch.stop, micro):
                    if step == args.hang_at and os.environ.get("STEADYTRAIN_RESTART", "0") == "0":
                        while True:  # blocked in user code
                            time.sleep(0.5)
                    time.sleep(args.slow)
                    xs, ys = x[part : part + micro], y[part : part + micro]
                    loss = torch.nn.functional.mse_loss(model(xs), ys) * len(xs) / args.batch
                    loss.backward()
                    total += loss.item()
                    guard.beat()
                optimizer.step()
                row.update(loss=total, micro_batch_size=micro, samples=args.batch)
            if step % args.save_every == 0 or guard.stop_requested:
                path = run_dir / "checkpoints" / f"step-{step:08d}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, path)
                guard.checkpoint_saved(path, step)
            if guard.stop_requested:
                break  # leaving the block exits 130 / 143
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "params.pt"
    )


if __name__ == "__main__":
    main()
