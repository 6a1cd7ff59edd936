#!/usr/bin/env python
"""A real CUDA out-of-memory survived: micro_batch_size "auto" under a 16 GiB cap.

The process's CUDA memory is capped with torch.cuda.set_per_process_memory_fraction so that about
16 GiB is usable (a 16 GB GPU on a big one). A Llama-style model is trained at seq 1024 with an
effective batch of 64 and micro_batch_size "auto": the first attempt runs the whole batch of 64 at
once, which does not fit, so steadytrain runs out of memory for real (torch.OutOfMemoryError),
halves the micro-batch and redoes the same optimizer step until it fits.

Reported: every oom / shrink event (phase, micro size, old -> new), the final micro size, the time
from the first OOM to the end of the redone step (events.jsonl "time" of the oom against
metrics.jsonl "time" of that step), the steady step time afterwards, the peak memory against the
cap, and whether every step still saw 64 samples. Then a reference run, the same training started
directly at the final micro size from the same initial weights on the same data (same cap), and
the parameter difference and loss curves of the two side by side. bf16 on a GPU is not bitwise
deterministic and the first run's later steps may differ in micro size, so only numbers are
reported, no pass/fail.

    python bench/cuda_oom.py --smoke                         # CPU, tiny model, no cap, seconds
    python bench/cuda_oom.py --out $OUT/cuda_oom.json        # GPU
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

from steadytrain.run.records import Metric

NOTABLE = ("oom", "shrink", "memory_saver")
EVENT_FIELDS = ("phase", "micro_batch_size", "old", "new", "reason", "requested", "error", "saver")


def train(model, data, micro, run_dir: Path, args, device) -> dict[str, Any]:
    """One Trainer.fit(); what it did, read back from its run directory."""
    from steadytrain import TrainConfig, Trainer

    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=args.effective,
        micro_batch_size=micro,
        precision=args.precision,
        device=str(device),
        max_steps=args.steps,
        save_every_steps=args.steps,
        log_every_steps=1,
        max_grad_norm=1.0,
        seed=args.seed,
    )
    C.synchronize(device)
    t0 = time.perf_counter()
    trainer = Trainer(
        model, lambda params: C.make_optimizer(params, device.type), C.loss_with_count, data, config
    )
    error = None
    try:
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - reported; the JSON still gets what the run saw
        error = f"{type(exc).__name__}: {exc}"
        result = None
        print(f"fit() failed: {error}", file=sys.stderr)
    C.synchronize(device)
    wall = time.perf_counter() - t0
    del trainer

    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    events = C.read_jsonl(run_dir / "events.jsonl")
    fit_start = next((e["time"] for e in events if e["event"] == "fit_start"), None)
    origin = fit_start if fit_start is not None else (events[0]["time"] if events else 0.0)
    notable = [
        {
            "t": e["time"] - origin,
            "time": e["time"],
            "event": e["event"],
            "step": e["step"] + 1,  # the step being attempted (events carry steps completed)
            **{k: e.get(k) for k in EVENT_FIELDS},
            "peak": (e.get("memory") or {}).get("peak"),
            "reserved": (e.get("memory") or {}).get("reserved"),
        }
        for e in events
        if e["event"] in NOTABLE
    ]
    by_step = {m[Metric.STEP]: m for m in metrics}
    first_oom = next((e for e in notable if e["event"] == "oom"), None)
    recovery = None
    redone = None
    if first_oom is not None and first_oom["step"] in by_step:
        redone = first_oom["step"]
        recovery = by_step[redone][Metric.TIME] - first_oom["time"]
    # Steady: the steps after the last step that had an OOM (or after step 1 when none did).
    last_oom_step = max((e["step"] for e in notable if e["event"] == "oom"), default=1)
    steady = [m for m in metrics if m[Metric.STEP] > last_oom_step]
    deltas = [
        m[Metric.TIME] - by_step[m[Metric.STEP] - 1][Metric.TIME]
        for m in steady
        if m[Metric.STEP] - 1 in by_step
    ]
    step_peaks = [m.get(Metric.MEM_PEAK) for m in metrics if m.get(Metric.MEM_PEAK) is not None]
    oom_peaks = [e["peak"] for e in notable if e["event"] == "oom" and e["peak"] is not None]
    ooms = [e for e in notable if e["event"] == "oom"]
    return {
        "error": error,
        "exit_code": result.exit_code if result else None,
        "steps": result.steps if result else len(metrics),
        "oom_count": result.oom_count if result else len(ooms),
        "final_micro_batch_size": (
            result.micro_batch_size
            if result
            else (metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None)
        ),
        "fit_wall_s": wall,
        "events": notable,
        "first_oom_to_redone_step_end_s": recovery,
        "redone_step": redone,
        "fit_start_to_first_oom_s": first_oom["t"] if first_oom else None,
        "fit_start_to_step1_end_s": by_step[1][Metric.TIME] - origin if 1 in by_step else None,
        "steady_steps": [m[Metric.STEP] for m in steady],
        "steady_step_s_median": C.median(deltas),
        "steady_engine_step_time_median": C.median([m[Metric.STEP_TIME] for m in steady]),
        "peak_allocated_steps": max(step_peaks) if step_peaks else None,
        "peak_allocated_failed_attempts": max(oom_peaks) if oom_peaks else None,
        "reserved_max": max(
            [m.get(Metric.MEM_RESERVED) or 0 for m in metrics]
            + [e["reserved"] or 0 for e in notable]
        )
        or None,
        "samples_per_step": [m[Metric.SAMPLES] for m in metrics],
        "micro_per_step": [(m[Metric.MICRO_BATCH_SIZE], m[Metric.MICRO_STEPS]) for m in metrics],
        "effective_batch_kept": all(
            m[Metric.SAMPLES] == args.effective
            and m[Metric.MICRO_BATCH_SIZE] * m[Metric.MICRO_STEPS] == args.effective
            for m in metrics
        )
        and len(metrics) == args.steps,
        "losses": [m[Metric.LOSS] for m in metrics],
        "tokens": [m[Metric.TOKENS] for m in metrics],
        "run_dir": str(run_dir),
        "per_step": [
            {
                k: m.get(k)
                for k in (
                    "step",
                    "time",
                    "step_time",
                    "loss",
                    "micro_batch_size",
                    "micro_steps",
                    "samples",
                    "tokens",
                    "mem_peak",
                    "mem_reserved",
                    "mem_alloc_retries",
                )
            }
            for m in metrics
        ],
    }


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], init: dict[str, torch.Tensor]):
    """How far run a's parameters are from reference b's, absolutely and against b's own update."""
    worst_name, worst = None, 0.0
    diff_sq = ref_sq = update_sq = 0.0
    max_abs = 0.0
    for name, ref in b.items():
        d = (a[name] - ref).abs()
        scale = ref.abs().max().item()
        rel = d.max().item() / scale if scale > 0 else d.max().item()
        if rel >= worst:
            worst_name, worst = name, rel
        max_abs = max(max_abs, d.max().item())
        diff_sq += d.pow(2).sum().item()
        ref_sq += ref.pow(2).sum().item()
        update_sq += (ref - init[name].float()).pow(2).sum().item()
    return {
        "max_rel_diff": worst,  # max over tensors of max|a-b| / max|b|
        "max_rel_diff_tensor": worst_name,
        "max_abs_diff": max_abs,
        "global_rel_l2": math.sqrt(diff_sq / ref_sq) if ref_sq else None,  # ||a-b|| / ||b||
        "diff_over_update": math.sqrt(diff_sq / update_sq) if update_sq else None,  # / ||b-init||
    }


