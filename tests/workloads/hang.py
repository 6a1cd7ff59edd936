"""A small training run whose step blocks, for the hang watchdog tests.

    python hang.py RUN_DIR --block KIND [--at STEP] [--once MARKER] [--timeout S]
                   [--action exit|report] [--block-seconds S] [--slow-save S] [--workers N]
                   [--startup-s S] [--async-save]

KIND says how step STEP blocks (after its first micro-batch), each inside a function whose name
the hang report must show:

    none     no block (a normal run)
    sleep    blocked_in_sleep: time.sleep, the GIL released (--block-seconds, default an hour)
    lock     deadlocked_on_lock: a threading.Lock acquired twice (C, GIL released)
    pipe     blocked_reading_pipe: os.read on a pipe nobody writes (C, GIL released)
    worker   a DataLoader worker stuck in stuck_in_worker; the main thread waits on its queue
    gil      holding_the_gil: libc sleep() called through ctypes.PyDLL, which keeps the GIL
    stop     stopping_myself: SIGSTOP to itself, the whole process frozen (only an outside
             watcher can act)
    startup  blocked_in_sleep while fit() reads the first sample for the data fingerprint,
             before any step (--startup-s S shortens the start-up phases' limit,
             hang_limits.STARTUP_S, from 600 s)
    before   blocked_in_sleep before fit() is called (no fit() watchdog yet: under
             steadytrain run, the watch from the process start catches it after
             --first-heartbeat-timeout)

--once MARKER blocks only while MARKER does not exist (it is created just before blocking, with
the pid and the wall time the block began), so under `steadytrain run` the first attempt hangs
and the restarted one finishes. Writes
RUN_DIR/done.json (steps, exit code) when fit() returns.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from steadytrain import Callback, TrainConfig, Trainer, entrypoint

N, FEATURES, BATCH = 64, 4, 8  # 8 steps an epoch


class Data(torch.utils.data.Dataset):
    def __init__(self, block_worker_at_item: int | None, once: Path | None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.block_at, self.once, self.fetched = block_worker_at_item, once, 0
        self.block_startup = False

    def __len__(self):
        return N

    def __getitem__(self, i):
        if self.block_startup and not self.fetched and _arm(self.once):
            blocked_in_sleep(3600)
        self.fetched += 1
        if self.block_at is not None and self.fetched == self.block_at and _arm(self.once):
            stuck_in_worker()
        return self.x[i], self.y[i]


def _arm(once: Path | None) -> bool:
    """True when this attempt should block (and marks it, so the next one does not)."""
    if once is None:
        return True
    if once.exists():
        return False
    once.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
    return True


def blocked_in_sleep(seconds: float) -> None:
    time.sleep(seconds)


def deadlocked_on_lock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def blocked_reading_pipe() -> None:
    read_end, _write_end = os.pipe()
    os.read(read_end, 1)


def stuck_in_worker() -> None:
    time.sleep(3600)


def holding_the_gil() -> None:
    ctypes.PyDLL(None).sleep(3600)


def stopping_myself() -> None:
    time.sleep(0.6)  # less than the timeout: lets the watchdog write a heartbeat of this phase
    os.kill(os.getpid(), signal.SIGSTOP)


class Block(Callback):
    def __init__(self, args):
        self.args = args

    def on_micro_step_end(self, state, control, info):
        args = self.args
        if state.step + 1 != args.at or info["index"] != 0 or args.block in ("none", "worker"):
            return
        if not _arm(args.once):
            return
        if args.block == "sleep":
            blocked_in_sleep(args.block_seconds)
        elif args.block == "lock":
            deadlocked_on_lock()
        elif args.block == "pipe":
            blocked_reading_pipe()
        elif args.block == "gil":
            holding_the_gil()
        elif args.block == "stop":
            stopping_myself()


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@entrypoint
def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument(
        "--block",
        choices=["none", "sleep", "lock", "pipe", "worker", "gil", "stop", "startup", "before"],
        default="none",
    )
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--once", type=Path)
    p.add_argument("--timeout", default="2")
    p.add_argument("--action", default="exit")
    p.add_argument("--block-seconds", type=float, default=3600.0)
    p.add_argument("--slow-save", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--startup-s", type=float)
    p.add_argument("--async-save", action="store_true")  # checkpoints written in the background
    args = p.parse_args()
    if args.startup_s is not None:
        from steadytrain.safety import hang_limits

        hang_limits.STARTUP_S = args.startup_s
    if args.block == "before" and _arm(args.once):
        blocked_in_sleep(3600)

    if args.slow_save:  # a save that takes longer than hang_timeout must not count as a hang
        from steadytrain.checkpoint.store import CheckpointStore

        real_save = CheckpointStore.save

        def slow_save(self, step, payload):
            time.sleep(args.slow_save)
            return real_save(self, step, payload)

        CheckpointStore.save = slow_save

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    block_item = (args.at - 1) * BATCH + 1 if args.block == "worker" else None
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=BATCH,
        micro_batch_size=4,
        max_steps=args.steps,
        save_every_steps=args.save_every,
        keep_last=2,
        async_save=args.async_save,
        device="cpu",
        num_workers=args.workers,
        hang_timeout=args.timeout if args.timeout == "auto" else float(args.timeout),
        hang_action=args.action,
        progress="lines",
        log_every_steps=100,
    )
    data = Data(block_item, args.once)
    data.block_startup = args.block == "startup"
    result = Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn,
        data,
        config,
        callbacks=[Block(args)],
    ).fit()
    (Path(args.run_dir) / "done.json").write_text(
        json.dumps({"steps": result.steps, "exit_code": result.exit_code})
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
