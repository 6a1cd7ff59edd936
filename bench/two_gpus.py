#!/usr/bin/env python
"""Two GPUs (or --gpus N) of one host through torchrun (NCCL): scaling, an out-of-memory on one
rank, a rank killed under the supervisor. The workload is bench/torchrun_one_gpu.py's (the 1B LoRA shape,
bf16 base, sequence 1024, micro-batch 8, CausalLMLoss), effective batch 64.

Scenarios (each run in its own processes, each with a time limit so a hang is a failure):

* scale: one process (micro 8 × accumulation 8) against 2 ranks (each micro 8 × 4 of its
  32-sample share): tokens/s of the global batch, and the per-step losses of the two runs.
* oom: 2 ranks starting at micro 16, rank 1's GPU capped (`set_per_process_memory_fraction`)
  so that 16 runs out of memory there and 8 fits: both ranks shrink together, no hang, every
  step has the 64 samples asked for.
* kill: `steadytrain run -- torchrun --nproc_per_node 2 ...`, rank 1 SIGKILLed after step 3 of
  the first attempt (checkpoints every 2 steps): the group restarts, resumes, finishes.
* fsdp: a full fine-tune of the 1B shape with untied embeddings (1.50 B parameters: fp32
  weights, gradients and AdamW, 22.4 GiB of state) with each GPU capped at --fsdp-cap-gib, so
  one GPU cannot hold it (at 16 GiB the sharded step 1 runs out of memory too: 24 GiB trains): 2 ranks with `distributed: fsdp`, micro-batch 1,
  checkpoints through torch.distributed.checkpoint; then one process, uncapped, resumes it.
* fsdp_scale: the scale workload (1B LoRA, micro 8) sharded over 2 ranks (`distributed: fsdp`):
  tokens/s against the one process of 'scale' (run 'scale' first in the same call), and each
  rank's peak allocated memory against the one process's.

* fsdp_auto, fsdp_offload: the 'fsdp' workload under the same cap with `micro_batch_size: auto`,
  the second with `fsdp_offload: true` (FSDP2's CPUOffloadPolicy; CUDA only, left out with
  --smoke): the plan each rank chose before its first step (the per-rank estimate's reason,
  the savers, and whether it put the shards on the host by itself: `fsdp_offload` with its
  reason, chosen before sharding where only that fits), whether attempt 1 trained with no
  out-of-memory, its peak allocated and speed.
  Run both in one call to set the offload's cost against the plan without it:

    python bench/two_gpus.py --scenarios fsdp_auto,fsdp_offload --out $OUT/two_gpus_plan.json

--gpus N runs every scenario on N ranks instead of 2 (each rank's share of the batch is 64 / N;
rank 1 is the one capped in 'oom' and killed in 'kill'). The JSON is written after each scenario,
so a call cut short keeps the scenarios it finished.

On GPUs, every scenario samples `nvidia-smi --query-compute-apps` twice a second while it runs:
each process's memory on each GPU, and the processes seen on more than one GPU (a rank that
works on another rank's GPU; there must be none).

    python bench/two_gpus.py --smoke                     # CPU, gloo, tiny model
    python bench/two_gpus.py --out $OUT/two_gpus.json    # two GPUs
    python bench/two_gpus.py --gpus 4 --scenarios scale,fsdp_scale,oom,kill,fsdp --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch
import torchrun_one_gpu as one

EFFECTIVE = 64


class GpuProcesses:
    """Each process's memory on each GPU while a scenario runs, from nvidia-smi (a thread
    sampling twice a second): {pid: {gpu index: largest MiB seen}}."""

    def __init__(self, period: float = 0.5):
        self.period, self.seen = period, {}
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.index = {}

    def __enter__(self) -> GpuProcesses:
        ids = self._query("--query-gpu=index,uuid")
        self.index = {uuid: int(index) for index, uuid in ids}
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _query(self, what: str) -> list[list[str]]:
        done = subprocess.run(
            ["nvidia-smi", what, "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        return [[f.strip() for f in line.split(",")] for line in done.stdout.splitlines() if line]

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            for row in self._query("--query-compute-apps=pid,gpu_uuid,used_memory"):
                if len(row) != 3 or not row[2].isdigit():
                    continue
                with self.lock:
                    gpus = self.seen.setdefault(row[0], {})
                    gpu = self.index.get(row[1], row[1])
                    gpus[gpu] = max(gpus.get(gpu, 0), int(row[2]))

    def figures(self) -> dict[str, Any]:
        with self.lock:
            seen = {pid: dict(gpus) for pid, gpus in self.seen.items()}
        return {
            "per_process_mib": seen,
            "processes_on_several_gpus": [p for p, g in seen.items() if len(g) > 1],
        }


def launch(command: list[str], limit: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"no end after {limit:.0f} s (a hang?): {' '.join(command)}") from exc


def checked(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def scale(args, work: Path) -> dict[str, Any]:
    runs = {}
    n = args.gpus
    for name, ranks in (("1 rank", 1), (f"{n} ranks", n)):
        result = work / f"scale-{ranks}.json"
        accumulation = EFFECTIVE // ranks // args.micro
        command = one.child_command(args, work / f"scale-{ranks}", result, effective=EFFECTIVE)
        command[command.index("--accumulation") + 1] = str(accumulation)
        launcher = [sys.executable] if ranks == 1 else one.torchrun(ranks)
        checked(launch([*launcher, *command], args.limit), f"scale, {name}")
        runs[name] = json.loads(result.read_text())
    a, b = runs["1 rank"]["losses"], runs[f"{n} ranks"]["losses"]
    return {
        "ranks": n,
        "runs": runs,
        "speedup": runs[f"{n} ranks"]["tokens_per_s"] / runs["1 rank"]["tokens_per_s"],
        "largest_loss_difference": max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)),
    }


def oom(args, work: Path) -> dict[str, Any]:
    result = work / "oom.json"
    command = one.child_command(
        args, work / "oom", result, effective=EFFECTIVE, cap_gib=args.oom_cap_gib
    )
    command[command.index("--micro") + 1] = str(args.micro * 2)
    checked(launch([*one.torchrun(args.gpus), *command], args.limit), "oom")
    figures = json.loads(result.read_text())
    run_dir = work / "oom" / "run"
    paths = [run_dir / "events.jsonl"]
    paths += [run_dir / "ranks" / f"rank-{r}" / "events.jsonl" for r in range(1, args.gpus)]
    events = {
        rank: [e for e in C.read_jsonl(path) if e["event"] in ("oom", "shrink")]
        for rank, path in enumerate(paths)
    }
    return {"result": figures, "events": events}


def kill(args, work: Path) -> dict[str, Any]:
    run_dir, result = work / "kill-run", work / "kill.json"
    command = one.child_command(
        args,
        work / "kill",
        result,
        effective=EFFECTIVE,
        run_dir=run_dir,
        save_every=2,
        kill_at=3,
    )
    supervisor = [sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)]
    done = launch(
        [*supervisor, "--backoff-initial", "1", "--", *one.torchrun(args.gpus), *command],
        2 * args.limit,
    )
    checked(done, "kill")
    events = C.read_jsonl(run_dir / "events.jsonl")
    return {
        "result": json.loads(result.read_text()),
        "restarts": [e for e in events if e["event"] == "restart"],
        "resumed_from": [e["step"] for e in events if e["event"] == "resume"],
        "supervisor_says": done.stderr[-1500:],
    }


def fsdp(args, work: Path) -> dict[str, Any]:
    """A full fine-tune whose state (fp32 weights, gradients, AdamW: 16 B a parameter, 22.4 GiB
    for the untied 1B shape) does not fit one GPU capped at --fsdp-cap-gib: 2 ranks with
    `distributed: fsdp` under that cap on each GPU, checkpoints through DCP; then one process,
    uncapped, resumes the run and trains 2 steps more."""
    run_dir, result = work / "fsdp-run", work / "fsdp.json"
    common = {"effective": 8, "run_dir": run_dir, "method": "full", "save_every": 2}
    common["data_steps"] = args.steps + 2  # the same data for the resumed run's longer schedule
    command = one.child_command(
        args,
        work / "fsdp",
        result,
        **common,
        distributed="fsdp",
        cap_gib=args.fsdp_cap_gib,
        cap_rank=-1,
    )
    command[command.index("--micro") + 1] = "1"
    checked(launch([*one.torchrun(args.gpus), *command], args.limit), "fsdp, sharded")
    sharded = json.loads(result.read_text())
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    files = sorted(p.name for p in (run_dir / "checkpoints" / latest).iterdir())
    command = one.child_command(args, work / "fsdp-1", result, **common)
    command[command.index("--micro") + 1] = "1"
    command[command.index("--steps") + 1] = str(args.steps + 2)
    checked(launch([sys.executable, *command], args.limit), "fsdp, resumed on one GPU")
    events = C.read_jsonl(run_dir / "events.jsonl")
    return {
        "ranks": args.gpus,
        "two_ranks": sharded,  # the sharded run (the key kept from the 2-GPU results)
        "checkpoint": {"name": latest, "files": files},
        "one_gpu": json.loads(result.read_text()),
        "resumed_from": [e["step"] for e in events if e["event"] == "resume"],
        "overrides": [e for e in events if e["event"] in ("resume_override", "note")][-3:],
    }


def fsdp_planned(args, work: Path, offload: bool) -> dict[str, Any]:
    """The 'fsdp' workload, each GPU capped at --fsdp-cap-gib, with `micro_batch_size: auto`
    (and `fsdp_offload: true` where `offload`): what the plan chose before the first step and
    how attempt 1 went. A run that fails is reported, not raised: its out-of-memory is the
    finding."""
    name = "fsdp-offload" if offload else "fsdp-auto"
    run_dir, result = work / f"{name}-run", work / f"{name}.json"
    command = one.child_command(
        args,
        work / name,
        result,
        effective=8,
        run_dir=run_dir,
        method="full",
        distributed="fsdp",
        cap_gib=args.fsdp_cap_gib,
        cap_rank=-1,
    )
    command += ["--auto-micro"] + (["--fsdp-offload"] if offload else [])
    done = launch([*one.torchrun(args.gpus), *command], args.limit)
    events = C.read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    plans = [e for e in events if e["event"] == "plan"]
    return {
        "ranks": args.gpus,
        "offload": offload,
        "exit_code": done.returncode,
        "result": json.loads(result.read_text()) if done.returncode == 0 else None,
        "plan": plans[-1] if plans else None,
        "estimate": next((e for e in events if e["event"] == "estimate"), None),
        "ooms": [e for e in events if e["event"] == "oom"],
        "stderr_tail": done.stderr[-3000:] if done.returncode else "",
    }


def fsdp_scale(args, work: Path) -> dict[str, Any]:
    """The scale workload sharded over --gpus ranks, against 'scale''s one process when it ran."""
    result = work / "fsdp-scale.json"
    command = one.child_command(
        args, work / "fsdp-scale", result, effective=EFFECTIVE, distributed="fsdp"
    )
    command[command.index("--accumulation") + 1] = str(EFFECTIVE // args.gpus // args.micro)
    checked(launch([*one.torchrun(args.gpus), *command], args.limit), "fsdp_scale, sharded")
    two = json.loads(result.read_text())
    single = work / "scale-1.json"
    alone = json.loads(single.read_text()) if single.exists() else None
    return {
        "ranks": args.gpus,
        "two_ranks": two,  # the sharded run (the key kept from the 2-GPU results)
        "speedup": two["tokens_per_s"] / alone["tokens_per_s"] if alone else None,
        "one_rank_tokens_per_s": alone["tokens_per_s"] if alone else None,
        "one_rank_peak_allocated": alone["peak_allocated"] if alone else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one.add_child_options(p)
    p.add_argument("--scenarios", default="scale,oom,kill")
    p.add_argument("--gpus", type=int, default=2, help="ranks (GPUs) of the sharded runs")
    p.add_argument("--oom-cap-gib", type=float, default=40.0, help="rank 1's cap in 'oom'")
    p.add_argument("--fsdp-cap-gib", type=float, default=16.0, help="each GPU's cap in 'fsdp'")
    p.add_argument("--limit", type=float, default=240.0, help="seconds a run may take")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.compile = {"true": True, "false": False}.get(args.compile, args.compile)
    if args.smoke:
        args.steps, args.warmup, args.micro, args.oom_cap_gib = 4, 2, 8, 0
    else:
        args.steps, args.warmup = min(args.steps, 12), min(args.warmup, 4)
    C.require_steadytrain()
    figures: dict[str, Any] = {}
    device = torch.device("cpu" if args.smoke else "cuda")
    environment = C.environment(device)
    out = args.out or C.default_out("two_gpus", args.smoke)
    with tempfile.TemporaryDirectory() as work:
        for name in args.scenarios.split(","):
            scenario = {
                "scale": scale,
                "oom": oom,
                "kill": kill,
                "fsdp": fsdp,
                "fsdp_scale": fsdp_scale,
                "fsdp_auto": lambda a, w: fsdp_planned(a, w, offload=False),
                "fsdp_offload": lambda a, w: fsdp_planned(a, w, offload=True),
            }[name]
            if args.smoke and name == "fsdp_offload":
                print("fsdp_offload: left out with --smoke (CUDA only)", flush=True)
                continue
            if args.smoke:
                figures[name] = scenario(args, Path(work))
            else:
                with GpuProcesses() as gpus:
                    try:
                        figures[name] = scenario(args, Path(work))
                    finally:  # a failed or hung scenario's memory map is printed too
                        seen = gpus.figures()
                        print(f"{name}: gpu processes {json.dumps(seen)}", flush=True)
                figures[name]["gpu_processes"] = seen
            print(f"{name}: {json.dumps(summary_of(name, figures[name]))}", flush=True)
            # after each scenario (a call cut short keeps what finished), and before the
            # folder's removal, which can take minutes after the fsdp checkpoints
            C.write_json(out, {"environment": environment, "settings": vars(args), **figures})


def summary_of(name: str, f: dict[str, Any]) -> dict[str, Any]:
    seen = f.get("gpu_processes")
    several = {"processes on several GPUs": seen["processes_on_several_gpus"]} if seen else {}
    n = f.get("ranks", 2)
    if name == "scale":
        return several | {
            "tokens/s 1 rank": round(f["runs"]["1 rank"]["tokens_per_s"]),
            f"tokens/s {n} ranks": round(f["runs"][f"{n} ranks"]["tokens_per_s"]),
            "speedup": round(f["speedup"], 3),
            "largest relative loss difference": f["largest_loss_difference"],
        }
    if name == "fsdp_scale":
        two = f["two_ranks"]
        return several | {
            f"tokens/s {n} ranks fsdp": round(two["tokens_per_s"]),
            "speedup over 1 process": f["speedup"] and round(f["speedup"], 3),
            "peak_allocated rank 0": two["peak_allocated"],
            "peak_allocated 1 process": f.get("one_rank_peak_allocated"),
        }
    if name == "fsdp":
        two, one_gpu = f["two_ranks"], f["one_gpu"]
        return several | {
            f"{n} ranks": {
                k: two[k] for k in ("steps", "peak_allocated", "process_group", "losses")
            },
            "checkpoint files": f["checkpoint"]["files"],
            "resumed_from": f["resumed_from"],
            "one GPU": {k: one_gpu[k] for k in ("steps", "peak_allocated", "losses")},
        }
    if name in ("fsdp_auto", "fsdp_offload"):
        plan, r = f["plan"] or {}, f["result"] or {}
        return several | {
            "exit_code": f["exit_code"],
            "plan": {
                k: plan.get(k)
                for k in ("micro_batch_size", "activation_checkpointing", "fsdp_offload")
            },
            "per-rank reason": [
                x for x in plan.get("reasons", []) if "per-rank" in x or "fsdp_offload:" in x
            ],
            "ooms": len(f["ooms"]),
            **{k: r.get(k) for k in ("steps", "peak_allocated", "tokens_per_s")},
        }
    r = f["result"]
    out = several | {k: r[k] for k in ("steps", "micro_batch_size", "oom_count", "samples")}
    if name == "kill":
        out |= {"restarts": len(f["restarts"]), "resumed_from": f["resumed_from"]}
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
