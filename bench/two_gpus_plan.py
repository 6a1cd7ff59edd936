#!/usr/bin/env python
"""Issue 40's proof on two GPUs: a model too big for one 16 GiB GPU, planned and trained on two.

The workload is the issue's script as a user writes it: a Qwen2-1.5B-shaped model (random init
from its config, tied embeddings), full fine-tune, fp32 weights, plain `torch.optim.AdamW`,
`precision: bf16`, sequence 1024, effective batch 16, `micro_batch_size: auto`,
`distributed: fsdp`, each GPU capped at --cap-gib with `set_per_process_memory_fraction` (a
real CUDA out-of-memory above it), launched as
`steadytrain run -- torchrun --nproc_per_node 2 two_gpus_plan.py --child ...`.

What it runs, in one call:

* estimate: `steadytrain estimate MODEL --gpus 2 --distributed fsdp` and `--distributed ddp`
  (`--json` and the printed text): the per-rank figures, the verdict, the savers named.
* whole: the run uninterrupted to --steps; each rank records its peak allocated memory (the
  whole process's, and the largest of the training steps'), the plan it chose before step 1,
  the estimate event (the analytic per-rank peak at the chosen settings), every out-of-memory
  and restart.
* killed: the same run, rank 1 SIGKILLed at the end of step --kill-at of the first attempt
  (checkpoints every 2 steps): the supervisor restarts the group, it resumes and finishes;
  its per-step losses against the whole run's, bit for bit.

    python bench/two_gpus_plan.py --smoke                  # CPU, gloo, a tiny Qwen2: minutes
    python bench/two_gpus_plan.py --out $OUT/two_gpus_plan.json   # two GPUs

The JSON is written after each part, so a call cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch

SEQ = 1024
EFFECTIVE = 16


def qwen2_config(smoke: bool):
    from transformers import Qwen2Config

    if smoke:
        shape = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2)
        shape |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    else:  # Qwen2-1.5B
        shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
        shape |= dict(num_attention_heads=12, num_key_value_heads=2, vocab_size=151_936)
    config = Qwen2Config(
        **shape, tie_word_embeddings=True, max_position_embeddings=32768, use_cache=False
    )
    config._attn_implementation = "sdpa"
    return config


# -- one rank of the run (--child, under torchrun) ----------------------------------------------


def child(args) -> None:
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from steadytrain import TrainConfig, Trainer
    from steadytrain.events import Callback
    from steadytrain.memory.chunked_loss import CausalLMLoss

    if args.deterministic:  # a CUDA run equal bit for bit to another (atomic adds otherwise)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group()
    rank = int(os.environ["RANK"])
    device = torch.device("cpu" if args.smoke else f"cuda:{os.environ['LOCAL_RANK']}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(args.smoke)).to(device)  # fp32 weights
    vocab = model.config.vocab_size
    data = C.synthetic_tokens(EFFECTIVE * args.steps, args.seq, vocab, 1)
    step_peaks: list[int] = []

    class Watch(Callback):
        """Each step's peak allocated memory (reset at its start), and the kill."""

        def on_step_start(self, state, control, info) -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_step_end(self, state, control, info) -> None:
            if device.type == "cuda":
                step_peaks.append(torch.cuda.max_memory_allocated(device))
            first = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
            if args.kill_at and first and state.step == args.kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=EFFECTIVE,
        micro_batch_size="auto",
        precision="fp32" if args.smoke else "bf16",
        device=str(device),
        distributed="fsdp",
        max_steps=args.steps,
        save_every_steps=2,
        seed=0,
        progress="off",
        log_every_steps=1,
    )
    started = time.perf_counter()
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-5)  # noqa: E731
    result = Trainer(model, optimizer, CausalLMLoss(), data, config, callbacks=[Watch()]).fit()
    figures = {
        "rank": rank,
        "steps": result.steps,
        "micro_batch_size": result.micro_batch_size,
        "oom_count": result.oom_count,
        "seconds": time.perf_counter() - started,
        "peak_allocated": C.peak_allocated(device),  # since the last step's start
        "step_peaks": step_peaks,
        "restart": int(os.environ.get("STEADYTRAIN_RESTART", "0")),
    }
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        figures["process_peak_allocated"] = stats.get("allocated_bytes.all.peak")
        figures["reserved_peak"] = stats.get("reserved_bytes.all.peak")
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------


def child_command(args, run_dir: Path, result: Path, kill_at: int = 0) -> list[str]:
    command = [str(Path(__file__).resolve()), "--child", "--run-dir", str(run_dir)]
    command += ["--result", str(result), "--steps", str(args.steps), "--seq", str(args.seq)]
    command += ["--cap-gib", str(args.cap_gib), "--kill-at", str(kill_at)]
    command += ["--deterministic"] if args.deterministic else []
    return command + (["--smoke"] if args.smoke else [])


