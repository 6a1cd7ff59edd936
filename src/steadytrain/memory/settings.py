"""What a run will do, for `estimate` and `plan`: one dataclass whose fields are the options of
`steadytrain estimate` and `steadytrain plan` (the command line is generated from it: each
field's `option(...)` carries its flag, its help and the commands that show it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from steadytrain._options import Alias, aliases_of
from steadytrain._units import parse_memory_budget
from steadytrain.errors import BadInputError
from steadytrain.run import savers as run_savers

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "sgd-momentum")
# What the first optimizer step adds, in multiples of the trainable parameters' bytes: AdamW two
# states plus one parameter-sized temporary of its foreach step; 8-bit AdamW about half a byte a
# value; SGD with momentum one state; plain SGD none. The estimate's own table is per row.
FIRST_STEP_PARAM_MULTIPLE = {"adamw": 3.0, "adamw8bit": 0.5, "sgd": 0.0, "sgd-momentum": 1.0}
METHODS = ("full", "lora")
ATTENTIONS = ("sdpa", "flash", "eager")
DEVICE_TYPES = ("cuda", "mps", "cpu")
CHECKPOINTING_CHOICES = ("auto", "on", "off", "offload")
UNIFIED_MEMORY = ("cpu", "mps")
"""Device types whose host memory is the device's own: offload there frees nothing."""
SIZE_POLICIES = ("powers_of_two", "divisors")
DISTRIBUTED = ("auto", "replicate", "ddp", "fsdp", "none")
"""A run's `distributed` values (TrainConfig), and none: one process."""
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk of the chunked loss (memory/chunked_loss.py). One chunk of a 128k vocabulary
peaks at 12 B × 1,024 × 128,256 = 1.47 GiB (a quarter of that for a 32k vocabulary), so the loss
stops growing with micro-batch × seq past 1,024 tokens; a 1,024-row matmul against the output
weight still runs at full matmul throughput on a GPU, and under autocast over fp32 weights every
chunk casts the output weight again (vocab × hidden values, in forward and in backward), which
smaller chunks would repeat more often. A smaller chunk is for when even one sequence's loss does
not fit."""

DEFAULT_TILE_TOKENS = 8192
"""Tokens per piece of the tiled MLP (memory/tiled_mlp.py). A piece of 8,192 tokens of the 1B
Llama shape holds 384 MiB of intermediate activations in bf16, and an (8,192 × 2,048) by
(2,048 × 8,192) matmul runs at full throughput on a GPU; at 65,536 tokens and more the pieces'
extra forward costs a few per cent of a step (bench/long_context_lever.py)."""

BOTH = ("estimate", "plan")

CONFIG, FLAGS = "config", "flags"
"""The two vocabularies an answer about a run is given in: a fine-tune config's keys
(`chunked_loss: true`), for a config file, or `estimate`'s command-line flags (`--chunked-loss`),
for a model named on the command line."""
WORDS = {
    CONFIG: {
        "bf16": "`bf16: true`",
        "fp16": "`fp16: true`",
        "auto": "memory_budget: auto",
        "chunked": "`chunked_loss: true`",
        "shorter": "a lower `max_seq_length`",
        "targets": "lora.target_modules",
        "all_linear": "`lora.target_modules: all-linear`",
        "device": "set `device: mps` or `device: cuda` in the config",
        "budget": "set `memory_budget: 16GiB` in the config",
    },
    FLAGS: {
        "bf16": "`--precision bf16`",
        "fp16": "`--precision fp16 --weights-dtype fp16`",
        "auto": "--memory-budget auto",
        "chunked": "--chunked-loss",
        "shorter": "a shorter --seq",
        "targets": "--lora-targets",
        "all_linear": "pass all-linear",
        "device": "pass --device-type mps or cuda",
        "budget": "pass --memory-budget 16GiB",
    },
}
"""What the estimate's notes and the advisor call a setting in each vocabulary (`Settings.words`)."""


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    commands: tuple[str, ...] = BOTH,
    required: bool = False,
    cli_default: Any = dataclasses.MISSING,
    aliases: tuple[Alias, ...] = (),
) -> Any:
    """A settings field and its command-line option. `flag` defaults to the field's name in
    kebab case; `cli_default` is the option's default where it differs from the field's
    (device_type: None on the command line means this machine's device), or a dict of them by
    command; `aliases` are its earlier flags (`steadytrain._options.Alias`), kept working."""
    return field(
        default=default,
        metadata={
            "help": help,
            "flag": flag,
            "commands": commands,
            "required": required,
            "cli_default": default if cli_default is dataclasses.MISSING else cli_default,
            "aliases": aliases,
        },
    )


