#!/usr/bin/env python
"""The estimate and the plan on every decoder family people fine-tune: Qwen3, Gemma 2, Gemma 3,
Phi-3, GPT-NeoX, GPT-2 and OLMo 2, each at the shape of a real public model (random init on the
GPU, no downloads; Gemma 2 and Phi-3 keep their widths with fewer layers, to stay near 1B).

1. Estimate: for each family, LoRA r16 on every linear projection and a full fine-tune, activation
   checkpointing off and on, bf16 base and bf16 autocast, micro-batch 2 × seq 1024: two real
   training steps (fp32 cross-entropy summed over tokens, backward, torch AdamW with its default
   foreach step), `torch.cuda.max_memory_allocated` against the estimate's tensor peak.
2. Plan: in one child process capped at 16 GiB (torch.cuda.set_per_process_memory_fraction), for
   each family the LoRA workload through the public Trainer with `micro_batch_size: "auto"`
   (effective batch 16, seq 1024): the micro-batch it planned, whether any step ran out of memory,
   tokens/s over the steps after the first. Then a hand-tuned sweep of the same workload with
   the levers the plan has (`--sweep levers`, the default): the layers compiled as the run
   compiles them (on CUDA with Triton), the fused or chunked loss (CausalLMLoss with 1024-token
   chunks), micro-batch 2, 4, 8, ... without checkpointing until one does not fit, then the larger
   sizes with checkpointing; the fastest that fits is "best", and the plan's tokens/s is given as
   % of it. `--sweep plain`: the earlier sweep, a plain eager loop with the full logits.

No family's plan starts later than --budget-s (420) after the start, so the whole run stays
within 8 minutes on one H100; a family left out for time says so in the JSON and the table.

    python bench/families.py --out $OUT/families.json      # one H100, about 6 minutes
    python bench/families.py --smoke                        # CPU, tiny shapes, code paths only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

from steadytrain.run.records import Metric

GiB = 2**30
FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "gpt2", "olmo2")
# fmt: off
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # (the public model, its config's shape)
    "qwen3": ("Qwen3-0.6B", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "gemma2": ("gemma-2-2b widths, 8 of 26 layers", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256,
        sliding_window=4096)),
    "gemma3": ("gemma-3-1b", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, query_pre_attn_scalar=256,
        sliding_window=512)),
    "phi3": ("Phi-3-mini widths, 8 of 32 layers", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, sliding_window=2047, pad_token_id=32000,
        eos_token_id=32000)),
    "gpt_neox": ("pythia-410m", dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        vocab_size=50304)),
    "gpt2": ("gpt2-medium", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257)),
    "olmo2": ("OLMo-2-0425-1B", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352)),
}
# fmt: on
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
SMOKE_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
CASES = [("lora", False), ("lora", True), ("full", False), ("full", True)]
SMOKE_CASES = [("lora", False), ("full", True)]


def config_of(family: str, smoke: bool):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GPT2Config,
        GPTNeoXConfig,
        Olmo2Config,
        Phi3Config,
        Qwen3Config,
    )

    kind = {
        "qwen3": Qwen3Config,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
        "phi3": Phi3Config,
        "gpt_neox": GPTNeoXConfig,
        "gpt2": GPT2Config,
        "olmo2": Olmo2Config,
    }[family]
    if not smoke:
        fields = SHAPES[family][1]
    elif family == "gpt2":
        fields = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256)
    elif family == "gpt_neox":
        fields = dict(SMOKE, num_attention_heads=4)
    elif family == "phi3":
        fields = dict(SMOKE, **SMOKE_HEADS, pad_token_id=0)
    else:
        fields = dict(SMOKE, **SMOKE_HEADS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # token ids outside the smoke vocabulary
        config = kind(**fields)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return config


def build(config, method: str, checkpointing: bool, device: torch.device, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # GPT-2's Conv1D: fan_in_fan_out set
            model = get_peft_model(model, lora)
    set_checkpointing(model, checkpointing)
    return model.train()


def set_checkpointing(model, on: bool) -> None:
    if not on:
        off = getattr(model, "activation_checkpointing_disable", None)
        (off or model.gradient_checkpointing_disable)()
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (transformers 5.2x)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# -- 1. the estimate against two real steps ----------------------------------------------------


def estimate_case(family, config, method, checkpointing, args, device) -> dict[str, Any]:
    from steadytrain.memory.estimate import Settings, estimate

    precision = "bf16" if device.type == "cuda" else "fp32"
    settings = Settings(
        micro_batch_size=args.micro,
        seq=args.seq,
        precision=precision,
        weights_dtype=precision,
        method=method,
        lora_r=16,
        lora_targets="all-linear",
        checkpointing=checkpointing,
        attention="sdpa",
        device_type=device.type,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        est = estimate(config, settings, model_name=family)
    C.free_device_memory(device)
    error = None
    t0 = time.perf_counter()
    model = optimizer = None
    try:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = build(config, method, checkpointing, device, dtype)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        vocab = config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (args.micro, args.seq), device=device)
        batch = {"input_ids": ids, "labels": ids}
        C.synchronize(device)
        C.reset_peak(device)
        for _ in range(args.steps):
            with C.autocast(device, precision):
                loss = C.lm_loss_sum(model, batch)
            (loss / C.label_tokens(batch["labels"])).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
    except torch.OutOfMemoryError as exc:
        error = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    measured = C.peak_allocated(device)
    del model, optimizer
    gc.collect()
    C.free_device_memory(device)
    return {
        "family": family,
        "method": method,
        "checkpointing": checkpointing,
        "params": est.params,
        "estimate_peak": est.peak,
        "estimate_phase": est.phase,
        "activations": est.row("activations"),
        "measured_peak": measured,
        "error_pct": 100 * (est.peak - measured) / measured if measured else None,
        "seconds": time.perf_counter() - t0,
        "error": error,
        "formula": next(r.formula for r in est.rows if r.name == "activations"),
    }


# -- 2. the plan under a cap, against a hand-tuned sweep ---------------------------------------


def plan_family(family: str, args, device: torch.device, work: Path) -> dict[str, Any]:
    """The Trainer with micro_batch_size auto on the LoRA workload, then the sweep."""
    from steadytrain import TrainConfig, Trainer
    from steadytrain.memory.chunked_loss import CausalLMLoss

    config = config_of(family, args.smoke)
    vocab = config.get_text_config().vocab_size
    precision = "bf16" if device.type == "cuda" else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    data = C.synthetic_tokens(args.effective * args.plan_steps, args.seq, vocab, seed=1)
    C.free_device_memory(device)
    model = build(config, "lora", False, device, dtype)
    run_dir = work / family
    t0 = time.perf_counter()
    result = Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda"),
        CausalLMLoss(),
        data,
        config=TrainConfig(
            run_dir=str(run_dir),
            effective_batch_size=args.effective,
            micro_batch_size="auto",
            precision=precision,
            device=str(device),
            max_steps=args.plan_steps,
            save_every_steps=args.plan_steps,
            seed=0,
            progress="off",
            log_every_steps=1,
        ),
    ).fit()
    seconds = time.perf_counter() - t0
    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    events = C.read_jsonl(run_dir / "events.jsonl")
    plan = next((e for e in events if e["event"] == "plan"), {})
    # Steps after the first (which takes what compile is left) and before the last (whose
    # checkpoint save the sweep does not pay): the training rate itself
    timed = metrics[:-1] if len(metrics) > 3 else metrics
    times = [m[Metric.TIME] for m in timed]
    tokens = sum(m[Metric.SAMPLES] for m in timed[1:]) * args.seq
    window = times[-1] - times[0] if len(times) > 1 else None
    model = None
    C.free_device_memory(device)
    budget = plan.get("budget")
    sweep = hand_sweep(config, args, device, dtype, args.sweep == "levers", budget)
    fitting = [s for s in sweep if s["tokens_per_s"]]
    best = max(fitting, key=lambda s: s["tokens_per_s"]) if fitting else None
    within = [s for s in fitting if _within(s["peak_allocated"], budget)]
    best_within = max(within, key=lambda s: s["tokens_per_s"]) if within else None
    planned_tps = tokens / window if window else None
    return {
        "family": family,
        "planned_micro": plan.get("micro_batch_size"),
        "planned_checkpointing": plan.get("activation_checkpointing"),
        "planned_chunked_loss": plan.get("chunked_loss"),
        "final_micro": metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None,
        "oom_count": result.oom_count,
        "out_of_memory": bool(result.oom_count),
        "tokens_per_s": planned_tps,
        "fit_seconds": seconds,
        "best": best,
        "pct_of_best": 100 * planned_tps / best["tokens_per_s"] if planned_tps and best else None,
        "budget": budget,
        "best_within_budget": best_within,
        "pct_of_best_within_budget": 100 * planned_tps / best_within["tokens_per_s"]
        if planned_tps and best_within
        else None,
        "sweep": sweep,
    }


def hand_sweep(config, args, device, dtype, levers: bool, budget=None) -> list[dict[str, Any]]:
    """Micro sizes without checkpointing until one runs out of memory, then with checkpointing
    the sizes above the largest whose peak stayed within `budget` (the plan's memory budget); each timed over one optimizer step of the effective batch after a warm-up
    micro-step (which takes any compile). `levers`: the layers compiled as the run compiles them
    and the loss in 1024-token chunks (fused where Liger Kernel runs), from micro 2; else a plain
    eager loop with the full logits, from micro 1."""
    from steadytrain.engine.compiling import compile_blocks, compile_wanted
    from steadytrain.memory.chunked_loss import CausalLMLoss

    model = build(config, "lora", False, device, dtype)
    loss_fn = None
    if levers:
        if compile_wanted("auto", device.type):
            compile_blocks(model, device.type)
        chunked = CausalLMLoss(chunk_tokens=1024)
        loss_fn = chunked if chunked.can_chunk(model) else CausalLMLoss()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=2e-4, fused=device.type == "cuda"
    )
    vocab = config.get_text_config().vocab_size
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    sizes = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= args.effective and m >= 1 + levers]
    rows: list[dict[str, Any]] = []
    largest = 0
    for checkpointing in (False, True):
        set_checkpointing(model, checkpointing)
        for micro in (s for s in sizes if s > largest):
            row = time_step(model, optimizer, micro, vocab, precision, args, device, loss_fn)
            rows.append({"micro": micro, "checkpointing": checkpointing, **row})
            if row["tokens_per_s"] is None:
                break
            within = _within(row["peak_allocated"], budget)
            largest = micro if not checkpointing and within else largest
    del model, optimizer
    C.free_device_memory(device)
    return rows


def _within(peak: int | None, budget: int | None) -> bool:
    """Whether a peak stays within the plan's budget (no reading or no budget: it does)."""
    return budget is None or peak is None or peak <= budget


def time_step(model, optimizer, micro, vocab, precision, args, device, loss_fn) -> dict[str, Any]:
    ids = torch.randint(0, vocab, (micro, args.seq), device=device)
    batch = {"input_ids": ids, "labels": ids}
    count = C.label_tokens(batch["labels"])
    C.free_device_memory(device)
    try:
        for step in range(2):  # the first: warm-up (one micro-step)
            if step:
                C.synchronize(device)
                t0 = time.perf_counter()
            for _ in range(args.effective // micro if step else 1):
                with C.autocast(device, precision):
                    loss = (
                        C.lm_loss_sum(model, batch) if loss_fn is None else loss_fn(model, batch)[0]
                    )
                (loss / count).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        loss = None
        C.free_device_memory(device)
        return {"tokens_per_s": None, "peak_allocated": None, "out_of_memory": True}
    return {
        "tokens_per_s": args.effective * args.seq / seconds,
        "peak_allocated": C.peak_allocated(device),
        "out_of_memory": False,
    }


def plan_child(args) -> None:
    """The plan part in this process, under the cap; one JSON line per family on stdout."""
    device = C.resolve(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and args.cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
    with tempfile.TemporaryDirectory(prefix="families-plan-") as work:
        for family in args.families.split(","):
            if args.until and time.time() > args.until:
                row = {"family": family, "error": "skipped: the run's time budget is spent"}
                print("PLAN " + json.dumps(row), flush=True)
                continue
            try:
                row = plan_family(family, args, device, Path(work))
            except Exception as exc:  # noqa: BLE001 - a family's failure is a result, not an end
                row = {"family": family, "error": f"{type(exc).__name__}: {exc}"[:500]}
            print("PLAN " + json.dumps(row, default=str), flush=True)


# -- the whole run -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--micro", type=int, default=None, help="estimate part (2; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (1024; smoke 32)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per estimate case")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--effective", type=int, default=None, help="plan part (16; smoke 2)")
    ap.add_argument("--plan-steps", type=int, default=None, help="Trainer steps (4; smoke 2)")
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--skip-estimate", action="store_true")
    ap.add_argument(
        "--sweep",
        choices=("levers", "plain"),
        default="levers",
        help="the hand-tuned runs: with the plan's levers (compile, fused loss) or a plain loop",
    )
    ap.add_argument(
        "--budget-s", type=float, default=420, help="no family's plan starts after this"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plan-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.micro = args.micro or 2
    args.seq = args.seq or (32 if args.smoke else 1024)
    args.effective = args.effective or (2 if args.smoke else 16)
    args.plan_steps = args.plan_steps or (2 if args.smoke else 4)
    C.require_steadytrain()
    if args.plan_child:
        plan_child(args)
        return
    device = C.resolve(args.device or ("cpu" if args.smoke else "cuda"))
    out = args.out or C.default_out("families", args.smoke)
    started = time.perf_counter()
    estimates = []
    for family in [] if args.skip_estimate else args.families.split(","):
        config = config_of(family, args.smoke)
        for method, checkpointing in SMOKE_CASES if args.smoke else CASES:
            row = estimate_case(family, config, method, checkpointing, args, device)
            estimates.append(row)
            print(
                f"{family} {method}{' ckpt' if checkpointing else ''}: estimate "
                f"{C.gib(row['estimate_peak'])}, measured {C.gib(row['measured_peak'])} "
                f"({row['seconds']:.1f} s){' ' + row['error'] if row['error'] else ''}",
                file=sys.stderr,
                flush=True,
            )
    args.until = time.time() + args.budget_s - (time.perf_counter() - started)
    plans = [] if args.skip_plan else run_plan_child(args)
    data = {
        "benchmark": "families",
        "smoke": args.smoke,
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("out", "plan_child", "until")
        },
        "shapes": {f: SHAPES[f][0] for f in args.families.split(",")},
        "environment": C.environment(device),
        "seconds": time.perf_counter() - started,
        "estimate": estimates,
        "plan": plans,
    }
    C.write_json(out, data)
    print(report(data, out))


def run_plan_child(args) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--plan-child", "--families", args.families]
    for flag in ("device", "seq", "effective", "plan_steps", "cap_gib", "until", "sweep"):
        value = getattr(args, flag)
        if value is not None:
            command += ["--" + flag.replace("_", "-"), str(value)]
    if args.smoke:
        command.append("--smoke")
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("PLAN ")]
    if done.returncode != 0:
        rows.append({"family": "(child)", "error": done.stderr[-2000:]})
    return rows


def report(data: dict[str, Any], out: Path) -> str:
    estimate_rows = [
        [
            r["family"],
            r["method"] + (" ckpt" if r["checkpointing"] else ""),
            f"{r['params'] / 1e6:,.0f}M",
            C.gib(r["estimate_peak"]),
            C.gib(r["measured_peak"]),
            C.fmt(r["error_pct"], 1, "%"),
            "OOM" if r["error"] else "",
        ]
        for r in data["estimate"]
    ]
    errors = [abs(r["error_pct"]) for r in data["estimate"] if r["error_pct"] is not None]
    text = C.table(
        ["family", "case", "params", "est peak", "meas peak", "err %", ""],
        estimate_rows,
        title=f"estimate vs two real steps (median |error| {C.fmt(C.median(errors), 1, '%')})",
    )
    plan_rows = []
    for r in data["plan"]:
        best = r.get("best") or {}
        within = r.get("best_within_budget") or {}
        plan_rows.append(
            [
                r["family"],
                str(r.get("planned_micro", "-")),
                "yes" if r.get("out_of_memory") else ("error" if r.get("error") else "no"),
                C.fmt(r.get("tokens_per_s"), 0),
                f"{best.get('micro', '-')}{' ckpt' if best.get('checkpointing') else ''}",
                C.fmt(best.get("tokens_per_s"), 0),
                C.fmt(r.get("pct_of_best"), 0, "%"),
                f"{within.get('micro', '-')}{' ckpt' if within.get('checkpointing') else ''}",
                C.fmt(r.get("pct_of_best_within_budget"), 0, "%"),
            ]
        )
    cap = data["settings"]["cap_gib"]
    text += "\n\n" + C.table(
        [
            "family",
            "planned micro",
            "OOM",
            "tokens/s",
            "best micro",
            "best tokens/s",
            "% of best",
            "best in budget",
            "% of it",
        ],
        plan_rows,
        title=(
            f"plan under a {cap:g} GiB cap vs a hand-tuned sweep "
            f"({data['settings'].get('sweep', 'plain')}); written to {out}"
        ),
    )
    return text


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
