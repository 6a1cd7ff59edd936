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
The engine compiles before the plan (`micro_batch_size: auto`), whose probe passes run eagerly
(`eager_stance`; compiling for each probed size would cost more than the probe) and whose CUDA
finalists run compiled, so their speed and peak are the compiled run's (the compile happens in
the first finalist's pass, and once more for a second size). Where torch has no
stance to run compiled code eagerly (before 2.6), it compiles after the plan. The first step
takes whatever compile is left (seconds to a minute; the hang watchdog allows the first step
10 minutes, and each start-up phase as long).

`compile: "auto"` (the default) compiles on CUDA where Triton is installed and nowhere else: on an
H100 the Llama-3.2-1B LoRA workload runs 1.65-1.71 × faster compiled, with less memory for
activations (docs/benchmarks.md), for a compile of about 20 s in the first step (less with
inductor's disk cache warm); on CPU the gain is unmeasured and the compile needs a C++ toolchain,
and on MPS it is a prototype.

What a compiled layer keeps for backward: the products of its matrix multiplies (and attention's
output), not the elementwise results computed from them. Each block is compiled through inductor
with an activation memory budget below 1 (`RECOMPUTE_BUDGET`), which turns on the partitioner's
knapsack: it recomputes in backward what is cheapest to recompute until the saved bytes fit the
budget, and elementwise ops (the norms' outputs, SiLU × gate, LoRA's scaled sum) cost no matrix
flops, so they are recomputed and nothing that needs a matrix multiply is. On the Llama shape a
layer keeps 13 hidden-widths per token instead of 20 (eager keeps 30): on an H200 the 1B LoRA
at micro 8 peaks at 9.73 GiB instead of 12.97 GiB, for 1.7 % of the speed (docs/benchmarks.md).
Older torch without the budget compiles with its default.

On CUDA the LoRA projections that read the same input (q, k, v; gate, up) are fused first
(`FUSED_PROJECTIONS`, engine/fused_projections.py): one product of the input with their stacked
A matrices per group instead of one per projection, and each LoRA term added inside its frozen
product (engine/lora_product.py), the adapters' parameters and names as they were. The event's
`fused_projections` counts the groups (o and down are groups of one).

`compile: true` is refused before anything runs where it cannot work: on CPU inductor builds C++ and
needs a compiler, on CUDA it generates Triton kernels and needs Triton. On MPS, where inductor's
Metal backend is still a prototype, the model stays eager and the run says so.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from steadytrain.engine.fused_projections import fuse_projections
from steadytrain.errors import ConfigError

CXX = ("g++", "c++", "clang++")
RECOMPUTE_BUDGET = 0.9
"""The activation memory budget each block is compiled with (1.0 is the partitioner's default,
0.0 recomputes the whole block). Any value below 1 lets the knapsack recompute the elementwise
ops, which cost nothing in its flop count; 0.9 keeps it from reaching for a matrix multiply
where the elementwise savings are under a tenth."""
CUDA_GRAPHS = False
"""Whether CUDA blocks are compiled with inductor's CUDA graphs (`triton.cudagraphs`): each
block's compiled forward and backward replayed as a graph, so that the host launches one graph
per block instead of its hundred kernels. `stable_gradients` makes it exact under gradient
accumulation, and each forward of the model begins a new step of the graphs
(`cudagraph_mark_step_begin`). Off: on an H200 the 1B LoRA at micro 8 ran 78.5k tokens/s
graphed against 81.1k without, and a warm inductor cache served the ungraphed kernels to a
graphed run (docs/benchmarks.md, "CUDA graphs over the compiled layers")."""
FUSED_PROJECTIONS = True
"""Whether a CUDA run's LoRA projections that read the same input (q, k, v; gate, up) compute
their A products as one product per group, set up before their layers are compiled
(engine/fused_projections.py), each LoRA term added inside its frozen product: on an H200 the
1B LoRA's kernels took 3-5 % less time a step for the stacked A matrices and 3-5 % less again for
the products (docs/benchmarks.md, "Fused LoRA projections", "The LoRA term inside the frozen
product")."""


def compile_blocks(
    model: torch.nn.Module, device_type: str, budget: float | None = None
) -> dict[str, Any]:
    """Compile `model`'s repeated blocks (or the model) in place for `device_type`, with the
    activation memory `budget` (None: `RECOMPUTE_BUDGET`). Returns the `compile` event: what was
    compiled, or why nothing was."""
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
    budget = RECOMPUTE_BUDGET if budget is None else budget
    graphed = CUDA_GRAPHS and device_type == "cuda"
    backend = (
        recomputing_inductor(budget, cudagraphs=True) if graphed else recomputing_inductor(budget)
    )
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    fused = {"groups": 0, "fused": []}
    if FUSED_PROJECTIONS and device_type == "cuda":
        fused = fuse_projections(model)
    after = "; the first step includes the compile time"
    if fused["groups"]:
        after = (
            f", {fused['groups']} groups of projections fused ({', '.join(fused['fused'])}){after}"
        )
    if not blocks:
        model.compile(backend=backend)
        name = type(model).__name__
        return {
            "compiled": 1,
            "blocks": name,
            "whole_model": True,
            "fused_projections": fused["groups"],
            "message": f"the whole model ({name}) with torch.compile{after}",
        }
    for block in blocks:
        block.compile(backend=backend)
        if graphed:
            stable_gradients(block)
    if graphed:
        model.register_forward_pre_hook(
            lambda module, args: torch.compiler.cudagraph_mark_step_begin()
        )
    kinds = ", ".join(sorted({type(b).__name__ for b in blocks}))
    return {
        "compiled": len(blocks),
        "blocks": kinds,
        "whole_model": False,
        "fused_projections": fused["groups"],
        "message": f"{len(blocks)} × {kinds} with torch.compile, each in place{after}",
    }


@functools.cache
def recomputing_inductor(budget: float, cudagraphs: bool = False) -> Any:
    """Inductor with the partitioner's activation memory budget at `budget` while it partitions
    a block's forward and backward (which happens when the backend is called, at the first
    call of each shape), and with `cudagraphs`, inductor's CUDA graphs (decided for forward and
    backward alike at that call). One backend object per setting: dynamo reuses a compiled
    block for every block of the same code only under the same backend. Plain "inductor" where
    this torch has no budget."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    if not hasattr(functorch_config, "activation_memory_budget"):
        return "inductor"
    from torch._inductor.compile_fx import compile_fx

    def inductor_recomputing_elementwise(graph, example_inputs):
        with (
            functorch_config.patch(activation_memory_budget=budget),
            inductor_config.patch({"triton.cudagraphs": cudagraphs}),
        ):
            return compile_fx(graph, example_inputs)

    return inductor_recomputing_elementwise


def stable_gradients(block: torch.nn.Module) -> None:
    """Hand each trainable parameter of `block` a copy of the gradient its compiled backward
    made, not the tensor itself. Under CUDA graphs that tensor lives in the graph's memory and
    the next replay writes over it; autograd would keep it as `.grad` at the first micro-batch
    of a step (nothing to add it to yet) and add the next micro-batch's into memory the replay
    had already rewritten. A copy of the adapters' gradients costs a few megabytes a pass."""
    for param in block.parameters():
        if param.requires_grad:
            param.register_hook(torch.Tensor.clone)


def eager_stance() -> Callable[[], AbstractContextManager] | None:
    """A context in which compiled blocks run eagerly (`torch.compiler.set_stance("force_eager")`,
    torch 2.6 and later), or None where this torch has none: then the layers are compiled after
    the plan instead of before it."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    return lambda: set_stance("force_eager")


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
