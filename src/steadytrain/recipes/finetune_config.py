"""The `steadytrain finetune` config: the names people already write in Hugging Face
`TrainingArguments` (and in peft / bitsandbytes blocks), validated like `TrainConfig` and mapped
onto it.

A config pasted from a Hugging Face script should run as written, so the keys are Hugging Face's,
with their meaning. Where steadytrain has its own name for the same setting (`save_every_steps` for
`save_steps`) either name is accepted; both with different values is an error, because one of them
would be silently dropped. Every `TrainConfig` field without a Hugging Face counterpart
(`memory_budget`, `device`, `hang_timeout`, ...) passes through unchanged. A few Hugging Face keys
that only matter to Hugging Face's own trainer (`report_to`, `push_to_hub: false`) are accepted and
ignored with a printed note; any other unknown key is an error with the closest name suggested.

Every problem is reported at once, one plain line each, like `TrainConfig`. `docs/finetune.md`
holds the mapping table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from steadytrain.config import EARLIER_NAMES, TrainConfig
from steadytrain.config.explain import (
    MEMORY_NAMES,
    accepts,
    flat_types,
    show_value,
    suggestion,
)
from steadytrain.config.files import load_config_file, parse_overrides, strip_json_comments
from steadytrain.errors import BadInputError, ConfigError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""A model folder with one of these has a tokenizer transformers can load."""

Optim = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_hf",
    "sgd",
    "paged_adamw_8bit",
    "adamw_bnb_8bit",
]
OPTIMIZERS: tuple[str, ...] = get_args(Optim)
BNB_OPTIMIZERS = ("paged_adamw_8bit", "adamw_bnb_8bit")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")

ENGINE_NAMES = {
    "save_every_steps": "save_steps",
    "keep_last": "save_total_limit",
    "log_every_steps": "logging_steps",
    "run_dir": "output_dir",
    "epochs": "num_train_epochs",
    "num_workers": "dataloader_num_workers",
    "activation_checkpointing": "gradient_checkpointing",
    "compile": "torch_compile",
}
"""steadytrain's name -> the Hugging Face field that holds the same setting."""

DATA_ALIASES = {
    "train_data": "train_file",
    "train_path": "train_file",
    "dataset_path": "train_file",
    "data_path": "train_file",
    "eval_data": "eval_file",
    "eval_path": "eval_file",
    "validation_file": "eval_file",
    "evaluation_strategy": "eval_strategy",
}
"""Other names scripts use for the data files (run_clm uses train_file / validation_file)."""

DERIVED = {
    "effective_batch_size": "it is per_device_train_batch_size × gradient_accumulation_steps × "
    "processes; set those two instead",
    "micro_batch_size": "per_device_train_batch_size is the starting micro-batch (out-of-memory "
    "halves it); set that instead, or micro_batch_size: auto to let the planner split the "
    "effective batch",
}
"""TrainConfig fields the mapping computes, so they cannot be given directly."""

IGNORED = {
    "report_to": "steadytrain writes metrics.jsonl (and TensorBoard with tensorboard: true)",
    "logging_dir": "metrics and events go to output_dir",
    "logging_strategy": "progress is logged every logging_steps steps",
    "logging_first_step": "progress is logged every logging_steps steps",
    "save_strategy": "checkpoints are written every save_steps steps, at the end and on a signal",
    "per_device_eval_batch_size": "evaluation uses per_device_train_batch_size",
    "remove_unused_columns": "the data loader reads only the fields of its format",
    "group_by_length": "each optimizer batch is already sorted by length before it is split",
    "overwrite_output_dir": "rerunning on the same output_dir resumes it; use a new output_dir "
    "for a fresh run",
    "run_name": "the run is named by output_dir",
    "disable_tqdm": "set progress: off for no progress display",
    "dataloader_pin_memory": "memory is pinned on CUDA automatically",
    "ddp_find_unused_parameters": "not used by the engine",
    "do_train": "finetune always trains",
    "do_eval": "the eval loss is computed when eval data is given",
    "push_to_hub": "steadytrain does not upload; the adapter is in output_dir/final",
    "load_best_model_at_end": "the adapter of the last step is exported",
}
"""Hugging Face keys accepted and ignored, with why they are harmless here."""

