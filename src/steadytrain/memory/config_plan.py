"""Plans for a model known by its config alone (`steadytrain plan`): from the analytic estimate,
or from real passes of the model built with random weights on this device."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from steadytrain._units import DEFAULT_BUDGET_FRACTION, budget_spec, format_bytes
from steadytrain.device import resolve_device
from steadytrain.errors import BadInputError
from steadytrain.memory.analytic import Analytic
from steadytrain.memory.choice import Mode, choose
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS, Settings
from steadytrain.memory.offload import OFFLOAD
from steadytrain.memory.plan import (
    Plan,
    Room,
    accumulation_reason,
    compiled_growth,
    plan,
)
from steadytrain.memory.probe import Fit
from steadytrain.memory.settings import DEFAULT_TILE_TOKENS, FIRST_STEP_PARAM_MULTIPLE

ASSUMED_RECOMPUTE = 4 / 3
"""Without a probe the times are unknown; checkpointing is taken to cost one more forward per
sample (a forward is about a third of forward + backward), so plain wins wherever it fits."""
ASSUMED_CHUNKED = 1.1
"""The chunked loss's cost per sample when nothing is measured: 8-10 % on an H100 for Llama 3's
vocabulary (docs/benchmarks.md)."""
ASSUMED_SHARDED_PASS = 1.0
"""On ranks sharded (fsdp) every pass gathers every layer's parameters from the ranks and
every step reduce-scatters their gradients: a pass is taken to cost one sample's time more, so
of two sizes that fit the one with fewer micro-batches is faster. A floor: on two H200s the
Qwen2-1.5B full fine-tune's probe measured 691 ms a pass against 32 ms a sample
(docs/benchmarks.md, "Two 16 GiB GPUs that plan")."""
ANALYTIC_MARGIN = 1.0
"""Without a probe the plan takes the whole budget, as `estimate` does: the analytic total
already carries the estimate's overhead margin (10-30 % of the peak + 512 MiB; on CPU 400 MiB or
1 GiB, by torch's build), so `--memory X` means the same X to both commands. `--margin` still
applies when given; the device margins (`MARGINS`) are for the peaks a probe measures, which have
no overhead in them."""
CHECKPOINTING = {"auto": "auto", "on": True, "off": False, OFFLOAD: OFFLOAD}
"""`--checkpointing` in the config's terms (activation_checkpointing: auto, true, false,
offload)."""


CompileLayers = Callable[[Any, str], Callable[[], AbstractContextManager] | None]
"""compile_layers(model, device_type): compile the model's layers in place as a run does, and
return the context that runs them eagerly (None where torch has none). The command line passes
the engine's (`cli/memory_commands.py: compile_before_plan`), a layer this one may not import."""
TrialPass = Callable[[Any, Any, Any, Callable[[], AbstractContextManager]], None]
"""trial_pass(model, loss_fn, batch, autocast): one forward and backward of `batch` under
`autocast()`, its gradients dropped: the pass a probe measures at each size. The command line
passes the engine's (`engine.side_pass.trial_pass`): the planner measures the passes it is
given and runs no backward of its own."""


def plan_for_config(
    config,
    settings: Settings,
    budget: int | None,
    compile_layers: CompileLayers | None = None,
    trial_pass: TrialPass | None = None,
) -> Plan:
    """The plan for `config` under `settings` (checked, device_type and compiled resolved, as
    `steadytrain plan` does: cli/memory_commands.py `resolve_target`): probed on this
    device where `settings.probe` says so (default: a CUDA machine planning for CUDA), else from
    the analytic estimate against `budget`. A probe runs `trial_pass` at each size; of compiled
    layers it compiles them first with `compile_layers`, as a run does before its plan: the
    probe's passes run eager, the CUDA finalists compiled."""
    analytic = Analytic(config, settings, strict=True)
    here = resolve_device("auto").type
    probe = settings.probe
    if probe is None:
        probe = here == "cuda" and settings.device_type == "cuda"
    if probe and settings.device_type != here:
        raise BadInputError(
            f"--probe: this machine trains on {here}, the plan is for {settings.device_type} "
            "(--device-type); probe on the machine itself, or leave --probe out for the "
            "analytic plan"
        )
    if probe:
        if trial_pass is None:
            raise TypeError("plan_for_config: a probe needs the trial_pass it measures")
        return _probe_plan(config, settings, analytic, compile_layers, trial_pass)
    return analytic_plan(analytic, settings, budget)