def _with_saver_fields(cls: type) -> type:
    """Give `cls` one bool field per registered memory saver (`steadytrain.run.savers.SAVERS`,
    named by its `estimate_field`, False by default), placed after `activation_checkpointing`.

    The registration is the one place a saver is declared: the estimate prices it through this
    field (`checkpointing`, `offload`, `chunked_loss`), and it is an option of `steadytrain
    estimate` where the saver's flag is the field's own (`--chunked-loss`), not an earlier
    spelling of another option (`--checkpointing`, `--offload`: `--activation-checkpointing`)."""
    taken = {  # flags that are another option's earlier spelling (--checkpointing, --offload)
        alias.flag
        for name in cls.__annotations__
        for alias in getattr(cls, name).metadata["aliases"]
    }
    added = {}
    for saver in run_savers.SAVERS:
        name = saver.estimate_field
        own = saver.flag not in taken and saver.flag == "--" + name.replace("_", "-")
        setattr(cls, name, option(False, saver.estimate_help, commands=("estimate",) * own))
        added[name] = "bool"
    declared = list(cls.__annotations__.items())
    at = next(i for i, (name, _) in enumerate(declared) if name == "activation_checkpointing")
    cls.__annotations__ = dict(declared[: at + 1]) | added | dict(declared[at + 1 :])
    return cls


