"""What would make a run fit, worked out on its own model and settings: every knob the run has
not set yet is tried with the estimator (`memory.estimate`), and the ones that lower the total
by at least 1 % of it (`LEAST_SAVING`) are listed, those that fit first (the most room left
first), each with the total it gives:

    `bf16: true` → 12.9 GiB of 16.0 GiB: fits
    `max_seq_length: 1024` → 18.8 GiB of 16.0 GiB: still over

When no knob fits alone, the knobs are combined, the largest saving first, until the run fits,
and the combination leads the list. One advisor for every place that says "does not fit":
`steadytrain estimate` and `plan` (in their flags' words), `steadytrain finetune` at start-up and
its `--dry-run`, and the supervisor's exit 3 after the OS killed a run with every saver in force
(in the fine-tune config's words: recipes/finetune_config.py field names).

Each line shows its total and the budget at the precision that tells them apart, so its verdict
can be read off the figures; a budget that is a Mac's RAM on MPS is also priced against the
default a run on that Mac gets (`mac_default_budget`); bf16 on MPS is said with what it needs
(macOS 14) and fp16 beside it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from steadytrain._units import DEFAULT_BUDGET_FRACTION
from steadytrain.device.mps import RECOMMENDED_SHARE as MPS_RECOMMENDED_SHARE
from steadytrain.memory.compiled import family_share
from steadytrain.memory.estimate import Estimate, estimate
from steadytrain.memory.settings import CONFIG, FLAGS, WORDS, Settings
from steadytrain.run import savers as run_savers
from steadytrain.run.savers import DISCRETE_MEMORY

MAC_RAM_GIB = frozenset({8, 16, 18, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512})
"""The RAM sizes (GiB) Apple Silicon Macs are sold with: a budget of one of them on MPS is read
as possibly the machine's RAM (`mac_default_budget`)."""
BF16_ON_MPS = (
    "{bf16} on MPS needs macOS 14 or later and a torch whose MPS backend runs bf16 "
    "(`steadytrain doctor` says whether this Mac does); {fp16} saves the same on any macOS"
)
"""What bf16 on MPS needs, with {bf16} and {fp16} in the vocabulary's words (`WORDS`): the
fp16 alternative is offered here, not as a line of its own with the same total."""
MIN_SEQ = 256
"""The shortest sequence the advisor proposes (halving the config's length down to it)."""
SEQ_STEP = 1024
"""From this length on, the sequence the advisor proposes is a multiple of it (below, of
`MIN_SEQ`): the longest that fits, not the largest halving (`_longest_seq`)."""
LISTED = 6
"""At most this many pieces of advice (the fitting ones and the best of the rest)."""
LEAST_SAVING = 0.01
"""A knob is listed only where it lowers the total by at least this share of it: less is within
the estimate's own error (measured 0.1-1.8 % from the peak) and no reason to change a setting;
on a small model, whose total is mostly the runtime's fixed overhead, bf16 or offload saves a
few KiB of hundreds of MiB."""


@dataclass(frozen=True)
class Knob:
    """One change: the settings fields it sets, and how a config and the command line say it."""

    changes: dict[str, Any]
    """Settings field -> value."""
    config: tuple[tuple[str, Any], ...]
    """(fine-tune config key, value) pairs; empty where a fine-tune config has no such key."""
    flags: str
    alters: bool = False
    """It changes what is trained (shorter samples, a smaller adapter, a quantized base), not
    only how: offered after the knobs that leave the training the same."""
    needs: str = ""
    """What the machine must have for the change to run (bf16 on MPS: macOS 14), said once
    below the list; empty where nothing more is needed."""