def analytic_plan(
    analytic: Analytic,
    settings: Settings,
    budget: int | None,
    chunked: bool | None = None,
    tiled: bool | None = None,
) -> Plan:
    """The plan from the estimate alone: peak(b) is the analytic total (tensors and overhead)
    against the whole budget, on the line through micro 1 and 2; on several ranks sharded, each
    size's own total (a size that is a rank's whole share holds no whole gradients between
    micro-batches, and the line would price it as if it did); times are assumed
    (`ASSUMED_RECOMPUTE`, `ASSUMED_CHUNKED`).
    `chunked`: the chunked loss is offered (None, as a run whose loss can chunk), in force from
    the start (True) or never (False), as a fine-tune's `chunked_loss` says. `tiled`: the tiled
    MLP likewise (`tiled_mlp`); offered, it is on in every mode where one sample with every
    other saver does not fit without it, as a run's planner decides (`plan._Job.tiling`)."""
    ckpt = CHECKPOINTING[settings.activation_checkpointing]
    modes = [Mode.of(ckpt if ckpt != "auto" else False)]
    modes += [Mode(True)] if ckpt == "auto" else []
    if ckpt == "auto" and settings.device_type == "cuda":  # a run there may offload the inputs
        modes.append(Mode(True, offload=True))
    if chunked is None:
        modes += [m._replace(chunked_loss=True) for m in modes]
    elif chunked:
        modes = [m._replace(chunked_loss=True) for m in modes]
    if budget is None:
        raise BadInputError("plan: this device's budget is unknown; pass --memory 16GiB")
    margin = settings.plan_margin if settings.plan_margin is not None else ANALYTIC_MARGIN
    room = Room(settings.effective_batch_size, budget, 0, margin, settings.device_type)
    if tiled or (tiled is None and _tiling_needed(analytic, modes, room.limit)):
        modes = [m._replace(tiled_mlp=True) for m in modes]
    sharded = (settings.gpus or 1) > 1 and settings.distributed == "fsdp"
    per_pass = ASSUMED_SHARDED_PASS if sharded else 0.0
    fits = {mode: _analytic_line(analytic, mode, per_pass) for mode in modes}
    against = (
        f"the budget {format_bytes(budget)}"
        if margin == 1.0
        else f"{margin:.0%} of the budget {format_bytes(budget)}, {format_bytes(room.limit)}"
    )
    reasons = [
        f"no probe: the analytic total (tensors + overhead){' at each size' * sharded} against "
        f"{against}, as "
        "`steadytrain estimate` compares it; times are not measured, so a "
        "checkpointed or chunked-loss size is taken only where no plain one fits (run with "
        "--probe on the training machine to compare measured speeds)"
        + (
            "; sharded, a pass is taken to cost one sample's time more (it gathers every "
            "layer's parameters), so fewer micro-batches are faster"
            if sharded
            else ""
        )
    ]
    for mode, line in fits.items():
        reasons.append(
            f"{mode.describe()}: total ≈ {format_bytes(line.fixed)} + "
            f"{format_bytes(line.per_sample)} × micro (analytic, micro 1 and 2)"
        )
    best, candidates, why = choose(
        fits,
        room.effective_batch_size,
        room.limit,
        micro_batch_sizes=settings.micro_batch_sizes,
        predict=(lambda mode, size: analytic.of(size, mode).total) if sharded else None,
    )
    if best is None:
        reasons.append(
            "nothing fits, not even one sample checkpointed: what would change it follows"
        )
        mode = Mode.of(True if ckpt == "auto" else ckpt, chunked is not False)
        if ckpt == "auto" and settings.device_type == "cuda":
            mode = mode._replace(offload=True)
        mode = mode._replace(tiled_mlp=tiled is not False)
        peak = None
    else:
        reasons += [r for r in why if "samples/s" not in r]
        reasons.append(accumulation_reason(best.micro_batch_size, room.effective_batch_size))
        mode, peak = best.mode, best.peak
    micro = 1 if best is None else best.micro_batch_size
    return room.plan(micro, mode, peak, reasons, candidates=candidates, analytic=analytic)


