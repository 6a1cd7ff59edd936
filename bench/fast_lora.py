#!/usr/bin/env python
"""Lean and fast LoRA: steadytrain against the anchors users pick for speed (Unsloth, Liger Kernel)
and a plain loop, on the issue-17 workload, at full memory and under a 16 GiB cap, in one call.

Workload (bench/_common.py): the Llama-3.2-1B shape with random init (hidden 2048, intermediate
8192, 16 layers, 32/8 heads, vocab 128256, tied embeddings), bf16 base, LoRA r16 / alpha 32 /
dropout 0 on the 7 projections of every layer, sequence 1024, AdamW (fused) lr 2e-4, clip 1.0,
token-weighted loss, the same synthetic data in the same order for every arm.

Arms (each in its own process; "cap" arms under torch.cuda.set_per_process_memory_fraction so
that 16 GiB is usable, effective batch 64; full-memory arms micro 8 × accumulation 4 = 32):

* unsloth: FastLanguageModel (bf16, no quantization) and its get_peft_model, no checkpointing,
  a plain loop calling the model with labels (its fused loss). unsloth-cap: micro 16 × 4 with its
  offloaded checkpointing (use_gradient_checkpointing="unsloth").
* liger-cap: apply_liger_kernel_to_llama (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) and
  peft, a plain loop calling the model with labels, micro 8 × 8.
* plain: a plain loop, the model's logits and an fp32 cross-entropy.
* steadytrain[-compile]: Trainer, micro 8, CausalLMLoss() (the plain loss), compile false [true].
* steadytrain-fused[-compile]: the same with CausalLMLoss(chunk_tokens=1024): on CUDA with Liger
  Kernel installed its chunked mode is the fused linear cross-entropy (memory/fused_loss.py).
* steadytrain-fused-compile-unfused: the same with each projection's LoRA A product its own
  (compiling's `FUSED_PROJECTIONS` off; on by default on CUDA: the A matrices of q, k, v and of
  gate, up stacked into one product per group, engine/fused_projections.py).
* steadytrain-fused-compile-noepilogue: the same with each LoRA term added after its frozen
  product, as peft adds it (fused_projections' `EPILOGUE_ADD` off; on by default: one `addmm`).
* steadytrain-fused-compile-reads: the same with the loss's avoidable reads of the GPU back
  (memory/chunked_loss.py's `SKIP_PACKED_CHECK` and fused_loss.py's `DEVICE_SCALED_BACKWARD`
  off: transformers' packed-sequence check before every forward, Liger's module and its
  backward's read of the incoming gradient).
* steadytrain-fused-compile-keep: the same, compiled with the partitioner's default (activation
  memory budget 1.0): each block keeps its elementwise results too (engine/compiling.py).
* steadytrain-fused-compile-cudnn: the same with cuDNN's attention first in SDPA's order;
  -cudagraphs: the same with each compiled block replayed as CUDA graphs
  (`engine/compiling.py`'s `CUDA_GRAPHS`: inductor's `triton.cudagraphs`, with the adapters'
  gradients copied out of the graphs' memory); -cudagraphs-keep: the same at the partitioner's
  default budget (1.0; 0.95 partitions a Llama layer as 0.9 does): speed levers tried for P6.
  -autotune: inductor times Triton's matrix-multiply templates against cuBLAS for each shape of
  the compiled blocks (`max_autotune_gemm`). -tuned: inductor's `coordinate_descent_tuning`
  (each Triton kernel's block sizes timed at compile); -rows: row reductions up to 4,096 wide in
  one pass over the row (inductor loops over rows wider than 1,024); -rows-tuned: both. These
  three run with inductor's caches off.
* steadytrain-auto: cap, micro_batch_size "auto", CausalLMLoss(), nothing else set: the planner
  chooses micro size, accumulation and savers (the fused loss among them), and `compile` is its
  default, "auto" (compiled on CUDA with Triton). -eager: compile false; -compile: compile true.
* steadytrain-finetune-cli: cap, the user's path: `steadytrain finetune --config` (the CLI's own
  `main`, in the arm's process after the cap is set) on the same model saved as a folder (with a
  word-level tokenizer of its vocabulary) and the same token ids written as text records, with
  `micro_batch_size: auto`, per_device_train_batch_size 16 × gradient_accumulation_steps 4, bf16,
  adamw_torch_fused, LoRA r16 / alpha 32 / dropout 0 on the 7 projections, constant lr 2e-4, and
  nothing else: figures from the run's own metrics.jsonl and events.jsonl.
* steadytrain-cap-m4/m8-fused-compile: cap, the micro size set by hand, the fused loss, compiled,
  no checkpointing: the hand-tuned runs the planner's choice is measured against.
* steadytrain-cap-m16-ckpt/offload-fused-compile: Unsloth's capped setting (micro 16 × 4) by
  hand, the fused loss, compiled, with activation checkpointing, plain or with the kept layer
  inputs offloaded to host memory (`activation_checkpointing: "offload"`).

With `--sync-debug`, each arm runs one step more after those (timed and profiled) under
`torch.cuda.set_sync_debug_mode("warn")`, and its JSON's "syncs" lists every host
synchronisation of that step with the Python stack that made it, each stack once with a count.

With `--profile N`, each arm runs N more optimizer steps after the timed ones under
torch.profiler, and its JSON gets the GPU kernel time of those steps by kind (matrix multiplies,
attention, Triton kernels, elementwise, reductions, copies, optimizer), the 40 kernels that took
longest, and the share of the steps' wall time the GPU was busy: where two arms of the same
function spend their time differently.

Per arm: tokens/s over the steady steps (after --warmup), peak allocated and reserved memory
(CUDA graphs keep their memory in a pool of their own), the first step's
loss (the same base weights and LoRA B = 0 give every arm the same value: a check that each arm
computes the same function), seconds from the process start (and from the model load) to the end
of the first optimizer step and from the process start to the first million trained tokens,
out-of-memory events, the batch each step used. Each arm runs at least as many steps as its first
million tokens take (31 at batch 32 × 1,024; `--steps` sets more), so every arm has both times.

    python bench/fast_lora.py --smoke                         # CPU, tiny model, plain + steadytrain
    python bench/fast_lora.py --arms unsloth,plain,steadytrain-fused --out $OUT/fast_lora.json
    python bench/fast_lora.py --arms unsloth,steadytrain-fused-compile --profile 2
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before any heavy import: Unsloth's patching counts

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _common as C  # noqa: E402  (torch only: transformers is not imported before Unsloth)
import torch  # noqa: E402

from steadytrain.run.records import Metric  # noqa: E402  (no torch, no transformers)

GiB = 2**30
MILLION = 1_000_000
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS: dict[str, dict[str, Any]] = {
    "unsloth": {"cap": False, "micro": 8},
    "unsloth-cap": {"cap": True, "micro": 16, "checkpointing": "unsloth"},
    "liger-cap": {"cap": True, "micro": 8},
    "plain": {"cap": False, "micro": 8},
    "steadytrain": {"cap": False, "micro": 8, "compile": False},
    "steadytrain-compile": {"cap": False, "micro": 8, "compile": True},
    "steadytrain-fused": {"cap": False, "micro": 8, "chunk": 1024, "compile": False},
    "steadytrain-fused-compile": {"cap": False, "micro": 8, "chunk": 1024, "compile": True},
    "steadytrain-fused-compile-unfused": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "fused_projections": False,
    },
    "steadytrain-fused-compile-noepilogue": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "epilogue": False,
    },
    "steadytrain-fused-compile-reads": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "host_reads": True,
    },
    "steadytrain-fused-compile-keep": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "budget": 1.0,
    },
    "steadytrain-fused-compile-tuned": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "inductor": {"coordinate_descent_tuning": True},
    },
    "steadytrain-fused-compile-rows": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "persistent_rows": 4096,
    },
    "steadytrain-fused-compile-rows-tuned": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "persistent_rows": 4096,
        "inductor": {"coordinate_descent_tuning": True},
    },
    "steadytrain-auto": {"cap": True, "micro": "auto"},
    "steadytrain-auto-eager": {"cap": True, "micro": "auto", "compile": False},
    "steadytrain-auto-compile": {"cap": True, "micro": "auto", "compile": True},
    "steadytrain-fused-compile-cudnn": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "attention": "cudnn",
    },
    "steadytrain-fused-compile-cudagraphs": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "cudagraphs": True,
    },
    "steadytrain-fused-compile-cudagraphs-keep": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "cudagraphs": True,
        "budget": 1.0,
    },
    "steadytrain-fused-compile-autotune": {
        "cap": False,
        "micro": 8,
        "chunk": 1024,
        "compile": True,
        "autotune": True,
    },
    "steadytrain-cap-m16-ckpt-fused-compile": {
        "cap": True,
        "micro": 16,
        "chunk": 1024,
        "compile": True,
        "checkpointing": True,
    },
    "steadytrain-cap-m16-offload-fused-compile": {
        "cap": True,
        "micro": 16,
        "chunk": 1024,
        "compile": True,
        "checkpointing": "offload",
    },
    "steadytrain-finetune-cli": {"cap": True, "micro": "auto"},
    "steadytrain-cap-m4-fused-compile": {"cap": True, "micro": 4, "chunk": 1024, "compile": True},
    "steadytrain-cap-m8-fused-compile": {"cap": True, "micro": 8, "chunk": 1024, "compile": True},
}
SMOKE_ARMS = "plain,steadytrain,steadytrain-fused,steadytrain-auto,steadytrain-finetune-cli"
KERNEL_KINDS = (  # (kind, lower-case pieces of a kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma", "splitk")),
    ("optimizer", ("multi_tensor", "adam")),
    ("copy", ("memcpy", "memset", "copy_kernel", "cat_", "catarray")),
    ("triton", ("triton",)),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def host_time(prof, count: int) -> dict[str, Any]:
    """Where the host's time went in the profiled steps: the CPU-side events (ops, autograd
    nodes, compiled regions) with the most time of their own and the most in all, a step."""
    events = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CPU and not e.key.startswith("ProfilerStep")
    ]

    def row(e, us: float) -> dict[str, Any]:
        return {"name": e.key[:120], "calls": e.count // count, "ms_per_step": us / 1e3 / count}

    own = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    total = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:30]
    return {
        "self_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / count,
        "top_self": [row(e, e.self_cpu_time_total) for e in own],
        "top_total": [row(e, e.cpu_time_total) for e in total],
    }


def gaps(prof, on_device: bool) -> dict[str, Any] | None:
    """Where the device sat idle between kernels in the profiled steps: the idle time, and the
    longest gaps with the kernels on either side."""
    if not on_device:
        return None
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Profiler")
    )
    if not spans:
        return None
    idle, found, reach, last = 0.0, [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            idle += start - reach
            found.append((start - reach, last, name))
        if end >= reach:
            reach, last = end, name
    found.sort(reverse=True)
    return {
        "window_ms": (reach - spans[0][0]) / 1e3,
        "idle_ms": idle / 1e3,
        "gaps_over_50us": sum(1 for g in found if g[0] > 50),
        "idle_in_gaps_over_50us_ms": sum(g[0] for g in found if g[0] > 50) / 1e3,
        "longest": [
            {"us": round(g, 1), "after": a[:90], "before": b[:90]} for g, a, b in found[:25]
        ],
    }


class StepProfile:
    """torch.profiler over the `count` optimizer steps after the first `skip`: `step()` is called
    at each optimizer step's end (after a host sync), `summary` is filled when the window ends."""

    def __init__(self, skip: int, count: int, device: torch.device, trace: Path | None = None):
        self.skip, self.count, self.steps, self.bounds = skip, count, 0, []
        self.trace = trace
        self.summary: dict[str, Any] | None = None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.device_type = device.type
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=max(skip - 1, 0), warmup=1, active=count, repeat=1
            ),
            on_trace_ready=self._summarize,
        )
        self.prof.start()

    def step(self) -> None:
        self.steps += 1
        if self.steps in (self.skip, self.skip + self.count):
            self.bounds.append(time.perf_counter())
        if self.summary is None:
            self.prof.step()

    def _summarize(self, prof) -> None:
        on_device = self.device_type == "cuda"
        kernels = [
            e
            for e in prof.key_averages()
            if (e.device_type == torch.autograd.DeviceType.CUDA) == on_device
            and (on_device or e.self_cpu_time_total > 0)
        ]

        def self_us(e) -> float:
            if on_device:
                return getattr(e, "self_device_time_total", 0.0) or e.self_cuda_time_total
            return e.self_cpu_time_total

        kernels = [e for e in kernels if not e.key.startswith("ProfilerStep")]
        kinds: dict[str, float] = {}
        for e in kernels:
            kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + self_us(e) / 1e3
        busy = sum(kinds.values())
        top = sorted(kernels, key=self_us, reverse=True)[:40]
        self.summary = {
            "steps": self.count,
            "busy_ms_per_step": busy / self.count,
            "ms_per_step_by_kind": {k: v / self.count for k, v in sorted(kinds.items())},
            "top_kernels": [
                {
                    "name": e.key[:160],
                    "calls": e.count,
                    "ms_per_step": self_us(e) / 1e3 / self.count,
                }
                for e in top
            ],
            "gaps": gaps(prof, on_device),
            "host": host_time(prof, self.count),
        }
        if self.trace is not None:
            prof.export_chrome_trace(str(self.trace))

    def finish(self) -> dict[str, Any] | None:
        self.prof.stop()
        if self.summary is not None and len(self.bounds) == 2:
            wall = (self.bounds[1] - self.bounds[0]) * 1e3 / self.count
            self.summary["wall_ms_per_step"] = wall
            self.summary["busy_share"] = self.summary["busy_ms_per_step"] / wall
        return self.summary


