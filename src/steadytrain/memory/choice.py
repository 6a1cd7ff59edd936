"""The choice among candidates: every allowed micro-batch size of every mode (plain,
checkpointed, checkpointed with offloaded inputs, each with or without the chunked loss), the
one with the most samples per second within the limit, and the sentences that say why."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from steadytrain.errors import BadInputError
from steadytrain.memory.offload import OFFLOAD
from steadytrain.memory.probe import Fit
from steadytrain.memory.settings import SIZE_POLICIES
from steadytrain.run import savers as run_savers

SAVER_GAIN = 1.05
"""A memory saver (checkpointing, offload, chunked loss) must be predicted this much faster than
the best plain candidate to be chosen: its recomputation cost is certain, a few per cent of
timing noise is not."""


_ModeFields = collections.namedtuple(
    "_ModeFields",
    [saver.estimate_field for saver in run_savers.SAVERS],
    defaults=[False] * len(run_savers.SAVERS),
)


class Mode(_ModeFields):
    """Which savers a plan's candidate runs with: one bool field per registered saver
    (`run_savers.SAVERS`), named as its estimate field and made from the registration, in the
    ladder's order: `checkpointing`, `offload` (checkpointing whose kept layer inputs live in
    host memory, `memory.offload`), `chunked_loss`, `tiled_mlp` (`memory.tiled_mlp`). Pass them
    by name beyond the first."""

    __slots__ = ()

    @classmethod
    def of(cls, activation_checkpointing: bool | str, chunked_loss: bool = False) -> Mode:
        """The mode of an `activation_checkpointing` value: False, True or "offload"."""
        offload = activation_checkpointing == OFFLOAD
        return cls(
            checkpointing=bool(activation_checkpointing), offload=offload, chunked_loss=chunked_loss
        )

    @property
    def activation_checkpointing(self) -> bool | str:
        """What a pass runs with (`probe.RunPass`): False, True or "offload"."""
        return OFFLOAD if self.offload else self.checkpointing

    def within(self, other: Mode) -> bool:
        """Every saver this mode has on, `other` has on too."""
        return all(mine <= theirs for mine, theirs in zip(self, other, strict=True))

    @property
    def savers(self) -> int:
        """How many of the registry's savers the mode has on (`run_savers.SAVERS`, each by
        its estimate field, which is this mode's field too: offload counts on top of
        checkpointing)."""
        return sum(bool(getattr(self, saver.estimate_field)) for saver in run_savers.SAVERS)

    def describe(self) -> str:
        parts = ["checkpointed" if self.checkpointing else "plain"]
        if self.offload:
            parts.append("inputs offloaded to host")
        if self.chunked_loss:
            parts.append("chunked loss")
        if self.tiled_mlp:
            parts.append("tiled MLP")
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    micro_batch_size: int
    mode: Mode
    peak: float
    samples_per_second: float | None
    fits: bool

    @property
    def micro(self) -> int:
        """The earlier name of `micro_batch_size`."""
        return self.micro_batch_size


Predict = Callable[[Mode, int], float]
Speed = Callable[[Mode, int], "float | None"]


def allowed_sizes(
    effective_batch_size: int, micro_batch_sizes: str = "powers_of_two", cap: int | None = None
) -> list[int]:
    """Micro sizes the plan may choose, ascending: divisors of the effective batch (powers of two
    only under the policy 'powers_of_two'), always the effective batch itself, none above
    `cap`."""
    if micro_batch_sizes not in SIZE_POLICIES:
        raise BadInputError(
            f"micro_batch_sizes: {micro_batch_sizes!r} is not one of {', '.join(SIZE_POLICIES)}"
        )
    effective = effective_batch_size
    sizes = {d for d in range(1, effective + 1) if effective % d == 0}
    if micro_batch_sizes == "powers_of_two":
        sizes = {d for d in sizes if d & (d - 1) == 0} | {effective}
    top = effective if cap is None else min(cap, effective)
    found = sorted(d for d in sizes if d <= top)
    return found or [1]


def choose(
    fits: dict[Mode, Fit],
    effective_batch_size: int,
    limit: float,
    *,
    micro_batch_sizes: str = "powers_of_two",
    cap: int | None = None,
    predict: Predict | None = None,
    speed: Speed | None = None,
) -> tuple[Candidate | None, list[Candidate], list[str]]:
    """The best candidate by predicted samples per second among those within `limit`, every
    candidate, and the reasons. `predict(mode, size)` replaces the fitted line's peak (MPS adds
    the analytic floor); `speed(mode, size)` the line's samples per second (CUDA's measured
    finalists; None: not a contender). None when nothing fits, not even one sample."""
    sizes = allowed_sizes(effective_batch_size, micro_batch_sizes, cap)
    predict = predict or (lambda mode, size: fits[mode].peak(size))
    how = "predicted" if speed is None else "measured"
    speed = speed or (lambda mode, size: fits[mode].samples_per_second(size))
    candidates = [
        Candidate(m, mode, predict(mode, m), speed(mode, m), predict(mode, m) <= limit)
        for mode in fits
        for m in sizes
    ]
    fitting = [c for c in candidates if c.fits and c.samples_per_second is not None]
    if not fitting:
        return None, candidates, []
    best, reasons = _fastest(fitting)
    reasons.append(_why_fastest(best, fitting, how))
    top_size = min(effective_batch_size, cap or effective_batch_size)
    largest = max(
        (m for m in range(best.micro_batch_size, top_size + 1) if predict(best.mode, m) <= limit),
        default=best.micro_batch_size,
    )
    if best.micro_batch_size < largest:
        reasons.append(_why_not_larger(largest, effective_batch_size, micro_batch_sizes))
    return best, candidates, reasons


def _rate(c: Candidate) -> tuple[float, int]:
    return (c.samples_per_second, c.micro_batch_size)


def _fastest(fitting: list[Candidate]) -> tuple[Candidate, list[str]]:
    """The fastest fitting candidate, plain on ties; a saver only when `SAVER_GAIN` faster."""
    best = max(
        fitting,
        key=lambda c: (
            c.samples_per_second,
            not c.mode.checkpointing,
            not c.mode.offload,
            not c.mode.chunked_loss,
            not c.mode.tiled_mlp,
            c.micro_batch_size,
        ),
    )
    plain = [c for c in fitting if c.mode == Mode()]
    if plain and best.mode != Mode():
        fastest_plain = max(plain, key=_rate)
        if best.samples_per_second < SAVER_GAIN * fastest_plain.samples_per_second:
            return fastest_plain, [
                f"a memory saver must be predicted at least {SAVER_GAIN - 1:.0%} faster than "
                "plain to be chosen"
            ]
    return best, []


def _why_fastest(best: Candidate, fitting: list[Candidate], how: str) -> str:
    top: dict[Mode, Candidate] = {}
    for c in fitting:
        if c.mode not in top or _rate(c) > _rate(top[c.mode]):
            top[c.mode] = c
    rivals = [c for mode, c in top.items() if mode != best.mode]
    said = (
        f"{best.mode.describe()} micro {best.micro_batch_size}: {how} "
        f"{best.samples_per_second:.3g} samples/s"
    )
    if not rivals:
        return f"{said}, the largest allowed size that fits"
    beaten = ", ".join(
        f"{c.mode.describe()} micro {c.micro_batch_size} {c.samples_per_second:.3g}" for c in rivals
    )
    return f"{said}, the most among those that fit (best of the others: {beaten})"


def _why_not_larger(largest: int, effective_batch_size: int, micro_batch_sizes: str) -> str:
    what = "a power of two dividing" if micro_batch_sizes == "powers_of_two" else "a divisor of"
    return (
        f"up to {largest} would fit, but the micro-batch must be {what} the effective batch "
        f"{effective_batch_size} (every step splits into equal micro-batches, as "
        "micro_batch_size requires)"
        + (
            "; micro_batch_sizes: divisors allows any divisor"
            if micro_batch_sizes != "divisors"
            else ""
        )
    )
