"""The process group this machine would train in: one process, or the ranks torchrun describes in
the environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), with the backends and
devices they would use. See docs/distributed.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from steadytrain.doctor.findings import Context, Finding

TORCHRUN = "start the ranks with `torchrun --nproc_per_node N train.py`, which sets them"


def check_process_group(ctx: Context) -> list[Finding]:
    env = ctx.environ
    backends = _backends()
    data = {
        "distributed": dist.is_available(),
        "backends": backends,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        **{k.lower(): env.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")},
    }
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return [_fail(f"WORLD_SIZE is {env['WORLD_SIZE']!r}, not a whole number", TORCHRUN, data)]
    if world <= 1:
        message = "one process (the group of one)"
        if backends:
            message += f"; torchrun would use {', '.join(backends)}"
        return [Finding("process group", "info", message, data=data)]
    if not dist.is_available():
        fix = "install a torch build with distributed support, or run one process"
        return [_fail(f"WORLD_SIZE={world}, but torch.distributed is missing", fix, data)]
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        return [_fail(f"WORLD_SIZE={world}, but {', '.join(missing)} not set", TORCHRUN, data)]
    local = int(env.get("LOCAL_RANK", "0"))
    if data["cuda_devices"] and local >= data["cuda_devices"]:
        message = f"LOCAL_RANK {local}, but this machine has {data['cuda_devices']} CUDA device(s)"
        fix = "start at most as many ranks per machine as it has GPUs (--nproc_per_node)"
        return [Finding("process group", "warn", message, fix, data)]
    device = f"cuda:{local}" if data["cuda_devices"] else "cpu"
    message = (
        f"rank {env['RANK']} of {world} (local rank {local}) on {device}, "
        f"backends {', '.join(backends)}, rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    )
    return [Finding("process group", "ok", message, data=data)]


def _backends() -> list[str]:
    if not dist.is_available():
        return []
    found = [("gloo (CPU)", dist.is_gloo_available()), ("nccl (CUDA)", dist.is_nccl_available())]
    return [name for name, available in found if available]


def _fail(message: str, fix: str, data: dict) -> Finding:
    return Finding("process group", "fail", message, fix, data)