def cpu_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.3e}"


def report(res: dict[str, Any], args) -> str:
    auto, ref, cap, cmp = res["auto"], res["reference"], res["cap"], res["comparison"]
    ref = ref or {}
    cmp = cmp or {}
    device = res["environment"].get("gpu") or args.device
    if cap["applied"]:
        cap_line = (
            f"cap {C.gib(cap['bytes'])} = fraction {cap['fraction']:.4f} of "
            f"{C.gib(cap['total'])} (torch.cuda.set_per_process_memory_fraction)"
        )
    else:
        cap_line = f"NO CAP APPLIED: {cap['note']}"
    title = (
        f"real out-of-memory survived: {res['model']} ({res['params'] / 1e6:.1f}M params), seq "
        f"{args.seq_used}, effective batch {args.effective}, micro 'auto', {args.precision} on "
        f"{device}, {args.steps} steps\n{cap_line}"
    )
    for name, run in (("auto run", auto), ("reference run", ref)):
        if run.get("error"):
            title += f"\n{name} FAILED: {run['error']}"
    events = C.table(
        ["#", "t since fit_start (s)", "event", "step", "phase", "micro", "detail"],
        [
            [
                i + 1,
                C.fmt(e["t"], 3),
                e["event"],
                e["step"],
                e["phase"] or "",
                f"{e['old']} -> {e['new']}" if e["event"] == "shrink" else e["micro_batch_size"],
                (
                    f"requested {C.gib(e['requested'])}, peak {C.gib(e['peak'])}"
                    if e["event"] == "oom"
                    else (e["reason"] or e["saver"] or "")
                ),
            ]
            for i, e in enumerate(auto["events"])
        ]
        or [["-", "-", "(no oom or shrink event)", "-", "-", "-", "-"]],
        "events (events.jsonl)",
    )
    peaks = (auto["peak_allocated_steps"], auto["peak_allocated_failed_attempts"])
    peak = max([v for v in peaks if v] or [0])
    eff = args.effective
    micro = auto["final_micro_batch_size"]
    ratio = f" ({100 * peak / cap['bytes']:.0f} % of cap)" if cap["applied"] and peak else ""
    samples = sorted(set(auto["samples_per_step"]))
    shrinks = sum(e["event"] == "shrink" for e in auto["events"])
    summary = C.table(
        ["", "value"],
        [
            ["exit code / steps done", f"{auto['exit_code']} / {auto['steps']}"],
            ["OOM events / shrinks", f"{auto['oom_count']} / {shrinks}"],
            ["final micro-batch", f"{micro} x {eff // micro} = {eff}" if micro else "-"],
            ["fit_start -> first OOM (s)", C.fmt(auto["fit_start_to_first_oom_s"], 3)],
            [
                f"first OOM -> end of redone step {auto['redone_step'] or '-'} (s)",
                C.fmt(auto["first_oom_to_redone_step_end_s"], 3),
            ],
            ["fit_start -> end of step 1 (s)", C.fmt(auto["fit_start_to_step1_end_s"], 3)],
            ["steady step time after, median (s)", C.fmt(auto["steady_step_s_median"], 3)],
            ["  engine step_time field (s)", C.fmt(auto["steady_engine_step_time_median"], 3)],
            ["  reference run, same (s)", C.fmt(ref.get("steady_step_s_median"), 3)],
            [
                "whole fit wall: auto / reference (s)",
                f"{C.fmt(auto['fit_wall_s'], 2)} / {C.fmt(ref.get('fit_wall_s'), 2)}",
            ],
            ["peak allocated, completed steps", C.gib(auto["peak_allocated_steps"])],
            ["peak allocated, failed attempts", C.gib(auto["peak_allocated_failed_attempts"])],
            [
                "peak allocated vs cap",
                f"{C.gib(peak)} / {C.gib(cap.get('bytes'))}{ratio}" if peak else "-",
            ],
            ["reserved, max seen", C.gib(auto["reserved_max"])],
            [
                "effective batch kept every step",
                f"{'yes' if auto['effective_batch_kept'] else 'NO'} (samples per step: "
                f"{', '.join(map(str, samples))})",
            ],
            [
                f"reference: started at micro {res['reference_micro']}",
                f"{ref.get('oom_count')} OOM, final micro {ref.get('final_micro_batch_size')}, "
                f"exit {ref.get('exit_code')}"
                if ref
                else "not run",
            ],
            [
                "max relative param diff (max|a-b|/max|b|)",
                f"{_sci(cmp.get('max_rel_diff'))} ({cmp.get('max_rel_diff_tensor')})"
                if cmp
                else "-",
            ],
            ["global relative L2 diff ||a-b||/||b||", _sci(cmp.get("global_rel_l2"))],
            ["diff / reference update ||a-b||/||b-init||", _sci(cmp.get("diff_over_update"))],
            ["memory allocated after cleanup", C.gib(res["allocated_after_cleanup"])],
        ],
        "summary",
    )
    ref_losses = ref.get("losses") or []
    curves = C.table(
        ["step", "micro (auto)", "loss auto", f"loss ref (micro {res['reference_micro']})", "diff"],
        [
            [
                i + 1,
                f"{m} x {k}",
                f"{a:.5f}",
                f"{ref_losses[i]:.5f}" if i < len(ref_losses) else "-",
                f"{a - ref_losses[i]:+.2e}" if i < len(ref_losses) else "-",
            ]
            for i, ((m, k), a) in enumerate(
                zip(auto["micro_per_step"], auto["losses"], strict=True)
            )
        ],
        "loss curves",
    )
    return "\n\n".join([title, events, summary, curves])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, no cap, a few steps")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="default: bf16 (fp32 with --smoke)",
    )
    ap.add_argument("--cap-gib", type=float, default=16.0, help="usable CUDA memory (GiB)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (8; smoke 3)")
    ap.add_argument("--effective", type=int, default=None, help="effective batch (64; smoke 8)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (1024; smoke 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--keep-runs", type=Path, default=None, help="keep the run directories here (default: temp)"
    )
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.precision = args.precision or ("fp32" if args.smoke else "bf16")
    args.steps = args.steps or (3 if args.smoke else 8)
    args.effective = args.effective or (8 if args.smoke else 64)
    C.require_steadytrain()

    device = C.resolve(args.device)
    base = C.SMOKE_MODEL if args.smoke else C.GPU_MODEL
    spec = C.ModelSpec(**{**C.as_dict(base), "seq": args.seq or (base.seq if args.smoke else 1024)})
    args.seq_used = spec.seq
    env = C.environment(device)

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(args.cap_gib * C.GiB / total, 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        cap = {
            "applied": fraction < 1.0,
            "fraction": fraction,
            "total": total,
            "bytes": int(fraction * total),
            "note": None
            if fraction < 1.0
            else f"--cap-gib {args.cap_gib} is not below the GPU's {total / C.GiB:.1f} GiB",
        }
    else:
        cap = {
            "applied": False,
            "fraction": None,
            "total": None,
            "bytes": None,
            "note": f"device {device.type} has no CUDA memory cap; this run exercises the "
            "code path only, so no out-of-memory is expected",
        }
    print(
        ("capped: " if cap["applied"] else "") + (cap["note"] or C.gib(cap["bytes"])),
        file=sys.stderr,
    )

    model = C.build_model(spec, args.seed)  # on the CPU; the Trainer moves it
    n_params = C.param_count(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = C.synthetic_tokens(args.steps * args.effective, spec.seq, spec.vocab, seed=args.seed + 1)

    with C.run_dirs(args.keep_runs, "steadytrain-cuda-oom-") as work:
        auto = train(model, data, "auto", work / "auto", args, device)
        params_auto = cpu_params(model)
        del model
        C.free_device_memory(device)  # gc.collect, synchronize, empty_cache, reset peak
        after = torch.cuda.memory_allocated(device) if device.type == "cuda" else None

        micro = auto["final_micro_batch_size"]
        ref = params_ref = None
        if auto["error"] is None:
            reference_model = C.build_model(spec, args.seed)
            reference_model.load_state_dict(init)
            ref = train(reference_model, data, micro, work / "reference", args, device)
            params_ref = cpu_params(reference_model)
            del reference_model
            C.free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)

    result = {
        "benchmark": "cuda_oom",
        "smoke": args.smoke,
        "environment": env,
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model_spec": C.as_dict(spec),
        },
        "model": spec.name,
        "params": n_params,
        "cap": cap,
        "auto": auto,
        "reference_micro": micro,
        "reference": ref,
        "comparison": compare(params_auto, params_ref, init) if params_ref else None,
        "allocated_after_cleanup": after,
    }
    text = report(result, args)
    result["table"] = text
    out = args.out or C.default_out("cuda_oom", args.smoke)
    C.write_json(out, result)
    print(f"\nresults: {out}\n")
    print(text)
    if auto["error"] or (ref and ref["error"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
