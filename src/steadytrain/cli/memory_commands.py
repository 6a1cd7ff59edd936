"""`steadytrain estimate` and `steadytrain plan`: the options come from the settings dataclass
(`cli/options.py`); these functions resolve the target machine, call the model code in
`steadytrain.memory`, and print its result as a table or as JSON.

`estimate_command` and `plan_command` are also the commands' Python form: keyword arguments by
field name (`micro_batch_size`, `memory_budget`, ...) or by the commands' earlier names
(`micro_batch`, `memory`, ...)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from steadytrain._units import budget_spec, format_bytes, format_count
from steadytrain.cli.options import settings_command
from steadytrain.cli.readable import readable_console
from steadytrain.errors import BadInputError
from steadytrain.memory.settings import Settings, from_options

if TYPE_CHECKING:
    from steadytrain.memory.estimate import Estimate
    from steadytrain.memory.plan import Plan


def register(app: typer.Typer) -> None:
    """Add `estimate` and `plan` to the command line."""
    settings_command(
        app,
        "estimate",
        "Memory breakdown for training MODEL: exit 0 fits, 3 does not fit, 2 bad input.",
        "Print the estimate as JSON.",
        estimate_command,
    )
    settings_command(
        app,
        "plan",
        "Choose micro-batch, accumulation, checkpointing and chunked loss for MODEL: exit 0, 3 "
        "nothing fits.",
        "Print the plan as JSON.",
        plan_command,
    )


def estimate_command(model: str, *, json_output: bool = False, console=None, **given: Any) -> int:
    """`steadytrain estimate`: print the breakdown; exit 0 fits or unknown, 3 does not fit. What
    would fit is worked out by the advisor (memory/advice.py): in the flags' words for a model,
    in the config's for a fine-tune config file."""
    from steadytrain.cli.finetune_commands import is_finetune_file
    from steadytrain.memory.advice import CONFIG, FLAGS, WORDS
    from steadytrain.memory.estimate import estimate, load_config

    vocabulary, accumulation, own, lengths = FLAGS, 1, {}, None
    if is_finetune_file(model):  # the fine-tune's own settings, not a full fine-tune's
        from steadytrain.recipes.finetune_config import FinetuneConfig
        from steadytrain.recipes.finetune_memory import (
            base_load_settings,
            data_lengths,
            estimate_settings,
        )

        config = FinetuneConfig.load(model)
        own = _run_target(config, given)
        device_type = given.get("device_type") or own.get("device_type")
        if device_type is None and config.quantization.load_in_4bit:
            device_type = resolve_target(from_options("estimate", {}))[2].device_type
        loaded = base_load_settings(config, device_type)
        lengths, _ = data_lengths(config)  # priced at what a batch is padded to, as the run
        given = {**given, **estimate_settings(config, lengths), **loaded, **own}
        model = config.model_name_or_path
        vocabulary, accumulation = CONFIG, config.gradient_accumulation_steps
    settings = from_options("estimate", given, vocabulary)
    settings.check("estimate")
    budget, source, resolved = resolve_target(
        settings, "memory_budget:" if "memory_budget" in own else "--memory-budget"
    )
    if vocabulary is CONFIG and config.gradient_checkpointing == "offload":
        # the run offloads the kept inputs where the device has memory of its own, as the
        # fine-tune's plan prices it (recipes/finetune_memory.py `_settings`)
        on_cuda = resolved.device_type == "cuda"
        resolved = dataclasses.replace(resolved, offload=resolved.offload or on_cuda)
    model_config = load_config(model)
    result = estimate(model_config, resolved, model_name=model, budget=budget)
    result.budget, result.budget_source = budget, source
    sized = settings.memory_budget is not None and isinstance(
        budget_spec(settings.memory_budget), int
    )
    if sized and settings.device_type is None:  # a size may be another machine's
        words = CONFIG if "memory_budget" in own else FLAGS  # where the size was written
        result.notes.append(
            f"planned for a {resolved.device_type} device (this machine's); "
            f"{WORDS[words]['device']} when the other machine differs"
        )
    if lengths is not None:
        result.notes.append(lengths.said(config).removeprefix("data: "))
    advice = advice_for(model_config, result, vocabulary, accumulation)
    more = more_gpus(model_config, result)
    if json_output:
        found = {**result.to_dict(), "advice": advice}
        found["fewest_gpus"] = [
            {
                "gpus": m.gpus,
                "distributed": "fsdp",
                "total_bytes_per_rank": m.total,
                "savers": [k.flags for k in m.savers],
                "line": m.describe(),
            }
            for m in more
        ]
        print(json.dumps(found, indent=2))
    else:
        render_estimate(result, console, advice, [m.describe() for m in more])
    return 3 if result.fits is False else 0