@dataclass(frozen=True)
class Advice:
    knobs: tuple[Knob, ...]
    total: int
    budget: int
    mac_default: int | None = None
    """Where the budget is a Mac's RAM size on MPS (`mac_default_budget`): the budget a run on
    a Mac with that much RAM gets by default, so a "fits" against the RAM is not taken for a
    fit there."""

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def keys(self, vocabulary: str = CONFIG) -> str:
        """The change as the config (`bf16: true`) or the command line (`--precision bf16`)
        writes it."""
        if vocabulary == CONFIG:
            pairs = [pair for k in self.knobs for pair in k.config]
            return ", ".join(f"`{key}: {_value(value)}`" for key, value in pairs)
        return " ".join(f"`{k.flags}`" for k in self.knobs)

    def describe(self, vocabulary: str = CONFIG) -> str:
        """`bf16: true` → 12.9 GiB of 16.0 GiB: fits; the two sizes at the precision that
        tells them apart (10.81 GiB of 10.80 GiB: still over), so the verdict can be read off
        the figures."""
        total, budget = _sizes(self.total, self.budget)
        verdict = "fits" if self.fits else "still over"
        said = f"{self.keys(vocabulary)} → {total} of {budget}: {verdict}"
        mac = self.mac_default
        if self.fits and mac is not None and self.total > mac:
            over, default = _sizes(self.total - mac, mac)
            ram = self.budget // 2**30
            said += (
                f" that budget, but not a {ram} GB Mac's default of {default} "
                f"({over} over; {WORDS[vocabulary]['auto']}, where {budget} is the Mac's RAM)"
            )
        return said


def advise(
    config: Any,
    settings: Settings,
    budget: int,
    vocabulary: str = CONFIG,
    accumulation: int = 1,
    current: Estimate | None = None,
) -> list[Advice]:
    """The knobs that lower the estimated total of training `config` (a model config) under
    `settings` against `budget` bytes by at least `LEAST_SAVING` of it, fitting ones first.
    `accumulation`: the config's gradient accumulation, kept with a smaller micro-batch so the
    effective batch stays."""
    base = current or estimate(config, settings)
    if base.total is None:
        return []
    mac = mac_default_budget(budget) if settings.device_type == "mps" else None
    found: list[Advice] = []
    for knob in knobs(config, settings, budget, vocabulary, accumulation, base.total):
        total = _total(config, settings, knob.changes)
        if total is not None and base.total - total >= LEAST_SAVING * base.total:
            found.append(Advice((knob,), total, budget, mac))
    found.sort(key=lambda a: (not a.fits, a.knobs[0].alters, a.total))
    if found and not found[0].fits:
        combined = _combined(config, settings, budget, found)
        if combined is not None:
            found.insert(0, dataclasses.replace(combined, mac_default=mac))
    return found[:LISTED]


def lines(advice: list[Advice], vocabulary: str = CONFIG) -> list[str]:
    """One line per piece of advice, for a message, then once each what a listed change needs
    of the machine (bf16 on MPS: macOS 14)."""
    said = [a.describe(vocabulary) for a in advice]
    needs = dict.fromkeys(k.needs for a in advice for k in a.knobs if k.needs)
    return said + [need.format(**WORDS[vocabulary]) for need in needs]


def mac_default_budget(budget: int) -> int | None:
    """The budget a run gets by default (`memory_budget: auto`) on a Mac whose RAM is `budget`
    (a whole number of GiB a Mac is sold with): 0.9 of Metal's recommended working set, about
    0.75 of RAM; None for any other size. A budget written as the Mac's RAM ("16GiB" on a 16 GB
    Mac) is more than a run there may use."""
    if budget % 2**30 or budget // 2**30 not in MAC_RAM_GIB:
        return None
    return int(budget * MPS_RECOMMENDED_SHARE * DEFAULT_BUDGET_FRACTION)


def knobs(
    config: Any,
    s: Settings,
    budget: int,
    vocabulary: str = CONFIG,
    accumulation: int = 1,
    total: int | None = None,
) -> list[Knob]:
    """The knobs `s` has not set yet, each once, in the vocabulary's reach (a knob a fine-tune
    config cannot express is left out of its advice). `total`: the estimate of `s` itself,
    where the caller has it (the longest sequence that fits is found from it)."""
    found = _keeping_knobs(config, s, budget, accumulation)
    found += _altering_knobs(config, s, budget, total)
    return [k for k in found if vocabulary != CONFIG or k.config]


