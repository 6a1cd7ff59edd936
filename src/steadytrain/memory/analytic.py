"""The analytic estimate in the planner's terms: linear in the micro-batch per mode, read off a
config (`steadytrain plan`) or off a live model, its batch and its optimizer (the trainer); and
what the first optimizer step adds (`first_step_bytes`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.errors import BadInputError
from steadytrain.memory.choice import Mode
from steadytrain.memory.estimate import KNOWN_FAMILIES, Estimate, Settings, estimate, text_config
from steadytrain.memory.settings import FIRST_STEP_PARAM_MULTIPLE

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass
class Analytic:
    """The analytic estimate of a known Hugging Face family, linear in the micro-batch: two
    `estimate` calls per mode (each builds the model on the meta device), cached."""

    config: Any
    settings: Settings
    strict: bool = False
    """False in the trainer: the estimate is a cross-check there, and a config it cannot read
    (an odd family, a new transformers) must not stop a run; the error is kept in `problem`."""
    problem: str | None = None
    _cache: dict = field(default_factory=dict)
    _eager: Analytic | None = None  # the same settings with eager layers (`compiled_share`)

    def at(
        self,
        micro_batch_size: int,
        checkpointing: bool,
        chunked_loss: bool = False,
        offload: bool = False,
    ) -> Estimate | None:
        """The estimate at these settings, or None when it cannot be made (see `problem`)."""
        mode = Mode(checkpointing=checkpointing, offload=offload, chunked_loss=chunked_loss)
        return self.of(micro_batch_size, mode)

    def of(self, micro_batch_size: int, mode: Mode) -> Estimate | None:
        """`at` for a plan's mode: its savers are the estimate's fields of the same names."""
        key = (micro_batch_size, mode)
        if key not in self._cache:
            changes = {"micro_batch_size": micro_batch_size, **mode._asdict()}
            if (self.settings.gpus or 1) > 1:  # a rank's micro-batches of its share a step
                share = self.settings.effective_batch_size
                changes["accumulation"] = max(1, -(-share // micro_batch_size))
            try:
                found = estimate(self.config, dataclasses.replace(self.settings, **changes))
            except (BadInputError, AttributeError, KeyError, TypeError, ValueError) as exc:
                if self.strict:
                    raise
                self.problem, found = f"{type(exc).__name__}: {exc}", None
            self._cache[key] = found
        return self._cache[key]

    def compiled_share(self, mode: Mode) -> float | None:
        """A sample's growth of the tensor peak in `mode` with the layers compiled, as a share
        of its growth with them eager (where the estimate credits compiled layers: see
        estimate.py `_compiled`); None where the settings do not compile or either estimate
        cannot be made."""
        if not self.settings.compiled:
            return None
        if self._eager is None:
            eager = dataclasses.replace(self.settings, compiled=False)
            self._eager = Analytic(self.config, eager, strict=self.strict)
        growths = []
        for priced in (self, self._eager):
            one, two = priced.of(1, mode), priced.of(2, mode)
            if one is None or two is None or one.peak is None or two.peak is None:
                return None
            growths.append(two.peak - one.peak)
        compiled, eager = growths
        return min(1.0, compiled / eager) if eager > 0 and compiled > 0 else None

    def total(self, micro_batch_size: int, mode: Mode) -> float | None:
        one, two = self.of(1, mode), self.of(2, mode)
        if one is None or two is None or one.total is None or two.total is None:
            return None
        return one.total + (two.total - one.total) * (micro_batch_size - 1)


def analytic_for(
    model,
    batch,
    *,
    precision: str,
    optimizer,
    device_type: str,
    compiled: bool = False,
    fused_loss: bool = False,
    sharding: Sharding | None = None,
):
    """(Analytic, None) for a known Hugging Face family, read off the live model (its config,
    peft adapters, weights dtype, attention), the batch (sequence length), the optimizer,
    whether the run compiles its layers and whether its chunked loss is the fused kernel;
    (None, why not) otherwise. `sharding`: the model is sharded over several ranks (FSDP2), and
    the estimate is one rank's (memory/ranks.py: its shard of the model state, the gathered
    layers, the backward's gradient buffers, its own micro-batch's activations)."""
    unknown = unknown_model(model)
    if unknown is not None:
        return None, unknown
    config = model.config
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
        return None, "the batch has no input_ids of shape (batch, seq)"
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    attention = {"flash_attention_2": "flash", "eager": "eager"}.get(
        getattr(config, "_attn_implementation", None) or "sdpa", "sdpa"
    )
    try:
        chosen = Settings(
            micro_batch_size=1,
            seq=int(ids.shape[1]),
            precision=precision,
            weights_dtype=DTYPE_NAMES.get(str((frozen or params)[0].dtype), "fp32"),
            optimizer=optimizer_name(optimizer),
            attention=attention,
            device_type=device_type,
            compiled=compiled,
            fused_loss=fused_loss,
            load_in_4bit=bool(getattr(model, "is_loaded_in_4bit", False)),
            **_method_of(model),
            **(sharding.settings() if sharding is not None else {}),
        )
        chosen.check()
    except BadInputError as exc:
        return None, str(exc)
    return Analytic(config, chosen), None


def unknown_model(model) -> str | None:
    """Why the estimate cannot price `model` (no Hugging Face config, a family it does not
    model), None where it can: asked before drawing a batch to price it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return "the model has no Hugging Face config"
    family = getattr(text_config(config), "model_type", None)
    if family not in KNOWN_FAMILIES:
        return f"family {family!r} is not modelled ({', '.join(KNOWN_FAMILIES)})"
    return None


