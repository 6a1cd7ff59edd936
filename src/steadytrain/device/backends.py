"""One small class per device type. Everything device-specific goes through a `Backend`; tests
substitute a double (`steadytrain.device.testing.FakeMPSBackend`, `FakeCUDABackend`)."""

from __future__ import annotations

import ctypes
import functools
from typing import Protocol

import torch

from steadytrain.device.autocast import run_autocast_matmul
from steadytrain.device.budget import capped, cpu_usable
from steadytrain.device.system import SystemProbe


class Backend(Protocol):
    """What the rest of steadytrain may ask of a device type."""

    name: str  # "cuda" | "mps" | "cpu"

    def is_built(self) -> bool: ...
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def device_name(self, index: int) -> str: ...
    def probe(self, index: int) -> None:
        """Allocate, compute and synchronize a small tensor; raise if the device does not work."""

    def allocated(self, index: int) -> int | None: ...
    def reserved(self, index: int) -> int | None:
        """Bytes held by the allocator or driver (CUDA reserved, MPS driver-allocated)."""

    def peak(self, index: int) -> int | None: ...
    def reset_peak(self, index: int) -> None: ...
    def total(self, index: int) -> int | None: ...
    def usable(self, index: int) -> int | None:
        """What one process may reasonably use in total (see `steadytrain.device.budget`)."""

    def alloc_retries(self, index: int) -> int | None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self, index: int) -> None: ...
    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        """Run a tiny matmul + backward under autocast; return the matmul's output dtype."""


def check_matmul(torch_device: torch.device) -> None:
    """8×8 ones squared sums to 512 exactly: a device that allocates but computes garbage (the
    paravirtual GPU of macOS VMs returned zeros, mps.md §9) fails here."""
    x = torch.ones(8, 8, device=torch_device)
    value = float((x @ x).sum().cpu())
    if value != 512.0:
        raise RuntimeError(f"{torch_device} matmul returned a wrong result ({value}, expected 512)")


class CPUBackend:
    name = "cpu"

    def __init__(self, system: SystemProbe | None = None) -> None:
        self.system = system or SystemProbe()

    def is_built(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int) -> str:
        return self.system.chip_name()

    def probe(self, index: int) -> None:
        check_matmul(torch.device("cpu"))

    def allocated(self, index: int) -> int | None:
        return None  # torch keeps no CPU allocation counter; process RSS stands in

    def reserved(self, index: int) -> int | None:
        return None

    def peak(self, index: int) -> int | None:
        return None

    def reset_peak(self, index: int) -> None:
        pass

    def total(self, index: int) -> int | None:
        return self.system.memory_total()

    def usable(self, index: int) -> int | None:
        return cpu_usable(self.system)

    def alloc_retries(self, index: int) -> int | None:
        return None

    def empty_cache(self) -> None:
        # Freed CPU tensors go back to glibc's heap, which keeps the pages; after an
        # out-of-memory, hand them back to the OS so memory limits see the real use.
        trim = _malloc_trim()
        if trim is not None:
            trim(0)

    def synchronize(self, index: int) -> None:
        pass

    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        return run_autocast_matmul(torch.device("cpu"), dtype)


class CUDABackend:
    name = "cuda"

    def is_built(self) -> bool:
        return torch.backends.cuda.is_built()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_available() else 0

    def device_name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def select(self, index: int) -> None:
        """The current device: what torch means by "cuda" with no index (device/core.py)."""
        torch.cuda.set_device(index)

    def probe(self, index: int) -> None:
        check_matmul(torch.device("cuda", index))
        torch.cuda.synchronize(index)

    def allocated(self, index: int) -> int | None:
        return torch.cuda.memory_allocated(index)

    def reserved(self, index: int) -> int | None:
        return torch.cuda.memory_reserved(index)

    def peak(self, index: int) -> int | None:
        return torch.cuda.max_memory_allocated(index)

    def reset_peak(self, index: int) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def total(self, index: int) -> int | None:
        return torch.cuda.get_device_properties(index).total_memory

    def usable(self, index: int) -> int | None:
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return capped(self.total(index), fraction(index) if fraction is not None else None)

    def alloc_retries(self, index: int) -> int | None:
        return torch.cuda.memory_stats(index).get("num_alloc_retries")

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        return run_autocast_matmul(torch.device("cuda", index), dtype)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