def _keeping_knobs(config: Any, s: Settings, budget: int, accumulation: int) -> list[Knob]:
    """The knobs that leave what is trained as it is: precision, the memory savers, compiling,
    a smaller micro-batch with the effective batch kept."""
    found: list[Knob] = []
    lora = s.method == "lora"
    if s.weights_dtype == "fp32" and lora:
        flags = ("--precision bf16 " if s.precision == "fp32" else "") + "--weights-dtype bf16"
        changes = {
            "weights_dtype": "bf16",
            **({"precision": "bf16"} if s.precision == "fp32" else {}),
        }
        needs = BF16_ON_MPS if s.device_type == "mps" else ""  # fp16 offered in its words
        found.append(Knob(changes, (("bf16", True),), flags, needs=needs))
    elif s.precision == "fp32":
        found.append(Knob({"precision": "bf16"}, (("precision", "bf16"),), "--precision bf16"))
    found += _saver_knobs(s) + _rank_knobs(s)
    if (
        not s.compiled
        and not s.checkpointing
        and s.device_type != "mps"
        and family_share(_family(config)) < 1.0
    ):
        found.append(Knob({"compiled": True}, (("torch_compile", True),), "--compile"))
    if s.micro_batch_size > 1:
        micro = _largest(config, s, budget, "micro_batch_size", s.micro_batch_size, 1, 1)
        steps = accumulation * s.micro_batch_size // micro
        found.append(
            Knob(
                {"micro_batch_size": micro},
                (("per_device_train_batch_size", micro), ("gradient_accumulation_steps", steps)),
                f"--micro-batch {micro}",
            )
        )
    return found


def _saver_knobs(s: Settings) -> list[Knob]:
    """The memory savers `s` does not have on, in the ladder's order (`run_savers.SAVERS`), each
    as its estimate flag and fine-tune keys: one whose `after` saver is not on yet waits for it,
    one that needs memory of the GPU's own only on CUDA, one worth it only past one chunk of
    tokens only there."""
    found: list[Knob] = []
    for saver in run_savers.SAVERS:
        after = saver.after is None or getattr(s, run_savers.by_name(saver.after).estimate_field)
        if (
            getattr(s, saver.estimate_field)
            or not after
            or (DISCRETE_MEMORY in saver.needs and s.device_type != "cuda")
            or (saver.worth_above_tokens and s.micro_batch_size * s.seq <= getattr(s, saver.piece))
        ):
            continue
        found.append(Knob({saver.estimate_field: True}, saver.finetune, saver.flag))
    return found


def _rank_knobs(s: Settings) -> list[Knob]:
    """On several GPUs: sharding for a replicated run, and the shards in host memory (FSDP2's
    offload policy, a GPU with memory of its own) for a sharded one. A run's key is
    `distributed`; a fine-tune config has none, so these are the flags' advice."""
    if (s.gpus or 1) <= 1:
        return []
    if s.distributed in ("replicate", "ddp"):
        return [Knob({"distributed": "fsdp"}, (), "--distributed fsdp")]
    if s.distributed == "fsdp" and not s.fsdp_offload and s.device_type == "cuda":
        return [Knob({"fsdp_offload": True}, (), "--fsdp-offload")]
    return []


MOST_GPUS = 1024
"""The most GPUs `fewest_gpus` tries."""


@dataclass(frozen=True)
class MoreGpus:
    """The fewest GPUs on which a run fits under fsdp, and what each rank then needs."""

    gpus: int
    total: int
    budget: int
    savers: tuple[Knob, ...] = ()
    """The savers it needs on top of the run's settings (none: as it is)."""

    def describe(self, vocabulary: str = FLAGS) -> str:
        """fits on 4 GPUs of 16.0 GiB with fsdp (14.2 GiB a rank)."""
        total, budget = _sizes(self.total, self.budget)
        with_ = "fsdp" + (
            f" and {' '.join(f'`{k.flags}`' for k in self.savers)}" if self.savers else ""
        )
        flags = "".join(f" {k.flags}" for k in self.savers)  # the command, savers included
        return (
            f"fits on {self.gpus} GPUs of {budget} with {with_} ({total} a rank; "
            f"`--gpus {self.gpus} --distributed fsdp{flags}`)"
        )


