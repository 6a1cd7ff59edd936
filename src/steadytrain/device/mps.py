"""The only module that calls `torch.mps`. Kept thin: the logic around it is tested with
`steadytrain.device.testing.FakeMPSBackend`, the real thing by `steadytrain doctor --selftest`."""

from __future__ import annotations

import torch


class MPSBackend:
    name = "mps"

    def is_built(self) -> bool:
        return torch.backends.mps.is_built()

    def is_available(self) -> bool:
        return self.is_built() and torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def probe(self, index: int) -> None:
        # MPS can report available and then fail on the first allocation (CI runners, sandboxes).
        x = torch.ones(8, 8, device="mps")
        value = float((x @ x).sum().cpu())
        torch.mps.synchronize()
        if value != 512.0:
            raise RuntimeError(f"mps matmul returned a wrong result ({value})")

    def allocated(self, index: int) -> int | None:
        return torch.mps.current_allocated_memory()

    def reserved(self, index: int) -> int | None:
        return torch.mps.driver_allocated_memory()

    def peak(self, index: int) -> int | None:
        return None  # torch.mps keeps no peak; the memory watch samples driver memory instead

    def reset_peak(self, index: int) -> None:
        pass

    def total(self, index: int) -> int | None:
        import psutil

        return psutil.virtual_memory().total

    def usable(self, index: int) -> int | None:
        recommended = getattr(torch.mps, "recommended_max_memory", None)  # torch >= 2.5
        if recommended is not None:
            return recommended()
        total = self.total(index)
        return int(total * 0.75) if total else None  # Metal's usual working-set share

    def alloc_retries(self, index: int) -> int | None:
        return None

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def synchronize(self, index: int) -> None:
        torch.mps.synchronize()
