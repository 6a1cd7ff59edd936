"""How busy the CPU is: this process's compute threads against the cores it may use, and the
cores other processes keep busy. Steps on a CPU slow down (and vary from step to step) when the
threads of every process together outnumber the cores; `doctor` and the contention watch
(`telemetry/cpu.py`) read these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS has no affinity call
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class CpuLoad:
    """One reading. `others_busy` is how many cores' worth of time other processes used since
    the previous reading (None: not measured yet)."""

    cores: int
    threads: int
    others_busy: float | None
    load_average: float | None

    @property
    def oversubscribed(self) -> bool:
        """More runnable threads than cores: ours alone, or ours plus the others' work."""
        others = self.others_busy or 0.0
        return self.threads > self.cores or self.threads + others > self.cores + 0.5

    @property
    def advised_threads(self) -> int:
        """Threads that fit beside the other processes' work: the cores they leave free."""
        others = round(self.others_busy or 0.0)
        return max(1, min(self.threads, self.cores) if others == 0 else self.cores - others)

    def describe(self) -> str:
        text = (
            f"torch runs {self.threads} compute thread{'s' if self.threads != 1 else ''} on "
            f"{self.cores} core{'s' if self.cores != 1 else ''}"
        )
        if self.others_busy is not None:
            text += f", other processes keep {self.others_busy:.1f} cores busy"
        if self.load_average is not None:
            text += f" (load average {self.load_average:.1f})"
        return text


class CpuMeter:
    """Reads `CpuLoad`: the whole machine's CPU time and this process's, between two calls."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call starts the interval
        psutil.cpu_percent(None)

    def read(self) -> CpuLoad:
        cores = usable_cores()
        machine = psutil.cpu_percent(None) / 100 * (psutil.cpu_count() or cores)
        ours = self._process.cpu_percent(None) / 100
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
        return CpuLoad(cores, torch.get_num_threads(), max(0.0, machine - ours), load)
