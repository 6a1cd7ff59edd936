"""A fine-tune's memory, estimated before anything loads, with the fine-tune's own settings
(LoRA on its targets with its dropout, its precision, batch, sequence length, optimizer and
savers), not `steadytrain estimate`'s command-line defaults (a full fine-tune): the start-up
line of `steadytrain finetune`, and what `--dry-run` says the run will do (its micro-batch, its
savers, its peak against its `memory_budget`). Where it does not fit, the advisor
(memory/advice.py) says in the config's own keys what would, with the total each gives."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.errors import BadInputError, SteadytrainError
from steadytrain.memory.advice import CONFIG, advise, lines
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS, Estimate, estimate
from steadytrain.memory.model_shape import load_config
from steadytrain.memory.settings import DEFAULT_TILE_TOKENS, DEVICE_TYPES, Settings, from_options
from steadytrain.recipes.finetune_config import BNB_OPTIMIZERS, FinetuneConfig
from steadytrain.run import savers as run_savers
from steadytrain.run.records import Record

ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash"}
PLAN_CHECKPOINTING = {True: "on", False: "off", "auto": "auto", "offload": "offload"}
"""The config's gradient_checkpointing as the plan's --checkpointing."""


def chunk_tokens(config: FinetuneConfig) -> int | None:
    """Tokens per chunk of the loss from the start of the run (None: the plain loss)."""
    value = config.chunked_loss
    if value is True:
        return DEFAULT_CHUNK_TOKENS
    return None if isinstance(value, bool) or value == "auto" else int(value)


def tile_tokens(config: FinetuneConfig) -> int | None:
    """Tokens per piece of the tiled MLP from the start of the run (None: untiled)."""
    value = config.tiled_mlp
    if value is True:
        return DEFAULT_TILE_TOKENS
    return None if isinstance(value, bool) or value == "auto" else int(value)


@dataclass(frozen=True)
class DataLengths:
    """The training data's token lengths, as tokenising found them (recipes/data.py
    `SplitStats`): a batch is padded to its own longest item, so where every sample is shorter
    than max_seq_length, the longest sample, not max_seq_length, is what a step's activations
    cost, and a lower max_seq_length at or above it saves nothing. The fine-tune records them
    (`Record.DATA_LENGTHS`) for the supervisor's advice."""

    longest: int
    """Tokens in the longest item as trained (cut to max_seq_length; with packing, a window)."""
    longest_sample: int
    """Tokens in the longest sample before truncation."""
    p95: int
    samples: int
    max_seq_length: int
    packing: bool

    @classmethod
    def of(cls, stats: Any) -> DataLengths:
        """From the training split's `SplitStats`."""
        return cls(
            stats.longest,
            stats.longest_sample,
            stats.p95,
            stats.samples,
            stats.max_seq_length,
            stats.windows is not None,
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> DataLengths | None:
        try:
            return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError):
            return None

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def seq(self, config: FinetuneConfig) -> int:
        """The sequence length a step of `config` sees at most on this data: max_seq_length,
        or the longest sample where every one is shorter. With packing, the longest window where
        the windows were made at this max_seq_length (else max_seq_length)."""
        if self.packing or config.packing:
            same = self.packing == config.packing and self.max_seq_length == config.max_seq_length
            return min(config.max_seq_length, self.longest) if same else config.max_seq_length
        return max(2, min(config.max_seq_length, self.longest_sample))

    def said(self, config: FinetuneConfig) -> str:
        """One line for the console: the lengths, and the length the estimate prices."""
        seq = self.seq(config)
        head = (
            f"data: the longest training {'window' if config.packing else 'sample'} is "
            f"{self.longest_sample if not config.packing else self.longest:,} tokens (95 % of "
            f"the samples at most {self.p95:,})"
        )
        if seq < config.max_seq_length:
            return (
                f"{head}, under max_seq_length {config.max_seq_length:,}: the estimate prices "
                f"activations at {seq:,} tokens, what a batch is padded to at most; a "
                f"max_seq_length at or above {seq:,} saves nothing"
            )
        return f"{head}: the estimate prices activations at max_seq_length {seq:,}"


