#!/usr/bin/env python
"""The longest context under a memory cap, and QLoRA: steadytrain's fine-tune command against
Unsloth, in one call (issue 43).

Workload: the Llama-3.2-1B shape (bench/_common.py's LLAMA_1B; `--model 3b` the 3B shape) with
random weights saved once as a model folder (bf16, a word-level tokenizer of its vocabulary),
LoRA r16 / alpha 32 / dropout 0 on the 7 projections, AdamW (fused) lr 2e-4, clip 1.0, random
tokens. Every arm runs in its own process under
`torch.cuda.set_per_process_memory_fraction` so that `--cap-gib` is usable.

Arms (`--arms`, comma-separated, each `KIND@SEQ`, SEQ defaulting to 1024; an ours arm may add
`:BUDGET`, its config's `memory_budget`, e.g. `ours-tiled@131072:17GiB`):

* ours@N: `steadytrain finetune --config` (the CLI's `main`) with `max_seq_length: N`, every
  sample N tokens long, per_device_train_batch_size 1 × gradient_accumulation_steps 1,
  `micro_batch_size: auto`, bf16, adamw_torch_fused and nothing else: the planner chooses the
  savers. Figures from the run's own metrics.jsonl and events.jsonl.
* ours-manual@N: the same with the savers set by hand (`gradient_checkpointing: offload`,
  `chunked_loss: true`, micro-batch 1): what the planner should find.
* ours-eager@N, ours-manual-eager@N: the same with `torch_compile: false`.
* ours-tiled@N: ours-manual-eager with the tiled MLP on from the start (`tiled_mlp: true`:
  each decoder layer's MLP over 8,192 tokens at a time, each piece checkpointed,
  memory/tiled_mlp.py); ours@N, with `micro_batch_size: auto`, gets it where the planner
  estimates that one sample does not fit without it.
* ours-qlora@N: `quantization.load_in_4bit: true`, per_device 16 × 4 (1 × 1 above 4,096 tokens),
  `micro_batch_size: auto`;
  ours-qlora-nockpt@N: the same with `gradient_checkpointing: false`.
* unsloth@N: FastLanguageModel (bf16) at max_seq_length N, its get_peft_model with
  use_gradient_checkpointing="unsloth" (layer inputs offloaded to host), micro-batch 1, a plain
  loop calling the model with labels (its fused loss).
* unsloth-qlora@N: the same with load_in_4bit=True at 16 × 4 (the issue's Unsloth 4-bit arm;
  1 × 1 above 4,096 tokens).

Per arm: exit code, steps run, tokens/s over the steps after the first, the peak allocated
memory of the training steps (ours: the run's own `mem_peak`, without the planner's probe
passes; Unsloth: the process's), out-of-memory events, the plan (ours), and for ours the
analytic estimate (`steadytrain estimate FILE --json`, the config with the plan's savers) and
its error against the measured peak.

    python bench/long_context.py --arms ours@65536,unsloth@65536 --out $OUT/long_context.json

The tiled MLP at the lengths Unsloth does not reach (about 4 minutes on an H200): 98,304 tokens
under the cap; 131,072 as the fine-tune command decides it (its estimate, 16.2 GiB, is over
`memory_budget: auto`'s 14.4 GiB: refused before loading, exit 3), then with `memory_budget`
raised past the estimate so that it trains under the same 16 GiB cap:

    python bench/long_context.py --steps 3 --out $OUT/long_context_tiled.json \
        --arms ours-tiled@98304,ours-tiled@131072,ours-tiled@131072:17GiB

`--smoke` runs the given ours arms on the CPU with a tiny Llama shape (no cap, fp32, a few
hundred tokens, the tiled MLP by 64 tokens): the code path, not a figure.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C  # noqa: E402
import torch  # noqa: E402

GiB = 2**30
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOKE_TILE = 64
"""--smoke's tokens per piece of the tiled MLP: several pieces in its few hundred tokens."""
LLAMA_3B = dataclasses.replace(
    C.LLAMA_1B, hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8
)
"""The Llama-3.2-3B shape (tied embeddings)."""
KINDS = (
    "ours",
    "ours-eager",
    "ours-manual",
    "ours-manual-eager",
    "ours-tiled",
    "ours-qlora",
    "ours-qlora-nockpt",
    "unsloth",
    "unsloth-qlora",
)