def more_gpus(model_config: Any, result: Estimate) -> list:
    """Where the estimate does not fit: the fewest GPUs on which it would under fsdp, as it is
    and with the savers (memory/advice.py `fewest_gpus`); [] where it fits or is unknown."""
    from steadytrain.memory.advice import fewest_gpus

    if result.fits is not False or result.budget is None:
        return []
    return fewest_gpus(model_config, result.settings, result.budget)


def _run_target(config: Any, given: dict[str, Any]) -> dict[str, Any]:
    """A fine-tune config's own budget and device where the command line gives none: its
    `memory_budget` (a size, or a fraction resolved as --memory-budget's; `auto` is the
    command's own default), and its `device` where it names a device type."""
    from steadytrain.memory.settings import DEVICE_TYPES

    train = config.to_train_config()
    found: dict[str, Any] = {}
    if given.get("memory_budget", given.get("memory")) is None and train.memory_budget != "auto":
        found["memory_budget"] = train.memory_budget
    device = train.device.split(":")[0]
    if given.get("device_type") is None and device in DEVICE_TYPES:
        found["device_type"] = device
    return found


def advice_for(
    model_config: Any, result: Estimate, vocabulary: str, accumulation: int = 1
) -> list[str]:
    """The advisor's lines for an estimate that does not fit (none for one that fits)."""
    from steadytrain.memory.advice import advise, lines

    if result.fits is not False or result.budget is None:
        return []
    found = advise(
        model_config, result.settings, result.budget, vocabulary, accumulation, current=result
    )
    return lines(found, vocabulary)


