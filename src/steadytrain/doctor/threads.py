"""The doctor's thread check: torch's compute threads against the cores, beside what other
processes use now, and the thread count that fits (`device/cpu_load.py` reads them)."""

from __future__ import annotations

import time

from steadytrain.device.cpu_load import CpuLoad, CpuMeter
from steadytrain.doctor.findings import Context, Finding

THREADS_SAMPLE_S = 0.5  # how long doctor watches the other processes' CPU use


def check_threads(ctx: Context, load: CpuLoad | None = None) -> list[Finding]:
    """More runnable threads than cores make CPU steps slow and uneven: warn when torch's
    threads alone outnumber the cores; otherwise say what fits beside the other work now."""
    if load is None:
        meter = CpuMeter()
        time.sleep(THREADS_SAMPLE_S)
        load = meter.read()
    n = load.advised_threads
    advice = (
        f"{n} thread{'s' if n != 1 else ''} (OMP_NUM_THREADS={n} or torch.set_num_threads({n}))"
    )
    data = {
        "threads": load.threads,
        "cores": load.cores,
        "others_busy_cores": load.others_busy,
        "load_average": load.load_average,
        "advised_threads": n,
    }
    if load.threads > load.cores:
        message = f"{load.describe()}: more threads than cores, so they take turns"
        return [Finding("threads", "warn", message, f"use {advice}", data)]
    if load.oversubscribed:
        message = (
            f"{load.describe()}: together more than the cores, so CPU training steps slow down "
            f"and vary while the other work runs; for CPU training now, {advice}"
        )
        return [Finding("threads", "info", message, data=data)]
    return [Finding("threads", "ok", f"{load.describe()}: for CPU training, {advice}", data=data)]