@dataclass(frozen=True)
class Sharding:
    """A run sharded over `world_size` ranks (`distributed: fsdp`), each rank holding `share`
    samples of every optimizer batch; `fsdp_offload`: the shards live in host memory (FSDP2's
    `CPUOffloadPolicy`)."""

    world_size: int
    share: int
    fsdp_offload: bool = False

    def settings(self) -> dict[str, Any]:
        """The estimate's fields for one rank of this run (`Analytic.of` then prices each
        micro-batch with the accumulation that covers the share)."""
        return {
            "gpus": self.world_size,
            "distributed": "fsdp",
            "effective_batch_size": self.share,
            "fsdp_offload": self.fsdp_offload,
        }


@dataclass(frozen=True)
class OffloadChoice:
    """The estimate's word on `fsdp_offload` before the model is sharded: one rank's total at
    micro-batch 1 with every saver the plan may use (`mode`), its shards on the GPU
    (`on_device`) and in host memory (`on_host`), against the rank's `budget`. `on`: the
    first is over the budget and the second within it."""

    on: bool
    on_device: int
    on_host: int
    budget: int
    mode: Mode

    @classmethod
    def of(cls, on_device: float, on_host: float, budget: float, mode: Mode) -> OffloadChoice:
        """The rule: on where the shards on the GPU are over the budget and on the host within."""
        on = on_device > budget and on_host <= budget
        return cls(on, int(on_device), int(on_host), int(budget), mode)

    def reason(self) -> str:
        """The plan's sentence: the choice, with the estimate with and without."""
        one = (
            f"one sample {self.mode.describe()} is estimated at {format_bytes(self.on_device)} "
            f"a rank with the shards on the GPU and {format_bytes(self.on_host)} with them in "
            f"host memory, against the budget {format_bytes(self.budget)}"
        )
        if self.on:
            return (
                f"fsdp_offload: on, chosen before sharding ({one}): each rank's shards of the "
                "parameters, gradients and optimizer state in pinned host memory, the optimizer "
                "step on the CPU"
            )
        return f"fsdp_offload: off ({one})"

    def to_dict(self) -> dict[str, Any]:
        """Its fields for the run's records (`fit_start`'s `distributed`)."""
        return {
            "on": self.on,
            "on_device": self.on_device,
            "on_host": self.on_host,
            "budget": self.budget,
            "mode": self.mode.describe(),
        }


def fsdp_offload_choice(
    analytic: Analytic | None, mode: Mode, budget: int | None, discrete_memory: bool
) -> OffloadChoice | None:
    """Whether a sharded run should keep its shards in host memory (FSDP2's `CPUOffloadPolicy`),
    from the per-rank estimate alone: it must be decided before the model is sharded and the
    optimizer built, before any pass can run. On where one sample with every saver the plan may
    use (`mode`) is over a rank's `budget` with the shards on the GPU and within it with them in
    host memory: without it the plan has nothing that fits, and an attempt would end in an
    out-of-memory the supervisor answers with this same rung, after a restart. None where
    there is nothing to decide: a device without memory of its own (CPU, MPS: host memory is
    the device's), no budget, a model the estimate does not know (`analytic` None or failing),
    one not sharded, or the shards in host memory already."""
    if not discrete_memory or budget is None or analytic is None:
        return None
    settings = analytic.settings
    if (settings.gpus or 1) <= 1 or settings.distributed != "fsdp" or settings.fsdp_offload:
        return None
    host = Analytic(analytic.config, dataclasses.replace(settings, fsdp_offload=True))
    on_device, on_host = analytic.of(1, mode), host.of(1, mode)
    if on_device is None or on_host is None or on_device.total is None or on_host.total is None:
        return None
    return OffloadChoice.of(on_device.total, on_host.total, budget, mode)


def _method_of(model) -> dict[str, Any]:
    """The settings of the peft LoRA adapter the model carries, else a full fine-tune."""
    peft_config = getattr(model, "peft_config", None)
    if not (isinstance(peft_config, dict) and peft_config):
        return {"method": "full"}
    lora = next(iter(peft_config.values()))
    targets = lora.target_modules
    return {
        "method": "lora",
        "lora_r": int(lora.r),
        "lora_targets": targets if isinstance(targets, str) else ",".join(sorted(targets)),
        "lora_dropout": float(lora.lora_dropout or 0.0),
    }


def optimizer_name(optimizer) -> str:
    """The estimate's name for a live optimizer: sgd, sgd-momentum, adamw8bit, else adamw."""
    kind = type(optimizer).__name__.lower()
    if kind == "sgd":
        return "sgd-momentum" if optimizer.param_groups[0].get("momentum", 0) else "sgd"
    return "adamw8bit" if "8bit" in kind else "adamw"


def first_step_bytes(optimizer) -> int:
    """Memory the first optimizer step adds that no probed pass shows: the optimizer's state,
    created lazily at that step (`FIRST_STEP_PARAM_MULTIPLE` by the optimizer's estimate name;
    an optimizer the estimate does not know is taken as AdamW). 0 when the state exists
    already."""
    if any(optimizer.state.values()):
        return 0
    size = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    return int(size * FIRST_STEP_PARAM_MULTIPLE[optimizer_name(optimizer)])
