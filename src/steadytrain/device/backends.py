"""One small class per device type. Everything device-specific goes through a `Backend`; tests
substitute a double (see `steadytrain.device.testing`)."""

from __future__ import annotations

from typing import Protocol

import psutil
import torch


class Backend(Protocol):
    """What the rest of steadytrain may ask of a device type."""

    name: str  # "cuda" | "mps" | "cpu"

    def is_built(self) -> bool: ...
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def probe(self, index: int) -> None:
        """Allocate, compute and synchronize a small tensor; raise if the device does not work."""
    def allocated(self, index: int) -> int | None: ...
    def reserved(self, index: int) -> int | None:
        """Bytes held by the allocator or driver (CUDA reserved, MPS driver-allocated)."""
    def peak(self, index: int) -> int | None: ...
    def reset_peak(self, index: int) -> None: ...
    def total(self, index: int) -> int | None: ...
    def usable(self, index: int) -> int | None:
        """What one process may reasonably use: CUDA total, MPS recommended_max_memory, CPU
        available RAM."""
    def alloc_retries(self, index: int) -> int | None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self, index: int) -> None: ...


class CPUBackend:
    name = "cpu"

    def is_built(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def probe(self, index: int) -> None:
        x = torch.ones(8, 8)
        if float((x @ x).sum()) != 512.0:
            raise RuntimeError("CPU matmul returned a wrong result")

    def allocated(self, index: int) -> int | None:
        return None  # torch keeps no CPU allocation counter; process RSS stands in

    def reserved(self, index: int) -> int | None:
        return None

    def peak(self, index: int) -> int | None:
        return None

    def reset_peak(self, index: int) -> None:
        pass

    def total(self, index: int) -> int | None:
        return psutil.virtual_memory().total

    def usable(self, index: int) -> int | None:
        return psutil.virtual_memory().available + psutil.Process().memory_info().rss

    def alloc_retries(self, index: int) -> int | None:
        return None

    def empty_cache(self) -> None:
        pass

    def synchronize(self, index: int) -> None:
        pass


class CUDABackend:
    name = "cuda"

    def is_built(self) -> bool:
        return torch.backends.cuda.is_built()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_available() else 0

    def probe(self, index: int) -> None:
        x = torch.ones(8, 8, device=f"cuda:{index}")
        value = float((x @ x).sum())
        torch.cuda.synchronize(index)
        if value != 512.0:
            raise RuntimeError(f"cuda:{index} matmul returned a wrong result ({value})")

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
        # A cap set with set_per_process_memory_fraction is what this process may really use.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        total = self.total(index)
        if fraction is not None and total is not None:
            return int(total * fraction(index))
        return total

    def alloc_retries(self, index: int) -> int | None:
        return torch.cuda.memory_stats(index).get("num_alloc_retries")

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)


BACKENDS: dict[str, type] = {"cpu": CPUBackend, "cuda": CUDABackend}
