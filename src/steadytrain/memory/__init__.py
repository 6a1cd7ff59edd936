"""How much memory a run needs: `estimate` works it out from the config alone (meta device, no
allocation); `probe` measures real passes at a few small micro-batch sizes; `plan` chooses the
micro-batch, accumulation and activation checkpointing from those measurements.

The modules, in the order they build on each other: `settings` (what the run will do),
`model_shape` (config and parameter counts), `activations`, `estimate`; `probe`, `choice` (the
candidates and the winner), `finalists` (CUDA's timed finalists), `analytic` (the estimate in
the planner's terms), `plan` (bound, probe, choose, explain), `config_plan` (a plan from a config
alone, for `steadytrain plan`)."""

from steadytrain.memory.estimate import (
    KNOWN_FAMILIES,
    Estimate,
    Row,
    Settings,
    estimate,
    load_config,
)
from steadytrain.memory.plan import Candidate, Mode, Plan, allowed_sizes, choose, plan
from steadytrain.memory.probe import Fit, ProbeResult, Sample, fit, measure, probe

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
    "plan",
    "probe",
]
