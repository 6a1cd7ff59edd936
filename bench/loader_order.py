"""What a DataLoader's drawn epoch order costs to hold and to checkpoint: a list of Python ints
(as steadytrain held it before) against the int64 tensor `held_order` fills a chunk at a time.

A RandomSampler over `--samples` indices (10,000,000 by default) is drawn as `LoaderOrder`
draws it, each arm in a fresh process so that the resident-memory figures are its own: the
memory the drawn order holds afterwards (RSS after the draw, the sampler's own temporary list
gone and the freed heap trimmed, less RSS before; and the bytes of the order's own objects), the peak while drawing (RandomSampler itself builds a list of the
whole permutation while it yields), the draw time, the time of `DataOrderState.save` (the
list was copied into a tensor there at every checkpoint), the write of data_order.safetensors,
its load back (the list was rebuilt from the tensor), and one step's batch taken from the
order (`batch_at`, the hot loop's only use of it).

    python bench/loader_order.py [--samples N] [--repeat R] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import torch
from _common import default_out, environment, fmt, require_steadytrain, table, write_json

BATCH = 64


def rss() -> int:
    """Resident memory, after giving freed heap pages back (glibc keeps them otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def object_bytes(drawn: object) -> int:
    """What the order's own objects take: the tensor's data, or the list and its ints (the
    ints -5..256 are shared by the interpreter)."""
    if isinstance(drawn, torch.Tensor):
        return drawn.nbytes
    return sys.getsizeof(drawn) + sum(sys.getsizeof(i) for i in drawn if not -5 <= i <= 256)


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(arm: str, samples: int) -> dict[str, float]:
    """One arm in this process: 'list' (the previous code's steps, written out here) or
    'tensor' (steadytrain's)."""
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader, RandomSampler

    from steadytrain.checkpoint.file_io import safetensors_parts
    from steadytrain.checkpoint.payload import Payload
    from steadytrain.checkpoint.state import DATA_ORDER_FILE, DataOrderState, Host
    from steadytrain.engine.sampler import LoaderOrder, OptimizerBatchSampler

    sampler = RandomSampler(range(samples), generator=torch.Generator().manual_seed(0))
    order = LoaderOrder(DataLoader(range(samples), batch_size=BATCH, sampler=sampler))
    before = rss()
    start = time.perf_counter()
    if arm == "list":  # the previous LoaderOrder._draw
        order.drawn = {0: [int(i) for i in sampler]}
    drawn = order(0)
    draw_s = time.perf_counter() - start
    peak = peak_rss() - before
    held = rss() - before

    batches = OptimizerBatchSampler(samples, BATCH, 0, True, True, order)
    out = Payload()
    start = time.perf_counter()
    if arm == "list":  # the previous DataOrderState.save: a tensor made from the list
        out.tensors[DATA_ORDER_FILE] = {"0": torch.tensor(drawn, dtype=torch.int64)}
    else:
        DataOrderState(batches).save(out, {}, Host())
    save_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as work:
        file = Path(work) / DATA_ORDER_FILE
        start = time.perf_counter()
        with open(file, "wb") as f:
            for part in safetensors_parts(out.tensors[DATA_ORDER_FILE])[0]:
                f.write(part)
        write_s = time.perf_counter() - start
        del out
        start = time.perf_counter()
        loaded = load_file(file)["0"]
        back = loaded.tolist() if arm == "list" else loaded  # the previous load: a list again
        load_s = time.perf_counter() - start
    assert (back == drawn) if arm == "list" else torch.equal(back, drawn)
    steps = iter(range(10**9))
    per_batch_us = min(
        timeit.repeat(
            lambda: batches.batch_at(0, next(steps) % batches.steps_per_epoch),
            number=2000,
            repeat=5,
        )
    )
    per_batch_us *= 1e6 / 2000
    return {
        "held_bytes": held,
        "object_bytes": object_bytes(drawn),
        "draw_peak_bytes": peak,
        "bytes_per_sample": held / samples,
        "draw_s": draw_s,
        "save_s": save_s,
        "write_s": write_s,
        "load_s": load_s,
        "batch_us": per_batch_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per arm")
    parser.add_argument("--out", type=Path, default=default_out("loader_order", False))
    parser.add_argument("--arm", choices=["list", "tensor"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_steadytrain()
    if args.arm:
        print(json.dumps(measure(args.arm, args.samples)))
        return
    runs: dict[str, list[dict[str, float]]] = {"list": [], "tensor": []}
    for _ in range(args.repeat):
        for arm in runs:  # interleaved, so drift hits both alike
            done = subprocess.run(
                [sys.executable, __file__, "--arm", arm, "--samples", str(args.samples)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[arm].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"{arm}: {runs[arm][-1]}", file=sys.stderr)
    best = {arm: {k: min(r[k] for r in rows) for k in rows[0]} for arm, rows in runs.items()}
    mb = 1e6
    rows = [
        [
            "list of ints (before)" if arm == "list" else "int64 tensor (now)",
            fmt(b["held_bytes"] / mb, 0, " MB"),
            fmt(b["bytes_per_sample"], 1),
            fmt(b["object_bytes"] / mb, 0, " MB"),
            fmt(b["draw_peak_bytes"] / mb, 0, " MB"),
            fmt(b["draw_s"], 2, " s"),
            fmt(b["save_s"] * 1e3, 1, " ms"),
            fmt(b["write_s"] * 1e3, 0, " ms"),
            fmt(b["load_s"] * 1e3, 0, " ms"),
            fmt(b["batch_us"], 2, " us"),
        ]
        for arm, b in best.items()
    ]
    headers = [
        "order",
        "held (RSS)",
        "B/sample",
        "objects",
        "draw peak",
        "draw",
        "save()",
        "write",
        "load",
        "batch",
    ]
    title = f"A RandomSampler's drawn order, {args.samples:,} indices (best of {args.repeat})"
    print(table(headers, rows, title))
    write_json(
        args.out,
        {
            "samples": args.samples,
            "batch": BATCH,
            "environment": environment(torch.device("cpu")),
            "best": best,
            "runs": runs,
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
