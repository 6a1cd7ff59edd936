"""Test doubles for the device layer: stand-ins named as such, never used by a real run.

There is no Apple hardware where steadytrain is tested, so the logic around MPS is tested against
`FakeMPSBackend`, which reproduces the documented behaviour of torch's MPS backend (the project's
reference `mps.md`): the exact out-of-memory texts of §3.2 raised as a plain `RuntimeError`, the
high-watermark limit of §2, `recommended_max_memory` and driver memory that agree with each other
(§1.2), no peak counter, the GitHub-runner case of §9 (available, every allocation fails), a torch
without MPS (§1.2), autocast that warns and disables itself for an unsupported dtype (§4), and a Mac
described by `FakeSystem` (macOS version, `hw.memsize`, memory pressure levels of §6). Only
`steadytrain doctor --selftest` on a real Mac proves the real thing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from steadytrain.device.budget import capped
from steadytrain.device.system import CgroupMemory, SystemProbe
from steadytrain.device.watermarks import read_watermarks

GiB = 1024**3
MiB = 1024**2

RUNNER_OOM = (
    "MPS backend out of memory (MPS allocated: 0 bytes, other allocations: 0 bytes, "
    "max allowed: 7.93 GB). Tried to allocate {size} on private pool."
)
"""mps.md §9 (actions/runner-images#9918): on a GitHub-hosted macOS runner, MPS reports available
and the first allocation fails with this; with the probe's 256 bytes it is the quoted text exactly."""

WATERMARK_HINT = (
    " Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory "
    "allocations (may cause system failure)."
)
NOT_LINKED = "PyTorch is not linked with support for mps devices"
NO_METAL = (
    "The MPS backend is supported on macOS 14.0+. Current OS version can be queried using sw_vers"
)
AUTOCAST_DISABLED = (
    "In MPS autocast, but the target dtype is not supported. Disabling autocast.\n"
    "MPS Autocast only supports dtypes of torch.bfloat16, torch.float16 currently."
)


def format_mps_size(size: int) -> str:
    """MPSAllocator's `format_size`: powers of 1024 labelled KB / MB / GB, two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    for limit, divisor, unit in ((MiB, 1024, "KB"), (GiB, MiB, "MB")):
        if size <= limit:
            return f"{size / divisor:.2f} {unit}"
    return f"{size / GiB:.2f} GB"


def format_cuda_size(size: int) -> str:
    """c10's CUDA `format_size`: KiB / MiB / GiB, two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    for limit, divisor, unit in ((MiB, 1024, "KiB"), (GiB, MiB, "MiB")):
        if size <= limit:
            return f"{size / divisor:.2f} {unit}"
    return f"{size / GiB:.2f} GiB"


class FakeSystem(SystemProbe):
    """A described machine instead of this one. Defaults describe an Apple Silicon Mac on macOS
    14.5 with 16 GiB; pass `os_name="Linux"` for a Linux box. `pressure` is a script of
    `kern.memorystatus_vm_pressure_level` readings (1, 2, 4), one per reading, the last repeated;
    `swap_in` is a script of the machine's cumulative swapped-in bytes, read the same way."""

    pressure_interval_s = 0.0

    def __init__(
        self,
        *,
        os_name: str = "Darwin",
        machine: str = "arm64",
        macos: str = "14.5",
        proc_translated: int | None = None,
        memsize: int = 16 * GiB,
        available: int | None = None,
        swap_used: int = 0,
        swap_in: Sequence[int] = (0,),
        rss: int = 512 * MiB,
        vms: int | None = None,
        rlimit_as: int | None = None,
        cgroup: CgroupMemory | None = None,
        pressure: Sequence[int] = (1,),
        chip: str = "Apple M2",
        disk_free: int = 100 * GiB,
        python_version: str = "3.12.4",
        sysctl: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._os, self._machine, self._macos = os_name, machine, macos
        self._memsize = memsize
        self._available = available if available is not None else memsize // 2
        self._swap, self._rss = swap_used, rss
        self._vms = vms if vms is not None else 4 * rss
        self._rlimit, self._cgroup = rlimit_as, cgroup
        self._pressure_script = list(pressure)
        self._swap_in_script = list(swap_in)
        self._disk_free, self._python = disk_free, python_version
        self._sysctl = {"hw.memsize": str(memsize), "machdep.cpu.brand_string": chip}
        if proc_translated is not None:
            self._sysctl["sysctl.proc_translated"] = str(proc_translated)
        self._sysctl.update(sysctl or {})

    def os_name(self) -> str:
        return self._os

    def machine(self) -> str:
        return self._machine

    def mac_ver(self) -> str:
        return self._macos if self._os == "Darwin" else ""

    def os_release(self) -> str:
        return "23.5.0" if self._os == "Darwin" else "6.8.0"

    def python_version(self) -> str:
        return self._python

    def python_executable(self) -> str:
        return "/usr/local/bin/python3"

    def sysctl(self, key: str) -> str | None:
        if self._os != "Darwin":
            return None
        if key == "kern.memorystatus_vm_pressure_level" and self._pressure_script:
            level = self._pressure_script[0]
            if len(self._pressure_script) > 1:
                self._pressure_script.pop(0)
            return str(level)
        return self._sysctl.get(key)

    def memory_total(self) -> int:
        return self._memsize

    def memory_available(self) -> int:
        return self._available

    def swap_used(self) -> int:
        return self._swap

    def swap_in(self) -> int | None:
        if not self._swap_in_script:
            return None
        value = self._swap_in_script[0]
        if len(self._swap_in_script) > 1:
            self._swap_in_script.pop(0)
        return value

    def process_rss(self) -> int:
        return self._rss

    def process_vms(self) -> int:
        return self._vms

    def rlimit_as(self) -> int | None:
        return self._rlimit

    def cgroup_memory(self) -> CgroupMemory | None:
        return self._cgroup

    def disk_free(self, path: str | Path) -> tuple[int, Path]:
        return self._disk_free, Path(path)

    def chip_name(self) -> str:
        return self._sysctl["machdep.cpu.brand_string"]


@dataclass
class _Buffer:
    size: int
    live: bool = True


SCALER_CANNOT_STEP = (
    "The operator 'aten::_amp_foreach_non_finite_check_and_unscale_' is not currently "
    "implemented for the MPS device."
)
"""What `GradScaler.step` raises on MPS in a torch without the MPS unscale kernel."""


class FakeMPSBackend:
    """A double of torch's MPS backend (see the module docstring for what it reproduces).

    `mode`: "working"; "runner" (available, every allocation raises the §9 text); "not_built"
    (a torch without MPS); "unavailable" (built, but `is_available()` is False: macOS too old,
    no Metal device reachable). Memory is scripted with `allocate` / `free` / `leak`:
    `allocated()` counts live tensors, `reserved()` is driver memory (live + cached + other
    Metal allocations), so driver >= allocated always, and `empty_cache()` returns the cache.
    """

    name = "mps"
    MODES = ("working", "runner", "not_built", "unavailable")

    def __init__(
        self,
        mode: str = "working",
        *,
        total: int = 16 * GiB,
        recommended_max: int | None = None,
        environ: Mapping[str, str] | None = None,
        max_buffer_size: int | None = None,
        autocast_dtypes: Iterable[torch.dtype] = (torch.float16, torch.bfloat16),
        scaler_steps: bool = True,
        system: FakeSystem | None = None,
        **system_kwargs,
    ) -> None:
        """`scaler_steps=False`: a torch whose GradScaler cannot step on MPS (its unscale
        kernel is missing there): fp16's probe fails as the real one does."""
        if mode not in self.MODES:
            raise ValueError(f"FakeMPSBackend mode {mode!r}; use one of {', '.join(self.MODES)}")
        self.mode = mode
        self.total_bytes = total
        self.recommended = recommended_max if recommended_max is not None else int(total * 0.75)
        self.watermarks = read_watermarks(environ or {})
        self.max_buffer_size = max_buffer_size if max_buffer_size is not None else total // 2
        self.supported_autocast = frozenset(autocast_dtypes)
        self.scaler_steps = scaler_steps
        self.system = system or FakeSystem(memsize=total, **system_kwargs)
        self._buffers: list[_Buffer] = []
        self._cached = 0
        self._other = 0
        self._initialized = False
        self.synchronize_calls = 0
        self.empty_cache_calls = 0

    # -- availability ------------------------------------------------------------------------

    def is_built(self) -> bool:
        return self.mode != "not_built"

    def is_available(self) -> bool:
        return self.mode in ("working", "runner")

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device_name(self, index: int) -> str:
        return f"{self.system.chip_name()} (FakeMPSBackend double)"

    # -- scripted memory ---------------------------------------------------------------------

    @property
    def max_allowed(self) -> int | None:
        """HIGH × recommended_max_memory; None when the watermark is 0.0 (no limit)."""
        ratio = self.watermarks.limit_ratio
        return None if ratio is None else int(ratio * self.recommended)

    def allocate(self, nbytes: int, pool: str = "private") -> int:
        """Allocate `nbytes` like the MPS allocator would; returns a handle for `free`."""
        self._check_usable()
        if self.mode == "runner":
            raise RuntimeError(RUNNER_OOM.format(size=format_mps_size(nbytes)))
        if nbytes >= self.max_buffer_size:
            raise RuntimeError(f"Invalid buffer size: {format_mps_size(nbytes)}")
        if self._cached >= nbytes:
            self._cached -= nbytes
        else:
            if self._over_limit(nbytes):
                self._cached = 0  # the allocator releases its cache and retries before failing
            if self._over_limit(nbytes):
                raise RuntimeError(self._oom_text(nbytes, pool))
        self._buffers.append(_Buffer(nbytes))
        return len(self._buffers) - 1

    def free(self, handle: int) -> None:
        buffer = self._buffers[handle]
        if buffer.live:
            buffer.live = False
            self._cached += buffer.size

    def leak(self, nbytes: int) -> None:
        """Metal memory outside the allocator (MPSGraph caches, mps.md §5): driver memory grows,
        `current_allocated_memory()` does not."""
        self._other += nbytes

    def _live(self) -> int:
        return sum(b.size for b in self._buffers if b.live)

    def _heap(self) -> int:
        return self._live() + self._cached

    def _over_limit(self, nbytes: int) -> bool:
        limit = self.max_allowed if self.max_allowed is not None else self.total_bytes
        return self._heap() + self._other + nbytes > limit

    def _oom_text(self, nbytes: int, pool: str) -> str:
        head = (
            f"MPS backend out of memory (MPS allocated: {format_mps_size(self._heap())}, "
            f"other allocations: {format_mps_size(self._other)}"
        )
        tail = f"Tried to allocate {format_mps_size(nbytes)} on {pool} pool."
        if self.max_allowed is None:
            return f"{head}). {tail}"
        return f"{head}, max allowed: {format_mps_size(self.max_allowed)}). {tail}{WATERMARK_HINT}"

    def _check_usable(self) -> None:
        if self.mode == "not_built":
            raise RuntimeError(NOT_LINKED)
        if self.mode == "unavailable":
            raise RuntimeError(NO_METAL)
        if not self._initialized:
            error = self.watermarks.init_error()  # read once, at the first allocation (§2)
            if error is not None:
                raise RuntimeError(error)
            self._initialized = True

    # -- the Backend protocol ----------------------------------------------------------------

    def probe(self, index: int) -> None:
        handle = self.allocate(8 * 8 * 4)  # the 8×8 float32 probe: 256 bytes
        self.free(handle)
        self.synchronize(index)

    def allocated(self, index: int) -> int | None:
        self._check_built()
        return self._live()

    def reserved(self, index: int) -> int | None:
        self._check_built()
        return self._heap() + self._other

    def peak(self, index: int) -> int | None:
        return None

    def reset_peak(self, index: int) -> None:
        pass

    def total(self, index: int) -> int | None:
        return self.system.memsize() or self.total_bytes

    def recommended_max_memory(self) -> int:
        self._check_built()
        return self.recommended

    def usable(self, index: int) -> int | None:
        return capped(self.recommended_max_memory(), self.watermarks.limit_ratio)

    def alloc_retries(self, index: int) -> int | None:
        return None

    def empty_cache(self) -> None:
        self._check_built()
        self.empty_cache_calls += 1
        self._cached = 0

    def synchronize(self, index: int) -> None:
        self._check_built()
        self.synchronize_calls += 1

    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        handle = self.allocate(8 * 8 * 4)
        self.free(handle)
        if dtype not in self.supported_autocast:
            warnings.warn(AUTOCAST_DISABLED, UserWarning, stacklevel=2)
            return torch.float32
        if dtype == torch.float16 and not self.scaler_steps:
            raise NotImplementedError(SCALER_CANNOT_STEP)
        return dtype

    def _check_built(self) -> None:
        if self.mode == "not_built":
            raise RuntimeError("Cannot execute this function without MPS backend.")


class FakeCUDABackend:
    """A double of CUDA for resolution, budget and doctor tests on machines without a GPU.
    `devices` lists (name, total bytes); `memory_fraction` is the per-process cap;
    `mode="broken"` makes the probe fail the way a wedged driver does."""

    name = "cuda"

    def __init__(
        self,
        devices: Sequence[tuple[str, int]] = (("NVIDIA H100 80GB HBM3", 80 * GiB),),
        *,
        built: bool = True,
        mode: str = "working",
        memory_fraction: float = 1.0,
        bf16: bool = True,
    ) -> None:
        self.devices = list(devices)
        self.built = built
        self.mode = mode
        self.memory_fraction = memory_fraction
        self.bf16 = bf16
        self._allocated = [0] * len(self.devices)
        self._reserved = [0] * len(self.devices)
        self._peak = [0] * len(self.devices)
        self.retries = 0

    def is_built(self) -> bool:
        return self.built

    def is_available(self) -> bool:
        return self.built and bool(self.devices)

    def device_count(self) -> int:
        return len(self.devices) if self.is_available() else 0

    def device_name(self, index: int) -> str:
        return f"{self.devices[index][0]} (FakeCUDABackend double)"

    def allocate(self, nbytes: int, index: int = 0) -> None:
        limit = self.usable(index) or 0
        if self._reserved[index] + nbytes > limit:
            self.retries += 1
            total = self.devices[index][1]
            free = total - self._reserved[index]
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {format_cuda_size(nbytes)}. GPU {index} has "
                f"a total capacity of {format_cuda_size(total)} of which {format_cuda_size(free)} "
                "is free."
            )
        self._allocated[index] += nbytes
        self._reserved[index] += nbytes
        self._peak[index] = max(self._peak[index], self._allocated[index])

    def free(self, nbytes: int, index: int = 0) -> None:
        self._allocated[index] -= nbytes

    def probe(self, index: int) -> None:
        if self.mode == "broken":
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        self.allocate(256, index)
        self.free(256, index)

    def allocated(self, index: int) -> int | None:
        return self._allocated[index]

    def reserved(self, index: int) -> int | None:
        return self._reserved[index]

    def peak(self, index: int) -> int | None:
        return self._peak[index]

    def reset_peak(self, index: int) -> None:
        self._peak[index] = self._allocated[index]

    def total(self, index: int) -> int | None:
        return self.devices[index][1]

    def usable(self, index: int) -> int | None:
        return capped(self.total(index), self.memory_fraction)

    def alloc_retries(self, index: int) -> int | None:
        return self.retries

    def empty_cache(self) -> None:
        self._reserved = list(self._allocated)

    def synchronize(self, index: int) -> None:
        pass

    def autocast_probe(self, index: int, dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype == torch.float16 or self.bf16 else torch.float32
