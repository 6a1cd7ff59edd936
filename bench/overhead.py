#!/usr/bin/env python
"""steadytrain engine overhead against a plain PyTorch loop doing the same work.

Same process, same model and optimizer objects (they keep training from arm to arm), same data in
the same order, same micro-batch and accumulation, same precision, same token-weighted loss. The
arms are run in turn (plain, steadytrain, steadytrain with an int count, plain, ...) so clock and
thermal drift hit all of them alike; each arm's figure is the median over its rounds.

Arms:

* plain: a competent hand-written loop: collate on the CPU, pin, split, .to(device,
  non_blocking=True), autocast, loss_sum / total label tokens (counted on the CPU) -> backward,
  clip_grad_norm_(1.0), optimizer.step(), zero_grad(set_to_none=True); no per-step host sync (the
  loss stays on the device until the end of the round).
* plain-sync: the same loop reading the step's loss on the host every step (float(loss), as a
  loop that logs every step does): one device sync per step, like steadytrain's.
* steadytrain: `Trainer(...).fit()` with max_steps = N and loss_fn returning (loss_sum, count) with
  count a device tensor (labels != -100).sum(); every default callback on (hang watchdog, memory
  watch, progress lines every 10 steps, metrics and events files), as a user runs it.
* steadytrain-bare: the same engine with the hang watchdog, the memory watch and the progress
  display off (metrics and events files stay: the benchmark reads its timings from them), so that
  steadytrain against steadytrain-bare, paired by round, is what watching and telemetry cost.
* steadytrain-callbacks: as steadytrain, with the device synchronised before every event
  dispatch and the host time of each callback's event methods added up: the direct figure for
  what watching and telemetry cost per step (a callback that reads a step's loss would otherwise
  be charged for the device's work). Its throughput is not comparable (a sync per event).
* steadytrain-int-count: the same, but the count is a Python int (precomputed on the CPU by the
  collate function), the other form the API accepts; it shows the cost of the engine turning that
  int into a device tensor on every micro-batch.

Per arm and round: tokens/s over the steady steps (plain: all N steps, synchronised at both ends;
steadytrain: steps 2..N, from metrics.jsonl "time" of step 1 to that of step N, both of which end
in a host sync inside the engine), median step time, the whole `fit()` wall time including setup,
and the GPU peak allocated memory.

    python bench/overhead.py --smoke                         # CPU, tiny model, seconds
    python bench/overhead.py --out $OUT/overhead.json        # GPU, the real measurement
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch
from torch.utils.data import default_collate

from steadytrain.run.records import Metric

ARMS = (
    "plain",
    "plain-sync",
    "steadytrain",
    "steadytrain-bare",
    "steadytrain-callbacks",
    "steadytrain-int-count",
)


@dataclass
class Setup:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: list[dict[str, torch.Tensor]]
    device: torch.device
    precision: str
    micro: int
    effective: int
    seed: int
    work: Path


# -- the plain PyTorch loop -------------------------------------------------------------------


def plain_round(s: Setup, steps: int, sync_each_step: bool = False) -> dict[str, Any]:
    model, optimizer, device, micro, eff = s.model, s.optimizer, s.device, s.micro, s.effective
    params = [p for p in model.parameters() if p.requires_grad]
    order = C.data_order(len(s.data), s.seed)
    pin = device.type == "cuda"
    cuda = device.type == "cuda"
    model.train()
    losses, marks, host = [], [], []
    tokens = 0

    C.reset_peak(device)
    C.synchronize(device)
    if cuda:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    t0 = time.perf_counter()
    host.append(t0)
    for step in range(steps):
        batch = default_collate([s.data[i] for i in order[step * eff : (step + 1) * eff]])
        if pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        n_tokens = int(C.label_tokens(batch["labels"]))  # CPU tensor: no device sync
        tokens += n_tokens
        step_loss = torch.zeros((), device=device)
        for start in range(0, eff, micro):
            piece = {
                k: v[start : start + micro].to(device, non_blocking=True) for k, v in batch.items()
            }
            with C.autocast(device, s.precision):
                loss = C.lm_loss_sum(model, piece) / n_tokens
            loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(step_loss) if sync_each_step else step_loss)
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        host.append(time.perf_counter())
    C.synchronize(device)
    wall = time.perf_counter() - t0

    if cuda:  # step times on the GPU timeline: from the end of one step to the end of the next
        step_s = [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(marks)]
    else:
        step_s = [b - a for a, b in itertools.pairwise(host)]
    return {
        "steps": steps,
        "tokens": tokens,
        "window_s": wall,
        "tokens_per_s": tokens / wall,
        "step_s": step_s,
        "step_s_median": C.median(step_s),
        "fit_wall_s": wall,
        "fit_tokens_per_s": tokens / wall,
        "peak_allocated": C.peak_allocated(device),
        "losses": [float(x) for x in losses],
    }


# -- steadytrain ------------------------------------------------------------------------------


def loss_int_count(model, batch):
    """(loss_sum, count) with count a Python int the collate function computed on the CPU."""
    return C.lm_loss_sum(model, batch), sum(batch["n_label"])


def collate_with_counts(samples):
    batch = default_collate(samples)
    # A list leaf is sliced with the batch and left on the host by the engine.
    batch["n_label"] = [int((x["labels"][1:] != -100).sum()) for x in samples]
    return batch


CALLBACK_SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def _timed_callbacks(sync):
    """Add up the host time each callback class spends in its event methods, so the cost of
    watching and telemetry is read directly, not as a difference of two noisy throughputs."""
    from steadytrain import events

    real = events.Dispatcher.__call__

    def timed(self, event, info=None):
        info = {} if info is None else info
        sync()
        for callback in self.callbacks:
            method = getattr(callback, event.method, None)
            if method is not None:
                t0 = time.perf_counter()
                method(self.state, self.control, info)
                name = f"{type(callback).__name__}.{event.method}"
                CALLBACK_SECONDS[name] = CALLBACK_SECONDS.get(name, 0.0) + time.perf_counter() - t0

    events.Dispatcher.__call__ = timed
    try:
        yield
    finally:
        events.Dispatcher.__call__ = real


@contextlib.contextmanager
def _watchers_off(off: bool):
    """Leave out the hang watchdog and the memory watch (the bare arm); a benchmark-only switch:
    the default callbacks are built with a watchdog that watches nothing and no memory watch."""
    if not off:
        yield
        return
    import steadytrain.trainer.callbacks as D
    from steadytrain.events import Callback

    class Unwatched(Callback):
        """A hang watchdog that watches nothing: what the Trainer calls on one does nothing."""

        say = None

        def start(self, *args: Any) -> None: ...
        def set_up_done(self, *args: Any) -> None: ...
        def stop(self) -> None: ...

    saved = D.HangWatchdog.from_config, D.MemoryWatch.from_config
    D.HangWatchdog.from_config = classmethod(lambda cls, *a, **k: Unwatched())
    D.MemoryWatch.from_config = classmethod(lambda cls, *a, **k: None)
    try:
        yield
    finally:
        D.HangWatchdog.from_config, D.MemoryWatch.from_config = saved


def steadytrain_round(s: Setup, steps: int, arm: str, tag: str) -> dict[str, Any]:
    from steadytrain import TrainConfig, Trainer

    run_dir = s.work / tag
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=s.effective,
        micro_batch_size=s.micro,
        precision=s.precision,
        device=str(s.device),
        max_steps=steps,
        save_every_steps=steps,  # the config refuses more than max_steps; there is no "never"
        log_every_steps=10 if arm in ("steadytrain", "steadytrain-callbacks") else 10**9,
        progress="off" if arm == "steadytrain-bare" else "lines",
        max_grad_norm=1.0,
        seed=s.seed,
    )
    int_count = arm == "steadytrain-int-count"
    C.reset_peak(s.device)
    C.synchronize(s.device)
    wall0 = time.time()
    t0 = time.perf_counter()
    trainer = Trainer(
        s.model,
        s.optimizer,
        loss_int_count if int_count else C.loss_with_count,
        s.data,
        config=config,
        collate_fn=collate_with_counts if int_count else None,
    )
    CALLBACK_SECONDS.clear()
    timed = _timed_callbacks(lambda: C.synchronize(s.device))
    with (
        _watchers_off(arm == "steadytrain-bare"),
        timed if arm == "steadytrain-callbacks" else contextlib.nullcontext(),
    ):
        result = trainer.fit()
    callback_s = dict(CALLBACK_SECONDS)
    C.synchronize(s.device)
    fit_wall = time.perf_counter() - t0
    wall1 = time.time()

    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    events = C.read_jsonl(run_dir / "events.jsonl")
    if result.steps != steps or len(metrics) != steps:
        raise RuntimeError(f"{arm}: fit did {result.steps} steps, {len(metrics)} metric rows")
    fit_start = next((e["time"] for e in events if e["event"] == "fit_start"), None)
    times = [m[Metric.TIME] for m in metrics]
    steady = metrics[1:]  # step 1 also pays for the DataLoader and iterator creation
    intervals = [b - a for a, b in itertools.pairwise(times)]
    steady_tokens = sum(m[Metric.TOKENS] for m in steady)
    window = times[-1] - times[0]
    all_tokens = sum(m[Metric.TOKENS] for m in metrics)
    peaks = [m.get(Metric.MEM_PEAK) for m in metrics if m.get(Metric.MEM_PEAK) is not None]
    return {
        "steps": steps,
        "tokens": steady_tokens,
        "window_s": window,
        "tokens_per_s": steady_tokens / window if window > 0 else None,
        "step_s": intervals,
        "step_s_median": C.median(intervals),
        "engine_step_time_median": C.median([m[Metric.STEP_TIME] for m in steady]),
        "engine_compute_time_median": C.median([m[Metric.COMPUTE_TIME] for m in steady]),
        "engine_optimizer_time_median": C.median([m[Metric.OPTIMIZER_TIME] for m in steady]),
        "engine_data_time_median": C.median([m[Metric.DATA_TIME] for m in steady]),
        "fit_wall_s": fit_wall,
        "fit_tokens_per_s": all_tokens / fit_wall,
        "setup_s": (fit_start - wall0) if fit_start else None,
        "first_step_s": (times[0] - fit_start) if fit_start else None,
        "teardown_s": wall1 - times[-1],
        # The engine resets the peak counter at the start of every step, so the run's peak is the
        # largest per-step peak in metrics.jsonl, not max_memory_allocated() after fit().
        "peak_allocated": max(peaks) if peaks else C.peak_allocated(s.device),
        "peak_allocated_after_fit": C.peak_allocated(s.device),
        "callback_s": callback_s,
        "oom_count": result.oom_count,
        "exit_code": result.exit_code,
        "losses": [m[Metric.LOSS] for m in metrics],
        "run_dir": str(run_dir),
    }


# -- main -------------------------------------------------------------------------------------


# Watching and telemetry; the checkpoint saver is measured on its own (checkpoint_save.py).
WATCHING = ("HangWatchdog", "MemoryWatch", "SignalStop", "ConsoleLog", "RunFiles", "TensorBoardLog")


def _per_step_callback_s(r: dict[str, Any]) -> float:
    """Host seconds per optimizer step that watching and telemetry spend in the per-step events
    (step_start, micro_step_end, step_end); what every step pays."""
    per_step = ("on_step_start", "on_micro_step_end", "on_step_end")
    total = sum(
        v
        for k, v in r["callback_s"].items()
        if k.endswith(per_step) and k.split(".")[0] in WATCHING
    )
    return total / r["steps"]


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for arm, rs in rounds.items():
        row = {
            key: C.median([r.get(key) for r in rs])
            for key in (
                "tokens_per_s",
                "step_s_median",
                "fit_wall_s",
                "fit_tokens_per_s",
                "engine_step_time_median",
                "engine_compute_time_median",
                "engine_optimizer_time_median",
                "engine_data_time_median",
                "setup_s",
                "first_step_s",
                "teardown_s",
            )
        }
        peaks = [r["peak_allocated"] for r in rs if r.get("peak_allocated") is not None]
        row["peak_allocated"] = max(peaks) if peaks else None
        per_step = [_per_step_callback_s(r) for r in rs if r.get("callback_s")]
        row["callbacks_per_step_s"] = C.median(per_step) if per_step else None
        if per_step and row.get("step_s_median"):
            row["callbacks_pct_of_step"] = (
                100.0 * row["callbacks_per_step_s"] / row["step_s_median"]
            )
        row["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in rs]
        out[arm] = row
    base = out.get("plain", {})
    plain_rounds = [r["tokens_per_s"] for r in rounds.get("plain", [])]
    for arm, row in out.items():
        # Paired: each round's arm against the plain run beside it, so drift between rounds
        # cancels; the median of those ratios.
        ratios = [
            r["tokens_per_s"] / p
            for r, p in zip(rounds[arm], plain_rounds, strict=False)
            if p and r.get("tokens_per_s")
        ]
        row["overhead_paired_pct"] = 100.0 * (1.0 - C.median(ratios)) if ratios else None
    bare_rounds = [r["tokens_per_s"] for r in rounds.get("steadytrain-bare", [])]
    for arm, row in out.items():
        # What the watchdog, memory watch and progress display cost: each round's arm against
        # the bare engine run beside it.
        ratios = [
            r["tokens_per_s"] / b
            for r, b in zip(rounds[arm], bare_rounds, strict=False)
            if b and r.get("tokens_per_s")
        ]
        row["vs_bare_paired_pct"] = 100.0 * (1.0 - C.median(ratios)) if ratios else None
    for row in out.values():
        row["overhead_pct"] = C.pct(row["tokens_per_s"], base.get("tokens_per_s"))
        row["overhead_incl_setup_pct"] = C.pct(row["fit_tokens_per_s"], base.get("tokens_per_s"))
        row["step_time_vs_plain_pct"] = (
            -C.pct(row["step_s_median"], base.get("step_s_median"))
            if base.get("step_s_median") and row["step_s_median"] is not None
            else None
        )
        peak, base_peak = row["peak_allocated"], base.get("peak_allocated")
        row["peak_vs_plain_pct"] = (
            100.0 * (peak - base_peak) / base_peak if peak and base_peak else None
        )
    return out


def _ms(v):
    return C.fmt(None if v is None else v * 1000, 1)


def _ms3(v):
    return C.fmt(None if v is None else v * 1000, 3)


def _signed(v):
    return "-" if v is None else f"{v:+.1f} %"


def _num(digits):
    return lambda v: C.fmt(v, digits)


def report(summary, rounds, args, spec, n_params, env) -> str:
    arms = list(summary)

    def row(label, key, show, plain_too=True):
        cells = []
        for arm in arms:
            value = summary[arm].get(key) if isinstance(key, str) else key(summary[arm])
            cells.append(show(value) if plain_too or arm != "plain" else "-")
        return [label, *cells]

    def breakdown(s):
        keys = (
            "engine_compute_time_median",
            "engine_optimizer_time_median",
            "engine_data_time_median",
        )
        return None if s.get(keys[0]) is None else " / ".join(_ms(s[k]) for k in keys)

    rows = [
        row("tokens/s, steady steps (median of rounds)", "tokens_per_s", _num(0)),
        row("  overhead vs plain, paired by round", "overhead_paired_pct", _signed, False),
        row("  overhead vs plain", "overhead_pct", _signed, False),
        row("  overhead vs steadytrain-bare, paired", "vs_bare_paired_pct", _signed, False),
        row("  watching+telemetry host time per step (ms)", "callbacks_per_step_s", _ms3, False),
        row("  as % of the step time", "callbacks_pct_of_step", _num(3), False),
        row("step time, median (ms)", "step_s_median", _ms),
        row("  vs plain", "step_time_vs_plain_pct", _signed, False),
        row("  engine step_time field (ms)", "engine_step_time_median", _ms, False),
        row("    compute / optimizer / data (ms)", breakdown, C.fmt, False),
        row("whole run wall incl. setup (s)", "fit_wall_s", _num(2)),
        row("tokens/s incl. setup", "fit_tokens_per_s", _num(0)),
        row("  overhead vs plain", "overhead_incl_setup_pct", _signed, False),
        row("  fit() call to fit_start event (s)", "setup_s", _num(3), False),
        row("  fit_start to end of step 1 (s)", "first_step_s", _num(3), False),
        row("  end of last step to fit() return (s)", "teardown_s", _num(3), False),
        row("GPU peak allocated", "peak_allocated", C.gib),
        row("  vs plain", "peak_vs_plain_pct", _signed, False),
    ]
    device = env.get("gpu") or str(args.device)
    title = (
        f"steadytrain engine overhead vs plain PyTorch: {spec.name} "
        f"({n_params / 1e6:.1f}M params), seq {spec.seq}, micro {args.micro} x "
        f"{args.effective // args.micro} = {args.effective}, {args.precision} on {device}\n"
        f"{args.steps} optimizer steps per round, {args.rounds} rounds per arm, ABBA order; "
        "median over rounds.\nSteady step time: plain from CUDA events (host clock on CPU), "
        "steadytrain from metrics.jsonl time deltas (steps 2..N).\n"
        "Overhead = (plain - arm) / plain on tokens/s; positive = slower than plain."
    )
    main = C.table(["", *arms], rows, title)
    per_round = C.table(
        ["round", *[f"{a} tok/s" for a in arms]],
        [
            [i + 1, *[C.fmt(rounds[a][i]["tokens_per_s"], 0) for a in arms]]
            for i in range(args.rounds)
        ],
        "per round (run order within a round: " + ", ".join(arms) + ")",
    )
    return main + "\n\n" + per_round


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="default: bf16 (fp32 with --smoke)",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per round (25; smoke 3)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (5; smoke 1)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--effective", type=int, default=32)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (512; smoke 32)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--keep-runs", type=Path, default=None, help="keep the run directories here (default: temp)"
    )
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.precision = args.precision or ("fp32" if args.smoke else "bf16")
    args.steps = args.steps or (3 if args.smoke else 25)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "plain" not in arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms must include plain and be among {ARMS}")
    if args.effective % args.micro:
        ap.error("--micro must divide --effective")
    C.require_steadytrain()

    device = C.resolve(args.device)
    spec = C.SMOKE_MODEL if args.smoke else C.GPU_MODEL
    if args.seq:
        spec = C.ModelSpec(**{**C.as_dict(spec), "seq": args.seq})
    env = C.environment(device)

    from steadytrain.engine import OptimizerBatchSampler

    samples = max(args.steps, args.warmup) * args.effective
    data = C.synthetic_tokens(samples, spec.seq, spec.vocab, seed=args.seed + 1)
    sampler_order = [
        int(i) for i in OptimizerBatchSampler(samples, args.effective, args.seed).order(0)
    ]
    if sampler_order != C.data_order(samples, args.seed):
        sys.exit(
            "the plain loop's data order no longer matches steadytrain's sampler; update "
            "bench/_common.py data_order"
        )
    model = C.build_model(spec, args.seed).to(device)
    optimizer = C.make_optimizer(model.parameters(), device.type)
    n_params = C.param_count(model)

    with C.run_dirs(args.keep_runs, "steadytrain-overhead-") as work:
        s = Setup(
            model,
            optimizer,
            data,
            device,
            args.precision,
            args.micro,
            args.effective,
            args.seed,
            work,
        )

        def run(arm: str, steps: int, tag: str) -> dict[str, Any]:
            if arm in ("plain", "plain-sync"):
                return plain_round(s, steps, sync_each_step=arm == "plain-sync")
            return steadytrain_round(s, steps, arm, tag)

        print(f"warming up: {args.warmup} step(s) per arm", file=sys.stderr)
        for arm in arms:
            run(arm, args.warmup, f"warmup-{arm}")
        rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for i in range(args.rounds):
            # ABBA order: a slow drift (clocks, neighbours) favours neither arm.
            for arm in arms if i % 2 == 0 else arms[::-1]:
                r = run(arm, args.steps, f"round{i + 1}-{arm}")
                rounds[arm].append(r)
                print(f"round {i + 1} {arm}: {r['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)

    summary = summarize(rounds)
    text = report(summary, rounds, args, spec, n_params, env)
    out = args.out or C.default_out("overhead", args.smoke)
    C.write_json(
        out,
        {
            "benchmark": "overhead",
            "smoke": args.smoke,
            "environment": env,
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "model": C.as_dict(spec),
                "params": n_params,
                "arms": arms,
            },
            "summary": summary,
            "rounds": rounds,
            "table": text,
        },
    )
    print(f"\nresults: {out}\n")
    print(text)


if __name__ == "__main__":
    main()