MUST_BE_OFF = {"push_to_hub", "load_best_model_at_end"}
"""Ignored keys that, switched on, ask for something steadytrain does not do: refused then."""


def _engine_passthrough() -> list[str]:
    """TrainConfig fields with no Hugging Face name: they pass through unchanged. Generated from
    TrainConfig so that a new engine field needs no copy here."""
    handled = set(ENGINE_NAMES) | set(DERIVED) | {"max_steps", "seed", "max_grad_norm"}
    return [name for name in TrainConfig.model_fields if name not in handled]


ENGINE_FIELDS = _engine_passthrough()


class LoraSettings(BaseModel):
    """peft `LoraConfig` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    r: int = Field(16, ge=1, description="Rank of the adapter matrices.")
    lora_alpha: float = Field(
        32,
        gt=0,
        description="Scale: the adapter's update is multiplied by lora_alpha / r (2 × r is the "
        "common choice).",
    )
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear': every linear projection except the "
        "output head (the QLoRA paper's finding: all of them, not only q and v).",
    )
    task_type: Literal["CAUSAL_LM"] = Field(
        "CAUSAL_LM", description="Accepted because peft configs carry it; only CAUSAL_LM."
    )


class QuantizationSettings(BaseModel):
    """bitsandbytes 4-bit base (QLoRA), and what to do where it cannot run."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    load_in_4bit: bool = Field(
        False,
        description="Load the frozen base in 4 bits (NF4) through bitsandbytes: CUDA only.",
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(
        True, description="Quantize the quantization constants too (about 0.4 bit a weight)."
    )
    fallback: Literal["refuse", "fp32", "bf16", "fp16"] = Field(
        "refuse",
        description="Where 4-bit cannot run (MPS, CPU, no bitsandbytes): 'refuse' stops with "
        "exit 2 before anything loads; a dtype loads the base unquantized in it instead, with a "
        "printed note. 'refuse' by default because the unquantized base needs about 4× the "
        "memory the config was sized for.",
    )


