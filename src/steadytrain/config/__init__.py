"""The one validated config tree. Each field's description is its documentation and its default's
reason; `docs/config.md` is generated from this file (`python -m steadytrain.config > docs/config.md`)
and a test keeps the two equal.

Validation reports every problem at once, one plain line each: the field, what is allowed, what
was found. Rules between fields are checked even when other fields are wrong, as long as the
fields a rule reads are valid themselves.

This module is the package's face; beside it:

files.py     reading what a user wrote: text files, JSON with comments, YAML, --set overrides
explain.py   config problems in words: one line each, the closest valid name, a field's rule
__main__.py  `python -m steadytrain.config`: docs/config.md from the fields
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from steadytrain._units import DEFAULT_BUDGET_FRACTION, budget_spec, parse_memory_budget
from steadytrain.config.explain import (
    RULES,
    TRAINER_NAMES,
    accepts,
    explain,
    flat_types,
    is_text,
    key_problem,
    show_value,
    type_name,
)
from steadytrain.config.files import load_mapping, parse_overrides, read_config_text, read_user_text
from steadytrain.errors import ConfigError
from steadytrain.run.durable import write_atomic

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_TORCH_PRECISIONS = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}

RunDefiningField = Literal[
    "effective_batch_size", "seed", "model", "optimizer", "schedule", "data", "drop_last", "shuffle"
]


MAX_COUNT = 2**31 - 1
"""The most a count of the config (effective_batch_size, max_steps, save_every_steps) may be."""

EARLIER_NAMES = {
    "evaluate_every_steps": "eval_every_steps",
    "evaluate_every_epochs": "eval_every_epochs",
}
"""Field names a config may still use -> the field's name now (every evaluation setting a user
writes begins with eval_, as eval_data, eval_batch and eval_metric do)."""


def with_current_names(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its earlier field names (`EARLIER_NAMES`) written as today's; a setting given
    under both names is an error."""
    twice = [old for old, new in EARLIER_NAMES.items() if old in data and new in data]
    if twice:
        raise ConfigError(
            [
                f"{old}, {EARLIER_NAMES[old]}: the same setting given twice ({old} is its "
                f"earlier name); keep {EARLIER_NAMES[old]}"
                for old in twice
            ]
        )
    return {EARLIER_NAMES.get(key, key): value for key, value in data.items()}


