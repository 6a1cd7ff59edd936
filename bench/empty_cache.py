"""What `empty_cache` every step costs, and what the memory watch costs per step.

The memory watch's cache policy 'auto' empties the allocator cache only when the readings say the
cache dwarfs the tensors; 'every_step' empties it after every optimizer step. This measures the
price of the latter on a Llama-style training step (AdamW): median step time with no emptying
against emptying after every step, in interleaved rounds so drift hits both alike, and the time of
the `Device.empty_cache()` call itself (CPU: glibc `malloc_trim`, whose freed pages the next step
faults back in; CUDA: `torch.cuda.empty_cache`, after which the next step goes back to cudaMalloc).
It also times the per-step readings the watch relies on: `Device.memory()` (the loop takes one
every step), `Device.swap_in()` (the watch samples it at most once a second) and the watch's whole
`on_step_end`.

    python bench/empty_cache.py [--device cpu|cuda] [--smoke] [--rounds N] [--steps N] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import (
    GPU_MODEL,
    SMOKE_MODEL,
    ModelSpec,
    as_dict,
    autocast,
    build_model,
    default_out,
    environment,
    fmt,
    lm_loss_sum,
    make_optimizer,
    median,
    require_steadytrain,
    synchronize,
    synthetic_tokens,
    table,
    write_json,
)

CPU_MODEL = ModelSpec(
    hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2, vocab=4096, seq=128
)


def train_steps(model, opt, batches, device, precision, steps, device_obj, empty: bool):
    """`steps` optimizer steps; returns (step times, empty_cache call times) in seconds."""
    times, calls = [], []
    for i in range(steps):
        batch = {k: v.to(device) for k, v in batches[i % len(batches)].items()}
        synchronize(device)
        start = time.perf_counter()
        with autocast(device, precision):
            loss = lm_loss_sum(model, batch) / batch["labels"].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, batch
        if empty:
            synchronize(device)
            call = time.perf_counter()
            device_obj.empty_cache()
            synchronize(device)
            calls.append(time.perf_counter() - call)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times, calls


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (checks the code)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, help="steps per round and mode")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    require_steadytrain()
    from steadytrain.device import resolve_device
    from steadytrain.events import Control, StepMetrics, TrainState
    from steadytrain.safety.memory_watch import MemoryWatch

    device_obj = resolve_device(args.device)
    device = device_obj.torch_device
    spec = SMOKE_MODEL if args.smoke else GPU_MODEL if device.type == "cuda" else CPU_MODEL
    precision = "bf16" if device.type == "cuda" and not args.smoke else "fp32"
    steps = args.steps or (5 if args.smoke else 30 if device.type == "cuda" else 15)
    rounds = 1 if args.smoke else args.rounds

    model = build_model(spec, seed=0).to(device)
    opt = make_optimizer(model.parameters(), device.type)
    batches = [
        {k: torch.stack([s[k] for s in chunk]) for k in chunk[0]}
        for chunk in (
            synthetic_tokens(args.batch * 4, spec.seq, spec.vocab, seed=1)[i : i + args.batch]
            for i in range(0, args.batch * 4, args.batch)
        )
    ]
    train_steps(model, opt, batches, device, precision, 3, device_obj, empty=False)  # warm-up

    results = {"never": [], "every_step": []}
    calls: list[float] = []
    for _ in range(rounds):
        for mode in ("never", "every_step"):
            times, call_times = train_steps(
                model, opt, batches, device, precision, steps, device_obj, mode == "every_step"
            )
            results[mode] += times
            calls += call_times

    base, every = median(results["never"]), median(results["every_step"])
    slowdown = 100.0 * (every - base) / base
    call_ms = median(calls) * 1e3

    record: list[tuple[str, dict]] = []
    watch = MemoryWatch(device_obj, lambda name, info: record.append((name, info)))
    state = TrainState(steps_per_epoch=1000, effective_batch_size=8, micro_batch_size=8)
    control = Control()
    watch.on_fit_start(state, control, {})
    reading = device_obj.memory().to_dict()

    def watch_step():
        state.step += 1
        metrics = StepMetrics({"step_time": 0.1, "memory": reading})
        watch.on_step_end(state, control, {"metrics": metrics})

    memory_us = per_call_us(device_obj.memory, 200)
    swap_in_us = per_call_us(device_obj.swap_in, 200)
    watch_us = per_call_us(watch_step, 2000)

    print(
        table(
            ["empty_cache", "median step", "vs never", "steps"],
            [
                ["never", fmt(base * 1e3, 2, " ms"), "-", len(results["never"])],
                [
                    "every_step",
                    fmt(every * 1e3, 2, " ms"),
                    fmt(slowdown, 1, " %"),
                    len(results["every_step"]),
                ],
            ],
            title=f"{spec.name}, batch {args.batch}, {precision} on {device}",
        )
    )
    print()
    print(
        table(
            ["per-step cost", "time"],
            [
                ["Device.empty_cache() call", fmt(call_ms, 3, " ms")],
                ["Device.memory() (loop, every step)", fmt(memory_us, 1, " µs")],
                ["Device.swap_in() (watch, ≤ 1/s)", fmt(swap_in_us, 1, " µs")],
                ["MemoryWatch.on_step_end", fmt(watch_us, 1, " µs")],
            ],
        )
    )
    out = args.out or default_out(f"empty_cache-{device.type}", args.smoke)
    write_json(
        out,
        {
            "environment": environment(device),
            "model": as_dict(spec),
            "batch": args.batch,
            "precision": precision,
            "rounds": rounds,
            "steps_per_round": steps,
            "median_step_s": {"never": base, "every_step": every},
            "every_step_slowdown_pct": slowdown,
            "empty_cache_call_s": median(calls),
            "device_memory_us": memory_us,
            "device_swap_in_us": swap_in_us,
            "memory_watch_on_step_end_us": watch_us,
            "step_times_s": results,
        },
    )
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