class FinetuneConfig(BaseModel):
    """Settings of one LoRA fine-tune. Unknown keys are errors; every problem is reported at once."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    # -- model and data ----------------------------------------------------------------------
    model_name_or_path: str = Field(
        ...,
        description="A local model folder (config.json + weights) or a Hugging Face hub id "
        "(from the local cache when HF_HUB_OFFLINE=1).",
    )
    train_file: str = Field(
        ...,
        description="Training data: .jsonl or .json records of text, prompt + completion or "
        "messages (docs/finetune-data.md). Also read as train_data, train_path, dataset_path, "
        "data_path.",
    )
    eval_file: str | None = Field(
        None,
        description="Eval data in the same formats; also read as eval_data, eval_path, "
        "validation_file. Its loss is computed during training (eval_strategy) and after it.",
    )
    eval_split: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Instead of eval_file: this share of the training records, chosen with seed.",
    )
    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "epoch",
        description="Given eval data, when its loss is computed during training: at each epoch's "
        "end (epoch), every eval_steps optimizer steps (steps), or only after training (no). "
        "Also read as evaluation_strategy. The loss after training is always reported.",
    )
    eval_steps: int | None = Field(
        None, ge=1, description="With eval_strategy steps: every this many steps (logging_steps)."
    )
    max_seq_length: int = Field(
        1024, ge=2, description="Samples are cut to this many tokens (the stats say how many)."
    )
    packing: bool = Field(
        False,
        description="Pack whole samples into windows of max_seq_length tokens instead of padding "
        "each batch to its longest sample.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description="Attention kernel: sdpa runs on CUDA, MPS and CPU; flash_attention_2 needs "
        "CUDA and the flash-attn package.",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The adapter (peft).")
    quantization: QuantizationSettings = Field(
        default_factory=QuantizationSettings, description="4-bit base (QLoRA)."
    )
    # -- batch and length of training --------------------------------------------------------
    per_device_train_batch_size: int = Field(
        8,
        ge=1,
        description="Samples per forward pass to start with: the engine's micro_batch_size. "
        "Out-of-memory halves it while the optimizer still sees the whole effective batch.",
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Effective batch = per_device_train_batch_size × this × processes "
        "(WORLD_SIZE, 1 without torchrun).",
    )
    num_train_epochs: float = Field(
        3,
        gt=0,
        description="Passes over the data: a whole number (for part of an epoch set max_steps).",
    )
    max_steps: int = Field(
        -1,
        ge=-1,
        description="Optimizer steps to run; wins over num_train_epochs. -1: run for epochs.",
    )
    # -- optimizer and schedule --------------------------------------------------------------
    learning_rate: float = Field(
        2e-4,
        gt=0,
        description="Peak learning rate. 2e-4, not Hugging Face's 5e-5: LoRA recipes (the "
        "QLoRA paper, peft's examples) use 1e-4 to 2e-4 because only the small adapter moves.",
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Shape of the learning rate over the optimizer steps."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    warmup_ratio: float = Field(
        0.0, ge=0, lt=1, description="Warmup as a share of all optimizer steps (rounded up)."
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="AdamW / SGD weight decay on weight matrices (not on biases and norms).",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    optim: Optim = Field(
        "adamw_torch",
        description="adamw_torch; adamw_torch_fused (CUDA); adamw_hf (read as adamw_torch: "
        "transformers removed its own AdamW); sgd; paged_adamw_8bit and adamw_bnb_8bit "
        "(bitsandbytes, CUDA).",
    )
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip the gradient norm to this; 0 turns clipping off."
    )
    # -- precision and memory ----------------------------------------------------------------
    fp16: bool = Field(
        False, description="fp16 autocast with a grad scaler; the base loads in fp16."
    )
    bf16: bool = Field(False, description="bf16 autocast; the base loads in bf16.")
    gradient_checkpointing: Literal["offload", "auto"] | bool = Field(
        "auto",
        description="Activation checkpointing through the model's own switch: true from the "
        "start, false never, 'auto' (default, not Hugging Face's false) only when one sample "
        "does not fit otherwise, so the out-of-memory ladder keeps this step; 'offload' "
        "(CUDA only) from the start, with each layer's kept input in pinned host memory.",
    )
    chunked_loss: Literal["auto"] | bool | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="The loss a chunk of tokens at a time, so a large vocabulary's logits never "
        "exist all at once (docs/chunked-loss.md): true from the start (1,024 tokens a chunk), "
        "a number for that many tokens a chunk, false never, 'auto' (default) when the planner "
        "(micro_batch_size: auto) or the out-of-memory ladder at micro-batch 1 turns it on.",
    )
    tiled_mlp: Literal["auto"] | bool | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="Each decoder layer's MLP over a piece of the tokens at a time, each piece "
        "checkpointed, so a long sequence's recomputed layer holds one piece's MLP activations "
        "instead of every token's (the results are the untiled MLP's): true from the start "
        "(8,192 tokens a piece), a number for that many tokens a piece, false never, 'auto' "
        "(default) when the planner (micro_batch_size: auto) estimates that one sample does not "
        "fit otherwise, or the out-of-memory ladder at micro-batch 1 reaches it.",
    )
    fused_loss: bool = Field(
        True,
        description="With the chunked loss: compute it with the fused linear cross-entropy "
        "kernel where it runs (CUDA with liger-kernel installed), which holds fewer logits; "
        "false keeps the checkpointed chunks everywhere.",
    )
    torch_compile: Literal["auto"] | bool = Field(
        "auto",
        description="Compile the model's decoder layers with torch.compile (the engine's "
        "compile): faster steps on CUDA after a compile in the first step. 'auto' compiles on "
        "CUDA where Triton is installed and nowhere else; true needs Triton on CUDA, a C++ "
        "compiler on CPU; eager on MPS.",
    )
    # -- checkpoints, logging, run -----------------------------------------------------------
    save_steps: int = Field(
        250, ge=1, description="Optimizer steps between checkpoints: the most a crash can cost."
    )
    save_total_limit: int = Field(2, ge=1, description="Committed checkpoints to keep.")
    logging_steps: int = Field(10, ge=1, description="Optimizer steps between progress lines.")
    output_dir: str = Field(
        "runs/finetune",
        description="The run directory. Rerunning the same config on it resumes; the adapter "
        "ends in output_dir/final.",
    )
    seed: int = Field(
        42, ge=0, description="Seeds the adapter's initialisation, the data order and dropout."
    )
    dataloader_num_workers: int = Field(
        0, ge=0, description="Worker processes that collate batches."
    )

    _engine: dict[str, Any] = PrivateAttr(default_factory=dict)
    _notes: list[str] = PrivateAttr(default_factory=list)
    _given: frozenset[str] = PrivateAttr(default_factory=frozenset)
    _source: str | None = PrivateAttr(None)  # the config file, when read from one

    def __init__(self, /, **data: Any) -> None:
        fields, engine, given, problems, notes = _normalise(data)
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            problems += _explain(exc)
            problems += _engine_problems({**engine, "effective_batch_size": 1}, own=set(engine))
            raise ConfigError(problems) from None
        self._engine, self._given, self._notes = engine, frozenset(given), notes
        problems += self._combination_problems()
        if not problems:
            try:
                self.to_train_config()
            except ConfigError as exc:
                problems += [_hf_names(p) for p in exc.problems]
        if problems:
            raise ConfigError(problems)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Lax mode would read true as 1; only fields that take a bool get one.
        field = info.field_name
        if (
            isinstance(value, bool)
            and field is not None
            and bool not in flat_types(cls.model_fields[field].annotation)
        ):
            raise PydanticCustomError("bool_not_accepted", "true/false is not accepted here")
        return value

    @field_validator("num_train_epochs")
    @classmethod
    def _whole_epochs(cls, value: float) -> float:
        if value != int(value):
            raise ValueError(
                "must be a whole number: the engine resumes at exact epoch boundaries; for part "
                "of an epoch set max_steps instead"
            )
        return value

    @field_validator("max_steps")
    @classmethod
    def _steps_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (run for num_train_epochs) or at least 1")
        return value

    # -- the mapping -------------------------------------------------------------------------

    @property
    def notes(self) -> list[str]:
        """Lines to print before training: ignored keys and why they are harmless."""
        return list(self._notes)

    @property
    def world_size(self) -> int:
        return _world_size()

    @property
    def effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def precision(self) -> str:
        """fp16 / bf16 true -> that; both false -> the engine's `precision` if given, else fp32
        (Hugging Face's meaning of both false, and the seed user's choice on MPS)."""
        if self.fp16:
            return "fp16"
        if self.bf16:
            return "bf16"
        return self._engine.get("precision", "fp32")

    def to_train_config(self) -> TrainConfig:
        """The engine's config: the Hugging Face fields mapped (docs/finetune.md), the
        steadytrain-only fields passed through."""
        values: dict[str, Any] = {
            "run_dir": self.output_dir,
            "effective_batch_size": self.effective_batch_size,
            "micro_batch_size": self.per_device_train_batch_size,
            "epochs": int(self.num_train_epochs),
            "max_steps": None if self.max_steps == -1 else self.max_steps,
            "save_every_steps": self.save_steps,
            "keep_last": self.save_total_limit,
            "log_every_steps": self.logging_steps,
            "seed": self.seed,
            "max_grad_norm": self.max_grad_norm or None,
            "num_workers": self.dataloader_num_workers,
            "activation_checkpointing": self.gradient_checkpointing,
            "tiled_mlp": self.tiled_mlp,
            "compile": self.torch_compile,
            **self._engine,
            "precision": self.precision,
        }
        values |= self._evaluation()
        if "save_steps" not in self._given and values["max_steps"] is not None:
            values["save_every_steps"] = min(values["save_every_steps"], values["max_steps"])
        return TrainConfig(**values)

    def evaluates_during_training(self) -> bool:
        return self.eval_strategy != "no" and (self.eval_file or self.eval_split) is not None

    def _evaluation(self) -> dict[str, Any]:
        """The engine's evaluation cadence (docs/finetune.md): eval data and a strategy."""
        if not self.evaluates_during_training():
            return {}
        if self.eval_strategy == "steps":
            return {"eval_every_steps": self.eval_steps or self.logging_steps}
        return {"eval_every_epochs": 1}

    def schedule(self, steps_per_epoch: int) -> tuple[int, int]:
        """(optimizer steps in the run, warmup steps) for `steps_per_epoch` batches an epoch."""
        total = (
            self.max_steps if self.max_steps > 0 else int(self.num_train_epochs) * steps_per_epoch
        )
        warmup = self.warmup_steps or math.ceil(self.warmup_ratio * total)
        return total, min(warmup, total)

    def resolved(self) -> dict[str, Any]:
        """Every field with its value (defaults filled in), steadytrain-only fields included,
        as written to final/training_config.json."""
        return {**self.model_dump(mode="json"), **self._engine}

    def data_file_problems(self) -> list[str]:
        """The data files that are missing or folders, one line each naming the key: the run
        stops on them (exit 2) and the dry-run says them."""
        problems = []
        for field, name in (("train_file", self.train_file), ("eval_file", self.eval_file)):
            if name is None or os.path.isfile(name):
                continue
            problem = (
                "is a directory; give the file inside it"
                if os.path.isdir(name)
                else self._beside_config(field, name)
                or "does not exist; check the path (a relative one is read from the directory "
                "the command runs in)"
            )
            problems.append(f"{field}: data file {name} {problem}")
        return problems

    def model_folder_problems(self) -> list[str]:
        """A relative model_name_or_path that is not a folder here but is one beside the config
        (taken for a hub id before), and a model folder without a tokenizer (transformers'
        traceback after the estimate before): one line each, before anything is loaded."""
        name = self.model_name_or_path
        folder = os.path.expanduser(name)
        if not os.path.isdir(folder):
            beside = self._beside_config("model_name_or_path", name, os.path.isdir)
            return [f"model_name_or_path: folder {name} {beside}"] if beside else []
        from pathlib import Path

        from steadytrain.memory.model_shape import not_a_model

        has = set(os.listdir(folder))
        if "config.json" not in has or has & set(TOKENIZER_FILES) or not_a_model(Path(folder)):
            return []  # not a model folder: resolve_model_path says what it is
        return [
            f"model_name_or_path: {name} has no tokenizer (none of {', '.join(TOKENIZER_FILES)});"
            " save the tokenizer beside the model (tokenizer.save_pretrained(folder)) or copy "
            "its files from the model it was made from"
        ]

    def _beside_config(self, field: str, name: str, found=os.path.isfile) -> str | None:
        """For a relative path that is not found here but is beside the config file (the
        command run from another directory): where it is and the two fixes. `found` says
        whether a path is the kind of thing the field names (a file, or a folder)."""
        if self._source is None or os.path.isabs(name):
            return None
        beside = os.path.join(os.path.dirname(self._source), name)
        if not found(beside):
            return None
        return (
            f"does not exist in {os.getcwd()}, the directory the command runs in, which a "
            f"relative path is read from; it is beside the config, as {beside}: run the command "
            f"from {os.path.dirname(self._source) or '.'}, or write {field} as "
            f"{os.path.abspath(beside)!r}"
        )

    def _combination_problems(self) -> list[str]:
        problems = []
        if self.fp16 and self.bf16:
            problems.append("fp16, bf16: both true; choose one (or neither for fp32)")
        asked = self._engine.get("precision")
        if asked is not None and (self.fp16 or self.bf16) and asked != self.precision:
            problems.append(
                f"precision: {show_value(asked)} contradicts {self.precision}: true; keep one of them"
            )
        if self.warmup_steps and self.warmup_ratio:
            problems.append(
                f"warmup_steps, warmup_ratio: both set ({self.warmup_steps}, {self.warmup_ratio});"
                " give one, so the warmup is the one you meant"
            )
        if self.eval_file is not None and self.eval_split is not None:
            problems.append(
                "eval_file, eval_split: give one; eval_split takes a share of the training file "
                "when there is no separate eval file"
            )
        try:
            self.output_dir.encode()
        except UnicodeEncodeError:
            problems.append(
                f"output_dir: {self.output_dir!r} holds a byte that is not UTF-8, and the "
                "tokenizer's files cannot be saved under such a name (the tokenizers library "
                "takes UTF-8 paths only); choose a name in UTF-8"
            )
        return problems

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> FinetuneConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(
                [f"the config must be a mapping of field: value, found {show_value(data)}"], source
            )
        try:
            made = cls(**{str(k): v for k, v in data.items()})
        except ConfigError as exc:
            raise ConfigError(exc.problems, source) from None
        made._source = source
        return made

    @classmethod
    def load(
        cls, path: str | os.PathLike, overrides: list[str] | Mapping[str, Any] | None = None
    ) -> FinetuneConfig:
        """Read a JSON (comments allowed) or YAML file, apply `--set key=value` overrides
        (dotted keys reach into blocks: lora.r=8), and validate."""
        data = load_config_file(path)
        if overrides:
            pairs = (
                parse_overrides(list(overrides))
                if not isinstance(overrides, Mapping)
                else overrides
            )
            for key, value in pairs.items():
                _set_dotted(data, key, value)
        return cls.from_dict(data, source=str(path))


