"""Which low-precision dtypes autocast really runs on a device, found by running it.

A flag or a version table is not enough: on MPS (and CPU) an unsupported autocast dtype does not
raise, it warns "In MPS autocast, but the target dtype is not supported. Disabling autocast." and
runs in float32 (mps.md §4). So the probe runs a tiny matmul and a backward under autocast and
counts a dtype only when the matmul output really has that dtype and the gradients are finite.
MPS bf16 also needs macOS 14, which torch does not check (its warning is unreachable): the
`Device` checks that through the system probe before running anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

CANDIDATES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class AutocastResult:
    dtype: torch.dtype
    works: bool
    reason: str  # why not, when it does not work; "" when it does

    @property
    def name(self) -> str:
        return SHORT_NAMES.get(self.dtype, str(self.dtype))


def run_autocast_matmul(torch_device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Matmul under autocast, then backward; returns the matmul's output dtype. Uses fixed
    inputs, not the global RNG, so probing never shifts a seeded run."""
    a = torch.linspace(-1.0, 1.0, 64).reshape(8, 8).to(torch_device).requires_grad_(True)
    with torch.autocast(torch_device.type, dtype=dtype):
        out = a @ a
    out.float().sum().backward()
    if a.grad is None or not bool(torch.isfinite(a.grad).all()):
        raise RuntimeError("the backward pass produced no or non-finite gradients")
    return out.dtype


def check_autocast(dtype: torch.dtype, run: Callable[[torch.dtype], torch.dtype]) -> AutocastResult:
    """Run `run(dtype)` and judge whether autocast engaged; warnings are recorded, not raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            produced = run(dtype)
        except Exception as exc:  # noqa: BLE001 - any failure means "does not run here"
            return AutocastResult(dtype, False, f"failed: {type(exc).__name__}: {exc}")
    if produced != dtype:
        said = next((str(w.message).splitlines()[0] for w in caught), None)
        detail = f"; torch warned: {said}" if said else ""
        return AutocastResult(
            dtype, False, f"autocast did not engage: the matmul ran in {produced}{detail}"
        )
    return AutocastResult(dtype, True, "")
