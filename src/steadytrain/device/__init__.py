"""The only code that knows cuda / mps / cpu.

`resolve_device(spec)` gives a `Device`: memory readings, the budget, cache and peak control,
synchronisation, the autocast dtypes that really work here. `is_oom(exc)` classifies out-of-memory
errors of every backend (torch's, TensorFlow's, JAX's); `call_or_oom` / `retry_on_oom` are the one
catch, free and retry. `get_rng_state()` / `set_rng_state()` cover every RNG stream;
`to_device(batch, device)` moves a nested batch, keeping its containers' types. OS probes go
through `SystemProbe`; `steadytrain.device.testing` holds the doubles tests use instead.

core.py        a device spec resolved to a working `Device`, and its memory read
reading.py     what a memory reading holds (`MemoryReading`, `PeakReading`): plain values
budget.py      how much memory a run may use, per device type
backends.py    one small class per device type: everything device-specific goes through it
mps.py         the only module that calls `torch.mps`, kept thin
watermarks.py  the MPS allocator's watermark variables, read the way the allocator reads them
autocast.py    which low-precision dtypes autocast really runs on a device, found by running it
oom.py         out-of-memory classification, and the one catch, free and retry
rng.py         every RNG stream a run draws from, saved and restored
batches.py     a nested batch moved to a device, each container keeping its type
host.py        `HostDevice`: the host's memory as a `Device` gives it (Keras on TensorFlow or JAX)
system.py      what the operating system says about this machine and process (`SystemProbe`)
cpu_load.py    how busy the CPU is: this process's threads and other processes' load
selftest.py    proof that a device trains (`steadytrain doctor --selftest`)
testing.py     test doubles for the device layer, never used by a real run

The names load on first use: the classifier, the host probes and `HostDevice` (a Keras run on
TensorFlow or JAX) import without torch; `Device`, `resolve_device` and the RNG streams bring it.
"""

from __future__ import annotations

from steadytrain._lazy import lazy_names

_WHERE = {
    "AutocastResult": "autocast",
    "Device": "core",
    "MemoryReading": "reading",
    "PeakReading": "reading",
    "available_devices": "core",
    "default_backends": "core",
    "resolve_device": "core",
    "HostDevice": "host",
    "OutOfMemory": "oom",
    "call_or_oom": "oom",
    "is_oom": "oom",
    "oom_kind": "oom",
    "oom_request_bytes": "oom",
    "retry_on_oom": "oom",
    "RNGStateError": "rng",
    "get_rng_state": "rng",
    "seed_everything": "rng",
    "set_rng_state": "rng",
    "CgroupMemory": "system",
    "SystemProbe": "system",
    "to_device": "batches",
}


_MODULES = frozenset(
    [
        "autocast",
        "backends",
        "batches",
        "budget",
        "core",
        "cpu_load",
        "host",
        "mps",
        "oom",
        "reading",
        "rng",
        "selftest",
        "system",
        "testing",
        "watermarks",
    ]
)


__getattr__, __dir__ = lazy_names(__name__, _WHERE, _MODULES)
__all__ = sorted(_WHERE)