# -- normalising names before validation ---------------------------------------------------


def _normalise(data: Mapping[str, Any]) -> tuple[dict, dict, set, list[str], list[str]]:
    """Split the user's keys into FinetuneConfig fields and pass-through engine fields, reading
    steadytrain and data aliases. Returns (fields, engine, given field names, problems, notes)."""
    fields: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    problems: list[str] = []
    notes: list[str] = []
    written_as: dict[str, str] = {}
    aliases = {**ENGINE_NAMES, **DATA_ALIASES}
    for written, value in data.items():
        key = EARLIER_NAMES.get(written, written)
        if key in IGNORED:
            if key in MUST_BE_OFF and value not in (False, None):
                problems.append(f"{key}: {IGNORED[key]}; set it to false or remove it")
            else:
                notes.append(f"{key}: ignored ({IGNORED[key]})")
            continue
        if key == "micro_batch_size" and value == "auto":
            engine[key] = value  # the planner splits per_device × accumulation (docs/plan.md)
            continue
        if key in DERIVED:
            problems.append(f"{key}: not set directly here: {DERIVED[key]}")
            continue
        if key in ENGINE_FIELDS and key not in FinetuneConfig.model_fields:  # not its own
            if key in engine:
                old = next(o for o, new in EARLIER_NAMES.items() if new == key)
                problems.append(
                    f"{old}, {key}: the same setting given twice ({old} is its earlier name); "
                    f"keep {key}"
                )
            engine[key] = value
            continue
        target = aliases.get(key, key)
        if target in fields:
            if fields[target] != value:
                problems.append(
                    f"{written_as[target]}, {key}: the same setting given twice with different "
                    f"values ({show_value(fields[target])}, {show_value(value)}); keep one"
                )
            continue
        fields[target], written_as[target] = value, key
    return fields, engine, set(fields), problems, notes