def data_lengths(config: FinetuneConfig) -> tuple[DataLengths | None, str]:
    """The training data's lengths for `--dry-run`, tokenised as the run tokenises them, with
    the tokenizer this machine has (a model folder's, or a hub model's in the local cache:
    nothing is downloaded). None and why where the data or the tokenizer cannot be read here:
    the estimate then prices max_seq_length, as an upper bound."""
    if config.data_file_problems() or config.model_folder_problems():
        return None, "the data or the tokenizer cannot be read (above)"
    from steadytrain.recipes.data import load_datasets
    from steadytrain.recipes.model import resolve_model_path

    try:
        from transformers import AutoTokenizer

        path = resolve_model_path(config.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001  any tokenizer this machine cannot load: no lengths
        return None, "the tokenizer is not on this machine yet (the run downloads it)"
    try:
        _, _, stats = load_datasets(
            config.train_file,
            tokenizer,
            max_seq_length=config.max_seq_length,
            eval_split=config.eval_split,
            packing=config.packing,
            seed=config.seed,
        )
    except SteadytrainError as exc:
        return None, f"the training data did not tokenise ({str(exc).splitlines()[0]})"
    return DataLengths.of(stats.train), ""


def priced_seq(config: FinetuneConfig, lengths: DataLengths | None) -> int:
    """The sequence length the estimate prices for `config`: max_seq_length, or the data's
    longest where `lengths` (None: not tokenised yet) shows every sample shorter."""
    return config.max_seq_length if lengths is None else lengths.seq(config)


def loss_for(config: FinetuneConfig):
    """The fine-tune's loss as its `chunked_loss` and `fused_loss` say: chunked from the start
    (true, or a number of tokens), never (false: the planner and the ladder find no chunked mode
    to turn on), or when the planner or the ladder turns it on (auto)."""
    from steadytrain.recipes.data import LMLoss

    if config.chunked_loss is not False:
        return LMLoss(chunk_tokens(config), fused=config.fused_loss)

    class PlainLMLoss(LMLoss):
        """`chunked_loss: false`: no chunked mode to switch to."""

        def can_chunk(self, model: Any) -> bool:
            return False

    return PlainLMLoss(None, fused=config.fused_loss)


def estimate_settings(config: FinetuneConfig, lengths: DataLengths | None = None) -> dict[str, Any]:
    """`steadytrain estimate`'s options that describe `config` at its start, its sequence at
    the data's real lengths where they are known (`priced_seq`)."""
    targets = config.lora.target_modules
    precision = config.precision if config.precision in ("fp32", "bf16", "fp16") else "fp32"
    optimizer = (
        "adamw8bit"
        if config.optim in BNB_OPTIMIZERS
        else "sgd"
        if config.optim == "sgd"
        else "adamw"
    )
    chunk, tile = chunk_tokens(config), tile_tokens(config)
    return {
        "micro_batch_size": config.per_device_train_batch_size,
        "seq": priced_seq(config, lengths),
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
        "chunked_loss": chunk is not None,
        "chunk_tokens": chunk or DEFAULT_CHUNK_TOKENS,
        "tiled_mlp": tile is not None,
        "tile_tokens": tile or DEFAULT_TILE_TOKENS,
        # as the run compiles its layers; 'auto' is resolved for the device the run trains on
        "compiled": None if config.torch_compile == "auto" else config.torch_compile,
    }


def base_load_settings(config: FinetuneConfig, device_type: str | None) -> dict[str, Any]:
    """How the base loads on `device_type` as the estimate's options (`load_in_4bit`,
    `weights_dtype`), as the run decides it (recipes/model.py `plan_base_load`), its refusals in
    the config's keys: 4-bit where it cannot run (MPS, CPU) is refused, exit 2, unless
    `quantization.fallback` names the dtype to load in instead; a 4-bit base with fp32 compute
    (neither `bf16` nor `fp16`) has no estimate (a 4-bit base computes in bf16 or fp16). None
    for `device_type`: this machine's, decided by the caller once it knows it."""
    if not config.quantization.load_in_4bit:
        return {}
    if device_type is not None and device_type != "cuda":
        from steadytrain.recipes.model import plan_base_load

        load = plan_base_load(config, device_type, "fp32", bnb_available=False)  # refuses
        fallback = str(config.quantization.fallback)
        if not load.load_in_4bit:
            return {"load_in_4bit": False, "weights_dtype": fallback}
    if estimate_settings(config)["precision"] == "fp32":
        raise BadInputError(
            "quantization.load_in_4bit: true with fp32 compute (`bf16` and `fp16` false); a 4-bit "
            "base computes in bf16 or fp16: set `bf16: true` (what QLoRA uses for the layers it "
            "does not quantize), or `fp16: true`"
        )
    return {}


def _settings(
    config: FinetuneConfig, device_type: str, lengths: DataLengths | None = None, **options: Any
) -> Settings:
    loaded = base_load_settings(config, device_type)
    given = {**estimate_settings(config, lengths), **loaded, **options}
    settings = from_options("estimate", given, CONFIG)  # its notes in the config's keys
    settings.check("estimate")
    fused = config.fused_loss and settings.chunked_loss and _fused_runs(device_type)
    compiled = options.get("compiled", settings.compiled)
    compiled = _compiles(config, device_type) if compiled is None else compiled
    return dataclasses.replace(
        settings,
        device_type=device_type,
        offload=config.gradient_checkpointing == "offload" and device_type == "cuda",
        fused_loss=fused,
        compiled=compiled,
    )


def _compiles(config: FinetuneConfig, device_type: str) -> bool:
    """Whether the run compiles its decoder layers on `device_type`, as the engine decides it
    from `torch_compile` (its 'auto': on CUDA where Triton is installed): the estimate prices
    what the run keeps (compiled layers keep less for backward, memory/compiled.py)."""
    from steadytrain.engine.compiling import compile_wanted

    return compile_wanted(config.torch_compile, device_type)


def _fused_runs(device_type: str) -> bool:
    from steadytrain.memory.fused_loss import fused_available

    return fused_available(device_type)


def estimate_finetune(
    config: FinetuneConfig,
    device_type: str,
    budget: int | None,
    lengths: DataLengths | None = None,
    **options: Any,
) -> Estimate:
    """The estimate for `config` on a `device_type` device against `budget` bytes (None: no
    verdict), at the data's `lengths` where known; `options` override estimate settings
    (memory_budget, device_type)."""
    settings = _settings(config, device_type, lengths, **options)
    result = estimate(
        load_config(config.model_name_or_path), settings, model_name=config.model_name_or_path
    )
    result.budget = budget
    return result


def advice(config: FinetuneConfig, result: Estimate) -> list[str]:
    """The advisor's lines for a fine-tune estimate that does not fit, in the config's keys."""
    if result.fits is not False or result.budget is None:
        return []
    found = advise(
        load_config(config.model_name_or_path),
        result.settings,
        result.budget,
        CONFIG,
        config.gradient_accumulation_steps,
        current=result,
    )
    return lines(found, CONFIG)


def memory_line(
    config: FinetuneConfig,
    device_type: str,
    budget: int | None,
    lengths: DataLengths | None = None,
) -> str:
    """The start of a fine-tune: the estimated need at its micro-batch against the budget,
    before the base loads (the planner does this itself for micro_batch_size: auto), at the
    data's `lengths`, and where it does not fit, what would (the advisor, in the config's
    keys)."""
    from steadytrain.run.env import ENV_MAX_MICRO_BATCH, max_micro_batch

    micro, cap = config.per_device_train_batch_size, max_micro_batch()
    capped = cap is not None and cap < micro
    micro = cap if capped else micro  # the supervisor's cap after a memory kill, as the run
    try:
        result = estimate_finetune(config, device_type, budget, lengths, micro_batch_size=micro)
    except SteadytrainError as exc:
        return f"memory: no estimate before loading ({str(exc).splitlines()[0]})"
    if result.total is None or budget is None:
        return "memory: no estimate before loading (this architecture's activations are unknown)"
    head = (
        f"memory: estimated {format_bytes(result.total)} at micro-batch {micro}"
        + (f" ({ENV_MAX_MICRO_BATCH}={cap})" if capped else "")
        + f" against a budget of {format_bytes(budget)}"
    )
    if result.fits:
        return f"{head}: fits"
    found = advice(config, result)
    what = (
        "; what would change it (the estimate at each): " + "; ".join(found)
        if found
        else "; no setting of this config lowers it enough: a smaller model or more memory"
    )
    return (
        f"{head}: does not fit; out-of-memory will "
        + ("halve the micro-batch" if micro > 1 else "turn on a memory saver that is left")
        + f"{what} "
        "(steadytrain finetune --dry-run shows the breakdown)"
    )


def last_rung(
    config: FinetuneConfig,
    device_type: str,
    budget: int | None,
    lengths: DataLengths | None = None,
) -> Estimate:
    """The estimate where the out-of-memory ladder ends: micro-batch 1 with every saver this
    config lets the run use (checkpointing unless `gradient_checkpointing: false`, on CUDA its
    inputs offloaded too, the chunked loss unless `chunked_loss: false`, the tiled MLP unless
    `tiled_mlp: false`), against `budget`."""
    checkpointing = config.gradient_checkpointing is not False
    chunked = config.chunked_loss is not False
    settings = dataclasses.replace(
        _settings(config, device_type, lengths, checkpointing=checkpointing, chunked_loss=chunked),
        micro_batch_size=1,
        tiled_mlp=config.tiled_mlp is not False,
    )
    if checkpointing and device_type == "cuda":
        settings = dataclasses.replace(settings, offload=True)
    result = estimate(
        load_config(config.model_name_or_path), settings, model_name=config.model_name_or_path
    )
    result.budget = budget
    return result


def refusal(
    config: FinetuneConfig,
    device_type: str,
    budget: int | None,
    lengths: DataLengths | None = None,
) -> str | None:
    """Why the run stops before loading anything (exit 3), or None: the estimate at the
    ladder's last rung (`last_rung`) is over the budget, so no micro-batch and no saver keeps
    the run within `memory_budget`, the memory the process may use in total. The run and its
    `--dry-run` both ask this, so the two give one answer. None where no estimate can be made
    (an unknown architecture) or the budget is unknown."""
    if budget is None:
        return None
    try:
        result = last_rung(config, device_type, budget, lengths)
    except SteadytrainError:
        return None
    if result.total is None or result.total <= budget:
        return None
    found = advise(
        load_config(config.model_name_or_path),
        result.settings,
        budget,
        CONFIG,
        config.gradient_accumulation_steps * config.per_device_train_batch_size,
        current=result,
    )
    changes = lines(found, CONFIG)
    what = (
        "what would change it (the estimate at each): "
        + "; ".join([*changes, "or a larger `memory_budget`"])
        if changes
        else "no setting of this config lowers the estimate; what would change it: a smaller "
        "model, or a larger `memory_budget`"
    )
    return (
        f"memory_budget: the estimate at micro-batch 1 with every memory saver this config "
        f"allows is {format_bytes(result.total)}, over the budget of {format_bytes(budget)} "
        f"(memory_budget: {config.to_train_config().memory_budget}), so no micro-batch keeps "
        f"the run within it; {what}"
    )


def run_advice(run_dir: Any, in_force: list[str]) -> list[str]:
    """The supervisor's last word after the OS killed a fine-tune at micro-batch 1 with every
    saver in force (`in_force`, by the ladder's names): the advisor on the run's own config
    (RUN_DIR/training_config.json) at micro-batch 1 with those savers, at the sequence length
    its data really has (its data_lengths event), against the budget the run had (its
    fit_start event), in the config's keys: only the changes that make it fit. Where
    the estimate fits already, no setting changes the verdict: the memory that ran short was
    held by other programs, and that is what it says. Empty where the run directory holds no
    fine-tune config, or no budget can be found."""
    import json
    from pathlib import Path

    from steadytrain.run import files as run_files
    from steadytrain.telemetry.files import read_jsonl

    folder = Path(run_dir)
    written = folder / run_files.TRAINING_CONFIG
    if not written.is_file():
        return []
    config = FinetuneConfig.from_dict(json.loads(written.read_text()), source=str(written))
    events = read_jsonl(folder / run_files.EVENTS)
    starts = [e for e in events if e.get("event") == Record.FIT_START]
    start = starts[-1] if starts else {}
    budget = start.get("budget")
    if budget is None:
        spec = config.to_train_config().budget_bytes_or_fraction()
        budget = spec if isinstance(spec, int) else None
    device_type = str(start.get("device") or config.to_train_config().device).split(":")[0]
    if budget is None or device_type not in DEVICE_TYPES:
        return []
    lengths = [e for e in events if e.get("event") == Record.DATA_LENGTHS]
    data = DataLengths.from_record(lengths[-1]) if lengths else None
    settings = dataclasses.replace(
        _settings(config, device_type, data),  # at the data's real lengths, as the run priced
        micro_batch_size=1,
        checkpointing=config.gradient_checkpointing in (True, "offload"),
        offload=False,
        chunked_loss=chunk_tokens(config) is not None,
    )
    killed_with = {x.estimate_field: True for x in run_savers.SAVERS if x.name in in_force}
    settings = dataclasses.replace(settings, **killed_with)  # the registry's savers in force
    result = estimate(load_config(config.model_name_or_path), settings)
    result.budget = budget
    if result.total is None:
        return []
    if result.total <= budget:  # the run's own need fits: what ran short was held by others
        return [
            f"at micro-batch 1 the estimate is {format_bytes(result.total)}, within the budget "
            f"of {format_bytes(budget)}, so the memory that ran short was held outside this run: "
            "close other programs that hold memory, or set a lower `memory_budget` (what the "
            "machine has free with them open) so the run plans within it; no setting of this "
            "config changes the estimate's verdict"
        ]
    found = advise(
        load_config(config.model_name_or_path),
        settings,
        budget,
        CONFIG,
        config.gradient_accumulation_steps * config.per_device_train_batch_size,
        current=result,
    )
    head = (
        f"at micro-batch 1 the estimate is {format_bytes(result.total)} of {format_bytes(budget)}"
    )
    fitting = [a for a in found if a.fits]
    if not fitting:
        return [
            f"{head}; no setting of this config alone or combined makes it fit: a smaller model"
        ]
    return [head, *lines(fitting, CONFIG)]


# -- what the run will do (--dry-run) ------------------------------------------------------


@dataclass
class Target:
    """Where the run trains and the budget it gets, as the run itself resolves them."""

    device_type: str
    budget: int | None
    source: str


def target(config: FinetuneConfig) -> Target:
    """The run's device type and budget: its `device` and `memory_budget` resolved on this
    machine as the run resolves them; a device type this machine lacks (planning for a Mac on
    another machine) takes `memory_budget` as given (a size: its bytes; auto or a fraction:
    unknown there)."""
    from steadytrain.device import resolve_device
    from steadytrain.errors import DeviceUnavailableError

    train = config.to_train_config()
    spec = train.budget_bytes_or_fraction()
    named = train.device.split(":")[0]
    written = f"memory_budget: {train.memory_budget}"
    try:
        device = resolve_device(train.device, spec)
    except DeviceUnavailableError:
        if named not in DEVICE_TYPES:
            raise
        budget = spec if isinstance(spec, int) else None
        return Target(named, budget, f"{written}, for a {named} device (not this machine's)")
    source = (
        written if isinstance(spec, int) else f"{written}: {device.torch_device} ({device.name})"
    )
    return Target(device.type, device.budget, source)


@dataclass
class RunPlan:
    """What the run will do with its memory: the micro-batch and savers at its start and the
    estimated total against its budget."""

    micro_batch_size: int
    accumulation: int
    checkpointing: bool | str
    chunked_loss: int | None
    total: int | None
    budget: int | None
    how: str
    """How the micro-batch is decided ("set by per_device_train_batch_size", "planned ...")."""
    later: list[str]
    """What the run may still turn on (the ladder's savers with auto)."""
    tiled_mlp: int | None = None
    """Tokens per piece of the tiled MLP at the start (None: untiled)."""

    @property
    def fits(self) -> bool | None:
        if self.total is None or self.budget is None:
            return None
        return self.total <= self.budget

    def describe(self) -> list[str]:
        checkpointing = {
            True: "on",
            False: "off",
            "offload": "on, its kept inputs in host memory",
        }[self.checkpointing]
        chunked = f"on ({self.chunked_loss} tokens a chunk)" if self.chunked_loss else "off"
        lines = [
            f"micro-batch {self.micro_batch_size} × {self.accumulation} accumulation ({self.how})",
            f"savers: activation checkpointing {checkpointing}; chunked loss {chunked}"
            + (f"; tiled MLP on ({self.tiled_mlp} tokens a piece)" if self.tiled_mlp else "")
            + (f"; later, if memory runs out: {', '.join(self.later)}" if self.later else ""),
        ]
        if self.total is not None and self.budget is not None:
            verdict = "fits" if self.fits else "does not fit"
            lines.append(
                f"peak: estimated {format_bytes(self.total)} of {format_bytes(self.budget)}: "
                f"{verdict}"
            )
        elif self.total is not None:
            lines.append(f"peak: estimated {format_bytes(self.total)} (budget unknown)")
        return lines


def run_plan(
    config: FinetuneConfig, where: Target, lengths: DataLengths | None = None
) -> tuple[RunPlan, Estimate]:
    """What the run will do at its start, and the estimate of it at the data's `lengths`: the
    config's micro-batch and savers, or, with micro_batch_size: auto, the plan from the
    estimate (the run itself probes on the device, on CUDA measuring; the analytic plan is its
    preview)."""
    train = config.to_train_config()
    accumulation = config.gradient_accumulation_steps
    later = []
    if config.gradient_checkpointing == "auto":
        later.append("activation checkpointing (gradient_checkpointing: auto)")
    if config.chunked_loss == "auto":
        later.append("the chunked loss (chunked_loss: auto)")
    if config.tiled_mlp == "auto":
        later.append("the tiled MLP (tiled_mlp: auto)")
    if train.micro_batch_size != "auto":
        result = estimate_finetune(config, where.device_type, where.budget, lengths)
        plan = RunPlan(
            config.per_device_train_batch_size,
            accumulation,
            config.gradient_checkpointing if config.gradient_checkpointing != "auto" else False,
            chunk_tokens(config),
            result.total,
            where.budget,
            "per_device_train_batch_size; out-of-memory halves it"
            if config.per_device_train_batch_size > 1
            else "per_device_train_batch_size; the smallest: out-of-memory turns on a memory "
            "saver that is left, if any",
            later,
            tile_tokens(config),
        )
        return plan, result
    return _auto_plan(config, where, later, lengths)


def longest_length(config: FinetuneConfig, where: Target) -> str | None:
    """The longest max_seq_length one sample of which fits the run's budget with every saver
    the config allows (`config_plan.longest_seq`), as the dry-run says it; None where the budget
    or the model's activations are unknown."""
    from steadytrain.memory.config_plan import longest_seq, longest_seq_line

    if where.budget is None:
        return None
    try:
        settings = dataclasses.replace(
            _settings(config, where.device_type),
            activation_checkpointing=PLAN_CHECKPOINTING[config.gradient_checkpointing],
        )
        model = load_config(config.model_name_or_path)
        chunked = config.chunked_loss is not False
        tiled = config.tiled_mlp is not False
        found = longest_seq(model, settings, where.budget, chunked=chunked, tiled=tiled)
    except SteadytrainError:  # the plan above already said what stands in the way
        return None
    return longest_seq_line(found, where.budget, "max_seq_length")


def _auto_plan(
    config: FinetuneConfig, where: Target, later: list[str], lengths: DataLengths | None
) -> tuple[RunPlan, Estimate]:
    from steadytrain.memory.analytic import Analytic
    from steadytrain.memory.config_plan import analytic_plan

    base = _settings(config, where.device_type, lengths)
    effective = config.effective_batch_size // config.world_size
    settings = dataclasses.replace(
        base,
        effective_batch_size=effective,
        activation_checkpointing=PLAN_CHECKPOINTING[config.gradient_checkpointing],
        micro_batch_sizes=config.to_train_config().micro_batch_sizes,
    )
    model = load_config(config.model_name_or_path)
    chunk = chunk_tokens(config)
    chunked = None if config.chunked_loss == "auto" else chunk is not None
    tile = tile_tokens(config)
    tiled = None if config.tiled_mlp == "auto" else tile is not None
    if where.budget is None:
        result = estimate(model, base, model_name=config.model_name_or_path)
        plan = RunPlan(1, effective, False, chunk, result.total, None, "budget unknown", later)
        return plan, result
    chosen = analytic_plan(
        Analytic(model, settings, strict=True), settings, where.budget, chunked, tiled
    )
    micro = chosen.micro_batch_size
    used = dataclasses.replace(
        base,
        micro_batch_size=micro,
        checkpointing=bool(chosen.checkpointing),
        offload=chosen.offload,
        chunked_loss=chosen.chunked_loss,
        tiled_mlp=chosen.tiled_mlp,
    )
    result = estimate(model, used, model_name=config.model_name_or_path)
    result.budget = where.budget
    plan = RunPlan(
        micro,
        chosen.accumulation,
        chosen.activation_checkpointing,
        (chunk or DEFAULT_CHUNK_TOKENS) if chosen.chunked_loss else None,
        result.total,
        where.budget,
        "micro_batch_size: auto, planned from the estimate; the run measures on the device first",
        [item for item in later if not _in_force(item, chosen)],
        (tile or DEFAULT_TILE_TOKENS) if chosen.tiled_mlp else None,
    )
    return plan, result


def _in_force(item: str, chosen: Any) -> bool:
    return (
        ("checkpointing" in item and chosen.checkpointing)
        or ("chunked" in item and chosen.chunked_loss)
        or ("tiled" in item and chosen.tiled_mlp)
    )


__all__ = [
    "DataLengths",
    "RunPlan",
    "Target",
    "advice",
    "base_load_settings",
    "chunk_tokens",
    "data_lengths",
    "estimate_finetune",
    "estimate_settings",
    "last_rung",
    "loss_for",
    "memory_line",
    "priced_seq",
    "refusal",
    "run_advice",
    "run_plan",
    "target",
]