class SyncWatch:
    """Every host synchronisation of one optimizer step (the one after the timed and profiled
    steps): `torch.cuda.set_sync_debug_mode("warn")` over that step, each warning recorded with
    the Python stack that made it, the same stacks counted once. `step()` is called at each
    optimizer step's end, as `StepProfile.step` is."""

    def __init__(self, at: int) -> None:
        self.at, self.steps, self.seen = at, 0, {}
        self.saved: tuple | None = None

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.at:
            self.saved = (warnings.filters[:], warnings.showwarning)
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
        elif self.steps == self.at + 1:
            self.stop()

    def stop(self) -> None:
        if self.saved is not None:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            warnings.filters[:], warnings.showwarning = self.saved
            self.saved = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if not f.filename.endswith(("warnings.py", "fast_lora.py"))
        ]
        key = (str(message).splitlines()[0][:120], tuple(frames[-10:]))
        self.seen[key] = self.seen.get(key, 0) + 1

    def finish(self) -> list[dict[str, Any]]:
        self.stop()
        return [
            {"count": n, "message": m, "stack": list(stack)}
            for (m, stack), n in sorted(self.seen.items(), key=lambda kv: -kv[1])
        ]


def anchor_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("unsloth", "unsloth_zoo", "liger_kernel", "peft", "transformers", "triton"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# -- the loops -------------------------------------------------------------------------------


def total_steps(args) -> int:
    """The timed steps, then the profiled ones, then (with a profile) one more that saves, so
    that steadytrain's end-of-run checkpoint falls outside the profile; with `--sync-debug` one
    more before that save, watched for host synchronisations."""
    extra = args.profile + (1 if args.sync_debug else 0)
    return args.steps + (extra + 1 if extra else 0)


def batches(args, data, effective: int):
    """Each optimizer step's (input_ids, labels), pinned, in steadytrain's sampler order."""

    order = C.data_order(len(data), args.seed)
    for step in range(total_steps(args)):
        rows = [data[i] for i in order[step * effective : (step + 1) * effective]]
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["labels"] for r in rows])
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            ids, labels = ids.pin_memory(), labels.pin_memory()
        yield ids, labels