def _tiling_needed(analytic: Analytic, modes: list[Mode], limit: float) -> bool:
    """One sample with the most savers of `modes` is over `limit` and the tiled MLP lowers it."""
    most = max(modes, key=lambda m: m.savers)
    own, tiled = analytic.total(1, most), analytic.total(1, most._replace(tiled_mlp=True))
    return own is not None and tiled is not None and own > limit and tiled < own


def _analytic_line(analytic: Analytic, mode: Mode, per_pass: float = 0.0) -> Fit:
    """total(b) = fixed + per_sample × b through the analytic totals at micro 1 and 2; the
    assumed time of a pass, `per_pass` (in samples' time) beside the samples'."""
    one, two = analytic.of(1, mode).total, analytic.of(2, mode).total
    if one is None or two is None:
        raise BadInputError(
            "plan: the activations of this model family are not modelled, so only a probe "
            "can tell; run it where the model will train with --probe"
        )
    return Fit(
        checkpointing=mode.checkpointing,
        fixed=float(2 * one - two),
        per_sample=float(two - one),
        seconds_fixed=per_pass,
        seconds_per_sample=(ASSUMED_RECOMPUTE if mode.checkpointing else 1.0)
        * (ASSUMED_CHUNKED if mode.chunked_loss else 1.0),
        sizes=(1, 2),
        residual=0.0,
        kind="analytic",
    )


def _probe_plan(
    config,
    settings: Settings,
    analytic: Analytic,
    compile_layers: CompileLayers | None,
    trial_pass: TrialPass,
) -> Plan:
    """Build the model from its config with random weights on this device (LoRA through peft
    when asked), compile its layers where the run would, and plan with real passes on random
    tokens."""
    import torch

    from steadytrain.memory.chunked_loss import CausalLMLoss
    from steadytrain.memory.savers import MemorySavers

    memory = settings.memory_budget
    device = resolve_device(
        "auto", DEFAULT_BUDGET_FRACTION if memory is None else budget_spec(memory)
    )
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    model = _random_model(config, settings, dtypes[settings.weights_dtype], device.torch_device)
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = config.get_text_config().vocab_size if hasattr(config, "get_text_config") else 0
    tokens = _random_tokens(vocab or 2, settings.seq, device.torch_device)
    loss_fn = CausalLMLoss()
    savers = MemorySavers(model, loss_fn, discrete_memory=device.discrete_memory)
    compiled = settings.compiled and compile_layers is not None
    eager = compile_layers(model, device.type) if compiled else None

    def autocast():
        return torch.autocast(
            device.type, dtype=dtypes[settings.precision], enabled=settings.autocast
        )

    def one_pass(size: int) -> None:
        ids = tokens(size)
        trial_pass(model, loss_fn, {"input_ids": ids, "labels": ids}, autocast)

    return plan(
        savers.trial_run(one_pass, None),
        device,
        effective_batch_size=settings.effective_batch_size,
        activation_checkpointing=CHECKPOINTING[settings.activation_checkpointing],
        can_checkpoint=savers.can_checkpoint,
        can_offload=savers.can_offload,
        chunked_run=savers.trial_run(one_pass, DEFAULT_CHUNK_TOKENS)
        if savers.can_chunk_loss
        else None,
        plan_margin=settings.plan_margin,
        micro_batch_sizes=settings.micro_batch_sizes,
        analytic=analytic,
        pending=_pending_bytes(settings, params),
        compiled=compiled_growth(model) if settings.compiled else False,
        eager_passes=eager,
        tile=(lambda on: savers.set_tiled_mlp(DEFAULT_TILE_TOKENS if on else None))
        if savers.can_tile_mlp
        else None,
    )


def _random_tokens(vocab: int, seq: int, torch_device):
    """`tokens(size)`: `size` rows of `seq` random token ids on the device, the same rows for
    the same size (seed 0). Every pass gets the size it is asked for: the probe's sizes and
    the CUDA finalists' larger ones, whose time and peak are per sample of that size."""
    import torch

    made: dict[int, torch.Tensor] = {}

    def tokens(size: int) -> torch.Tensor:
        if size not in made:
            made.clear()  # one size at a time on the device
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(0, vocab, (size, seq), generator=generator)
            made[size] = ids.to(torch_device)
        return made[size]

    return tokens