def _engine_problems(values: dict[str, Any], own: set[str]) -> list[str]:
    """Problems TrainConfig finds in the pass-through fields (those named in `own`)."""
    try:
        TrainConfig(**values)
    except ConfigError as exc:
        return [p for p in exc.problems if p.split(":", 1)[0] in own]
    return []


def _hf_names(problem: str) -> str:
    """A TrainConfig problem about a mapped field, named as the user wrote it."""
    name, sep, rest = problem.partition(":")
    hf = ENGINE_NAMES.get(name)
    return f"{hf} ({name}){sep}{rest}" if hf and sep else problem


def _world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(value)
    except ValueError:
        raise BadInputError(f"WORLD_SIZE: {value!r} is not a whole number") from None
    return max(1, size)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    head, dot, rest = key.partition(".")
    if not dot:
        data[key] = value
        return
    block = data.get(head)
    if block is None:
        block = data[head] = {}
    if not isinstance(block, dict):
        raise BadInputError(f"--set {key}: {head} is not a block of settings in the config")
    _set_dotted(block, rest, value)


# -- explaining problems -------------------------------------------------------------------

_BLOCKS: dict[str, type[BaseModel]] = {"lora": LoraSettings, "quantization": QuantizationSettings}
_PEFT_NAMES = "peft's LoraConfig names it so"
_BLOCK_HINTS: dict[str, dict] = {
    "lora": {
        "rank": (["r"], _PEFT_NAMES),
        "alpha": (["lora_alpha"], _PEFT_NAMES),
        "dropout": (["lora_dropout"], _PEFT_NAMES),
    }
}
"""The names a LoRA section is written with in guides -> peft's, for an unknown `lora` key."""