def supervised(args, run_dir: Path, result: Path, kill_at: int = 0) -> dict[str, Any]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
    supervisor = [sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)]
    supervisor += ["--backoff-initial", "1", "--"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [*supervisor, *torchrun, *child_command(args, run_dir, result, kill_at)],
            capture_output=True,
            text=True,
            timeout=args.limit,
        )
        code, tail, stderr = done.returncode, done.stderr[-3000:], done.stderr
    except subprocess.TimeoutExpired as exc:
        stderr = str(exc.stderr)
        code, tail = None, f"no end after {args.limit:.0f} s: {stderr[-3000:]}"
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{run_dir.name}.stderr.txt").write_text(stderr)
    events = [run_dir / "events.jsonl", run_dir / "ranks" / "rank-1" / "events.jsonl"]
    by_rank = [C.read_jsonl(p) if p.exists() else [] for p in events]
    ranks = []
    for r in (0, 1):
        path = result.with_suffix(f".rank{r}.json")
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    metrics = run_dir / "metrics.jsonl"
    rows = C.read_jsonl(metrics) if metrics.exists() else []
    return {
        "exit_code": code,
        "seconds": time.perf_counter() - started,
        "ranks": ranks,
        "plans": [[e for e in ev if e["event"] == "plan"] for ev in by_rank],
        "estimates": [[e for e in ev if e["event"] == "estimate"] for ev in by_rank],
        "fit_start": [
            [e.get("distributed") for e in ev if e["event"] == "fit_start"] for ev in by_rank
        ],
        "ooms": [[e for e in ev if e["event"] == "oom"] for ev in by_rank],
        "restarts": [e for e in by_rank[0] if e["event"] == "restart"],
        "resumed_from": [e.get("step") for e in by_rank[0] if e["event"] == "resume"],
        "losses": {int(m["step"]): m["loss"] for m in rows},
        "supervisor_says": tail,
    }


def estimate(args, model_dir: Path, distributed: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "steadytrain.cli", "estimate", str(model_dir)]
    command += ["--gpus", "2", "--distributed", distributed, "--seq", str(args.seq)]
    command += ["--precision", "bf16", "--device-type", "cuda"]
    command += ["--memory-budget", f"{args.cap_gib:g}GiB"]
    text = subprocess.run(command, capture_output=True, text=True, timeout=300)
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300)
    try:
        figures = json.loads(as_json.stdout)
    except json.JSONDecodeError:
        figures = None
    return {
        "command": " ".join(command[2:]),
        "exit_code": text.returncode,
        "printed": text.stdout[-4000:] + text.stderr[-2000:],
        "json": figures,
    }


def summary(f: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"exit_code": f["exit_code"], "seconds": round(f["seconds"], 1)}
    plan = (f["plans"][0] or [{}])[-1]
    out["plan"] = {
        k: plan.get(k) for k in ("micro_batch_size", "activation_checkpointing", "fsdp_offload")
    }
    out["ooms per rank"] = [len(o) for o in f["ooms"]]
    out["restarts"] = len(f["restarts"])
    out["resumed_from"] = f["resumed_from"]
    for r, figures in enumerate(f["ranks"]):
        estimates = f["estimates"][r]
        predicted = estimates[-1].get("peak") if estimates else None
        if figures is None:
            out[f"rank {r}"] = None
            continue
        measured = max(figures["step_peaks"] or [0]) or figures["peak_allocated"]
        out[f"rank {r}"] = {
            "steps": figures["steps"],
            "step peak GiB": measured and round(measured / 2**30, 3),
            "process peak GiB": figures.get("process_peak_allocated")
            and round(figures["process_peak_allocated"] / 2**30, 3),
            "estimated peak GiB": predicted and round(predicted / 2**30, 3),
            "estimate error": predicted and measured and round(predicted / measured - 1, 4),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--kill-at", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny Qwen2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--cap-gib", type=float, default=16.0, help="each GPU's cap")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms: 'killed' against 'whole' bit for bit on CUDA",
    )
    p.add_argument("--parts", default="estimate,whole,killed")
    p.add_argument("--limit", type=float, default=420.0, help="seconds a run may take")
    p.add_argument("--out", type=Path)
    p.add_argument("--logs", type=Path, help="a folder for each run's whole stderr")
    p.add_argument(
        "--against", type=Path, help="an earlier call's JSON whose 'whole' run to compare"
    )
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.smoke:
        args.steps, args.seq = min(args.steps, 6), min(args.seq, 64)
    C.require_steadytrain()
    out = args.out or C.default_out("two_gpus_plan", args.smoke)
    device = torch.device("cpu" if args.smoke else "cuda")
    figures: dict[str, Any] = {"environment": C.environment(device), "settings": vars(args)}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        model_dir = work / "qwen2-1.5b"
        qwen2_config(args.smoke).save_pretrained(model_dir)
        for part in args.parts.split(","):
            if part == "estimate":
                figures["estimate"] = {d: estimate(args, model_dir, d) for d in ("fsdp", "ddp")}
                for d, e in figures["estimate"].items():
                    print(f"estimate --distributed {d}: exit {e['exit_code']}\n{e['printed']}")
            else:
                kill_at = 3 if part == "killed" else 0
                run_dir = work / f"{part}-run"
                figures[part] = supervised(args, run_dir, work / f"{part}.json", kill_at)
                print(f"{part}: {json.dumps(summary(figures[part]))}", flush=True)
                if figures[part]["exit_code"] != 0:
                    print(figures[part]["supervisor_says"], flush=True)
            if "whole" not in figures and args.against and args.against.exists():
                earlier = json.loads(args.against.read_text()).get("whole")
                if earlier:
                    earlier["losses"] = {int(k): v for k, v in earlier["losses"].items()}
                    figures["whole"] = earlier | {"from": str(args.against)}
            if "whole" in figures and "killed" in figures:
                a, b = figures["whole"]["losses"], figures["killed"]["losses"]
                figures["losses_equal_bitwise"] = bool(a) and a == b
                print(
                    f"killed against whole, losses bit for bit: {figures['losses_equal_bitwise']}"
                )
            C.write_json(out, figures)
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