class TrainConfig(BaseModel):
    """Settings of one training run. Unknown keys are errors; every problem is reported at once."""

    # strict: "8" is not read as 8, nor "yes" as true; a value of the wrong type is an error
    # that names the field and the type it takes.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, strict=True
    )

    run_dir: str = Field(
        "runs/default",
        description="Folder that holds everything the run writes: config.json, metrics.jsonl, "
        "events.jsonl, checkpoints/. Reusing a folder resumes the run in it.",
    )
    effective_batch_size: int = Field(
        ...,
        ge=1,
        description="Samples per optimizer step. The optimizer always sees this many, whatever "
        "micro-batch memory allows; no default, because it is part of the recipe.",
    )
    micro_batch_size: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="Samples per forward/backward pass. 'auto' plans it before the first step: "
        "one measured pass at micro-batch 1, and when the whole effective batch is not clearly "
        "within the budget, a probe at 1, 2 and 4 samples (with and without activation "
        "checkpointing) picks the size and checkpointing with the most predicted samples/s "
        "that fits (docs/plan.md); a resumed run keeps its saved size. A number is the "
        "starting size and must divide effective_batch_size. Either way out-of-memory halves "
        "it, and the size that fits is kept for later steps.",
    )
    micro_batch_sizes: Literal["powers_of_two", "divisors"] = Field(
        "powers_of_two",
        description="Sizes the 'auto' plan may choose: divisors of effective_batch_size that are "
        "powers of two (kernels are tuned for them, and halving on out-of-memory stays among "
        "them), or 'divisors' for any divisor. The effective batch itself is always allowed.",
    )
    plan_margin: Literal["auto"] | Annotated[float, Field(gt=0, le=1)] = Field(
        "auto",
        description="Share of the memory left above what is in use (weights, data) that the "
        "'auto' plan's predicted peak may take. 'auto': 0.9 on CUDA, where the peak is an exact "
        "counter and an out-of-memory is survivable; 0.75 on MPS and CPU, where the peak is read "
        "coarsely and running over swaps or gets the process killed instead of raising.",
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="Arithmetic of forward and backward. 'auto': bf16 autocast on CUDA where it "
        "works, else fp16 with a grad scaler; fp32 on MPS (fp16 grad scaling there has had "
        "gradient-zeroing bugs, bf16 is slow) and on CPU (bf16 autocast is slow on most CPUs). "
        "A dtype the device cannot run is refused with the alternative.",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="Passes over the data. Ignored when max_steps is set.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps to run; wins over epochs (the data is repeated as needed). "
        "null: run for epochs.",
    )
    save_every_steps: int = Field(
        250,
        ge=1,
        description="Optimizer steps between checkpoints: the most work a crash can cost. A "
        "checkpoint is also written at the end of training and when a signal stops it. Set "
        "explicitly, it must not exceed max_steps.",
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Committed checkpoints to keep; older ones are deleted only after a newer "
        "one is committed.",
    )
    device: str = Field(
        "auto",
        description="Where to train. 'auto' picks cuda, then mps, then cpu (an accelerator that "
        "fails a small computation is skipped); 'cuda' is GPU 0, 'cuda:N' GPU number N.",
    )
    memory_budget: Literal["auto"] | str | float = Field(
        "auto",
        description="Memory the run may use: a size with its unit ('12GiB', '16GB'; GB is 1000³ "
        "bytes, GiB 1024³; a bare '16' is refused, not read as 16 bytes) or a fraction of the "
        "device's usable memory (0.8, as a number or as text). 'auto' is "
        f"{DEFAULT_BUDGET_FRACTION} of it. The same words as `steadytrain estimate` and `plan` "
        "take in --memory-budget. Usable: "
        "CUDA total memory (or the per-process fraction cap), MPS recommended_max_memory, CPU "
        "what the process holds plus the least headroom among free RAM, RLIMIT_AS and the "
        "cgroup limit. A size below what the process already holds with the model in place is "
        "said in a note at the start.",
    )
    hang_timeout: Literal["auto"] | Annotated[float, Field(gt=0)] = Field(
        "auto",
        description="Seconds without progress before a hang is declared. 'auto': the larger of "
        "300 s and 10 × the median step time (after 5 steps); each start-up phase of fit() "
        "(data fingerprint, checkpoint load, plan, compile) and the first step of each process "
        "get 600 s (compilation, first allocations, data warm-up). A number bounds those too, "
        "and every collective; the set-up before them (model placement, optimizer) keeps 600 s, "
        "a checkpoint save at least 300 s and 4 × the longest save so far. The console says "
        "which allowance holds when fit() starts.",
    )
    hang_action: Literal["exit", "report"] = Field(
        "exit",
        description="What a detected hang does. 'exit': write hangs/<time>.txt (every thread's "
        "stack, the last events, the memory reading, the step), record a hang event and exit "
        "with 75, so `steadytrain run` restarts the run from its last checkpoint; 'report': "
        "write and record the same, and let the run go on.",
    )
    # -- memory watch: leaks, swap and pressure, cache policy (safety/memory_watch.py) --------
    memory_watch: bool = Field(
        True,
        description="Watch memory while training: a steady rise across epochs is reported as a "
        "leak with its rate; swapping with inflating step times shrinks the micro-batch before "
        "the OS kills the process.",
    )
    empty_cache: Literal["auto", "never", "every_step"] = Field(
        "auto",
        description="When to hand the allocator's cached memory back. 'auto': only when the "
        "readings say it helps (cache far above what a step uses: 2× its peak and 256 MiB more), "
        "checked at epoch ends; 'every_step' costs speed (+45 % step time on an H100, "
        "docs/memory-watch.md).",
    )
    leak_check_every_steps: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="How often memory is read for the leak check, besides every epoch end. "
        "'auto': a quarter of an epoch, at most 500 steps, so a leak is seen within the first "
        "epoch (four readings at the same point of the step) and a long epoch is not blind.",
    )
    leak_threshold_mib: float = Field(
        32.0,
        gt=0,
        description="A steady rise slower than this many MiB per epoch is not reported as a "
        "leak: allocator and Python bookkeeping drift by a few MiB in a clean run, while the "
        "leaks that kill runs grow by hundreds.",
    )
    thrash_slowdown: float = Field(
        2.0,
        gt=1,
        description="Step time, as a multiple of the median of the run's early steps, that "
        "counts as inflated. Together with swap-in activity, memory pressure or CUDA allocator "
        "retries it means thrashing and the micro-batch is halved; 2× because a smaller "
        "micro-batch alone can slow a step by about half, while swapping slows it many times.",
    )
    # -- end of memory watch fields -----------------------------------------------------------
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto",
        description="How progress is shown on stderr. 'auto': a live bar on an interactive "
        "terminal, plain lines every log_every_steps steps otherwise (CI, a log file).",
    )
    tensorboard: bool = Field(
        False,
        description="Also write loss, learning rate, step time and memory as TensorBoard scalars "
        "to RUN_DIR/tensorboard (needs the tensorboard package).",
    )
    seed: int | None = Field(
        0,
        ge=0,
        description="Seeds the data order, the RNG streams and the model's random ops when "
        "fit() starts. null: the RNG streams stay as the program left them (a ported program "
        "that seeded itself and built its model draws the same dropout masks as its own loop); "
        "the data order then uses seed 0.",
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Clip the gradient norm to this before each optimizer step; null (the "
        "default) does not clip: a program that did not clip trains as it did. The fine-tune "
        "recipe sets 1.0, as Hugging Face's Trainer does.",
    )
    drop_last: bool = Field(
        True,
        description="Drop an epoch's last batch when it is smaller than effective_batch_size, so "
        "every step sees the same batch size; the samples dropped per epoch are shown at the "
        "start. A DataLoader passed as train_data keeps its own drop_last (setting this "
        "against it is refused).",
    )
    shuffle: bool = Field(
        True,
        description="Shuffle the data each epoch (seeded). A DataLoader passed as train_data "
        "keeps its own sampler and order (setting this against it is refused).",
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="DataLoader worker processes that collate batches on the CPU; 0 collates in "
        "the training process.",
    )
    activation_checkpointing: Literal["offload", "auto"] | bool = Field(
        "auto",
        description="Recompute activations in backward to save memory. 'auto' turns it on only "
        "when one sample per micro-batch does not fit (on CUDA, then its offload when that "
        "does not fit either); true turns it on from the start; 'offload' (CUDA only) turns "
        "it on with each layer's kept input in pinned host memory until the backward, which "
        "frees hidden x seq x 2 bytes a sample a layer of GPU memory and costs two copies.",
    )
    tiled_mlp: Literal["auto"] | bool | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="Run each decoder layer's MLP (gate, up and down projections: Llama, "
        "Mistral, Qwen, Gemma and their kind) over a piece of the tokens at a time, each piece "
        "checkpointed, so a long sequence's recomputed layer holds one piece's MLP activations "
        "instead of every token's; the results are the untiled MLP's. 'auto' turns it on when "
        "the plan (micro_batch_size: auto) estimates that one sample does not fit otherwise, "
        "or when the out-of-memory ladder at micro-batch 1 reaches it; true from the start "
        "(8,192 tokens a piece), a number for that many tokens a piece, false never.",
    )
    compile: Literal["auto"] | bool = Field(
        "auto",
        description="Compile the model with torch.compile before the first step: each repeated "
        "block (a Hugging Face model's decoder layers, from its _no_split_modules) in place, "
        "else the whole model. Faster steps on CUDA, and less memory for activations, after a "
        "compile that takes the first step seconds to a minute. 'auto' compiles on CUDA where "
        "Triton is installed (1.65-1.71 x faster on an H100, docs/benchmarks.md) and nowhere "
        "else; true needs Triton on CUDA and a C++ compiler on CPU (refused without); on MPS "
        "the model stays eager.",
    )
    distributed: Literal["auto", "replicate", "ddp", "fsdp"] = Field(
        "auto",
        description="How several ranks (torchrun) hold the model. 'replicate' ('ddp' is the same): "
        "every rank holds all of it and the gradients are summed after the ranks agree. 'fsdp': "
        "each transformer block and the root are sharded with FSDP2 (fully_shard), checkpoints "
        "are written by every rank through torch.distributed.checkpoint, and an out-of-memory "
        "exits 76 for a smaller restart. 'auto': replicate when parameters, gradients and "
        "optimizer state fit the per-rank memory budget, fsdp otherwise. One process always "
        "replicates (nothing to shard).",
    )
    fsdp_offload: bool = Field(
        False,
        description="Under fsdp: each rank's shard of the parameters, gradients and optimizer "
        "state in pinned host memory, and the optimizer step on the CPU (FSDP2's "
        "CPUOffloadPolicy); the GPU holds the gathered layers, the backward's gradients and "
        "the activations. Frees the model state from the GPU for a slower step; `steadytrain "
        "estimate --fsdp-offload` prices it. CUDA only; with 'auto' it applies only where the "
        "run shards. Left false with micro_batch_size auto, the run turns it on by itself where "
        "the per-rank estimate fits one sample with every saver only with the shards on the host.",
    )
    log_every_steps: int = Field(
        10,
        ge=1,
        description="Optimizer steps between progress lines when not on a terminal. These "
        "steps (and the last) also have their forward+backward and optimizer phases timed on the "
        "device (device_compute_time, device_optimizer_time in metrics.jsonl), without a wait.",
    )
    async_save: Literal["auto"] | bool = Field(
        "auto",
        description="Write checkpoints in a background thread after copying the state to host "
        "memory at the step boundary, so training goes on during the write. 'auto': on when "
        "keep_last is at least 2; true needs keep_last of at least 2, because the newest "
        "checkpoint may be half-written when the process dies and the one before it must stay.",
    )
    # -- evaluation during training (engine/evaluation.py); the data is Trainer(eval_data=...) --
    eval_every_steps: int | None = Field(
        None,
        ge=1,
        description="Evaluate every this many optimizer steps (needs eval_data). With neither "
        "this nor eval_every_epochs set, a run given eval_data evaluates at each epoch's end "
        "and after its last step (a max_steps run may end mid-epoch).",
    )
    eval_every_epochs: int | None = Field(
        None,
        ge=1,
        description="Evaluate after the last step of every this many epochs (needs eval_data).",
    )
    eval_batch: int | None = Field(
        None,
        ge=1,
        description="Samples per evaluation batch. null: the eval DataLoader's batch_size, or "
        "effective_batch_size for a dataset. Out of memory splits it into smaller micro-batches.",
    )
    eval_metric: str = Field(
        "eval_loss",
        description="The evaluation metric that keep_best and a scheduler whose step() takes a "
        "metric (ReduceLROnPlateau) read: eval_loss (loss_fn's mean over eval_data) or a name "
        "the Trainer's eval_fn returns.",
    )
    eval_mode: Literal["min", "max"] = Field(
        "min",
        description="Whether a lower (loss) or a higher (accuracy) eval_metric is better.",
    )
    keep_best: bool = Field(
        False,
        description="Keep a full checkpoint of the best evaluation so far in "
        "RUN_DIR/best/checkpoints/ (written when eval_metric improves, synchronously).",
    )
    # -- end of evaluation fields -------------------------------------------------------------
    resume_overrides: list[RunDefiningField] = Field(
        default_factory=list,
        description="Run-defining values allowed to differ from the checkpoint being resumed "
        "(effective_batch_size, seed, model, optimizer, schedule, data, drop_last, shuffle); "
        "each difference is recorded as an event. Any other difference stops the resume with "
        "a list of what changed, old -> new. `model` lets through a parameter's dtype or "
        "trainability, never its shape: a parameter of another shape, new or gone is named "
        "(`a.weight: shape (16, 4) -> (32, 4)`) and the resume refused whatever the overrides, "
        "since the checkpoint cannot load into it (train the changed model in a new run_dir).",
    )
    continuity_strict: bool = Field(
        False,
        description="What a resume does when its first step does not reproduce the loss the "
        "checkpoint recorded for that step (data, code or random state differ from the run that "
        "wrote it). false: record it (a continuity event with both losses, shown on the console "
        "and in the report) and go on. true: stop with exit 2 instead.",
    )

    def __init__(self, /, **data: Any) -> None:
        data = with_current_names(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = explain(exc, type(self), TRAINER_NAMES)
            if not any(not err["loc"] for err in exc.errors()):
                # The rules between fields did not run: check them on the fields that are valid.
                problems += _combination_problems(_valid_values(type(self), data, exc), set(data))
            raise ConfigError(problems) from None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Lax mode would read true as 1 and false as 0; only fields that take a bool get one.
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if bool not in flat_types(annotation):
                raise PydanticCustomError("bool_not_accepted", "true/false is not accepted here")
        return value

    @field_validator("run_dir", mode="before")
    @classmethod
    def _run_dir_spec(cls, value: Any) -> Any:
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if isinstance(value, str) and (not value.strip() or "\0" in value):
            raise ValueError("must name a folder: a path, not empty, with no NUL byte (\\0)")
        return value

    @field_validator("device", "precision", mode="before")
    @classmethod
    def _from_torch(cls, value: Any) -> Any:
        # torch.device("cuda:1") and torch.bfloat16, as programs hold them, read as their text
        if type(value).__module__ == "torch" and type(value).__name__ == "device":
            return str(value)
        if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            return _TORCH_PRECISIONS.get(str(value), value)
        return value

    @field_validator("device")
    @classmethod
    def _device_spec(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"must be {RULES['device']}")
        return value

    @field_validator("effective_batch_size", "max_steps", "save_every_steps")
    @classmethod
    def _bounded_count(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A count past this is a typo (1e30): refused here, not by an overflow in the loop later.
        if isinstance(value, int) and value > MAX_COUNT:
            what = "optimizer steps"
            if info.field_name == "effective_batch_size":
                what = "samples per optimizer step"
            raise ValueError(
                f"must be at most {MAX_COUNT:,} {what} (2³¹ − 1): a value this large is a typo, "
                "not a training run"
            )
        return value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget_spec(cls, value: Any) -> str | float:
        # The one grammar of a memory budget (_units.parse_memory_budget), as estimate and plan
        # read --memory-budget: a size keeps its spelling, a fraction (0.8 or '0.8') is a number.
        parsed = parse_memory_budget(value)
        return value if isinstance(parsed, int) else parsed

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        problems = _combination_problems(self.__dict__, self.model_fields_set)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def evaluate_every_steps(self) -> int | None:
        """The earlier name of eval_every_steps."""
        return self.eval_every_steps

    @property
    def evaluate_every_epochs(self) -> int | None:
        """The earlier name of eval_every_epochs."""
        return self.eval_every_epochs

    def budget_bytes_or_fraction(self) -> int | float:
        """memory_budget as bytes (int) or as a fraction of usable memory (float)."""
        return budget_spec(self.memory_budget)

    # -- loading and saving ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> TrainConfig:
        """Validate a mapping of field: value; every problem is reported in one ConfigError."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                [
                    f"the config must be a mapping of field: value, found "
                    f"{type_name(data)} {show_value(data)}"
                ],
                source,
            )
        odd = [key for key in data if not isinstance(key, str) or not is_text(key)]
        if odd:
            problems = [key_problem(key) for key in odd]
            try:
                cls(**{k: v for k, v in data.items() if k not in odd})
            except ConfigError as exc:
                problems += exc.problems
            raise ConfigError(problems, source)
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(exc.problems, source) from None

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Read a JSON or YAML file (by suffix; anything else is tried as YAML, a JSON superset)."""
        data = load_mapping(path)
        data.update(overrides or {})
        return cls.from_dict(data, source=str(path))

    def to_json(self) -> str:
        """The resolved config, every default filled in, as JSON text."""
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def dump(self, path: str | os.PathLike) -> None:
        """Write the resolved config (every default filled in) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.to_json())


# -- rules between fields -------------------------------------------------------------------------


def _combination_problems(values: Mapping[str, Any], given: set[str]) -> list[str]:
    """Problems between fields; a rule is skipped when a field it reads is absent (invalid)."""
    problems = []
    eff, micro = values.get("effective_batch_size"), values.get("micro_batch_size")
    if isinstance(eff, int) and isinstance(micro, int) and eff % micro:
        problems.append(
            f"micro_batch_size: must divide effective_batch_size {eff} so every optimizer step "
            f"splits into equal micro-batches (found {micro}); {_divisor_hint(eff, micro)}, or "
            f"'auto'"
        )
    every, steps = values.get("save_every_steps"), values.get("max_steps")
    explicit = "save_every_steps" in given
    if isinstance(every, int) and isinstance(steps, int) and every > steps and explicit:
        problems.append(
            f"save_every_steps: must be at most max_steps {steps}, or no checkpoint would be "
            f"written before the end (found {every}); set save_every_steps to {steps} "
            f"or less"
        )
    device = values.get("device")
    if values.get("activation_checkpointing") == "offload" and isinstance(device, str):
        problems += [offload_problem(kind) for kind in ("cpu", "mps") if device.startswith(kind)]
    if values.get("fsdp_offload") is True:
        distributed = values.get("distributed")
        if distributed in ("replicate", "ddp"):
            problems.append(
                f"fsdp_offload: FSDP2's offload policy needs a sharded model, not distributed "
                f"'{distributed}' (found true); set distributed to 'fsdp', or fsdp_offload to "
                "false"
            )
        if isinstance(device, str):
            problems += [fsdp_offload_problem(k) for k in ("cpu", "mps") if device.startswith(k)]
    keep, async_save = values.get("keep_last"), values.get("async_save")
    if async_save is True and isinstance(keep, int) and keep < 2:
        problems.append(
            f"keep_last: must be at least 2 with async_save true (found {keep}): the newest "
            "checkpoint may be half-written when the process dies, so the one before it must "
            "stay; set keep_last to 2 or more, or async_save to false"
        )
    return problems


def offload_problem(device_type: str, name: str = "activation_checkpointing") -> str:
    """Why `name` 'offload' is refused on a device without memory of its own."""
    return (
        f"{name}: 'offload' needs a GPU with memory of its own (CUDA); on "
        f"{device_type} host memory is the same memory, so a copy there frees nothing (found "
        "'offload'); use true"
    )


def fsdp_offload_problem(device_type: str) -> str:
    """Why `fsdp_offload` is refused on a device without memory of its own."""
    return (
        f"fsdp_offload: needs a GPU with memory of its own (CUDA); on {device_type} host "
        "memory is the same memory, so a shard there frees nothing (found true); set "
        "fsdp_offload to false"
    )


def _divisor_hint(n: int, asked: int) -> str:
    divisors = _divisors(n)
    if len(divisors) <= 12:
        return "values that divide it: " + ", ".join(map(str, divisors))
    below = [d for d in divisors if d < asked][-2:]
    above = [d for d in divisors if d > asked][:2]
    return "the nearest values that divide it: " + ", ".join(map(str, below + above))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _valid_values(
    model: type[BaseModel], data: Mapping[str, Any], exc: ValidationError
) -> dict[str, Any]:
    """The validated value of every field that has no error: given ones parsed, others default."""
    bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
    values = {}
    for name, info in model.model_fields.items():
        if name in bad:
            continue
        if name in data:
            try:
                values[name] = _adapter(model, name).validate_python(data[name])
            except ValidationError:
                continue
        elif not info.is_required():
            values[name] = info.default
    return values


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter:
    info = model.model_fields[name]
    if not info.metadata:
        return TypeAdapter(info.annotation)
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)])


# -- reference page -------------------------------------------------------------------------------


def reference_markdown() -> str:
    """The config reference page, generated from the field definitions above."""
    lines = [
        "# Config reference",
        "",
        "Generated from `src/steadytrain/config.py` by `python -m steadytrain.config`; do not edit.",
        "The same fields are accepted as Python keyword arguments (`TrainConfig(...)`), as JSON and",
        "as YAML (`.json` files are read as JSON, any other as YAML). Unknown fields are errors,",
        "with the closest valid name suggested; every problem is reported at once.",
        "",
        "Check a file and see it with every default filled in: `steadytrain config FILE`; change a",
        "field for one check with `--set field=value` (the value is read as YAML: `4`, `null`,",
        "`true`, `12GiB`). A bad config exits with code 2.",
        "",
        "In Python, `TrainConfig.load(path, overrides=None)` reads a JSON or YAML file; `overrides`",
        'is a dict of fields that win over the file\'s (`{"max_steps": 10}`), and the result is',
        "checked as `TrainConfig(...)` is (`ConfigError`, exit 2 under `@entrypoint`, naming every",
        "problem). `config.dump(path)` writes a config back with every default filled in.",
        "",
        "| field | default | accepts | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, info in TrainConfig.model_fields.items():
        value = info.get_default(call_default_factory=True)
        default = "required" if info.is_required() else f"`{json.dumps(value)}`"
        lines.append(
            f"| `{name}` | {default} | {accepts(TrainConfig, name)} | {info.description} |"
        )
    lines += [
        "",
        "Rules between fields:",
        "",
        "- a `micro_batch_size` number must divide `effective_batch_size`;",
        "- `save_every_steps` must be at most `max_steps` when `max_steps` is set;",
        "- `fsdp_offload: true` needs `distributed` 'fsdp' or 'auto' and a CUDA device.",
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "TrainConfig",
    "load_mapping",
    "parse_overrides",
    "read_config_text",
    "read_user_text",
    "reference_markdown",
]