def _explain(exc: ValidationError) -> list[str]:
    """One line per problem, nested keys dotted (lora.r), like TrainConfig's messages."""
    seen: set[str] = set()
    lines: list[str] = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        if not loc:
            lines.extend(str(err["ctx"]["error"]).splitlines())
            continue
        model: type[BaseModel] = FinetuneConfig
        if len(loc) > 1 and loc[0] in _BLOCKS:
            model, name, where = _BLOCKS[loc[0]], loc[1], f"{loc[0]}.{loc[1]}"
        else:
            name, where = loc[0], loc[0]
        if where in seen:
            continue
        seen.add(where)
        if err["type"] == "extra_forbidden":
            known = list(model.model_fields)
            if model is FinetuneConfig:
                known += ENGINE_FIELDS + list(ENGINE_NAMES) + list(DATA_ALIASES)
            hints = _BLOCK_HINTS.get(loc[0]) if len(loc) > 1 else MEMORY_NAMES
            lines.append(f"{where}: unknown field; {suggestion(name, known, hints)}")
        elif err["type"] == "missing":
            description = model.model_fields[name].description or ""
            lines.append(f"{where}: missing, and it has no default ({description.split('. ')[0]})")
        elif err["type"] == "value_error":
            lines.append(f"{where}: {err['ctx']['error']} (found {show_value(err['input'])})")
        elif name in model.model_fields:
            lines.append(
                f"{where}: must be {accepts(model, name)} (found {show_value(err['input'])})"
            )
        else:
            lines.append(f"{where}: {err['msg']} (found {show_value(err['input'])})")
    return lines


__all__ = [
    "BNB_OPTIMIZERS",
    "ENGINE_FIELDS",
    "IGNORED",
    "OPTIMIZERS",
    "SCHEDULERS",
    "FinetuneConfig",
    "LoraSettings",
    "QuantizationSettings",
    "load_config_file",
    "strip_json_comments",
]