def plan_command(
    model: str,
    effective_batch_size: int | None = None,
    *,
    json_output: bool = False,
    console=None,
    **given: Any,
) -> int:
    """`steadytrain plan`: the analytic estimate, then (on CUDA by default, elsewhere with
    --probe) a probe of the model built from its config with random weights on this device,
    then the plan. Exit 0 with a plan, 3 when nothing fits, 2 bad input."""
    from steadytrain.cli.finetune_commands import is_finetune_file
    from steadytrain.engine.side_pass import trial_pass
    from steadytrain.memory.config_plan import longest_seq, longest_seq_line, plan_for_config
    from steadytrain.memory.estimate import load_config

    if is_finetune_file(model):  # plan takes a model; a fine-tune config's plan is its dry-run
        from steadytrain.recipes.finetune_config import load_config_file

        base = load_config_file(Path(model)).get("model_name_or_path")
        raise BadInputError(
            f"model: {model} is a fine-tune config, not a model folder; its plan is printed by "
            f"`steadytrain finetune --config {model} --dry-run` (the planner's with "
            f"micro_batch_size: auto), its memory by `steadytrain estimate {model}`; or give "
            "plan the model's folder: "
            + (
                f"`steadytrain plan {base} --effective-batch N`"
                if isinstance(base, str)
                else "its model_name_or_path"
            )
        )
    if effective_batch_size is not None:
        given["effective_batch_size"] = effective_batch_size
    settings = from_options("plan", given)
    settings.check("plan")
    budget, source, resolved = resolve_target(settings)
    resolved.check("plan")
    model_config = load_config(model)
    resolved, share = _rank_share(model_config, resolved, budget)
    chosen = plan_for_config(model_config, resolved, budget, compile_before_plan, trial_pass)
    chosen.fsdp_offload = bool(resolved.fsdp_offload)  # priced so (--fsdp-offload)
    chosen.reasons.insert(0, f"budget from {source}")
    if share:
        chosen.reasons.insert(1, share)
    if (resolved.gpus or 1) > 1:  # planned as one rank's share: said for the group
        from steadytrain.memory.plan_record import with_ranks

        effective, gpus = settings.effective_batch_size, resolved.gpus
        chosen.reasons[:] = with_ranks(chosen.reasons, chosen.micro_batch_size, effective, gpus)
    advice = (
        [] if chosen.predicted_peak is not None else _plan_advice(model_config, resolved, budget)
    )
    longest = longest_seq(model_config, resolved, budget)
    if json_output:
        gpus = resolved.gpus or 1
        ranks = {"world_size": gpus, "distributed": resolved.distributed, "per_rank": gpus > 1}
        event = {**chosen.to_event(), **ranks, "advice": advice, "longest_seq": longest}
        print(json.dumps(event, indent=2, default=str))
    else:
        ranks = (resolved.gpus or 1, settings.effective_batch_size)
        render_plan(chosen, settings.seq, console, ranks=ranks)
        line = longest_seq_line(longest, budget)
        if line:
            (console or readable_console()).print(line, markup=False, highlight=False)
        if chosen.predicted_peak is None:
            render_advice(advice, console)
    return 3 if chosen.predicted_peak is None else 0