def loop(args, model, data, device, effective: int, micro: int, with_labels: bool, watchers=()):
    """The plain loop every non-steadytrain arm runs: token-weighted loss per micro-batch,
    backward, clip, fused AdamW. `with_labels`: the model computes its own (mean) loss from
    labels, as Unsloth's and Liger's fused losses do; else the logits' fp32 cross-entropy."""

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda")
    precision = "bf16" if device.type == "cuda" else "fp32"
    marks, losses = [], []
    for ids, labels in batches(args, data, effective):
        count = C.label_tokens(labels).to(device)
        total = torch.zeros((), device=device)
        for start in range(0, effective, micro):
            piece = {
                "input_ids": ids[start : start + micro].to(device, non_blocking=True),
                "labels": labels[start : start + micro].to(device, non_blocking=True),
            }
            with C.autocast(device, precision):
                if with_labels:
                    mean = model(**piece, use_cache=False).loss
                    loss = mean * C.label_tokens(piece["labels"]) / count
                else:
                    loss = C.lm_loss_sum(model, piece) / count
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # a host sync: the step's end
        marks.append(time.perf_counter())
        for watcher in watchers:
            watcher.step()
    return {"marks": marks, "losses": losses, "micro": micro, "accumulation": effective // micro}


def inductor_settings(arm: dict) -> None:
    """An arm's inductor settings, set for the whole process (the layers compile at the first
    step): `inductor` maps dotted config names to values; `persistent_rows` makes row
    reductions up to that width one pass over the row (inductor's default loops over rows
    wider than 1,024, reading them twice: the norms' backward at hidden 2,048). Caches off, so
    that an earlier arm's kernels are not served to this one."""
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True
    for key, value in arm.get("inductor", {}).items():
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, inductor_config), name, value)
    limit = arm.get("persistent_rows")
    if not limit:
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, *args, **kwargs) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, *args, **kwargs):
                return True
            numel = features.reduction_numel
            return (
                features.get_reduction_hint() == ReductionHint.INNER
                and (isinstance(numel, int) or getattr(numel, "is_number", False))
                and int(numel) <= limit
            )

    V.set_choices_handler(PersistentRows())


