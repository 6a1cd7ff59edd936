"""The only module that calls `torch.mps`. Kept thin: the logic around it is tested with
`steadytrain.device.testing.FakeMPSBackend`, the real thing by `steadytrain doctor --selftest`.

Feature detection, not version checks (mps.md rule 1): `recommended_max_memory` is torch >= 2.5,
and on a build without MPS every `torch.mps` memory call raises, so each is guarded by `is_built`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from steadytrain.device.autocast import run_autocast_matmul
from steadytrain.device.backends import check_matmul
from steadytrain.device.budget import capped
from steadytrain.device.system import SystemProbe
from steadytrain.device.watermarks import read_watermarks

RECOMMENDED_SHARE = 0.75
"""Metal's recommended working set is "typically 75% of the total system memory" (MPSAllocator.h);
used only where `torch.mps.recommended_max_memory` is missing (torch < 2.5)."""


class MPSBackend:
    name = "mps"

    def __init__(
        self, system: SystemProbe | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.system = system or SystemProbe()
        self.environ = os.environ if environ is None else environ

    def is_built(self) -> bool:
        return torch.backends.mps.is_built()

    def is_available(self) -> bool:
        return self.is_built() and torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device_name(self, index: int) -> str:
        get_name = getattr(torch.backends.mps, "get_name", None)
        return get_name() if get_name is not None and self.is_built() else self.system.chip_name()

    def probe(self, index: int) -> None:
        # MPS can report available and then fail on the first allocation (CI runners, sandboxes).
        check_matmul(torch.device("mps"))
        torch.mps.synchronize()

    def allocated(self, index: int) -> int | None:
        return torch.mps.current_allocated_memory() if self.is_built() else None

    def reserved(self, index: int) -> int | None:
        return torch.mps.driver_allocated_memory() if self.is_built() else None

    def peak(self, index: int) -> int | None:
        return None  # torch.mps keeps no peak; the memory watch samples driver memory instead

    def reset_peak(self, index: int) -> None:
        pass

    def total(self, index: int) -> int | None:
        return self.system.memsize() or self.system.memory_total()

    def recommended_max_memory(self) -> int | None:
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        if recommended is not None and self.is_built():
            return recommended()
        total = self.total(0)
        return int(total * RECOMMENDED_SHARE) if total else None

    def usable(self, index: int) -> int | None:
        return capped(self.recommended_max_memory(), read_watermarks(self.environ).limit_ratio)

    def alloc_retries(self, index: int) -> int | None:
        return None

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def synchronize(self, index: int) -> None:
        torch.mps.synchronize()

    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        """The autocast matmul and backward; for fp16 also one GradScaler step, which fp16
        training takes every step: a torch whose scaler cannot step on MPS (its unscale kernel
        is missing there) fails here, so fp16 is refused before anything loads."""
        produced = run_autocast_matmul(torch.device("mps"), dtype)
        if dtype == torch.float16:
            step_grad_scaler(torch.device("mps"))
        torch.mps.synchronize()
        return produced


def step_grad_scaler(torch_device: torch.device) -> None:
    """One fp16 training step through `torch.amp.GradScaler` on `torch_device`: scale, backward,
    unscale and step, update. Raises what torch raises where its scaler cannot do that there."""
    weight = torch.ones(8, 8, device=torch_device, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = torch.amp.GradScaler(torch_device.type)
    with torch.autocast(torch_device.type, dtype=torch.float16):
        loss = (weight @ weight).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def rng_available() -> bool:
    """Whether this process can read and restore the MPS generator."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_built() and mps.is_available())


def get_rng_state() -> torch.Tensor:
    return torch.mps.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    torch.mps.set_rng_state(state)