def parse_arm(text: str) -> tuple[str, int]:
    kind, _, seq = text.partition("@")
    if kind not in KINDS:
        sys.exit(f"--arms: unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    return kind, int(seq.partition(":")[0] or 1024)


def budget_of(text: str) -> str | None:
    """An ours arm's `memory_budget` (`KIND@SEQ:BUDGET`, e.g. `ours-tiled@131072:17GiB`); None:
    the config leaves it at auto (0.9 of the capped memory)."""
    return text.partition("@")[2].partition(":")[2] or None


QLORA_BATCH_UP_TO = 4096
"""The 4-bit arms run the issue's 16 × 4 up to this length (its throughput shape, seq 1024) and
one sample a step above it, as the long-context arms do (the 3B at an 8 GiB cap)."""


def batch_of(kind: str, seq: int) -> tuple[int, int]:
    """(micro or per-device batch, accumulation) of an arm at sequence length `seq`."""
    return (16, 4) if "qlora" in kind and seq <= QLORA_BATCH_UP_TO else (1, 1)


# -- the model folder, saved once by the parent ---------------------------------------------------


def save_model(spec: C.ModelSpec, folder: Path, seed: int) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(C.llama_config(spec, tied=True, seq=spec.seq)).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    vocab = {f"t{i}": i for i in range(spec.vocab)}
    words = Tokenizer(WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    )
    tokenizer.model_max_length = spec.seq
    tokenizer.save_pretrained(folder)
    if device == "cuda":
        torch.cuda.empty_cache()


# -- ours: the fine-tune command ----------------------------------------------------------------


def ours_config(args, kind: str, seq: int, work: Path) -> dict[str, Any]:
    micro, accumulation = batch_of(kind, seq)
    samples = micro * accumulation * args.steps
    g = torch.Generator().manual_seed(args.seed + 1)
    train = work / "train.jsonl"
    with train.open("w") as f:
        for _ in range(samples):
            ids = torch.randint(4, args.spec.vocab, (seq,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")
    config: dict[str, Any] = {
        "model_name_or_path": str(args.model_dir),
        "train_file": str(train),
        "max_seq_length": seq,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "micro_batch_size": "auto",
        "max_steps": args.steps,
        "save_steps": args.steps,
        "logging_steps": 1,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": PROJECTIONS},
        "output_dir": str(work / "run"),
        "seed": args.seed,
        "bf16": True,
        "optim": "adamw_torch_fused",
    }
    if kind in ("ours-manual", "ours-manual-eager", "ours-tiled"):
        config |= {"gradient_checkpointing": "offload", "chunked_loss": True}
        del config["micro_batch_size"]  # per_device_train_batch_size 1 is the micro-batch
    if kind == "ours-tiled":
        config["tiled_mlp"] = SMOKE_TILE if args.smoke else True
    if budget_of(args.arm) is not None:
        config["memory_budget"] = budget_of(args.arm)
    if kind in ("ours-eager", "ours-manual-eager", "ours-tiled"):
        config["torch_compile"] = False
    if kind.startswith("ours-qlora"):
        config["quantization"] = {"load_in_4bit": True}
    if kind == "ours-qlora-nockpt":
        config["gradient_checkpointing"] = False
    return config


def spy_attention(calls: int = 2) -> None:
    """Print the first `calls` attention calls' mask and the memory in use then."""
    import torch.nn.functional as F

    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(*a, **k):
        if len(seen) < calls and not torch.compiler.is_compiling():
            seen.append(1)
            mask = k.get("attn_mask")
            print(
                f"sdpa: q {tuple(a[0].shape)} {a[0].dtype}, mask "
                f"{None if mask is None else (tuple(mask.shape), mask.dtype)}, is_causal "
                f"{k.get('is_causal')}, allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB",
                file=sys.stderr,
                flush=True,
            )
        return sdpa(*a, **k)

    F.scaled_dot_product_attention = spy


def run_ours(args, kind: str, seq: int, work: Path) -> dict[str, Any]:
    from steadytrain.cli import main as steadytrain_main

    config = ours_config(args, kind, seq, work)
    if args.smoke:
        config |= {"bf16": False, "optim": "adamw_torch", "device": "cpu"}
        if config.get("gradient_checkpointing") == "offload":  # CUDA only
            config["gradient_checkpointing"] = True
    else:
        spy_attention()
    path = work / "finetune.json"
    path.write_text(json.dumps(config, indent=1))
    code = 0
    try:
        steadytrain_main(["finetune", "--config", str(path)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    run_dir = Path(config["output_dir"])
    metrics = [m for m in C.read_jsonl(run_dir / "metrics.jsonl") if "micro_batch_size" in m]
    events = C.read_jsonl(run_dir / "events.jsonl")
    plan = next((e for e in events if e["event"] == "plan"), None)
    peaks = [m["mem_peak"] for m in metrics if m.get("mem_peak") is not None]
    offset = time.perf_counter() - time.time()
    return {
        "exit_code": code,
        "config": config,
        "marks": [m["time"] + offset for m in metrics],
        "losses": [m["loss"] for m in metrics],
        "micro": metrics[-1]["micro_batch_size"] if metrics else None,
        "steps_peak": max(peaks) if peaks else None,
        "oom_count": sum(1 for e in events if e["event"] == "oom"),
        "plan": plan,
        "errors": [e for e in events if e["event"] in ("oom", "error", "shrink")][:4],
    }


# -- Unsloth --------------------------------------------------------------------------------------


def run_unsloth(args, kind: str, seq: int) -> dict[str, Any]:
    from unsloth import FastLanguageModel

    four_bit = kind.endswith("qlora")
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(args.model_dir),
        max_seq_length=seq,
        dtype=torch.bfloat16,
        load_in_4bit=four_bit,
        use_gradient_checkpointing="unsloth",
        local_files_only=True,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=PROJECTIONS,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=args.seed,
    )
    model.train()
    device = torch.device("cuda")
    micro, accumulation = batch_of(kind, seq)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=True)
    g = torch.Generator().manual_seed(args.seed + 1)
    C.reset_peak(device)
    marks, losses = [], []
    for _ in range(args.steps):
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            ids = torch.randint(4, args.spec.vocab, (micro, seq), generator=g).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss / accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        marks.append(time.perf_counter())
    return {"exit_code": 0, "marks": marks, "losses": losses, "micro": micro}


# -- one arm in this process ----------------------------------------------------------------------


def child(args) -> None:
    kind, seq = parse_arm(args.arm)
    if "qlora" in kind:
        args.steps = max(args.steps, 8)  # short steps: enough of them to time
    if kind.startswith("unsloth"):
        import unsloth  # noqa: F401  before transformers, as Unsloth requires
    device = C.resolve("cpu" if args.smoke else "cuda")
    if not args.smoke:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
    result: dict[str, Any] = {"arm": args.arm, "kind": kind, "seq": seq, "cap_gib": args.cap_gib}
    try:
        with tempfile.TemporaryDirectory(prefix="long-context-") as work:
            if kind.startswith("ours"):
                result |= run_ours(args, kind, seq, Path(work))
            else:
                result |= run_unsloth(args, kind, seq)
    except torch.OutOfMemoryError as exc:
        result |= {"exit_code": "oom", "error": str(exc)[:400]}
    except Exception as exc:  # noqa: BLE001 - an arm's failure is its result
        result |= {"exit_code": "error", "error": traceback.format_exc()[-1500:] + repr(exc)}
    marks = result.pop("marks", [])
    micro, accumulation = batch_of(kind, seq)
    tokens = micro * accumulation * seq
    steady = marks[1:]
    result["steps"] = len(marks)
    result["tokens_per_s"] = (
        tokens * (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else None
    )
    if result["tokens_per_s"] is None and len(marks) == 2:  # one step after the first only
        result["tokens_per_s"] = tokens / (marks[1] - marks[0])
    result["peak_process"] = None if args.smoke else torch.cuda.max_memory_allocated(device)
    result["peak_allocated"] = result.get("steps_peak") or result["peak_process"]
    result["environment"] = C.environment(device)
    Path(args.result).write_text(json.dumps(result, default=str))


# -- the estimate for ours ------------------------------------------------------------------------


def estimate_of(result: dict[str, Any], work: Path) -> dict[str, Any] | None:
    """`steadytrain estimate FILE --json` on the arm's config with the plan's savers and size."""
    config, plan = result.get("config"), result.get("plan")
    if not config or not result.get("steps"):
        return None
    config = dict(config)
    if config.pop("micro_batch_size", None) is not None:  # planned: the plan's size and savers
        if not plan:
            return None
        config["per_device_train_batch_size"] = plan.get("micro_batch_size", 1)
        ckpt = plan.get("activation_checkpointing")
        config["gradient_checkpointing"] = "offload" if ckpt == "offload" else bool(ckpt)
        config["chunked_loss"] = bool(plan.get("chunked_loss"))
        config["tiled_mlp"] = bool(plan.get("tiled_mlp"))
    config["gradient_accumulation_steps"] = 1
    path = work / f"estimate-{result['arm'].replace('@', '-')}.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "steadytrain.cli", "estimate", str(path), "--json"]
    cmd += ["--memory-budget", f"{result['cap_gib']:g}GiB"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    try:
        found = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": (proc.stdout + proc.stderr)[-800:]}
    measured = result.get("peak_allocated")
    peak, total = found.get("peak_bytes"), found.get("total_bytes")
    return {
        "peak": peak,
        "total": total,
        "peak_error": (peak - measured) / measured if peak and measured else None,
        "total_over_measured": (total - measured) / measured if total and measured else None,
    }


def child_env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "UNSLOTH_DISABLE_STATISTICS": "1",
    }


def row_of(r: dict[str, Any]) -> list[str]:
    est = r.get("estimate") or {}
    plan = r.get("plan") or {}
    config = r.get("config") or {}
    savers = (
        f"ckpt={plan.get('activation_checkpointing')} chunked={plan.get('chunked_loss')} "
        f"tiled={plan.get('tiled_mlp')}"
        if plan
        else f"set: ckpt={config.get('gradient_checkpointing')} "
        f"chunked={config.get('chunked_loss')} tiled={config.get('tiled_mlp', 'auto')}"
        if config
        else "-"
    )
    return [
        r.get("arm", "?"),
        str(r.get("exit_code")),
        str(r.get("steps", "-")),
        C.fmt(r.get("tokens_per_s"), 0),
        C.gib(r.get("peak_allocated")),
        savers,
        "-" if est.get("peak_error") is None else f"{est['peak_error']:+.1%}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", default="ours@65536,unsloth@65536")
    ap.add_argument("--model", choices=("1b", "3b"), default="1b")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arm-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--smoke", action="store_true", help="the ours arms on the CPU, a tiny shape: the code path"
    )
    ap.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    arms = args.arms.split(",")
    longest = max(parse_arm(a)[1] for a in arms)
    base = C.LLAMA_1B if args.model == "1b" else LLAMA_3B
    if args.smoke:
        base = C.SMOKE_MODEL
        if any(not parse_arm(a)[0].startswith("ours") for a in arms):
            sys.exit("--smoke: the ours arms only (Unsloth needs a GPU)")
    args.spec = dataclasses.replace(base, seq=max(longest, base.seq))
    if args.arm:
        child(args)
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="long-context-model-") as work:
        args.model_dir = Path(work) / "model"
        save_model(args.spec, args.model_dir, args.seed)
        for arm in arms:
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            cmd = [sys.executable, __file__, "--arm", arm, "--result", path]
            cmd += ["--model", args.model, "--model-dir", str(args.model_dir)]
            cmd += ["--cap-gib", str(args.cap_gib), "--steps", str(args.steps)]
            cmd += ["--seed", str(args.seed), "--arms", args.arms]
            cmd += ["--smoke"] if args.smoke else []
            print(f"running arm {arm}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                code = subprocess.run(cmd, env=child_env(), timeout=args.arm_timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            text = Path(path).read_text()
            Path(path).unlink(missing_ok=True)
            result = json.loads(text) if text else {"arm": arm, "exit_code": f"process {code}"}
            result["wall_s"] = time.perf_counter() - started
            if parse_arm(arm)[0].startswith("ours"):
                result["cap_gib"] = args.cap_gib
                result["estimate"] = estimate_of(result, Path(work))
            results[arm] = result
            print(json.dumps(row_of(result)), file=sys.stderr, flush=True)
            if args.out:
                C.write_json(args.out, {"benchmark": "long_context", "partial": True, **results})
    headers = ["arm", "exit", "steps", "tokens/s", "peak", "plan savers", "estimate err"]
    title = f"{args.spec.name}, LoRA r16 7 projections, cap {args.cap_gib:g} GiB"
    text = C.table(headers, [row_of(r) for r in results.values()], title)
    out = args.out or C.default_out("long_context", args.smoke)
    settings = {k: str(v) for k, v in vars(args).items()}
    C.write_json(
        out,
        {"benchmark": "long_context", "settings": settings, "results": results, "table": text},
    )
    print(text)


if __name__ == "__main__":
    main()
