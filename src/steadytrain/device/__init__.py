"""The only code that knows cuda / mps / cpu.

`resolve_device(spec)` gives a `Device`: memory readings, the budget, cache and peak control,
synchronisation, the autocast dtypes that really work here. `is_oom(exc)` classifies out-of-memory
errors of every backend. `get_rng_state()` / `set_rng_state()` cover every RNG stream.
"""

from steadytrain.device.core import Device, MemoryReading, resolve_device
from steadytrain.device.oom import is_oom, oom_request_bytes
from steadytrain.device.rng import get_rng_state, seed_everything, set_rng_state

__all__ = [
    "Device",
    "MemoryReading",
    "get_rng_state",
    "is_oom",
    "oom_request_bytes",
    "resolve_device",
    "seed_everything",
    "set_rng_state",
]
