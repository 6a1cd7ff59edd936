"""`compile: true`: the model's repeated blocks compiled with `torch.compile`, each in place.

Why the blocks and not the whole model: a transformer is the same decoder layer N times, and
compiling that layer's code once serves every instance (regional compilation, as PyTorch's
tutorial on cold-start time recommends), so the compile takes the time of one layer, not of the
model, and the parts around the layers (embedding, the loss, peft's wrappers) stay eager, where a
graph break costs nothing. Within a layer the compiler fuses what eager mode launches as separate
kernels: RMSNorm's upcast, square, mean and scale, the rotary embedding, SiLU × gate, LoRA's
scaling and add. `nn.Module.compile()` works in place: parameter names, `state_dict()` and so the
checkpoints are those of the eager model, and activation checkpointing (the model's own switch)
still wraps each layer's call.

The blocks are the modules whose class a Hugging Face model names in `_no_split_modules` (its
decoder layer: the unit it keeps whole on one device); a model without one is compiled whole.
The engine compiles after the plan's probe passes (which measure the eager model: compiling for
each probed size would cost more than the probe) and before the first step, which then takes
the compile time (seconds to a minute; the hang watchdog allows the first step 10 minutes).

`compile: "auto"` (the default) compiles on CUDA where Triton is installed and nowhere else: on an
H100 the Llama-3.2-1B LoRA workload runs 1.65-1.71 × faster compiled, with less memory for
activations (docs/benchmarks.md), for a compile of about 20 s in the first step (less with
inductor's disk cache warm); on CPU the gain is unmeasured and the compile needs a C++ toolchain,
and on MPS it is a prototype.

`compile: true` is refused before anything runs where it cannot work: on CPU inductor builds C++ and
needs a compiler, on CUDA it generates Triton kernels and needs Triton. On MPS, where inductor's
Metal backend is still a prototype, the model stays eager and the run says so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from typing import Any

import torch

from steadytrain.errors import ConfigError

CXX = ("g++", "c++", "clang++")


def compile_blocks(model: torch.nn.Module, device_type: str) -> dict[str, Any]:
    """Compile `model`'s repeated blocks (or the model) in place for `device_type`. Returns the
    `compile` event: what was compiled, or why nothing was."""
    if device_type == "mps":
        return {
            "compiled": 0,
            "message": "not on MPS (inductor's Metal backend is a prototype); the model runs eager",
        }
    check_compiler(device_type)
    # Dynamo reads `.grad` of every tensor it meets while tracing, which warns for non-leaf
    # activations: noise about the tracer, not about the model (and an error under -W error).
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
    )
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    after = "; the first step includes the compile time"
    if not blocks:
        model.compile()
        name = type(model).__name__
        return {
            "compiled": 1,
            "blocks": name,
            "whole_model": True,
            "message": f"the whole model ({name}) with torch.compile{after}",
        }
    for block in blocks:
        block.compile()
    kinds = ", ".join(sorted({type(b).__name__ for b in blocks}))
    return {
        "compiled": len(blocks),
        "blocks": kinds,
        "whole_model": False,
        "message": f"{len(blocks)} × {kinds} with torch.compile, each in place{after}",
    }


def compile_wanted(setting: bool | str, device_type: str) -> bool:
    """Whether the run compiles: `setting` is the config's `compile` (True, False or "auto")."""
    if setting == "auto":
        return device_type == "cuda" and importlib.util.find_spec("triton") is not None
    return bool(setting)


def check_compiler(device_type: str) -> None:
    """ConfigError (exit 2) when inductor cannot build kernels for `device_type` here."""
    if device_type == "cpu":
        given = os.environ.get("CXX")
        if not (given and shutil.which(given)) and not any(shutil.which(c) for c in CXX):
            raise ConfigError(
                [
                    "compile: true on CPU needs a C++ compiler (torch.compile builds its CPU "
                    f"kernels with one); none of {', '.join(CXX)} or $CXX was found. Install "
                    "one (build-essential, Xcode command line tools) or set compile: false"
                ]
            )
    elif device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            [
                "compile: true on CUDA needs Triton (torch.compile generates its GPU kernels "
                "with it), which is not installed; install the triton that matches your torch "
                "(pip install triton) or set compile: false"
            ]
        )
