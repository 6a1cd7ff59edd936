"""A fine-tune's memory, estimated before anything loads, with the fine-tune's own settings
(LoRA on its targets with its dropout, its precision, batch, sequence length and optimizer),
not `steadytrain estimate`'s command-line defaults (a full fine-tune)."""

from __future__ import annotations

import dataclasses
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.errors import SteadytrainError
from steadytrain.memory.estimate import Estimate, estimate
from steadytrain.memory.model_shape import load_config
from steadytrain.memory.settings import from_options
from steadytrain.recipes.finetune_config import BNB_OPTIMIZERS, FinetuneConfig

ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash"}


def estimate_settings(config: FinetuneConfig) -> dict[str, Any]:
    """`steadytrain estimate`'s options that describe `config`."""
    targets = config.lora.target_modules
    precision = config.precision if config.precision in ("fp32", "bf16", "fp16") else "fp32"
    optimizer = (
        "adamw8bit"
        if config.optim in BNB_OPTIMIZERS
        else "sgd"
        if config.optim == "sgd"
        else "adamw"
    )
    return {
        "micro_batch_size": config.per_device_train_batch_size,
        "seq": config.max_seq_length,
        "precision": precision,
        "weights_dtype": precision,  # the frozen base loads in the precision's dtype
        "load_in_4bit": config.quantization.load_in_4bit,
        "method": "lora",
        "lora_r": config.lora.r,
        "lora_targets": targets if isinstance(targets, str) else ",".join(targets),
        "lora_dropout": config.lora.lora_dropout,
        "checkpointing": config.gradient_checkpointing in (True, "offload"),  # an upper bound
        "optimizer": optimizer,
        "attention": ATTENTION[config.attn_implementation],
    }


def estimate_finetune(
    config: FinetuneConfig, device_type: str, budget: int | None, **options: Any
) -> Estimate:
    """The estimate for `config` on a `device_type` device against `budget` bytes (None: no
    verdict); `options` override estimate settings (memory_budget, device_type)."""
    settings = from_options("estimate", {**estimate_settings(config), **options})
    settings.check("estimate")
    settings = dataclasses.replace(settings, device_type=device_type)
    result = estimate(
        load_config(config.model_name_or_path), settings, model_name=config.model_name_or_path
    )
    result.budget = budget
    return result


def memory_line(config: FinetuneConfig, device_type: str, budget: int | None) -> str:
    """One line for the start of a fine-tune: the estimated need at its micro-batch against the
    budget, before the base loads (the planner does this itself for micro_batch_size: auto)."""
    try:
        result = estimate_finetune(config, device_type, budget)
    except SteadytrainError as exc:
        return f"memory: no estimate before loading ({str(exc).splitlines()[0]})"
    if result.total is None or budget is None:
        return "memory: no estimate before loading (this architecture's activations are unknown)"
    head = (
        f"memory: estimated {format_bytes(result.total)} at micro-batch "
        f"{config.per_device_train_batch_size} against a budget of {format_bytes(budget)}"
    )
    if result.fits:
        return f"{head}: fits"
    return (
        f"{head}: does not fit; out-of-memory will halve the micro-batch (lower "
        "per_device_train_batch_size or max_seq_length, or set gradient_checkpointing: true; "
        "steadytrain finetune --dry-run shows the breakdown)"
    )


__all__ = ["estimate_finetune", "estimate_settings", "memory_line"]
