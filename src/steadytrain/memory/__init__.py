"""How much memory a run needs: `estimate` works it out from the config alone (meta device, no
allocation); `probe` measures real passes at a few small micro-batch sizes; `plan` chooses the
micro-batch, accumulation and activation checkpointing from those measurements.

The modules, in the order they build on each other: `settings` (what the run will do),
`model_shape` (config and parameter counts), `activations`, `estimate`; `probe`, `choice` (the
candidates and the winner), `finalists` (CUDA's timed finalists), `analytic` (the estimate in
the planner's terms), `plan` (bound, probe, choose, explain), `config_plan` (a plan from a config
alone, for `steadytrain plan`)."""

import importlib
from typing import Any

from steadytrain.memory.estimate import (
    KNOWN_FAMILIES,
    Estimate,
    Row,
    Settings,
    estimate,
    load_config,
)

_LAZY = {
    "Candidate": "plan",
    "Mode": "plan",
    "Plan": "plan",
    "allowed_sizes": "plan",
    "choose": "plan",
    "Fit": "probe",
    "ProbeResult": "probe",
    "Sample": "probe",
    "fit": "probe",
    "measure": "probe",
}
"""Names whose modules import torch (through the device layer), imported on first use so that
the command line reads its options from `memory.settings` without torch: the supervisor
(`steadytrain run`) stays a small process. `steadytrain.memory.plan` and `.probe` are the
modules; their functions are `plan.plan` and `probe.probe`."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "KNOWN_FAMILIES",
    "Candidate",
    "Estimate",
    "Fit",
    "Mode",
    "Plan",
    "ProbeResult",
    "Row",
    "Sample",
    "Settings",
    "allowed_sizes",
    "choose",
    "estimate",
    "fit",
    "load_config",
    "measure",
]
