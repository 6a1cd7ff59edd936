"""How much memory a training run will need, worked out from the model's config alone.

The model is built on the meta device (shapes, no storage), so a 70B config costs nothing to
estimate. Parameters, gradients and optimizer states are exact counts times bytes. Activations
are analytic for the decoder families people fine-tune (`KNOWN_FAMILIES`: Llama, Mistral,
Qwen2/Qwen3, Gemma 2/3, Phi-3, GPT-NeoX, GPT-2, OLMo 2): the bytes each op saves for backward,
summed per token, per layer, as PyTorch and Hugging Face code keep them under the settings given
(activations.py for Llama-style layers, families.py for the others, whose layout layout.py reads
off the config; see docs/estimate.md for the derivation). For any other family they are measured:
its own forward runs on the meta device and the bytes autograd saves are counted (measured.py);
only a family whose code cannot run there says "unknown", and a probe on the device tells.

The peak is not the sum of every row: the gradients are produced while the activations are
released, layer by layer, so

    peak = weights + adapters + optimizer states
           + max(activations + logits and loss + autocast weight copies,
                 gradients + optimizer step temporaries)
    total = peak + framework/allocator overhead

With activation checkpointing the logits' peak and a recomputed layer do not coexist, and the
forward (autocast's cached weight copies) can be the largest moment: `estimate` takes the max
over forward, backward and optimizer step. bench/estimate_accuracy.py measures the result on a
GPU (median error 1.2% against `torch.cuda.max_memory_allocated` on an H100).

Compiled layers (`compiled`) keep their family's `COMPILED_GROWTH` share of the eager
activations where no checkpointing is on (checkpointed with the MLP tiled, the recomputed
layer's `RECOMPUTED_TILED_SHARE`); offload (`offload`) leaves the layer inputs
checkpointing keeps in host memory, all but the two the backward holds (`OFFLOAD_INPUTS_BACK`);
the fused loss (`fused_loss`, with the chunked loss) holds a chunk of rows of logits in the
compute dtype and the hidden states' gradient (activations.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.memory.activations import (
    KNOWN_FAMILIES,
    Activations,
    activations_of,
    attention_kernel,
    logits_and_loss,
    weight_copies,
)
from steadytrain.memory.compiled import family_share
from steadytrain.memory.model_shape import (
    ParamCounts,
    Shape,
    count_parameters,
    load_config,
    lora_targets,
    shape_of,
    text_config,
)
from steadytrain.memory.ranks import (
    FSDP,
    ONE,
    REPLICATE,
    Ranks,
    budget_of,
    ddp_note,
    mode_of,
    share_of,
)
from steadytrain.memory.settings import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_LORA_TARGETS,
    DEVICE_TYPES,
    PRECISIONS,
    Settings,
)

__all__ = [  # the names other modules and users import from here
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_LORA_TARGETS",
    "DEVICE_TYPES",
    "KNOWN_FAMILIES",
    "NF4_BYTES_PER_PARAM",
    "PRECISIONS",
    "Estimate",
    "Row",
    "Settings",
    "attention_kernel",
    "count_parameters",
    "cpu_runtime_bytes",
    "estimate",
    "load_config",
    "per_rank",
    "shape_of",
    "text_config",
]

NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
"""bitsandbytes NF4 with double quantization (QLoRA's default): two 4-bit values per byte, one
uint8 absmax per block of 64 weights, and one fp32 absmax per 256 of those blocks."""

ADAM8BIT_MIN_NUMEL = 4096
"""bitsandbytes keeps the states of tensors smaller than this (`min_8bit_size`) in fp32."""
ADAM8BIT_BYTES_PER_STATE = 1 + 4 / 256
"""One byte per value plus one fp32 absmax per block of 256 (blockwise quantization)."""

OVERHEAD_FRACTION = 0.10
OVERHEAD_FRACTION_CHECKPOINTING = 0.30
OVERHEAD_FIXED = 512 * 2**20
"""Framework/allocator overhead: the caching allocator's rounding and fragmentation plus a
fixed share for the runtime itself (CUDA context or Metal/MPS driver state, torch's own
buffers). On an H100 (bench/estimate_accuracy.py) reserved over allocated was 1.04-1.14 without
activation checkpointing and 1.06-1.36 with it (recomputation churns the cache). A planning
margin, not a measurement."""
OVERHEAD_FRACTION_TILED = 0.10
"""The allocator's share with checkpointing and the MLP tiled (memory/tiled_mlp.py), at the long
sequences where it is on: the recomputed layer's transients are a piece's, the same sizes piece
after piece, rather than the whole MLP's, and the cache is not churned as checkpointing's 30 %
assumes. Bounded by measurement: on an H200 under a per-process cap of 16 GiB on the allocator's
reserved memory, one sample of 131,072 tokens of the 1B Llama LoRA peaked at 14.26 GiB allocated
(bench/long_context_lever.py), so reserved over allocated was at most 1.12 there."""
OVERHEAD_FIXED_CPU = 400 * 2**20
"""The fixed share on CPU with a CPU-only torch build. On CPU the budget is what the training
process may use in total, so the share is the process itself: its resident memory but the tensors
the rows count. Measured (a fresh process, Linux x86_64, torch 2.13.0+cpu, transformers 5.24,
Python 3.11): 254 MiB after importing torch, transformers and steadytrain, 367 MiB after building
a tiny Llama (35k parameters) and one forward/backward, and a peak of 395 MiB (ru_maxrss) for
`steadytrain finetune` of that model (LoRA, 20 steps, a checkpoint)."""
OVERHEAD_FIXED_CPU_GPU_BUILD = 2**30
"""The fixed share on CPU with a torch built for a GPU (CUDA; ROCm taken as the same), whose
libraries the process loads even where it trains on the CPU. Measured as above with torch
2.11.0+cu130 (transformers 5.17, Python 3.12, CUDA_VISIBLE_DEVICES empty or not): 491 MiB after
importing torch, 829 MiB after the tiny Llama's forward/backward, and a peak of 983 MiB for the
same `steadytrain finetune`."""
RUNTIME = {
    "cuda": "runtime: the CUDA context and torch's buffers",
    "mps": "runtime: Metal driver state and torch's buffers",
    "cpu": "runtime: torch's libraries and buffers in the process",
}
"""What the fixed share stands for on each device; the row names only the device in question."""


@dataclass
class Row:
    name: str
    bytes: int | None
    formula: str


@dataclass
class Estimate:
    model: str
    shape: Shape
    settings: Settings
    params: int
    trainable: int
    rows: list[Row]
    peak: int | None
    """Estimated tensor peak: what torch.cuda.max_memory_allocated would show."""
    overhead: int | None
    total: int | None
    phase: str | None
    """Which side of the max() sets the peak: 'forward', 'backward' or 'optimizer step'."""
    peak_formula: str | None
    activations_known: bool
    notes: list[str]
    budget: int | None = None
    budget_source: str | None = None
    ranks: Ranks | None = None
    """How the ranks hold the model and what one holds; every row, the peak and the total are
    one rank's (with one process, the process's)."""

    @property
    def world_size(self) -> int:
        return self.ranks.world_size if self.ranks else 1

    @property
    def distributed(self) -> str:
        """'one process', 'replicate' or 'fsdp'."""
        return self.ranks.mode if self.ranks else ONE

    @property
    def host(self) -> int:
        """Bytes each rank keeps in pinned host memory (FSDP2's offload), not in the total."""
        return self.ranks.host if self.ranks else 0

    @property
    def fits(self) -> bool | None:
        if self.total is None or self.budget is None:
            return None
        return self.total <= self.budget

    def row(self, name: str) -> int | None:
        return next(r.bytes for r in self.rows if r.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "shape": asdict(self.shape),
            "settings": self.settings.estimate_fields(),
            "params": self.params,
            "trainable": self.trainable,
            "rows": [asdict(r) for r in self.rows],
            "peak_bytes": self.peak,
            "overhead_bytes": self.overhead,
            "total_bytes": self.total,
            "peak_phase": self.phase,
            "peak_formula": self.peak_formula,
            "activations_known": self.activations_known,
            "budget_bytes": self.budget,
            "budget_source": self.budget_source,
            "fits": self.fits,
            "world_size": self.world_size,
            "distributed": self.distributed,
            "distributed_reason": self.ranks.why if self.ranks else None,
            "per_rank": self.world_size > 1,
            "host_bytes_per_rank": self.host,
            "notes": self.notes,
        }


@dataclass
class _Costs:
    """The rows every method has: weights, adapters, gradients, optimizer states."""

    rows: list[Row]
    weights: int
    adapters: int
    grads: int
    states: int
    temporaries: int
    trainable: int
    ranks: Ranks | None = None


def estimate(
    config, settings: Settings, model_name: str = "", budget: int | None = None
) -> Estimate:
    """The memory breakdown of training `config` under `settings` (no allocation): one rank's
    where `settings.gpus` is more than one (memory/ranks.py). `budget` (bytes a rank may use)
    resolves `distributed: auto` as a run does, where `settings.memory_budget` is no size; the
    result's settings carry the mode it came to."""
    settings.check()
    shape, counts, s = shape_of(config), count_parameters(config), settings
    notes: list[str] = []
    s = _fused_where_it_runs(config, s, notes)
    costs = _fixed_costs(counts, s, notes)
    costs = _on_ranks(counts, s, costs, notes, budget)
    s = dataclasses.replace(s, distributed=_SAID[costs.ranks.mode])
    known = shape.family in KNOWN_FAMILIES and shape.intermediate is not None
    measured = None if known else _measured(config, shape, s, notes)
    if known or measured is not None:
        peak, phase, peak_formula, extra = _peak(shape, counts, s, costs, notes, measured)
        overhead = int(_overhead_fraction(s) * peak) + _overhead_fixed(s)
        total = peak + overhead
    else:
        peak = overhead = total = phase = peak_formula = None
        extra = _unknown_rows(shape, notes)
    rows = costs.rows + extra + [_overhead_row(s, overhead)]
    kernel = attention_kernel(shape, s)
    if known and kernel != "fused":
        why = (
            f"{shape.family} always runs eager attention"
            if kernel == "eager" and s.attention != "eager"
            else f"{s.attention} on {s.device_type}, {s.precision}"
        )
        notes.append(
            f"attention keeps seq × seq probabilities per head ({why}): memory grows with seq²"
        )
    return Estimate(
        model=model_name,
        shape=shape,
        settings=s,
        params=counts.total,
        trainable=costs.trainable,
        rows=rows,
        peak=peak,
        overhead=overhead,
        total=total,
        phase=phase,
        peak_formula=peak_formula,
        activations_known=known or measured is not None,
        notes=notes,
        ranks=costs.ranks,
    )


def per_rank(
    config,
    settings: Settings,
    world_size: int,
    distributed: str = "fsdp",
    accumulation: int = 1,
    model_name: str = "",
    budget: int | None = None,
) -> Estimate:
    """One rank's memory when `world_size` ranks train `config` under `settings` with a run's
    `distributed` ('replicate', 'ddp', 'fsdp', 'auto' or 'none'), each rank running
    `settings.micro_batch_size` samples a micro-batch and `accumulation` micro-batches an
    optimizer step: `estimate` with those three set (memory/ranks.py says what each mode
    holds). 'auto' is resolved against `settings.memory_budget` where it is a size (else it
    replicates, as a run with no budget does); `Estimate.distributed` says what was priced."""
    chosen = dataclasses.replace(
        settings, gpus=world_size, distributed=distributed, accumulation=accumulation
    )
    return estimate(config, chosen, model_name, budget)


_SAID = {ONE: "none", REPLICATE: "replicate", FSDP: "fsdp"}
"""The settings' `distributed` value each resolved mode is written back as."""


def _on_ranks(
    counts: ParamCounts, s: Settings, costs: _Costs, notes: list[str], budget: int | None
) -> _Costs:
    """The model state one rank holds (memory/ranks.py): one process's, or its shard under
    fsdp, with the rows saying so."""
    gpus = s.gpus or 1
    state = costs.weights + costs.adapters + costs.grads + costs.states
    budget = budget_of(s.memory_budget) or budget
    mode, why = mode_of(gpus, s.distributed, state, budget)
    lora = s.method == "lora"
    ranks = share_of(
        counts,
        gpus=gpus,
        mode=mode,
        why=why,
        weights=costs.weights,
        adapters=costs.adapters,
        grads=costs.grads,
        states=costs.states,
        temporaries=costs.temporaries,
        trainable=costs.trainable,
        trainable_bytes=4 if lora else PRECISIONS[s.weights_dtype],
        weight_bytes=PRECISIONS[s.weights_dtype],
        lora=lora,
        accumulation=s.accumulation,
        offload=s.fsdp_offload and mode == FSDP,
    )
    if mode == REPLICATE:
        notes.append(ddp_note(costs.grads))
    if s.fsdp_offload and mode != FSDP:
        notes.append(f"--fsdp-offload: nothing offloaded, the run does not shard ({why})")
    if mode != FSDP:
        return dataclasses.replace(costs, ranks=ranks)
    rows = [
        dataclasses.replace(
            row,
            bytes=value,
            formula=ranks.formulas.get(row.name, row.formula) if row.bytes else row.formula,
        )
        for row, value in zip(
            costs.rows,
            (ranks.weights, ranks.adapters, ranks.grads, ranks.states, ranks.temporaries),
            strict=True,
        )
    ]
    rows += [
        Row("FSDP gathered parameters", ranks.gathered, ranks.gathered_formula),
        Row("FSDP gradient buffers (backward)", ranks.grad_buffers, ranks.grad_buffers_formula),
        Row(
            "unsharded gradients between micro-batches",
            ranks.held_grads,
            f"{s.accumulation} micro-batches a step: every layer's gradient whole until the last "
            "backward reduce-scatters it (gradient sync off in the others)"
            if ranks.held_grads
            else "none (one micro-batch a step: each layer's gradient is reduce-scattered in its "
            "backward)",
        ),
    ]
    if ranks.host:
        notes.append(
            f"--fsdp-offload: {format_bytes(ranks.host)} per rank in pinned host memory "
            f"({format_bytes(ranks.host * gpus)} for the {gpus} ranks, on the machines' RAM, not "
            "in this total); the optimizer step runs on the CPU"
        )
    return _Costs(
        rows,
        ranks.weights,
        ranks.adapters,
        ranks.grads,
        ranks.states,
        ranks.temporaries,
        costs.trainable,
        ranks,
    )


def _fused_where_it_runs(config, s: Settings, notes: list[str]) -> Settings:
    """The settings with the fused loss off where the fused kernel does not compute this
    model's loss (a logit scale it does not apply: memory/fused_loss.py), with a note."""
    if not (s.fused_loss and s.chunked_loss):
        return s
    from steadytrain.memory.fused_loss import UNSUPPORTED_TRANSFORMS  # torch, only here

    text = text_config(config)
    scaled = [n for n in UNSUPPORTED_TRANSFORMS if getattr(text, n, None) not in (None, 1, 1.0)]
    if not scaled:
        return s
    notes.append(
        f"the model scales its logits ({scaled[0]}), which the fused kernel does not apply: "
        "the chunked loss computes in checkpointed chunks"
    )
    return dataclasses.replace(s, fused_loss=False)


def _fixed_costs(counts: ParamCounts, s: Settings, notes: list[str]) -> _Costs:
    """Weights, trainable adapters, gradients, optimizer states and step temporaries: exact
    counts times bytes."""
    w = PRECISIONS[s.weights_dtype]
    if s.method == "lora":
        wrapped = lora_targets(counts, s.targets, s.vocabulary)
        adapters = [(s.lora_r * m.in_features, s.lora_r * m.out_features) for m in wrapped]
        trainable = sum(a + b for a, b in adapters)
        trainable_tensors = [n for pair in adapters for n in pair]
        trainable_bytes = 4
    else:
        wrapped, trainable, trainable_tensors, trainable_bytes = [], counts.total, counts.tensors, w
    weights, weights_formula = _weights(counts, s, notes)
    adapter_bytes = trainable * 4 if s.method == "lora" else 0
    grads = trainable * trainable_bytes
    states, states_formula = _optimizer_states(s.optimizer, trainable_tensors, trainable_bytes)
    temporaries = trainable * trainable_bytes if s.optimizer == "adamw" else 0
    if s.optimizer == "adamw8bit":
        notes.append("8-bit AdamW needs bitsandbytes (CUDA; recent releases also build for MPS)")
    rows = [
        Row("weights", weights, weights_formula),
        Row(
            "trainable adapters",
            adapter_bytes,
            f"LoRA r={s.lora_r} on {len(wrapped)} linears: {trainable:,} params × 4 B (fp32)"
            if s.method == "lora"
            else "none (full fine-tune: the weights are trained)",
        ),
        Row("gradients", grads, f"{trainable:,} trainable × {trainable_bytes} B"),
        Row("optimizer states", states, states_formula),
        Row(
            "optimizer step temporaries",
            temporaries,
            "foreach AdamW: one trainable-sized buffer (sqrt of the second moment); 0 when fused"
            if temporaries
            else "none",
        ),
    ]
    return _Costs(rows, weights, adapter_bytes, grads, states, temporaries, trainable)


def _weights(counts: ParamCounts, s: Settings, notes: list[str]) -> tuple[int, str]:
    w = PRECISIONS[s.weights_dtype]
    if not s.load_in_4bit:
        return counts.total * w, f"{counts.total:,} params × {w} B ({s.weights_dtype})"
    quantized = sum(m.in_features * m.out_features for m in counts.linears if m.in_layers)
    notes.append("a 4-bit base needs bitsandbytes, which runs on CUDA only")
    # The fine-tune keeps the others bf16 over a bf16 base; peft's preparation, which it keeps
    # for fp16, casts them to fp32 (recipes/model.py `prepare_4bit`).
    other = w if s.weights_dtype != "fp16" else PRECISIONS["fp32"]
    return (
        int(quantized * NF4_BYTES_PER_PARAM) + (counts.total - quantized) * other,
        f"{quantized:,} linear weights × {NF4_BYTES_PER_PARAM:.4f} B (NF4, double quant) + "
        f"{counts.total - quantized:,} others × {other} B"
        + (" (fp32: peft's 4-bit preparation under fp16)" if other != w else ""),
    )


def _peak(
    shape: Shape,
    counts: ParamCounts,
    s: Settings,
    costs: _Costs,
    notes: list[str],
    measured: Activations | None = None,
) -> tuple[int, str, str, list[Row]]:
    """(peak, the phase that sets it, its formula, the activation rows): the activations of a
    known family from its formula, of another as `measured` on the meta device."""
    tokens = s.micro_batch_size * s.seq
    act = measured or activations_of(shape, s, tokens)
    act = _offloaded(_compiled(act, shape, s, notes), shape, s, notes)
    copies, layer_copy, head_copy, copies_formula = weight_copies(shape, counts, s)
    loss = logits_and_loss(shape, s, tokens, head_copy)
    logits = loss.total
    if s.chunked_loss:
        copies -= head_copy
        if head_copy:
            copies_formula += "; the output layer's copy is in the logits row (chunked loss)"
    rows = [
        Row("activations", act.total, act.formula),
        Row("autocast weight copies", copies, copies_formula),
        Row("logits and loss", logits, loss.formula),
    ]
    sides = {"optimizer step": costs.grads + costs.temporaries}
    if s.checkpointing:
        head_outside = 0 if s.chunked_loss else head_copy
        sides["backward"] = act.kept + max(logits + head_outside, act.one_layer + layer_copy)
        sides["forward"] = act.kept + copies + loss.forward
        formula = (
            "weights + adapters + states + max(forward: layer inputs + weight copies + "
            "logits; backward: layer inputs + max(logits and loss, one recomputed layer); "
            "gradients + step temporaries)"
        )
    else:
        sides["backward"] = act.total + copies + logits
        formula = (
            "weights + adapters + states + max(activations + weight copies + logits and "
            "loss, gradients + step temporaries)"
        )
    ranks = costs.ranks
    if ranks is not None and ranks.sharded:
        sides, formula = _sharded_sides(sides, ranks, formula)
    phase = max(sides, key=sides.get)
    peak = costs.weights + costs.adapters + costs.states + sides[phase]
    if shape.vocab >= 64_000 and logits > 0.25 * peak and not s.chunked_loss:
        notes.append(
            f"logits and loss are {100 * logits / peak:.0f}% of the peak: vocab "
            f"{shape.vocab:,} × {tokens:,} tokens; {s.words('chunked')} (the loss "
            f"{DEFAULT_CHUNK_TOKENS} tokens at a time) or {s.words('shorter')} shrinks it"
        )
    return peak, phase, formula, rows


def _sharded_sides(sides: dict[str, int], ranks: Ranks, formula: str) -> tuple[dict[str, int], str]:
    """One rank's sides under fsdp: the gathered parameters in the forward and backward, the
    backward's gradient buffers, the gradients held whole between micro-batches, and the end
    of the backward, where the root's gradient is reduce-scattered."""
    held = ranks.held_grads
    found = {
        "optimizer step": sides["optimizer step"],
        "backward": sides["backward"] + ranks.gathered + ranks.grad_buffers + held,
        "end of backward (the root's reduce-scatter)": ranks.gathered + ranks.root_reduce + held,
    }
    if "forward" in sides:
        found["forward"] = sides["forward"] + ranks.gathered + held
    formula = formula.replace("weights + adapters + states", "shards of weights, adapters, states")
    formula += (
        "; FSDP: forward and backward + the gathered parameters, backward + its gradient "
        "buffers" + (" + the unsharded gradients held between micro-batches" if held else "")
    )
    return found, formula


def _compiled(act: Activations, shape: Shape, s: Settings, notes: list[str]) -> Activations:
    """Compiled layers (`compile`) keep their family's `COMPILED_GROWTH` share of what eager
    layers keep, where the run compiles (on MPS the layers stay eager). A checkpointed layer
    keeps its input either way; where its MLP is tiled, its recomputation keeps
    `RECOMPUTED_TILED_SHARE` of what eager's saves (`Activations.recomputed`)."""
    if not s.compiled:
        return act
    share = family_share(shape.family)
    tiled = s.tiled_mlp and s.micro_batch_size * s.seq > s.tile_tokens
    fused = attention_kernel(shape, s) == "fused"  # measured so; eager's seq × seq stays
    if s.checkpointing and tiled and fused and act.recomputed and s.device_type != "mps":
        share = RECOMPUTED_TILED_SHARE.get(shape.family, 1.0)
        if share < 1.0:
            credit = int(act.recomputed * (1.0 - share))
            notes.append(
                f"compiled layers: the recomputed layer, its MLP tiled, keeps {share:.2f} of "
                f"eager's saved tensors ({shape.family}, measured at long context), "
                f"{format_bytes(credit)} less; the layer inputs checkpointing keeps are eager's"
            )
            return dataclasses.replace(
                act,
                total=act.total - credit,
                one_layer=act.one_layer - credit,
                recomputed=act.recomputed - credit,
                formula=f"{act.formula}; compiled, the recomputed layer {share:.2f} × eager's",
            )
    if s.checkpointing or s.device_type == "mps" or share == 1.0:
        why = (
            "a checkpointed layer keeps only its input"
            if s.checkpointing
            else "a run on MPS leaves the layers eager (inductor's Metal backend is a prototype)"
            if s.device_type == "mps"
            else f"family {shape.family!r} has no measured share (bench/compiled_growth.py)"
        )
        notes.append(f"compiled layers: no credit, the activations row is eager's ({why})")
        return act
    notes.append(
        f"compiled layers: {share:.2f} of eager's activations, measured for {shape.family} "
        "(bench/compiled_growth.py; a compiled layer recomputes its elementwise results)"
    )
    formula = f"compiled layers, {share:.2f} × eager's: {act.formula}"
    return dataclasses.replace(act, total=int(act.total * share), formula=formula)


RECOMPUTED_TILED_SHARE = {"llama": 0.35, "mistral": 0.35, "qwen2": 0.35}
"""What a compiled, checkpointed layer whose MLP is tiled saves for its backward when it is
recomputed, as a share of what the eager layer saves (`Activations.recomputed`: its attention
side, whose norms and rotary embedding fuse away, and the tiled MLP's input), per family with
Llama's layer. Fitted to the compiled peaks an H200 measured (bench/long_context.py: the 1B and
3B Llama shapes, LoRA r16, offload, the fused loss, the tiled MLP): 4.64, 5.56 and 8.59 GiB at
32,768, 49,152 and 98,304 tokens on the 1B and 11.04 GiB at 49,152 on the 3B, estimated so at
4.88, 5.82, 8.65 and 11.12 GiB (+0.7 to +5.1 %, never under; the eager estimate said 5.82, 7.23,
11.46 and 13.25). Without the tiled MLP a checkpointed layer gets no credit: compiled, the 4-bit
1B's checkpointed micro 32 at seq 1,024 peaked at 8.26 GiB, above its eager line's 7.80."""

OFFLOAD_INPUTS_BACK = 2
"""Layer inputs offload has on the device during the backward (memory/offload.py): the input of
the layer being recomputed, and the next one's, copied back ahead of its turn (the prefetch)."""


def _offloaded(act: Activations, shape: Shape, s: Settings, notes: list[str]) -> Activations:
    """Offload (memory/offload.py): the layer inputs checkpointing keeps wait in pinned host
    memory, but for `OFFLOAD_INPUTS_BACK` of them during the backward."""
    if not s.offload or not act.inputs:
        return act
    layers = max(shape.layers, 1)
    back = act.inputs // layers * min(OFFLOAD_INPUTS_BACK, layers)
    kept = act.kept - act.inputs + back
    notes.append(
        f"offload: the {shape.layers} layer inputs checkpointing keeps, "
        f"{format_bytes(act.inputs)}, wait in pinned host memory (the machine's RAM, not in "
        "this total); in the backward the input of the layer being recomputed and the next "
        "one's (prefetched) are back on the device"
    )
    formula = f"{act.formula}; offload: the layer inputs in host memory but two"
    return Activations(kept + act.one_layer, kept, act.one_layer, formula, back)


def _measured(config, shape: Shape, s: Settings, notes: list[str]) -> Activations | None:
    """The activations of a family without a formula, measured on the meta device
    (`measured.py`); None (the rows say unknown) when transformers cannot run it there."""
    from steadytrain.memory.measured import measured_activations

    try:
        act = measured_activations(config, shape, s, s.micro_batch_size * s.seq)
    except Exception as exc:  # noqa: BLE001  any failure of a family's code on meta: say unknown
        notes.append(f"activations could not be measured on the meta device: {exc}"[:300])
        return None
    notes.append(
        f"activations measured: family {shape.family!r} has no formula (known: "
        f"{', '.join(KNOWN_FAMILIES)}), so its own forward ran on the meta device and the bytes "
        "autograd saves were counted"
    )
    return act


def _unknown_rows(shape: Shape, notes: list[str]) -> list[Row]:
    reason = f"family {shape.family!r} has no activation model (known: {', '.join(KNOWN_FAMILIES)})"
    notes.append(f"activations unknown: {reason}; run a probe (steadytrain plan) to measure")
    return [
        Row("activations", None, f"unknown: {reason}; a probe on the device measures it"),
        Row("autocast weight copies", None, "unknown"),
        Row("logits and loss", None, "unknown"),
    ]


def _overhead_fraction(s: Settings) -> float:
    if s.checkpointing and s.tiled_mlp and s.micro_batch_size * s.seq > s.tile_tokens:
        return OVERHEAD_FRACTION_TILED
    return OVERHEAD_FRACTION_CHECKPOINTING if s.checkpointing else OVERHEAD_FRACTION


def _overhead_fixed(s: Settings) -> int:
    return cpu_runtime_bytes() if s.device_type == "cpu" else OVERHEAD_FIXED


def cpu_runtime_bytes() -> int:
    """The fixed share of a run on CPU with this machine's torch build: `OVERHEAD_FIXED_CPU`, or
    `OVERHEAD_FIXED_CPU_GPU_BUILD` for a torch built for CUDA or ROCm."""
    import torch

    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    return OVERHEAD_FIXED_CPU_GPU_BUILD if gpu_build else OVERHEAD_FIXED_CPU


def _overhead_row(s: Settings, overhead: int | None) -> Row:
    formula = (
        f"{_overhead_fraction(s):.0%} of the peak (allocator rounding, fragmentation"
        f"{_overhead_words(s)}) + "
        f"{format_bytes(_overhead_fixed(s))} ({RUNTIME.get(s.device_type, RUNTIME['cpu'])})"
    )
    return Row("framework/allocator overhead", overhead, formula)


def _overhead_words(s: Settings) -> str:
    if _overhead_fraction(s) == OVERHEAD_FRACTION_TILED and s.checkpointing:
        return ", a tiled MLP's pieces reusing the same blocks"
    return ", more with checkpointing" if s.checkpointing else ""


def _optimizer_states(name: str, tensors: list[int], param_bytes: int) -> tuple[int, str]:
    total = sum(tensors)
    if name == "adamw":
        return 2 * param_bytes * total, f"AdamW: 2 states × {total:,} × {param_bytes} B"
    if name == "sgd":
        return 0, "plain SGD keeps no state"
    if name == "sgd-momentum":
        return param_bytes * total, f"SGD momentum: 1 state × {total:,} × {param_bytes} B"
    big = sum(n for n in tensors if n >= ADAM8BIT_MIN_NUMEL)
    small = total - big
    return (
        int(2 * ADAM8BIT_BYTES_PER_STATE * big) + 2 * 4 * small,
        f"8-bit AdamW: 2 states × {big:,} × {ADAM8BIT_BYTES_PER_STATE:.3f} B + "
        f"{small:,} in small tensors × 2 × 4 B",
    )