def _rank_share(model_config: Any, settings: Settings, budget: int | None) -> tuple[Settings, str]:
    """On several GPUs: the settings of one rank's plan (its share of the effective batch,
    `distributed: auto` resolved as a run resolves it, the estimate alone: a probe is one
    process, which cannot hold a rank's shard), and the reason that says so; as they are and
    "" on one."""
    from steadytrain.memory.estimate import estimate

    gpus = settings.gpus or 1
    if gpus <= 1:
        return settings, ""
    if settings.probe:
        raise BadInputError(
            f"--probe: a probe measures one process, and --gpus {gpus} plans each of {gpus} "
            "ranks (a shard of the model under fsdp); leave --probe out for the plan from the "
            "estimate per rank"
        )
    share = -(-settings.effective_batch_size // gpus)
    one = dataclasses.replace(settings, micro_batch_size=1, probe=False)
    mode = estimate(model_config, one, budget=budget)
    settings = dataclasses.replace(
        one, effective_batch_size=share, distributed=mode.settings.distributed
    )
    return settings, (
        f"{gpus} ranks ({mode.distributed}; {mode.ranks.why}): each plans its share of the "
        f"effective batch, {share} of {one.effective_batch_size}, from the estimate per rank "
        "(a probe is one process)"
    )


def _plan_advice(model_config: Any, settings: Settings, budget: int | None) -> list[str]:
    """When nothing fits: the advisor on the smallest run the plan tried (one sample,
    checkpointed unless --checkpointing off, the chunked loss), in the flags' words."""
    from steadytrain.memory.advice import FLAGS
    from steadytrain.memory.estimate import estimate

    if budget is None:
        return []
    ckpt = settings.activation_checkpointing
    smallest = dataclasses.replace(
        settings,
        micro_batch_size=1,
        checkpointing=ckpt != "off",
        offload=ckpt == "offload",
        chunked_loss=True,
        tiled_mlp=True,
    )
    result = estimate(model_config, smallest)
    result.budget = budget
    more = [m.describe() for m in more_gpus(model_config, result)]
    return advice_for(model_config, result, FLAGS, settings.effective_batch_size) + more


def compile_before_plan(model, device_type: str):
    """What a run does before its plan when it compiles (trainer/fit.py): the layers compiled in
    place (`compile_blocks`; refused, exit 2, where inductor cannot build kernels), and the
    context in which the probe runs them eagerly (`eager_stance`). Where torch has no such
    context the layers stay eager: nothing runs after the plan here."""
    from steadytrain.engine.compiling import compile_blocks, eager_stance

    eager = eager_stance()
    if eager is not None:
        compile_blocks(model, device_type)
    return eager


def resolve_target(
    settings: Settings, label: str = "--memory-budget"
) -> tuple[int | None, str, Settings]:
    """(budget, where it comes from, the settings for the target's device type and whether it
    compiles). --memory-budget wins over this device's budget: a size as it is (planning for
    another machine), a fraction or auto of the target device's usable memory, as a run resolves
    its memory_budget (`_budget_device`); --device-type over this device's type;
    --compile/--no-compile over a run's `compile: auto` on the target's device type
    (`compile_wanted`: CUDA with Triton installed here); --fused-loss/--no-fused-loss over what a
    run's chunked loss computes there (the fused kernel on CUDA where Liger Kernel is installed
    here). `label` names the budget's source: the flag, or a fine-tune config's key."""
    from steadytrain.device import resolve_device
    from steadytrain.engine.compiling import compile_wanted
    from steadytrain.memory.fused_loss import fused_available

    memory, device_type = settings.memory_budget, settings.device_type
    settings = dataclasses.replace(settings, gpus=settings.gpus or ranks_from_env())
    spec = None if memory is None else budget_spec(memory)
    if isinstance(spec, float):
        device = _budget_device(device_type, spec, f"{label} {memory}")
    else:
        device = None if spec is not None and device_type is not None else resolve_device("auto")
    target = device_type or device.type
    compiled, fused = settings.compiled, settings.fused_loss
    resolved = dataclasses.replace(
        settings,
        device_type=target,
        compiled=compile_wanted("auto", target) if compiled is None else compiled,
        fused_loss=fused_available(target) if fused is None else fused,
    )
    if isinstance(spec, int):
        return spec, f"{label} {memory}", resolved
    if spec is not None:
        usable = format_bytes(device.usable)
        return (
            device.budget,
            f"{label} {memory}: {spec:g} of usable memory ({usable}) on {device.torch_device} "
            f"({device.name})",
            resolved,
        )
    return device.budget, f"{device.torch_device} budget ({device.name})", resolved


def ranks_from_env() -> int:
    """The ranks of the torchrun run this command is called in (WORLD_SIZE; torchrun sets it
    in every rank), else 1."""
    import os

    found = os.environ.get("WORLD_SIZE", "").strip()
    if not found:
        return 1
    try:
        world = int(found)
    except ValueError:
        world = 0
    if world < 1:
        raise BadInputError(
            f"WORLD_SIZE: {found!r} is not a whole number of ranks (torchrun sets it); unset it, "
            "or pass --gpus N"
        )
    return world


def _budget_device(device_type: str | None, fraction: float, given: str):
    """The device whose usable memory a fraction (or auto) of it is taken of: the target device
    type on this machine, as a run resolves its memory_budget; refused, exit 2, where this
    machine has no such device (it cannot say how much memory another machine has)."""
    from steadytrain.device import resolve_device
    from steadytrain.errors import DeviceUnavailableError

    try:
        device = resolve_device(device_type or "auto", fraction)
    except DeviceUnavailableError as exc:
        raise BadInputError(
            f"{given}: a fraction of usable memory is taken of the {device_type} device the run "
            f"will train on, and this machine has none to measure ({exc}); give the memory the "
            "run may use there as a size, like --memory-budget 12GiB"
        ) from None
    if device.usable is None:
        raise BadInputError(
            f"{given}: the usable memory of {device.torch_device} ({device.name}) is unknown "
            "here, so a fraction of it cannot be taken; give a size, like --memory-budget 12GiB"
        )
    return device


def render_estimate(
    result: Estimate,
    console=None,
    advice: list[str] | None = None,
    more: list[str] | None = None,
) -> None:
    from rich.table import Table

    console = console or readable_console()
    s = result.settings
    sh = result.shape
    what = (
        f"LoRA r={s.lora_r} on {s.lora_targets}" + (" over a 4-bit base" if s.load_in_4bit else "")
        if s.method == "lora"
        else "full fine-tune"
    )
    ranks = (
        f"each of {result.world_size} ranks ({result.distributed}): "
        if result.world_size > 1
        else ""
    )
    title = (
        f"{ranks}{result.model or sh.family}: {format_count(result.params)} params "
        f"({sh.family}, {sh.layers} layers, hidden {sh.hidden}, vocab {sh.vocab:,}"
        f"{', tied' if sh.tied else ''}); {what}; micro-batch {s.micro_batch_size} × seq {s.seq}, "
        f"{s.precision} compute over {s.weights_dtype} weights, {s.optimizer}"
        f"{', activation checkpointing' if s.checkpointing else ''}"
        f"{' (inputs offloaded to host)' if s.offload else ''}"
        f"{', compiled layers' if s.compiled else ''}"
        f"{f', chunked loss ({s.chunk_tokens} tokens)' if s.chunked_loss else ''}"
        f"{f', tiled MLP ({s.tile_tokens} tokens)' if s.tiled_mlp else ''}, "
        f"{s.attention} attention, "
        f"on {s.device_type}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("memory", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("how")
    for row in result.rows:
        table.add_row(row.name, format_bytes(row.bytes), _gb(row.bytes), row.formula)
    table.add_section()
    table.add_row(
        "peak (tensors)",
        format_bytes(result.peak),
        _gb(result.peak),
        f"{result.peak_formula}; set by: {result.phase}" if result.peak else "unknown",
    )
    table.add_row("total", format_bytes(result.total), _gb(result.total), "peak + overhead")
    console.print(table)
    if result.budget is not None:
        budget = f"{format_bytes(result.budget)} ({result.budget_source})"
        if result.fits is None:
            console.print(f"fits: unknown against {budget}: activations are not modelled")
        elif result.fits:
            share = 100 * result.total / result.budget
            console.print(f"[green]fits[/]{_on_ranks(result)}: {share:.0f}% of {budget}")
        else:
            console.print(
                f"[red]does not fit[/]{_on_ranks(result)}: needs {format_bytes(result.total)}"
                f"{' a rank' if result.world_size > 1 else ''}, "
                f"{format_bytes(result.total - result.budget)} over {budget}."
            )
            replicated = _replicated_state(result)
            if replicated is not None:
                console.print(replicated, markup=False, highlight=False)
            render_advice(advice or [], console)
            for line in more or []:
                console.print(f"  {line}", markup=False, highlight=False)
    else:
        console.print(f"budget unknown ({result.budget_source}); {s.words('budget')}")
    for note in result.notes:
        console.print(f"note: {note}")


def _on_ranks(result: Estimate) -> str:
    """on 2 GPUs of 16.00 GiB with fsdp, for an estimate of several ranks."""
    if result.world_size <= 1:
        return ""
    return (
        f" on {result.world_size} GPUs of {format_bytes(result.budget)} with {result.distributed}"
    )


def _replicated_state(result: Estimate) -> str | None:
    """Under replicate, where the model's state alone (weights, gradients, optimizer states)
    exceeds a rank's budget: no micro-batch can fit, and sharding is the way."""
    if result.distributed != "replicate" or result.budget is None:
        return None
    names = ("weights", "trainable adapters", "gradients", "optimizer states")
    state = sum(r.bytes or 0 for r in result.rows if r.name in names)
    if state <= result.budget:
        return None
    return (
        f"replicate: every rank holds the whole model state, {format_bytes(state)} of weights, "
        f"gradients and optimizer states, over the {format_bytes(result.budget)} a rank may "
        "use before any activation: no micro-batch fits; shard it with --distributed fsdp"
    )


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def render_advice(advice: list[str], console=None) -> None:
    """The advisor's lines under a "does not fit", or what is left when no setting helps."""
    console = console or readable_console()
    if not advice:
        console.print(
            "No setting this run has left lowers the estimate: a smaller model, or a machine "
            "with more memory.",
            markup=False,
            highlight=False,
        )
        return
    console.print("What would change it (the estimate at each):", markup=False, highlight=False)
    for line in advice:
        console.print(f"  {line}", markup=False, highlight=False)


def render_plan(
    chosen: Plan, seq: int | None = None, console=None, ranks: tuple[int, int] | None = None
) -> None:
    """The candidates table and the reasons. `ranks`: the GPUs and the group's effective batch,
    where `chosen` is one rank's plan of its share: the title then says what each rank runs and
    what the group adds up to, as a run's plan line does."""
    from rich.table import Table

    from steadytrain.telemetry.console import plan_batches

    console = console or readable_console()
    batches = {
        "micro_batch_size": chosen.micro_batch_size,
        "accumulation": chosen.accumulation,
        "effective_batch_size": chosen.effective_batch_size,
    }
    if ranks is not None and ranks[0] > 1:
        group = dataclasses.replace(chosen, effective_batch_size=ranks[1], world_size=ranks[0])
        batches = {
            "micro_batch_size": chosen.micro_batch_size,
            "effective_batch_size": ranks[1],
            "world_size": ranks[0],
            "rank_batch": group.rank_batch,
            "rank_micro_steps": group.rank_micro_steps,
        }
    table = Table(
        title=f"plan: {plan_batches(batches)}, activation checkpointing "
        f"{'on' if chosen.checkpointing else 'off'}"
        + (", inputs offloaded to host" if chosen.offload else "")
        + (", chunked loss" if chosen.chunked_loss else "")
        + (", tiled MLP" if chosen.tiled_mlp else ""),
        title_justify="left",
    )
    for name in ("mode", "micro", "accum", "predicted peak", "of limit", "samples/s", "tokens/s"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    table.add_column("")
    # Per mode, the sizes that fit and the first that does not: the rest says nothing new.
    shown, over = [], set()
    for c in chosen.candidates:
        if c.fits or c.mode not in over:
            shown.append(c)
            over |= set() if c.fits else {c.mode}
    hidden = len(chosen.candidates) - len(shown)
    if hidden:
        table.caption = f"{hidden} larger size(s) over the limit not shown (--json lists them)"
    if not shown:  # the quick path measured one size and chose without a candidates table
        table.add_row(*_quick_row(chosen))
    for c in shown:
        picked = c.micro_batch_size == chosen.micro_batch_size and c.mode == chosen.mode
        rate = c.samples_per_second if chosen.probe is not None else None
        table.add_row(
            c.mode.describe().replace("checkpointed", "ckpt"),
            str(c.micro_batch_size),
            str(-(-chosen.effective_batch_size // c.micro_batch_size)),
            format_bytes(c.peak),
            f"{c.peak / chosen.limit:.0%}" if chosen.limit else "-",
            f"{rate:.3g}" if rate else "-",
            f"{rate * seq:,.0f}" if rate and seq else "-",
            "◀ chosen" if picked else ("fits" if c.fits else "over"),
        )
    console.print(table)
    for reason in chosen.reasons:
        console.print(f"- {reason}", markup=False, highlight=False)


def _quick_row(chosen: Plan) -> tuple[str, ...]:
    """The chosen settings as the one row of a plan that took the quick path (one measured
    size, the bound extrapolated from it: no candidates were compared, so no speeds)."""
    peak, limit = chosen.predicted_peak, chosen.limit
    return (
        chosen.mode.describe().replace("checkpointed", "ckpt"),
        str(chosen.micro_batch_size),
        str(chosen.accumulation),
        format_bytes(peak),
        f"{peak / limit:.0%}" if limit and peak else "-",
        "-",
        "-",
        "◀ chosen (bound from one measured size, see below)",
    )
