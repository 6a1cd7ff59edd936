"""How much memory a run needs: `estimate` works it out from the config alone (meta device, no
allocation); `probe` measures real passes at a few small micro-batch sizes; `plan` chooses the
micro-batch, accumulation and activation checkpointing from those measurements.

The modules, in the order they build on each other:

settings.py      what the run will do: the options of `steadytrain estimate` and `plan`
model_shape.py   a model's Hugging Face config and exact parameter counts (meta device)
layout.py        how a decoder family's layer is built, read off its config
activations.py   the activation bytes of Llama-style decoder layers, op by op
families.py      the activation formulas of the decoder families beyond Llama's
compiled.py      what a compiled decoder layer keeps for backward, per family
measured.py      activations of a family the formulas do not know, measured on the meta device
ranks.py         what each rank holds on several GPUs: replicated, or sharded by FSDP2
estimate.py      the estimate: how much memory a run needs, from the config alone (per rank)
advice.py        what would make a run fit: every knob not yet set, tried with the estimator
probe.py         real passes at a few small sizes, fitted to peak and seconds per sample
choice.py        the candidates (each size of each mode) and the winner, with the why
finalists.py     CUDA's timed finalists: each mode measured at its own finalist size
analytic.py      the estimate in the planner's terms (linear in the micro-batch per mode)
plan_record.py   the plan as a record (`Plan`) and its bound (`Room`)
plan.py          the plan: bound, probe, choose, explain
lockstep.py      the plan's trial passes run by every rank in lockstep (distributed: fsdp)
config_plan.py   a plan from a config alone, for `steadytrain plan`
savers.py        the memory savers: activation checkpointing, the chunked loss, the tiled MLP
offload.py       activation checkpointing whose kept inputs live in host memory (CUDA)
tiled_mlp.py     each decoder layer's MLP over a piece of the tokens at a time (long sequences)
chunked_loss.py  next-token cross-entropy without all logits at once
fused_loss.py    the output layer and the cross-entropy in one fused pass (CUDA)
"""

import importlib
from typing import Any

from steadytrain.memory.estimate import (
    KNOWN_FAMILIES,
    Estimate,
    Row,
    Settings,
    estimate,
    load_config,
    per_rank,
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
    "per_rank",
]
