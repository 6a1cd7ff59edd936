"""The only code that knows cuda / mps / cpu.

`resolve_device(spec)` gives a `Device`: memory readings, the budget, cache and peak control,
synchronisation, the autocast dtypes that really work here. `is_oom(exc)` classifies out-of-memory
errors of every backend; `call_or_oom` / `retry_on_oom` are the one catch, free and retry.
`get_rng_state()` / `set_rng_state()` cover every RNG stream. OS probes go through `SystemProbe`;
`steadytrain.device.testing` holds the doubles tests use instead.
"""

from steadytrain.device.autocast import AutocastResult
from steadytrain.device.core import (
    Device,
    MemoryReading,
    PeakReading,
    available_devices,
    default_backends,
    resolve_device,
)
from steadytrain.device.oom import (
    OutOfMemory,
    call_or_oom,
    is_oom,
    oom_kind,
    oom_request_bytes,
    retry_on_oom,
)
from steadytrain.device.rng import RNGStateError, get_rng_state, seed_everything, set_rng_state
from steadytrain.device.system import CgroupMemory, SystemProbe

__all__ = [
    "AutocastResult",
    "CgroupMemory",
    "Device",
    "MemoryReading",
    "OutOfMemory",
    "PeakReading",
    "RNGStateError",
    "SystemProbe",
    "available_devices",
    "call_or_oom",
    "default_backends",
    "get_rng_state",
    "is_oom",
    "oom_kind",
    "oom_request_bytes",
    "resolve_device",
    "retry_on_oom",
    "seed_everything",
    "set_rng_state",
]
