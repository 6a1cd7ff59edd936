"""Resolve a device spec to a working `Device`, and read its memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import psutil
import torch

from steadytrain.device.backends import Backend, CPUBackend, CUDABackend
from steadytrain.device.mps import MPSBackend
from steadytrain.errors import DeviceUnavailableError

AUTO_BUDGET_FRACTION = 0.9


@dataclass(frozen=True)
class MemoryReading:
    """One reading, in bytes; None where the device keeps no such counter."""

    allocated: int | None  # tensor bytes on the device
    reserved: int | None  # allocator cache (CUDA) or driver-allocated (MPS)
    peak: int | None  # peak allocated since the last reset
    total: int | None  # device memory (unified: system RAM)
    budget: int | None  # what this run may use
    rss: int  # process resident set size
    system_available: int
    swap_used: int
    alloc_retries: int | None = None  # CUDA allocator retries (rises when memory is tight)
    pressure: int | None = None  # macOS memory pressure: 1 normal, 2 warning, 4 critical

    def to_dict(self) -> dict:
        return asdict(self)


class Device:
    """A resolved, working device: `torch_device`, `type`, memory readings and controls."""

    def __init__(self, backend: Backend, index: int = 0, budget_spec: int | float = AUTO_BUDGET_FRACTION):
        self.backend = backend
        self.index = index
        self.type = backend.name
        self.torch_device = torch.device(self.type, index) if self.type == "cuda" else torch.device(self.type)
        self.budget_spec = budget_spec

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"

    def with_budget(self, spec: int | float) -> Device:
        return Device(self.backend, self.index, spec)

    @property
    def budget(self) -> int | None:
        """Bytes this run may use: an explicit size wins; a fraction multiplies usable memory."""
        if isinstance(self.budget_spec, int) and not isinstance(self.budget_spec, bool):
            return self.budget_spec
        usable = self.backend.usable(self.index)
        return int(usable * float(self.budget_spec)) if usable is not None else None

    def memory(self) -> MemoryReading:
        vm, swap = psutil.virtual_memory(), psutil.swap_memory()
        b, i = self.backend, self.index
        return MemoryReading(
            allocated=b.allocated(i), reserved=b.reserved(i), peak=b.peak(i), total=b.total(i),
            budget=self.budget, rss=psutil.Process().memory_info().rss,
            system_available=vm.available, swap_used=swap.used, alloc_retries=b.alloc_retries(i),
        )

    def empty_cache(self) -> None:
        self.backend.empty_cache()

    def synchronize(self) -> None:
        self.backend.synchronize(self.index)

    def reset_peak(self) -> None:
        self.backend.reset_peak(self.index)

    @cached_property
    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """Low-precision dtypes autocast really runs here, found by running a tiny matmul and a
        backward under autocast; a dtype that only warns and silently disables autocast is out."""
        import warnings

        found = []
        for dtype in (torch.bfloat16, torch.float16):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    a = torch.randn(8, 8, device=self.torch_device, requires_grad=True)
                    with torch.autocast(self.type, dtype=dtype):
                        out = a @ a
                    out.float().sum().backward()
                if out.dtype == dtype and a.grad is not None and torch.isfinite(a.grad).all():
                    found.append(dtype)
            except Exception:  # noqa: BLE001 - any failure means "not supported here"
                continue
        return tuple(found)


def _backends() -> dict[str, Backend]:
    return {"cuda": CUDABackend(), "mps": MPSBackend(), "cpu": CPUBackend()}


def resolve_device(spec: str = "auto", budget_spec: int | float = AUTO_BUDGET_FRACTION,
                   backends: dict[str, Backend] | None = None) -> Device:
    """'auto' prefers cuda, then mps (confirmed by computing on it), then cpu. A requested device
    that is missing or broken raises `DeviceUnavailableError` naming what is available."""
    backends = backends or _backends()
    if spec == "auto":
        for name in ("cuda", "mps"):
            backend = backends[name]
            if backend.is_available() and backend.device_count() > 0:
                try:
                    backend.probe(0)
                except Exception:  # noqa: BLE001 - a broken accelerator falls back to the next
                    continue
                return Device(backend, 0, budget_spec)
        return Device(backends["cpu"], 0, budget_spec)

    name, _, idx = spec.partition(":")
    index = int(idx) if idx else 0
    backend = backends.get(name)
    if backend is None:
        raise DeviceUnavailableError(f"device: unknown device {spec!r}; use auto, cpu, mps, cuda or cuda:N")
    if not backend.is_available() or index >= backend.device_count():
        raise DeviceUnavailableError(
            f"device: {spec!r} is not available on this machine; available: "
            f"{', '.join(available_devices(backends))}. Set device to one of those, or 'auto'."
        )
    try:
        backend.probe(index)
    except Exception as exc:  # noqa: BLE001
        raise DeviceUnavailableError(
            f"device: {spec!r} reports available but failed a small computation ({exc}); "
            f"available: {', '.join(available_devices(backends))}. "
            "Run `steadytrain doctor` for a diagnosis."
        ) from None
    return Device(backend, index, budget_spec)


def available_devices(backends: dict[str, Backend] | None = None) -> list[str]:
    backends = backends or _backends()
    names = []
    cuda = backends["cuda"]
    if cuda.is_available():
        names += [f"cuda:{i}" for i in range(cuda.device_count())]
    if backends["mps"].is_available():
        names.append("mps")
    names.append("cpu")
    return names
