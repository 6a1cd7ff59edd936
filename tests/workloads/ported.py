"""A ported program of examples/ (port_<PROGRAM>.py) run as a job, for the out-of-memory and
kill tests of tests/test_ports.py.

    python ported.py PROGRAM RUN_DIR [--micro N] [--limit-mib M] [--kill-at STEP]...
                     [--markers DIR] [--big]

--big uses the sizes whose activations dwarf everything else, so that a memory cap of
(address space after a warm-up + M MiB) fits half the batch per micro-batch but not the whole.
--kill-at STEP SIGKILLs the process after STEP once (a marker file in --markers remembers it):
under `steadytrain run` the next attempt resumes and goes past it. Those kills are this test's,
not the OS's: the micro-batch cap the supervisor sets after a SIGKILL is dropped here, so the
run keeps the micro-batch its checkpoint holds. Writes RUN_DIR/params.pt and result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import resource
import signal
import sys
from pathlib import Path

import torch
from _common import vm_size

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from steadytrain import Callback, Trainer, entrypoint  # noqa: E402, F401 - Trainer: imported before any limit

BIG = {  # cheap to compute, heavy in activations
    "mnist_cnn": {
        "image": 64,
        "channels": (4, 8),
        "samples": 64 * 6,
        "test_samples": 64,
        "batch_size": 64,
        "test_batch_size": 64,
        "epochs": 1,
    },
    "word_language_model": {
        "source": "argparse",
        "lines": 1600,
        "bptt": 20,
        "batch_size": 128,
        "eval_batch_size": 8,
        "epochs": 2,
    },
    "plateau_regression": {
        "samples": 8192 * 6,
        "val_samples": 8192,
        "batch_size": 8192,
        "hidden": 256,
        "epochs": 1,
    },
}


class MemoryCap(Callback):
    """At fit_start (threads started, data and model built): cap the address space at its size
    now plus `mib` MiB; with PORTED_MEASURE, print the peak resident rise of the fit."""

    def __init__(self, mib: int | None):
        self.mib = mib

    def on_fit_start(self, state, control, info):
        if os.environ.get("PORTED_MEASURE"):
            Path("/proc/self/clear_refs").write_text("5")
            self.start = vm_size("VmRSS")
        if self.mib:
            limit = vm_size() + self.mib * 2**20
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

    def on_fit_end(self, state, control, info):
        if os.environ.get("PORTED_MEASURE"):
            print("peak rise MiB", (vm_size("VmHWM") - self.start) / 2**20)


class KillOnce(Callback):
    def __init__(self, steps: list[int], markers: Path):
        self.steps, self.markers = steps, markers

    def on_step_end(self, state, control, info):
        marker = self.markers / f"killed-at-{state.step}"
        if state.step in self.steps and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def warm_up() -> None:
    """Forward and backward passes of each kind of layer before any limit: thread pools started
    under a tight limit abort the process instead of raising."""
    x = torch.randn(2, 1, 8, 8, requires_grad=True)
    torch.nn.functional.conv2d(x, torch.randn(4, 1, 3, 3)).relu().sum().backward()
    lstm = torch.nn.LSTM(8, 8, 2)
    with torch.no_grad():  # inference takes another path (oneDNN primitives) than training
        lstm.eval()(torch.randn(3, 2, 8))
    out, _ = lstm.train()(torch.randn(3, 2, 8))
    torch.nn.functional.log_softmax(
        torch.nn.functional.linear(out, torch.randn(5, 8)), -1
    ).sum().backward()


@entrypoint
def main():
    p = argparse.ArgumentParser()
    p.add_argument("program", choices=sorted(BIG))
    p.add_argument("run_dir")
    p.add_argument("--micro", type=int)
    p.add_argument("--limit-mib", type=int)
    p.add_argument("--kill-at", type=int, action="append", default=[])
    p.add_argument("--markers", type=Path)
    p.add_argument("--big", action="store_true")
    args = p.parse_args()
    os.environ.pop("STEADYTRAIN_MAX_MICRO_BATCH", None)
    example = importlib.import_module(f"port_{args.program}")
    sizes = example.Sizes()
    if args.big:
        sizes = dataclasses.replace(sizes, **BIG[args.program])
    warm_up()
    callbacks = [MemoryCap(args.limit_mib)]
    if args.kill_at:
        callbacks.append(KillOnce(args.kill_at, args.markers))
    model, result = example.port(
        args.run_dir,
        sizes,
        callbacks=callbacks,
        micro_batch_size=args.micro or sizes.batch_size,
        device="cpu",
        save_every_steps=2,
        async_save=False,
        progress="lines",
        log_every_steps=1,
        memory_watch=False,
    )
    run_dir = Path(args.run_dir)
    torch.save(model.state_dict(), run_dir / "params.pt")
    (run_dir / "result.json").write_text(
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
