"""Checkpoint save stall: synchronous vs asynchronous, against the disk's own write bandwidth.

A model and AdamW state of about 1 GB in all live on the device; each save captures the whole
training state (steadytrain.checkpoint.run_state.RunState.capture: copies to host memory) and
commits it
through the CheckpointStore (staging, fsync, manifest, rename). The stall is what the training
loop waits for: for a sync save, capture + write + commit; for an async save, capture + handing
the payload to the writer thread. The disk bandwidth is measured in the same run by writing the
same number of bytes to one file with fsync.

    python bench/checkpoint_save.py [--smoke] [--out PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from steadytrain.checkpoint.host import HostBuffers
from steadytrain.checkpoint.ranks import Ranks, RngState
from steadytrain.checkpoint.run_state import RunState
from steadytrain.checkpoint.state import OPTIMIZER_FILE, ModelState, ObjectState, TrainStateState
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.events import TrainState


def build(params_m: float, device: str):
    width = 4096
    layers = max(1, int(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()  # creates the two moment buffers
    opt.zero_grad(set_to_none=True)
    return model, opt


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def disk_bandwidth(folder: Path, nbytes: int) -> float:
    chunk = os.urandom(64 * 2**20)
    path = folder / "bandwidth.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < nbytes:
            handle.write(chunk)
            written += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return written / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--params-m", type=float, default=84.0, help="millions of parameters")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    params_m = 4.0 if args.smoke else args.params_m
    model, opt = build(params_m, device)
    state = TrainState(step=1)
    ranks = Ranks()
    run_state = RunState(
        {
            "model": ModelState(model),
            "optimizer": ObjectState(OPTIMIZER_FILE, opt, "opt", buffered=True),
            "train_state": TrainStateState(state),
            "rng": RngState(ranks),
        },
        {"bench": True},
        ranks,
    )
    folder = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="."))
    rows = {"sync": [], "async_stall": [], "async_total": []}
    host = HostBuffers()  # as the trainer does: allocated once, reused by every save
    try:
        nbytes = None
        for i in range(args.repeats):
            for mode in ("sync", "async"):
                run_dir = folder / f"{mode}{i}"
                store = CheckpointStore(run_dir, keep_last=2)
                sync(device)
                start = time.perf_counter()
                payload = run_state.capture(None, host)
                if mode == "sync":
                    path = store.save(1, payload)
                    rows["sync"].append(time.perf_counter() - start)
                else:
                    store.save_async(1, payload)
                    rows["async_stall"].append(time.perf_counter() - start)
                    path = store.wait()
                    rows["async_total"].append(time.perf_counter() - start)
                nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
                shutil.rmtree(run_dir)
        bandwidth = disk_bandwidth(folder, nbytes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "checkpoint_bytes": nbytes,
        "repeats": args.repeats,
        "seconds": rows,
        "median_s": med,
        "async_stall_over_sync": med["async_stall"] / med["sync"],
        "save_throughput_bytes_per_s": nbytes / med["sync"],
        "disk_write_bytes_per_s": bandwidth,
    }
    gib = nbytes / 2**30
    print(f"checkpoint of {gib:.2f} GiB on {result['device']} ({args.repeats} repeats, median)")
    print(f"  sync save stall          {med['sync']:8.3f} s")
    print(
        f"  async save stall         {med['async_stall']:8.3f} s  "
        f"({100 * result['async_stall_over_sync']:.1f} % of sync)"
    )
    print(f"  async save until commit  {med['async_total']:8.3f} s")
    print(f"  save throughput          {gib / med['sync']:8.2f} GiB/s (sync, capture included)")
    print(f"  disk write bandwidth     {bandwidth / 2**30:8.2f} GiB/s (one file, fsync)")
    out = args.out or Path(__file__).parent / "results" / (
        "checkpoint_save-smoke.json" if args.smoke else "checkpoint_save.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