def _random_model(config, settings, dtype, torch_device):
    import torch
    from transformers import AutoModelForCausalLM

    attention = {"flash": "flash_attention_2", "eager": "eager"}.get(settings.attention, "sdpa")
    config._attn_implementation = attention
    with torch.device(torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if settings.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = settings.targets
        with warnings.catch_warnings():
            # peft reads a property transformers 5 deprecated; the warning is not the user's.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
            )
            model = get_peft_model(
                model,
                LoraConfig(
                    r=settings.lora_r,
                    lora_alpha=2 * settings.lora_r,
                    lora_dropout=settings.lora_dropout,
                    target_modules="all-linear" if targets == ("all-linear",) else list(targets),
                ),
            )
    model.train()
    return model


def _pending_bytes(settings: Settings, params) -> int:
    """The first optimizer step's state for the optimizer the settings name."""
    size = sum(p.numel() * p.element_size() for p in params)
    return int(size * FIRST_STEP_PARAM_MULTIPLE[settings.optimizer])


LONGEST_STEP = 1024
"""`longest_seq` answers in whole multiples of this many tokens."""
LONGEST_CAP = 1 << 21
"""`longest_seq` looks no further than this (2,097,152 tokens)."""


def longest_seq(
    config, settings: Settings, budget: int | None, chunked: bool = True, tiled: bool = True
) -> dict[str, Any] | None:
    """The longest sequence one sample of which fits `budget` by the analytic estimate, with
    every saver these settings allow at micro-batch 1 (checkpointing unless it is off, its kept
    inputs offloaded on CUDA unless it is plainly on, the chunked loss unless `chunked` is
    False, as a fine-tune's `chunked_loss: false` says, the tiled MLP unless `tiled` is False,
    as `tiled_mlp: false` says): what `plan` says as the
    maximum `--seq`, so that a user of long documents knows the length before a run starts.
    None without a budget, for a family whose activations are not modelled, or when not even
    `LONGEST_STEP` tokens fit. A dict: `seq`, `total` (bytes at that length), `mode` (the savers
    in words) and `max_positions` (the model's `max_position_embeddings`, when it has one)."""
    from steadytrain.memory.estimate import estimate

    if budget is None:
        return None
    ckpt = settings.activation_checkpointing
    offload = ckpt == OFFLOAD or (ckpt == "auto" and settings.device_type == "cuda")
    mode = Mode(ckpt != "off", offload=offload, chunked_loss=chunked, tiled_mlp=tiled)

    def total(seq: int) -> int | None:
        at = dataclasses.replace(
            settings,
            seq=seq,
            micro_batch_size=1,
            checkpointing=mode.checkpointing,
            offload=mode.offload,
            chunked_loss=chunked,
            tiled_mlp=mode.tiled_mlp,
        )
        return estimate(config, at).total

    def fits(steps: int) -> bool:
        found = total(steps * LONGEST_STEP)
        return found is not None and found <= budget

    if not fits(1):
        return None
    low, high = 1, LONGEST_CAP // LONGEST_STEP
    while low < high:  # the largest number of steps that fits (the total grows with the length)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {
        "seq": low * LONGEST_STEP,
        "total": total(low * LONGEST_STEP),
        "mode": mode.describe(),
        "max_positions": getattr(text, "max_position_embeddings", None),
    }


def longest_seq_line(
    found: dict[str, Any] | None, budget: int | None, key: str = "--seq"
) -> str | None:
    """`longest_seq`'s answer as `plan` prints it (`key`: the fine-tune's dry-run says
    max_seq_length)."""
    if found is None or budget is None:
        return None
    line = (
        f"longest {key} for this budget: {found['seq']:,} tokens at micro-batch 1 "
        f"({found['mode']}: estimated {format_bytes(found['total'])} of "
        f"{format_bytes(budget)})"
    )
    positions = found.get("max_positions")
    if positions and found["seq"] > positions:
        line += f"; the model was trained on up to {positions:,} positions"
    return line
