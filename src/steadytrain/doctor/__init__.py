"""`steadytrain doctor`: what a user runs first, to learn whether this machine can train and why not.

Each check is a function of a `Context` (an injected `SystemProbe`, backends and environment) and
returns findings: a status (ok / warn / fail / info), what was found and, for warn and fail, the
fix. Exit 0 healthy, 1 warnings, 2 broken. Tests run it against `steadytrain.device.testing`'s
doubles to see a Rosetta Python, a broken MPS or a bad watermark on a Linux machine.

The names load on first use: `DoctorOptions` (the command's options) imports without torch, so
the command line reads it without loading the checks; `diagnose` and `run_doctor` bring torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DoctorOptions": "options",
    "Finding": "findings",
    "diagnose": "diagnosis",
    "exit_code": "diagnosis",
    "run_doctor": "diagnosis",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'steadytrain.doctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"steadytrain.doctor.{module}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = sorted(_WHERE)
