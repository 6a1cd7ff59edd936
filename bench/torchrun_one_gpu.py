#!/usr/bin/env python
"""One GPU, launched two ways: `python train.py` and `torchrun --nproc_per_node 1 train.py`.

The same steadytrain fine-tune (the issue-17 LoRA workload of bench/_common.py: the Llama-3.2-1B
shape, random init, bf16 base, LoRA r16 / alpha 32 on the 7 projections, sequence 1024, micro 8 ×
accumulation 4, fused AdamW, CausalLMLoss) runs in its own process per arm and round:

* plain: `python bench/torchrun_one_gpu.py --child`: the group of one, no process group.
* torchrun: `python -m torch.distributed.run --nproc_per_node 1 ... --child`: the script
  initialises the process group torchrun describes (NCCL for CUDA tensors, as
  `init_process_group()` picks) before the Trainer starts, and the Trainer takes that group;
  its `fit_start` event records the backend. With one rank the per-step agreement and
  gradient sum are skipped (a group of one has nothing to agree on), so what this measures is
  the launch path: torchrun's environment, `cuda:LOCAL_RANK`, the NCCL group.

The arms alternate (plain, torchrun, plain, torchrun, ...) so drift hits both alike. Per arm:
tokens/s over the steady steps (after --warmup) from metrics.jsonl, median over rounds; peak
allocated memory; the backend the run recorded.

    python bench/torchrun_one_gpu.py --smoke                    # CPU, tiny model, gloo
    python bench/torchrun_one_gpu.py --out $OUT/torchrun_one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C
import torch

from steadytrain.events import Callback
from steadytrain.run.records import Metric

ARMS = ("plain", "torchrun")


def child(args) -> None:
    """One run of the workload in this process (one rank of it under torchrun); rank 0 writes
    its figures to --result as JSON."""
    import torch.distributed as dist

    from steadytrain import TrainConfig, Trainer
    from steadytrain.memory.chunked_loss import CausalLMLoss

    if "WORLD_SIZE" in os.environ:  # under torchrun: the script's own group, as users write it
        dist.init_process_group()
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if not args.smoke else "cpu")
    capped = args.cap_rank < 0 or rank == args.cap_rank  # -1: every rank
    if args.cap_gib and capped and device.type == "cuda":  # a real CUDA OOM there
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    if args.method == "full":  # fp32 weights, every parameter trained: the large state
        model = C.build_model(spec, seed=0).to(device)
    else:
        model = C.lora_llama(spec, device, torch.float32 if args.smoke else torch.bfloat16, seed=0)
    effective = args.effective or args.micro * args.accumulation
    data = C.synthetic_tokens(effective * (args.data_steps or args.steps), spec.seq, spec.vocab, 1)
    run_dir = Path(args.run_dir or Path(args.work) / "run")
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=effective,
        micro_batch_size="auto" if args.auto_micro else args.micro,
        precision="fp32" if args.smoke else "bf16",
        device=str(device),
        max_steps=args.steps,
        save_every_steps=args.save_every or args.steps,
        seed=0,
        progress="off",
        log_every_steps=1,
        compile=args.compile,
        distributed=args.distributed,
        fsdp_offload=args.fsdp_offload,
    )
    C.reset_peak(device)
    optimizer = lambda params: torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda")  # noqa: E731
    callbacks = [KillOnce(args.kill_rank, args.kill_at)] if args.kill_at else []
    result = Trainer(model, optimizer, CausalLMLoss(), data, config, callbacks=callbacks).fit()
    if rank == 0:
        write_result(args, run_dir, spec, device, result)
    if dist.is_initialized():
        dist.destroy_process_group()


def write_result(args, run_dir: Path, spec, device, result) -> None:
    metrics = C.read_jsonl(run_dir / "metrics.jsonl")
    start = next(e for e in C.read_jsonl(run_dir / "events.jsonl") if e["event"] == "fit_start")
    steady = metrics[args.warmup - 1 :]
    tokens = sum(m[Metric.SAMPLES] * spec.seq for m in steady[1:])  # every position, as elsewhere
    seconds = steady[-1][Metric.TIME] - steady[0][Metric.TIME]
    figures = {
        "tokens_per_s": tokens / seconds,
        "steps": result.steps,
        "peak_allocated": C.peak_allocated(device),
        "process_group": start.get("process_group"),
        "final_loss": result.final_loss,
        "losses": [m[Metric.LOSS] for m in metrics],
        "samples": [m[Metric.SAMPLES] for m in metrics],
        "micro_batch_size": result.micro_batch_size,
        "oom_count": result.oom_count,
    }
    Path(args.result).write_text(json.dumps(figures))


class KillOnce(Callback):
    """SIGKILL rank `rank` at the end of step `step` of the first attempt (a rank lost)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, state, control, info) -> None:
        first = os.environ.get("STEADYTRAIN_RESTART", "0") == "0"
        if first and state.step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def add_child_options(p: argparse.ArgumentParser) -> None:
    """The options of one run (`--child`), shared with bench/two_gpus.py."""
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo: seconds")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--effective", type=int, help="the global batch (default micro × accumulation)")
    p.add_argument("--save-every", type=int)
    p.add_argument("--data-steps", type=int, help="batches of data (default --steps)")
    p.add_argument("--compile", default="false", choices=["true", "false", "auto"])
    p.add_argument("--cap-gib", type=float, help="cap rank --cap-rank's GPU memory (a real OOM)")
    p.add_argument("--cap-rank", type=int, default=1, help="-1: every rank")
    p.add_argument("--kill-at", type=int, help="SIGKILL rank --kill-rank after this step, once")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--method", default="lora", choices=["lora", "full"])
    p.add_argument("--distributed", default="auto", choices=["auto", "replicate", "fsdp"])
    p.add_argument("--auto-micro", action="store_true", help="micro_batch_size: auto (planned)")
    p.add_argument("--fsdp-offload", action="store_true", help="fsdp_offload: true (CUDA)")


