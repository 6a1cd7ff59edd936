"""`HostDevice`: the host's memory as a `Device` gives it, for a framework steadytrain does not
drive (Keras on TensorFlow or JAX). No torch: the readings come from the process and the OS
(`SystemProbe`), the budget from what this process may still use (RLIMIT_AS, cgroup, RAM), as
for the CPU `Device`. The framework's own accelerator memory is not read."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from functools import cached_property

from steadytrain._units import DEFAULT_BUDGET_FRACTION
from steadytrain.device.budget import budget_bytes, check_budget_spec, cpu_usable
from steadytrain.device.reading import MemoryReading, PeakReading
from steadytrain.device.system import SystemProbe


class HostDevice:
    """Duck-types the part of `Device` that `RunGuard`, the watchdog and the memory watch use."""

    type = "cpu"
    index = 0
    discrete_memory = False

    def __init__(
        self, budget_spec: int | float = DEFAULT_BUDGET_FRACTION, system: SystemProbe | None = None
    ) -> None:
        self.budget_spec = check_budget_spec(budget_spec)
        self.system = system or SystemProbe()
        self.torch_device = "cpu"  # what events and config.json name the device
        self.skipped: tuple[str, ...] = ()
        self._peak_resets = False

    def __repr__(self) -> str:
        return "HostDevice(cpu)"

    @property
    def name(self) -> str:
        return self.system.chip_name()

    @cached_property
    def usable(self) -> int | None:
        return cpu_usable(self.system)

    @property
    def budget(self) -> int | None:
        return budget_bytes(self.budget_spec, self.usable)

    def memory(self) -> MemoryReading:
        s, usable = self.system, self.usable
        return MemoryReading(
            allocated=None,
            reserved=None,
            peak=None,
            total=s.memory_total(),
            budget=budget_bytes(self.budget_spec, usable),
            rss=s.process_rss(),
            system_available=s.memory_available(),
            swap_used=s.swap_used(),
            pressure=s.pressure_level(),
            usable=usable,
        )

    def swap_in(self) -> int | None:
        return self.system.swap_in()

    def empty_cache(self) -> None:
        gc.collect()
        # glibc keeps freed pages; hand them back so memory limits see the real use
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)

    def synchronize(self) -> None:
        pass

    def reset_peak(self) -> None:
        pass

    def reset_peak_reading(self) -> None:
        self._peak_resets = self.system.reset_peak_rss()

    def peak_reading(self) -> PeakReading:
        if self._peak_resets:
            return PeakReading(self.system.peak_rss(), "resident")
        return PeakReading(None, "none")