@dataclass(frozen=True)
@_with_saver_fields
class Settings:
    """What the run will do and where. Every field is an option of `steadytrain estimate`,
    `steadytrain plan` or both; `estimate()` reads the model's side of it.

    The memory savers' fields (`checkpointing`, `offload`, `chunked_loss`: True where the run has
    the saver on) come from their registration (`_with_saver_fields`); `checkpointing` and
    `offload` are set from `activation_checkpointing` (on or offload), `chunked_loss` is the
    estimate's `--chunked-loss`."""

    micro_batch_size: int = option(
        1,
        "Samples per forward/backward.",
        commands=("estimate",),
        aliases=(Alias("--micro-batch"),),
    )
    effective_batch_size: int = option(
        1,
        "Samples per optimizer step (kept whatever the micro-batch).",
        commands=("plan",),
        required=True,
        aliases=(Alias("--effective-batch"),),
    )
    seq: int = option(1024, "Tokens per sample.")
    precision: str = option("fp32", "Autocast dtype: fp32 (none), bf16 or fp16.")
    """steadytrain's engine autocasts over fp32 weights."""
    weights_dtype: str = option("fp32", "dtype the weights (the frozen base with LoRA) load in.")
    """Everything with a full fine-tune; fp32 is what steadytrain's engine trains by default."""
    method: str = option("full", "full or lora.")
    lora_r: int = option(16, "LoRA rank.")
    lora_targets: str = option(
        DEFAULT_LORA_TARGETS,
        "Comma-separated module names (peft target_modules), or all-linear.",
    )
    lora_dropout: float = option(0.0, "LoRA dropout.")
    load_in_4bit: bool = option(False, "NF4 base (QLoRA, bitsandbytes, CUDA).")
    activation_checkpointing: str = option(
        "auto",
        "Activation checkpointing, as a run's activation_checkpointing: auto (the plan decides; "
        "the estimate counts a run's start, without), on, off or offload (on, each layer's kept "
        "input in pinned host memory; CUDA only).",
        cli_default={"estimate": "off", "plan": "auto"},
        aliases=(
            Alias("--checkpointing", "on", commands=("estimate",)),
            Alias("--offload", "offload", commands=("estimate",)),
            Alias("--checkpointing", commands=("plan",)),
        ),
    )
    optimizer: str = option("adamw", "adamw, adamw8bit, sgd or sgd-momentum.")
    attention: str = option("sdpa", "sdpa, flash or eager.")
    """sdpa: PyTorch picks the kernel (see `attention_kernel`); flash: flash_attention_2;
    eager: Hugging Face's own matmul-softmax-matmul."""
    device_type: str | None = option(
        "cuda",
        "Where the run will train: cuda, mps or cpu (default: this machine's device).",
        cli_default=None,
    )
    """It decides sdpa's kernel and the dropout mask's size."""
    gpus: int | None = option(
        1,
        "GPUs the run trains on, one rank each (torchrun --nproc_per_node × nodes); the "
        "estimate is each rank's (default: WORLD_SIZE inside a torchrun run, else 1).",
        cli_default=None,
    )
    """None only from the command line, which reads torchrun's WORLD_SIZE (else 1) before
    anything reads it (cli/memory_commands.py `resolve_target`)."""
    distributed: str = option(
        "auto",
        "How the ranks hold the model, as a run's distributed: replicate (ddp is the same: each "
        "rank holds all of it), fsdp (FSDP2: each decoder layer and the root sharded over the "
        "ranks), auto (replicate where parameters, gradients and optimizer state fit one "
        "rank's budget, else fsdp) or none (one process).",
    )
    fsdp_offload: bool = option(
        False,
        "Under fsdp: each rank's shard of the parameters, gradients and optimizer state in "
        "pinned host memory and the optimizer step on the CPU (FSDP2's CPUOffloadPolicy).",
    )
    """The estimate counts the shards in `Estimate.host`, not in the device's total."""
    accumulation: int = option(
        1,
        "Micro-batches per optimizer step on each rank; under fsdp each rank holds whole "
        "(unsharded) gradients between them, reduce-scattered in the last backward.",
        commands=("estimate",),
    )
    memory_budget: str | None = option(
        None,
        "The memory the run may use, in a run's memory_budget words: a size (16GiB), a fraction "
        "of the target device's usable memory (0.8) or auto (0.9 of it); default: this "
        "device's budget.",
        aliases=(Alias("--memory"),),
    )
    probe: bool | None = option(
        None,
        "Build the model with random weights on this device and measure passes (default: on a "
        "CUDA machine planning for CUDA; elsewhere the plan uses the estimate alone).",
        flag="--probe/--no-probe",
        commands=("plan",),
    )
    compiled: bool | None = option(
        False,
        "Compiled decoder layers (a run's `compile`), which keep less for backward: the "
        "estimate's activations row and the plan's growth per sample count them (plan's "
        "default: as a run's `compile: auto`, compiled on CUDA where Triton is installed; "
        "estimate's: off).",
        flag="--compile/--no-compile",
        cli_default={"estimate": False, "plan": None},
    )
    """None only from `plan`'s command line (as a run's `compile: auto`), which resolves it for
    the target device before anything reads it."""
    micro_batch_sizes: str = option(
        "powers_of_two",
        "powers_of_two (divisors of the effective batch that are powers of two) or divisors.",
        commands=("plan",),
    )
    """A policy, not a list of sizes: which divisors of the effective batch the plan may take."""
    plan_margin: float | None = option(
        None,
        "Share of the room above what is in use the peak may take (default 0.9 CUDA, 0.75 MPS "
        "and CPU).",
        commands=("plan",),
        aliases=(Alias("--margin"),),
    )
    chunk_tokens: int = option(
        DEFAULT_CHUNK_TOKENS, "Tokens per chunk with --chunked-loss.", commands=("estimate",)
    )
    """`DEFAULT_CHUNK_TOKENS` says why 1,024."""
    tile_tokens: int = option(
        DEFAULT_TILE_TOKENS, "Tokens per piece with --tiled-mlp.", commands=("estimate",)
    )
    """`DEFAULT_TILE_TOKENS` says why 8,192."""
    vocabulary: str = option(
        FLAGS, "The words of the estimate's notes: a config's keys or the flags.", commands=()
    )
    """`CONFIG` where the settings describe a fine-tune config (its notes name `chunked_loss:
    true`, `lora.target_modules`), `FLAGS` where they came from the command line."""
    fused_loss: bool | None = option(
        False,
        "The chunked loss is the fused linear cross-entropy (Liger Kernel on CUDA), which holds "
        "a few hundred tokens' logits in the compute dtype (default: where a run would use it, "
        "CUDA with liger-kernel installed here).",
        flag="--fused-loss/--no-fused-loss",
        cli_default=None,
    )
    """Read only with the chunked loss (memory/fused_loss.py). None only from the command line,
    which resolves it for the target before anything reads it."""

    def __post_init__(self) -> None:
        # A saver on has the one it comes after on too (offload is a way of checkpointing).
        for saver in run_savers.SAVERS:
            if saver.after is not None and getattr(self, saver.estimate_field):
                object.__setattr__(self, run_savers.by_name(saver.after).estimate_field, True)
        object.__setattr__(self, "_typed", {})  # field -> the earlier flag it was given as

    def _flag(self, name: str) -> str:
        """The flag a problem of field `name` names: the earlier one the user typed (set by
        `from_options`), else the field's own."""
        return self._typed.get(name) or flag_of(name)

    def check(self, command: str = "estimate") -> None:
        """Every problem of `command`'s options at once, each naming the flag, what was found
        and what would work."""
        shown = {f.name for f in options(command)}
        problems = [text for name, text in self._problems() if name in shown]
        if problems:
            raise BadInputError(f"{command}: " + "; ".join(problems))

    def _problems(self) -> list[tuple[str, str]]:
        """(field, problem) for every rule this settings breaks, whichever command reads it."""
        found = [
            (name, f"{self._flag(name)}: {value!r} is not one of {', '.join(allowed)}")
            for name, value, allowed in (
                ("precision", self.precision, tuple(PRECISIONS)),
                ("weights_dtype", self.weights_dtype, tuple(PRECISIONS)),
                ("method", self.method, METHODS),
                ("optimizer", self.optimizer, OPTIMIZERS),
                ("attention", self.attention, ATTENTIONS),
                ("device_type", self.device_type or DEVICE_TYPES[0], DEVICE_TYPES),
                ("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING_CHOICES),
                ("micro_batch_sizes", self.micro_batch_sizes, SIZE_POLICIES),
                ("distributed", self.distributed, DISTRIBUTED),
            )
            if value not in allowed
        ]
        if str(self.method).lower() == "qlora":  # a name guides use for LoRA on a 4-bit base
            found = [
                (n, t + "; QLoRA is --method lora --load-in-4bit" * (n == "method"))
                for n, t in found
            ]
        for name, hint in (
            ("micro_batch_size", "use 1 or more"),
            ("effective_batch_size", "use 1 or more"),
            ("seq", "use the sequence length in tokens"),
            ("chunk_tokens", f"use e.g. {DEFAULT_CHUNK_TOKENS}"),
            ("tile_tokens", f"use e.g. {DEFAULT_TILE_TOKENS}"),
            ("gpus", "use the number of ranks torchrun starts"),
            ("accumulation", "use 1 for one micro-batch a step"),
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                found.append(
                    (name, f"{self._flag(name)}: {getattr(self, name)} is not positive; {hint}")
                )
        return (
            found
            + self._offload_problems()
            + self._ranks_problems()
            + self._lora_and_budget_problems()
        )

    def _ranks_problems(self) -> list[tuple[str, str]]:
        """One process asked for with several GPUs, and host offload of the model's state
        without the sharding that offers it or a device with memory of its own."""
        found = []
        gpus = self.gpus or 1
        if self.distributed == "none" and gpus > 1:
            found.append(
                (
                    "distributed",
                    f"{self._flag('distributed')}: none (one process) with {flag_of('gpus')} "
                    f"{gpus}; use replicate or fsdp for {gpus} ranks, or --gpus 1",
                )
            )
        if self.fsdp_offload and self.distributed not in ("fsdp", "auto"):
            found.append(
                (
                    "fsdp_offload",
                    f"--fsdp-offload: FSDP2's offload policy needs --distributed fsdp, not "
                    f"{self.distributed}",
                )
            )
        elif self.fsdp_offload and self.device_type in UNIFIED_MEMORY:
            found.append(
                (
                    "fsdp_offload",
                    f"--fsdp-offload: needs a GPU with memory of its own (CUDA); on "
                    f"{self.device_type} host memory is the same memory",
                )
            )
        return found

    def _offload_problems(self) -> list[tuple[str, str]]:
        """Offload on a device whose memory is the host's (refused like the config's
        `activation_checkpointing: offload`); an unresolved device type is not judged yet."""
        if self.device_type not in UNIFIED_MEMORY:
            return []
        why = (
            f"needs a GPU with memory of its own (CUDA); on {self.device_type} host memory is "
            "the same memory, so a copy there frees nothing"
        )
        if not self.offload and self.activation_checkpointing != "offload":
            return []
        flag = self._flag("activation_checkpointing")
        if self.activation_checkpointing != "offload":  # Settings(offload=True): the estimate's
            flag = "--offload"
        said = f"{flag}:" if flag == "--offload" else f"{flag}: 'offload'"
        own = flag_of("activation_checkpointing")
        return [("activation_checkpointing", f"{said} {why}; use {own} on")]

    def _lora_and_budget_problems(self) -> list[tuple[str, str]]:
        found = []
        if self.method == "lora" and self.lora_r < 1:
            found.append(
                ("lora_r", f"--lora-r: {self.lora_r} is not positive; typical ranks are 8 to 64")
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            found.append(("lora_dropout", f"--lora-dropout: {self.lora_dropout} is outside [0, 1)"))
        if self.load_in_4bit and self.method != "lora":
            found.append(
                (
                    "load_in_4bit",
                    "--load-in-4bit: a 4-bit base cannot be trained directly (its weights are "
                    "quantized constants); use it with --method lora (QLoRA)",
                )
            )
        if self.load_in_4bit and self.weights_dtype == "fp32":
            found.append(
                (
                    "weights_dtype",
                    "--weights-dtype: fp32 with --load-in-4bit; the 4-bit base computes in bf16 or "
                    "fp16: pass --weights-dtype bf16 (what QLoRA uses for the layers it does not "
                    "quantize)",
                )
            )
        if self.plan_margin is not None and not 0 < self.plan_margin <= 1:
            found.append(
                (
                    "plan_margin",
                    f"{self._flag('plan_margin')}: {self.plan_margin} is outside (0, 1]; 0.9 means "
                    "90% of the room",
                )
            )
        if self.memory_budget is not None:
            try:
                parse_memory_budget(self.memory_budget)
            except ValueError as exc:  # the config's own words for the same value
                found.append(("memory_budget", f"{self._flag('memory_budget')}: {exc}"))
        return found

    def words(self, term: str) -> str:
        """How this answer names `term` (`WORDS`): in the config's keys or the flags."""
        return WORDS[self.vocabulary][term]

    @property
    def autocast(self) -> bool:
        return self.precision != "fp32"

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    def estimate_fields(self) -> dict[str, Any]:
        """The fields `estimate` reads, for its JSON: its options, and the memory savers they
        come to (`checkpointing`, `offload`, `chunked_loss`)."""
        shown = {f.name: getattr(self, f.name) for f in options("estimate")}
        return shown | {
            s.estimate_field: getattr(self, s.estimate_field) for s in run_savers.SAVERS
        }


PYTHON_ALIASES = {"probe_device": "probe"}
"""Earlier keyword names of the commands' Python functions that were never flags; the earlier
flags' names (`micro_batch`, `memory`, ...) come from each field's `Alias`es."""


def options(command: str) -> list[dataclasses.Field]:
    """The fields `command` shows as options, in declaration order."""
    return [f for f in dataclasses.fields(Settings) if command in f.metadata["commands"]]


def cli_default_of(f: dataclasses.Field, command: str) -> Any:
    """The command-line default of field `f` in `command`."""
    default = f.metadata["cli_default"]
    return default.get(command, f.default) if isinstance(default, dict) else default


def flag_of(name: str) -> str:
    """The command-line flag of a field (the first spelling of a --x/--no-x pair)."""
    meta = next(f.metadata for f in dataclasses.fields(Settings) if f.name == name)
    return (meta["flag"] or "--" + name.replace("_", "-")).split("/")[0]


def aliases(command: str) -> dict[str, tuple[str, Alias | None]]:
    """Earlier keyword -> (the field, its `Alias`) for `command`'s options."""
    found: dict[str, tuple[str, Alias | None]] = {
        old: (new, None) for old, new in PYTHON_ALIASES.items()
    }
    for f in options(command):
        found |= {a.keyword: (f.name, a) for a in aliases_of(f, command)}
    return found


def from_options(command: str, given: dict[str, Any], vocabulary: str = FLAGS) -> Settings:
    """Settings from `command`'s options by field name or an earlier flag's name (`aliases`:
    `memory` for memory_budget; a bare flag's, `checkpointing=True` for the estimate, sets its
    value, and False leaves the option as it is); the options not given take their
    command-line defaults. For the estimate, `activation_checkpointing` becomes the
    checkpointing it counts. `vocabulary`: the words its notes use (`CONFIG` for a config
    file's settings)."""
    earlier = aliases(command)
    shown = {f.name: f for f in options(command)}
    values = {name: cli_default_of(f, command) for name, f in shown.items()}
    typed = {}
    for key, value in given.items():
        name, alias = earlier.get(key, (key, None))
        if name not in shown:
            raise BadInputError(f"{command}: no option {key!r}; the options are {', '.join(shown)}")
        if alias is not None and alias.bare:
            if not value:
                continue
            value = alias.value
        values[name] = value
        if alias is not None:
            typed[name] = alias.flag
        else:
            typed.pop(name, None)
    missing = [f for f in shown.values() if f.metadata["required"] and f.name not in typed | given]
    if missing:
        names = ", ".join(flag_of(f.name) for f in missing)
        raise BadInputError(f"{command}: missing {names}; {missing[0].metadata['help']}")
    if command == "estimate":
        mode = values["activation_checkpointing"]
        values |= {"checkpointing": mode in ("on", "offload"), "offload": mode == "offload"}
    settings = Settings(**values, vocabulary=vocabulary)
    settings._typed.update(typed)
    return settings