def fewest_gpus(config: Any, settings: Settings, budget: int) -> list[MoreGpus]:
    """The fewest GPUs (two or more, at most `MOST_GPUS`) on which the run fits sharded with
    FSDP2: with its settings as they are, and, where fewer would do, with the savers it then
    needs (`run_savers.SAVERS`, then the shards on the host): one alone where one is enough,
    else the ladder's first ones until it fits; [] where nothing fits. The per-rank total falls as ranks are added (the
    shards shrink; the gathered layers and the activations stay), so a doubling then a
    bisection finds the fewest."""
    start = max(settings.gpus or 1, 2)
    base = dataclasses.replace(settings, distributed="fsdp")
    found: list[MoreGpus] = []
    hit = _fewest(config, base, budget, start)
    if hit is not None:
        found.append(MoreGpus(hit[0], hit[1], budget))
        if hit[0] == start:
            return found  # as it is, on the fewest there can be
    savers = _every_saver(base)
    every = _with(base, savers)
    least = _fewest(config, every, budget, start)
    if least is None or (hit is not None and least[0] >= hit[0]):
        return found
    # The fewest savers that fit on that many GPUs: one alone, else the ladder's first ones.
    tries = [[saver] for saver in savers] + [savers[:n] for n in range(2, len(savers) + 1)]
    for chosen in tries:
        total = estimate(config, dataclasses.replace(_with(base, chosen), gpus=least[0]))
        if total.total is not None and total.total <= budget:
            return [*found, MoreGpus(least[0], total.total, budget, tuple(chosen))]
    return found


def _with(s: Settings, knobs_on: list[Knob]) -> Settings:
    return dataclasses.replace(s, **{k: v for kn in knobs_on for k, v in kn.changes.items()})


def _every_saver(s: Settings) -> list[Knob]:
    """Every saver the run can have on several GPUs that is not on yet: the ladder's
    (`run_savers.SAVERS`, those that need CUDA only there) and the shards on the host."""
    found = []
    for saver in run_savers.SAVERS:
        if getattr(s, saver.estimate_field):
            continue
        if DISCRETE_MEMORY in saver.needs and s.device_type != "cuda":
            continue
        found.append(Knob({saver.estimate_field: True}, saver.finetune, saver.flag))
    if s.device_type == "cuda" and not s.fsdp_offload:
        found.append(Knob({"fsdp_offload": True}, (), "--fsdp-offload"))
    return found


def _fewest(config: Any, s: Settings, budget: int, start: int) -> tuple[int, int] | None:
    """(the fewest GPUs from `start` on which `s` fits `budget`, its per-rank total)."""

    def total(gpus: int) -> int | None:
        return estimate(config, dataclasses.replace(s, gpus=gpus)).total

    low, high = start, start
    while True:
        found = total(high)
        if found is None:
            return None
        if found <= budget:
            break
        if high >= MOST_GPUS:
            return None
        low, high = high + 1, min(2 * high, MOST_GPUS)
    best = (high, found)
    while low < high:
        middle = (low + high) // 2
        found = total(middle)
        if found is not None and found <= budget:
            high, best = middle, (middle, found)
        else:
            low = middle + 1
    return best


def _altering_knobs(config: Any, s: Settings, budget: int, total: int | None) -> list[Knob]:
    """The knobs that change what is trained: a shorter sequence, a lower LoRA rank, LoRA
    instead of full weights, 4-bit base weights, an 8-bit optimizer."""
    found: list[Knob] = []
    lora = s.method == "lora"
    if s.seq > MIN_SEQ:
        seq = _longest_seq(config, s, budget, total)
        found.append(Knob({"seq": seq}, (("max_seq_length", seq),), f"--seq {seq}", alters=True))
    if lora and s.lora_r > 8:
        found.append(Knob({"lora_r": 8}, (("lora.r", 8),), "--lora-r 8", alters=True))
    if not lora:
        found.append(Knob({"method": "lora"}, (), "--method lora", alters=True))
    if s.device_type == "cuda" and lora and not s.load_in_4bit:
        dtype = {"weights_dtype": "bf16", "precision": "bf16"} if s.weights_dtype == "fp32" else {}
        found.append(
            Knob(
                {"load_in_4bit": True, **dtype},
                (("quantization.load_in_4bit", True),) + ((("bf16", True),) if dtype else ()),
                "--load-in-4bit" + (" --precision bf16 --weights-dtype bf16" if dtype else ""),
                alters=True,
            )
        )
    if s.device_type == "cuda" and s.optimizer == "adamw":
        found.append(
            Knob(
                {"optimizer": "adamw8bit"}, (("optim", "adamw_bnb_8bit"),), "--optimizer adamw8bit"
            )
        )
    return found