def run_steadytrain(
    args, arm: dict, model, data, device, effective: int, watchers=()
) -> dict[str, Any]:
    from steadytrain import Callback, TrainConfig, Trainer
    from steadytrain.engine import compiling
    from steadytrain.memory.chunked_loss import CausalLMLoss

    if "budget" in arm:
        compiling.RECOMPUTE_BUDGET = arm["budget"]
    if arm.get("cudagraphs"):
        compiling.CUDA_GRAPHS = True
    if "fused_projections" in arm:
        compiling.FUSED_PROJECTIONS = arm["fused_projections"]
    if "epilogue" in arm:
        from steadytrain.engine import fused_projections

        fused_projections.EPILOGUE_ADD = arm["epilogue"]
    if arm.get("host_reads"):
        from steadytrain.memory import chunked_loss, fused_loss

        chunked_loss.SKIP_PACKED_CHECK = False
        fused_loss.DEVICE_SCALED_BACKWARD = False
    if arm.get("autotune"):
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm = True
        inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    if arm.get("inductor") or arm.get("persistent_rows"):
        inductor_settings(arm)
    attention = contextlib.nullcontext()
    if arm.get("attention") == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
        order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        attention = sdpa_kernel(order, set_priority=True)

    with tempfile.TemporaryDirectory(prefix="fast-lora-") as work:
        run_dir = Path(work) / "run"
        config = TrainConfig(
            run_dir=str(run_dir),
            effective_batch_size=effective,
            micro_batch_size=arm["micro"],
            precision="bf16" if device.type == "cuda" else "fp32",
            device=str(device),
            max_steps=total_steps(args),
            save_every_steps=total_steps(args),
            seed=args.seed,
            progress="lines",
            log_every_steps=1,
            **({"compile": arm["compile"]} if "compile" in arm else {}),
            **(
                {"activation_checkpointing": arm["checkpointing"]} if "checkpointing" in arm else {}
            ),
        )
        loss_fn = CausalLMLoss(chunk_tokens=arm.get("chunk"))

        class Profiling(Callback):
            def on_step_end(self, state, control, info) -> None:
                for watcher in watchers:
                    watcher.step()

        trainer = Trainer(
            model,
            lambda params: torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda"),
            loss_fn,
            data,
            config=config,
            callbacks=[Profiling()] if watchers else (),
        )
        with attention:
            result = trainer.fit()
        metrics = C.read_jsonl(run_dir / "metrics.jsonl")
        events = C.read_jsonl(run_dir / "events.jsonl")
    offset = time.perf_counter() - time.time()
    plan = next((e for e in events if e["event"] == "plan"), None)
    return {
        "marks": [m[Metric.TIME] + offset for m in metrics],
        "losses": [m[Metric.LOSS] for m in metrics],
        "micro": metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None,
        "accumulation": metrics[-1][Metric.MICRO_STEPS] if metrics else None,
        "samples_per_step": sorted({m[Metric.SAMPLES] for m in metrics}),
        "oom_count": result.oom_count,
        "loss_method": loss_fn.chunked_method(model, device) if loss_fn.chunk_tokens else "plain",
        "plan": plan,
        "events": [e for e in events if e["event"] in ("oom", "shrink", "memory_saver", "compile")],
    }