def child_command(args, work: Path, result: Path, **extra: Any) -> list[str]:
    """This script as one `--child` run with `args`' settings and `extra` options."""
    out = [str(Path(__file__).resolve()), "--child", "--work", str(work), "--result", str(result)]
    settings = {
        "steps": args.steps,
        "warmup": args.warmup,
        "micro": args.micro,
        "accumulation": args.accumulation,
        "compile": str(args.compile).lower(),
        **extra,
    }
    for name, value in settings.items():
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out + (["--smoke"] if args.smoke else [])


def torchrun(ranks: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--standalone",
    ]


def run_arm(arm: str, args, work: Path) -> dict[str, Any]:
    result = work / f"{arm}.json"
    launcher = torchrun(1) if arm == "torchrun" else [sys.executable]
    done = subprocess.run(
        [*launcher, *child_command(args, work, result)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{arm} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_child_options(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.compile = {"true": True, "false": False}.get(args.compile, args.compile)
    if args.child:
        return child(args)
    if args.smoke:
        args.steps, args.warmup, args.micro, args.accumulation, args.rounds = 4, 2, 2, 2, 1
    C.require_steadytrain()
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for i in range(args.rounds):
        for arm in ARMS:
            with tempfile.TemporaryDirectory() as work:
                rounds[arm].append(run_arm(arm, args, Path(work)))
                print(f"round {i + 1} {arm}: {rounds[arm][-1]['tokens_per_s']:,.0f} tokens/s")
    summary = {
        arm: {
            "tokens_per_s": C.median([r["tokens_per_s"] for r in rs]),
            "peak_allocated": max((r["peak_allocated"] or 0) for r in rs),
            "process_group": rs[-1]["process_group"],
        }
        for arm, rs in rounds.items()
    }
    ratio = summary["torchrun"]["tokens_per_s"] / summary["plain"]["tokens_per_s"]
    rows = [
        [arm, f"{s['tokens_per_s']:,.0f}", C.gib(s["peak_allocated"]), str(s["process_group"])]
        for arm, s in summary.items()
    ]
    print(C.table(["arm", "tokens/s", "peak allocated", "process group"], rows))
    print(f"torchrun / plain: {ratio:.3f}")
    device = torch.device("cpu" if args.smoke else "cuda")
    out = args.out or C.default_out("torchrun_one_gpu", args.smoke)
    C.write_json(
        out,
        {
            "environment": C.environment(device),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
            "rounds": rounds,
            "summary": summary,
            "torchrun_over_plain": ratio,
        },
    )


if __name__ == "__main__":
    main()