def _largest(
    config: Any, s: Settings, budget: int, field: str, start: int, least: int, otherwise: int
) -> int:
    """The largest halving of `start` (down to `least`) at which the run fits; `otherwise`
    when none does."""
    value = start // 2
    while value >= least:
        total = _total(config, s, {field: value})
        if total is not None and total <= budget:
            return value
        value //= 2
    return max(otherwise, least)


def _longest_seq(config: Any, s: Settings, budget: int, total: int | None) -> int:
    """The longest sequence under the run's at which it fits: the largest halving that fits,
    then the length at which the line through its total and the next longer length's (the
    run's own `total`, or the halving before) meets the budget (activations grow with the
    tokens), rounded down to `SEQ_STEP` (`MIN_SEQ` below it) and checked; the halving where the
    check fails. Half the run's length when no halving fits (the advice then says "still
    over"). The 3B Llama in 4 bits at 40,960 tokens under 7.2 GiB is told 33,792, where the
    halving said 20,480."""
    above = (s.seq, total)
    value = s.seq // 2
    while value >= MIN_SEQ:
        fits_at = _total(config, s, {"seq": value})
        if fits_at is not None and fits_at <= budget:
            return _towards(config, s, budget, (value, fits_at), above)
        above, value = (value, fits_at), value // 2
    return max(s.seq // 2, MIN_SEQ)


def _towards(
    config: Any, s: Settings, budget: int, low: tuple[int, int], high: tuple[int, int | None]
) -> int:
    """The length between `low` (fits) and `high` (does not) where their line meets the budget,
    rounded down to a step and checked; `low`'s length where it does not fit."""
    (seq, total), (top, top_total) = low, high
    if top_total is None or top_total <= total:
        return seq
    step = SEQ_STEP if seq >= SEQ_STEP else MIN_SEQ
    guess = seq + (budget - total) * (top - seq) // (top_total - total)
    guess = min(guess, top - 1) // step * step
    if guess <= seq:
        return seq
    found = _total(config, s, {"seq": guess})
    return guess if found is not None and found <= budget else seq


def _combined(config: Any, s: Settings, budget: int, found: list[Advice]) -> Advice | None:
    """No knob fits alone: the knobs together, the largest saving first, until the run fits
    (None when even all of them do not, or the first alone is all there is)."""
    chosen: list[Knob] = []
    changes: dict[str, Any] = {}
    fields: set[str] = set()
    for advice in sorted(found, key=lambda a: (a.knobs[0].alters, a.total)):
        knob = advice.knobs[0]
        if fields & set(knob.changes):
            continue  # two values of one setting (micro-batch and 4-bit's dtype): the first
        trial = {**changes, **knob.changes}
        try:
            total = _total(config, s, trial)
        except Exception:  # noqa: BLE001  a combination the settings refuse is not advised
            continue
        if total is None:
            continue
        chosen.append(knob)
        changes, fields = trial, fields | set(knob.changes)
        if total <= budget:
            return Advice(tuple(chosen), total, budget) if len(chosen) > 1 else None
    return None


def _total(config: Any, s: Settings, changes: dict[str, Any]) -> int | None:
    return estimate(config, dataclasses.replace(s, **changes)).total


def _family(config: Any) -> str:
    from steadytrain.memory.model_shape import shape_of

    return shape_of(config).family


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _sizes(a: int, b: int) -> tuple[str, str]:
    """Two sizes at the precision that tells them apart: GiB to a tenth (MiB below one GiB),
    more digits while the two read the same but differ (10.81 GiB of 10.80 GiB)."""
    for digits in range(1, 7):
        said = _gib(a, digits), _gib(b, digits)
        if said[0] != said[1] or a == b:
            return said
    return f"{a:,} bytes", f"{b:,} bytes"


def _gib(n: int, digits: int = 1) -> str:
    """A size in GiB to `digits` decimals, in MiB (one fewer) below one GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.{digits}f} GiB"
    return f"{n / 2**20:.{digits - 1}f} MiB"


__all__ = [
    "BF16_ON_MPS",
    "CONFIG",
    "FLAGS",
    "LEAST_SAVING",
    "MAC_RAM_GIB",
    "WORDS",
    "Advice",
    "Knob",
    "MoreGpus",
    "advise",
    "fewest_gpus",
    "knobs",
    "lines",
    "mac_default_budget",
]