# -- the anchors' models ------------------------------------------------------------------------


def save_model_folder(
    spec, folder: Path, seed: int, device: str = "cuda", dtype=torch.bfloat16
) -> None:
    """The random tied Llama of `spec` (the same weights `lora_llama` builds) in bf16, and a
    word-level tokenizer of its vocabulary built offline (token i is the word "t<i>", words split
    on whitespace): what Unsloth's from_pretrained and `steadytrain finetune` read."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(C.llama_config(spec, tied=True)).to(dtype)
    model.save_pretrained(folder)
    del model
    vocab = {f"t{i}": i for i in range(spec.vocab)}
    words = Tokenizer(WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="t0",
        bos_token="t1",
        eos_token="t2",
        pad_token="t3",
    )
    tokenizer.model_max_length = spec.seq
    tokenizer.save_pretrained(folder)


def unsloth_model(args, spec, arm: dict, work: Path):
    from unsloth import FastLanguageModel  # first: it patches transformers and peft

    folder = work / "model"
    save_model_folder(spec, folder, args.seed)
    torch.cuda.empty_cache()
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(folder),
        max_seq_length=spec.seq,
        dtype=torch.bfloat16,
        load_in_4bit=False,
        use_gradient_checkpointing=arm.get("checkpointing", False),
        local_files_only=True,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=PROJECTIONS,
        bias="none",
        use_gradient_checkpointing=arm.get("checkpointing", False),
        random_state=args.seed,
    )
    model.train()
    return model


def liger_model(args, spec, device):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )
    return C.lora_llama(spec, device, torch.bfloat16, args.seed)


def run_finetune_cli(args, spec, device, data, effective: int, work: Path) -> dict[str, Any]:
    """`steadytrain finetune --config` (the CLI's `main`, in this process, after the cap) on the
    model saved as a folder and the arm's token ids as text records; its own run's figures."""
    from steadytrain.cli import main as steadytrain_main

    folder, run_dir = work / "model", work / "run"
    on_cuda = device.type == "cuda"
    save_model_folder(
        spec, folder, args.seed, str(device), torch.bfloat16 if on_cuda else torch.float32
    )
    C.free_device_memory(device)
    train = work / "train.jsonl"
    with train.open("w") as f:
        for sample in data:
            text = " ".join(f"t{int(i)}" for i in sample["input_ids"])
            f.write(json.dumps({"text": text}) + "\n")
    micro = 16 if not args.smoke else 4
    config = {
        "model_name_or_path": str(folder),
        "train_file": str(train),
        "max_seq_length": spec.seq,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": effective // micro,
        "micro_batch_size": "auto",
        "max_steps": total_steps(args),
        "save_steps": total_steps(args),
        "logging_steps": 1,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": PROJECTIONS},
        "output_dir": str(run_dir),
        "seed": args.seed,
        **({"bf16": True, "optim": "adamw_torch_fused"} if on_cuda else {}),
    }
    path = work / "finetune.json"
    path.write_text(json.dumps(config, indent=1))
    C.reset_peak(device)
    code = 0
    try:
        steadytrain_main(["finetune", "--config", str(path)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    metrics = [m for m in C.read_jsonl(run_dir / "metrics.jsonl") if Metric.MICRO_BATCH_SIZE in m]
    events = C.read_jsonl(run_dir / "events.jsonl")
    offset = time.perf_counter() - time.time()
    plan = next((e for e in events if e["event"] == "plan"), None)
    peaks = [m[Metric.MEM_PEAK] for m in metrics if m.get(Metric.MEM_PEAK) is not None]
    return {
        "exit_code": code,
        "config": config,
        "marks": [m[Metric.TIME] + offset for m in metrics],
        "losses": [m[Metric.LOSS] for m in metrics],
        "micro": metrics[-1][Metric.MICRO_BATCH_SIZE] if metrics else None,
        "accumulation": metrics[-1][Metric.MICRO_STEPS] if metrics else None,
        "samples_per_step": sorted({m[Metric.SAMPLES] for m in metrics}),
        "oom_count": sum(1 for e in events if e["event"] == "oom"),
        "loss_method": _plan_loss(plan),
        "steps_peak": max(peaks) if peaks else None,
        "plan": plan,
        "events": [e for e in events if e["event"] in ("oom", "shrink", "memory_saver", "compile")],
    }


def _plan_loss(plan: dict | None) -> str:
    """The loss mode the plan chose, from its event ("chunked"/"plain", with the method)."""
    if not plan:
        return "-"
    text = json.dumps(plan)
    if "fused linear cross-entropy" in text:
        return "fused (plan)"
    return "chunked (plan)" if plan.get("chunked_loss") else "plain (plan)"


# -- one arm in this process --------------------------------------------------------------------


def steps_for_million(args, effective: int, seq: int) -> int:
    """`--steps`, raised to the steps the first million trained tokens take (not in smoke)."""
    if args.smoke:
        return args.steps
    return max(args.steps, -(-MILLION // (effective * seq)))


def child(args) -> None:
    name, arm = args.arm, ARMS[args.arm]
    if name.startswith("unsloth"):
        import unsloth  # noqa: F401  before transformers, as Unsloth requires

    device = C.resolve(args.device)
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    cap = None
    if arm["cap"] and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
        cap = int(args.cap_gib * GiB)
    effective = args.effective_cap if arm["cap"] else args.effective
    args.steps = steps_for_million(args, effective, spec.seq)
    data = C.synthetic_tokens(effective * total_steps(args), spec.seq, spec.vocab, args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="fast-lora-") as work:
        model = None
        if name == "steadytrain-finetune-cli":
            pass  # the CLI loads the model itself
        elif name.startswith("unsloth"):
            model = unsloth_model(args, spec, arm, Path(work))
        elif name.startswith("liger"):
            model = liger_model(args, spec, device)
        else:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model = C.lora_llama(spec, device, dtype, args.seed)
        C.synchronize(device)
        C.reset_peak(device)
        loaded = time.perf_counter()
        trace = args.trace_dir / f"{name}.json.gz" if args.trace_dir else None
        profile = StepProfile(args.steps, args.profile, device, trace) if args.profile else None
        watch = SyncWatch(args.steps + args.profile) if args.sync_debug else None
        watchers = [w for w in (profile, watch) if w is not None]
        if model is None:
            result = run_finetune_cli(args, spec, device, data, effective, Path(work))
        elif name.startswith("steadytrain"):
            result = run_steadytrain(args, arm, model, data, device, effective, watchers)
        else:
            micro = arm["micro"] if not args.smoke else min(arm["micro"], 4)
            labels = name != "plain"
            result = loop(args, model, data, device, effective, micro, labels, watchers)
    if profile is not None:
        result["profile"] = profile.finish()
    if watch is not None:
        result["syncs"] = watch.finish()
    result.update(summary(args, spec, result.pop("marks")[: args.steps], effective, loaded))
    result.update(
        arm=name,
        cap_bytes=cap,
        effective_batch_size=effective,
        peak_allocated=max(
            (p for p in (C.peak_allocated(device), result.get("steps_peak")) if p is not None),
            default=None,
        ),
        peak_reserved=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        cudagraph_counters=graph_counters(),
        trainable=None
        if model is None
        else sum(p.numel() for p in model.parameters() if p.requires_grad),
        versions=anchor_versions(),
        environment=C.environment(device),
    )
    Path(args.result).write_text(json.dumps(result, default=str))


def graph_counters() -> dict[str, Any]:
    """Inductor's CUDA-graph counters of this process (graphs recorded, skips and why)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k.lower()}


def summary(args, spec, marks: list[float], effective: int, loaded: float) -> dict[str, Any]:
    """Speed over the steady steps, and the start-up: seconds from the process start (imports,
    patching and model load included) to the first optimizer step's end and to the end of the
    step that completes the first million trained tokens."""
    steady = marks[args.warmup :]
    tokens = effective * spec.seq
    rate = tokens * (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else None
    million = next((t for i, t in enumerate(marks) if (i + 1) * tokens >= MILLION), None)
    return {
        "steps": len(marks),
        "timed_steps": max(len(steady) - 1, 0),
        "tokens_per_s": rate,
        "load_s": loaded - STARTED,
        "first_step_s": marks[0] - STARTED if marks else None,
        "first_step_after_load_s": marks[0] - loaded if marks else None,
        "million_tokens_s": million - STARTED if million else None,
    }


# -- the parent: every arm, then the table --------------------------------------------------------


def run_arms(args) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in args.arms.split(","):
        if name not in ARMS:
            sys.exit(f"--arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [sys.executable, __file__, "--arm", name, "--result", path, "--device", args.device]
        cmd += ["--effective", str(args.effective), "--effective-cap", str(args.effective_cap)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--seed", str(args.seed), "--cap-gib", str(args.cap_gib)]
        cmd += ["--profile", str(args.profile)]
        cmd += ["--sync-debug"] if args.sync_debug else []
        cmd += ["--trace-dir", str(args.trace_dir)] if args.trace_dir else []
        cmd += ["--smoke"] if args.smoke else []
        print(f"running arm {name}", file=sys.stderr, flush=True)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "UNSLOTH_DISABLE_STATISTICS": "1",
        }
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.arm_timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        text = Path(path).read_text() if code == 0 else ""
        key = name if name not in results else f"{name}#{len(results)}"  # an arm run again
        results[key] = json.loads(text) if text else {"arm": name, "error": f"exit {code}"}
        Path(path).unlink(missing_ok=True)
        print(json.dumps(row_of(results[key])), file=sys.stderr, flush=True)
        if args.out:  # what ran so far, kept should a later arm outrun the command's limit
            C.write_json(args.out, {"benchmark": "fast_lora", "partial": True, "results": results})
    return results


def row_of(r: dict[str, Any]) -> dict[str, Any]:
    """One arm's figures as the table shows them."""

    def num(key, form):
        return "-" if r.get(key) is None else form(r[key])

    steps = r.get("samples_per_step")
    return {
        "arm": r.get("arm"),
        "micro x accum": "-" if r.get("micro") is None else f"{r['micro']} x {r['accumulation']}",
        "batch": ",".join(map(str, steps)) if steps else num("effective_batch_size", str),
        "tokens/s": num("tokens_per_s", lambda v: f"{v:,.0f}"),
        "peak": num("peak_allocated", lambda v: f"{v / GiB:.2f} GiB"),
        "reserved": num("peak_reserved", lambda v: f"{v / GiB:.2f} GiB"),
        "loss 1": f"{r['losses'][0]:.4f}" if r.get("losses") else "-",
        "1st step s": num("first_step_s", lambda v: f"{v:.1f}"),
        "after load s": num("first_step_after_load_s", lambda v: f"{v:.1f}"),
        "1M tok s": num("million_tokens_s", lambda v: f"{v:.1f}"),
        "oom": num("oom_count", str),
        "loss mode": r.get("loss_method") or r.get("error") or "-",
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--arms", default=None, help=f"default: all ({len(ARMS)}); smoke: a CPU few")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--effective", type=int, default=32, help="full-memory arms' batch")
    ap.add_argument("--effective-cap", type=int, default=64, help="capped arms' batch")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per arm, at least the first million tokens' (16; smoke 3)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="steps left out (5; smoke 1)")
    ap.add_argument("--arm-timeout", type=float, default=420.0, help="seconds per arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile", type=int, default=0, help="profile this many steps after the timed ones"
    )
    ap.add_argument(
        "--trace-dir", type=Path, default=None, help="with --profile: a Chrome trace per arm here"
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="one more step after those under torch.cuda.set_sync_debug_mode: every host sync "
        "with its Python stack, in the arm's 'syncs'",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.arms = args.arms or (SMOKE_ARMS if args.smoke else ",".join(ARMS))
    args.steps = args.steps or (3 if args.smoke else 16)
    args.warmup = args.warmup or (1 if args.smoke else 5)
    if args.arm:
        child(args)
        return

    C.require_steadytrain()
    results = run_arms(args)
    rows = [row_of(r) for r in results.values()]
    spec = C.SMOKE_MODEL if args.smoke else C.LLAMA_1B
    title = (
        f"{spec.name}, LoRA r16 7 projections, bf16, seq {spec.seq}; full memory: batch "
        f"{args.effective}; cap arms: {args.cap_gib:g} GiB, batch {args.effective_cap}; "
        f"{args.steps} steps or the first 1M tokens', tokens/s after {args.warmup}"
    )
    text = C.table(list(rows[0]), [list(r.values()) for r in rows], title)
    out = args.out or C.default_out("fast_lora", args.smoke)
    C.write_json(
        out,
        {"benchmark": "fast_lora", "settings": vars(args), "results": results, "table": text},
    )
    print(f"\nresults: {out}\n")
    print(text)


if __name__ == "__main__":
    main()
