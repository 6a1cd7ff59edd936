"""What a memory reading holds (`MemoryReading`, `PeakReading`): plain values, no torch, so a
device of any framework (`Device`, `HostDevice`) gives the same readings."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryReading:
    """One reading, in bytes; None where the device keeps no such counter."""

    allocated: int | None  # tensor bytes on the device
    reserved: int | None  # allocator cache (CUDA) or driver-allocated (MPS, includes the cache)
    peak: int | None  # peak allocated since the last reset (CUDA only)
    total: int | None  # device memory (unified: system RAM)
    budget: int | None  # what this run may use
    rss: int  # process resident set size
    system_available: int
    swap_used: int
    alloc_retries: int | None = None  # CUDA allocator retries (rises when memory is tight)
    pressure: int | None = None  # macOS memory pressure: 1 normal, 2 warning, 4 critical
    usable: int | None = None  # what this process may reach in total; the budget is a share of it

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PeakReading:
    """The most memory in use since `Device.reset_peak_reading`, and how much to trust it.

    kind: 'exact' (CUDA: tensor bytes, the allocator's own high-water mark), 'resident' (CPU:
    the process's peak resident set, Linux VmHWM; it includes the interpreter and the
    libraries), 'lower_bound' (MPS: driver memory read afterwards; Metal keeps no peak, and the
    cache, emptied at the reset, keeps what the pass allocated, so the figure is at least most of
    the peak), or 'none' (no reading: bytes is None)."""

    bytes: int | None
    kind: str
