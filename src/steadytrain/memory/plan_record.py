"""The plan as a record: `Plan` (what was chosen, why, and the events it writes) and `Room`
(the bound: budget, what is in use and the margin, from which every `Plan` is made)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from steadytrain._units import format_bytes
from steadytrain.memory.choice import Candidate, Mode
from steadytrain.memory.offload import OFFLOAD
from steadytrain.memory.probe import ProbeResult


@dataclass
class Plan:
    """The choice and why. `reasons` are the sentences the console and docs show."""

    micro_batch_size: int
    effective_batch_size: int
    checkpointing: bool
    chunked_loss: bool
    predicted_peak: float | None
    limit: float | None
    budget: int | None
    margin: float
    in_use: int | None
    reasons: list[str]
    candidates: list[Candidate] = field(default_factory=list)
    probe: ProbeResult | None = None
    analytic: Any = None
    quick: bool = False
    largest_fitting: int | None = None
    device_type: str = "cuda"
    offload: bool = False
    """Checkpointing with its kept layer inputs in host memory (`memory.offload`)."""
    tiled_mlp: bool = False
    """Each decoder layer's MLP over a piece of the tokens at a time (`memory.tiled_mlp`)."""
    world_size: int = 1
    """The ranks sharing each optimizer batch (torchrun); `micro_batch_size` is each rank's."""
    fsdp_offload: bool = False
    """Sharded with each rank's shards in host memory (chosen before sharding, or asked)."""

    @property
    def mode(self) -> Mode:
        """The chosen savers as a plan's mode."""
        return Mode(
            self.checkpointing,
            offload=self.offload,
            chunked_loss=self.chunked_loss,
            tiled_mlp=self.tiled_mlp,
        )

    @property
    def activation_checkpointing(self) -> bool | str:
        """The choice in the config's terms: False, True or "offload"."""
        return OFFLOAD if self.offload else self.checkpointing

    @property
    def accumulation(self) -> int:
        """The effective batch in micro-batches: on one process the micro-steps of a step;
        under torchrun the micro-batches of the whole group (`rank_micro_steps` is each rank's)."""
        return -(-self.effective_batch_size // self.micro_batch_size)

    @property
    def rank_batch(self) -> int:
        """The largest rank's share of an optimizer batch (shares differ by at most one)."""
        return -(-self.effective_batch_size // self.world_size)

    @property
    def rank_micro_steps(self) -> int:
        """The micro-batches each rank runs in an optimizer step (the largest share's), as the
        step's `micro_steps` metric counts them."""
        return -(-self.rank_batch // self.micro_batch_size)

    def to_event(self) -> dict[str, Any]:
        """The `plan` event of events.jsonl."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulation": self.accumulation,
            "effective_batch_size": self.effective_batch_size,
            "world_size": self.world_size,
            "rank_batch": self.rank_batch,
            "rank_micro_steps": self.rank_micro_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "chunked_loss": self.chunked_loss,
            "tiled_mlp": self.tiled_mlp,
            "fsdp_offload": self.fsdp_offload,
            "predicted_peak": _int(self.predicted_peak),
            "limit": _int(self.limit),
            "budget": self.budget,
            "margin": self.margin,
            "in_use": self.in_use,
            "quick": self.quick,
            "reasons": self.reasons,
            "candidates": [
                {
                    "micro": c.micro_batch_size,
                    "mode": c.mode.describe(),
                    "peak": _int(c.peak),
                    "samples_per_second": c.samples_per_second,
                    "fits": c.fits,
                }
                for c in self.candidates
            ],
            "probe": self.probe.to_dict() if self.probe is not None else None,
        }

    def estimate_event(self) -> dict[str, Any] | None:
        """The `estimate` event the report sets against the measured peak: the analytic estimate
        at the chosen settings where the model is a known family, else the probe's prediction.
        `peak` is the tensor peak (CUDA's counter), `total` what the process holds. On CPU the
        report's measurement is the process's resident set, interpreter and libraries included,
        which the analytic total does not model: the probe's prediction is recorded there, with
        the analytic figures beside it. A sharded run's estimate is one rank's: `world_size`
        and `distributed` say so."""
        extra = {}
        ranks = {}
        if self.analytic is not None and (self.analytic.settings.gpus or 1) > 1:
            settings = self.analytic.settings
            ranks = {"world_size": settings.gpus, "distributed": settings.distributed}
        if self.analytic is not None:
            at = self.analytic.of(self.micro_batch_size, self.mode)
            if at is not None and at.peak is not None and self.device_type != "cpu":
                return {
                    "source": "analytic",
                    "peak": at.peak,
                    "total": at.total,
                    "probe_peak": _int(self.predicted_peak),
                    "micro_batch_size": self.micro_batch_size,
                    **ranks,
                }
            if at is not None:
                extra = {"analytic_peak": at.peak, "analytic_total": at.total, **ranks}
        if self.predicted_peak is None:
            return None
        return {
            "source": "probe",
            "peak": _int(self.predicted_peak),
            "total": _int(self.predicted_peak),
            "micro_batch_size": self.micro_batch_size,
            **extra,
        }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Room:
    """The bound: what the budget leaves above what is in use, and the share of it the plan
    may take. Every `Plan` is made by `Room.plan`."""

    effective_batch_size: int
    budget: int | None
    in_use: int | None
    margin: float
    device_type: str
    pending: int = 0
    """Bytes the first optimizer step adds that no probed pass holds (`first_step_bytes`)."""

    @property
    def limit(self) -> float | None:
        if self.budget is None or self.in_use is None:
            return None
        return self.in_use + self.margin * max(self.budget - self.in_use, 0)

    def within(self, share: float) -> float:
        """The peak that takes `share` of the room the limit allows."""
        return self.in_use + share * (self.limit - self.in_use)

    def plan(
        self,
        micro_batch_size: int,
        mode: Mode,
        predicted_peak: float | None,
        reasons: list[str],
        **found: Any,
    ) -> Plan:
        """The one way to make a Plan: this room's figures, the choice and its reasons."""
        return Plan(
            micro_batch_size=micro_batch_size,
            effective_batch_size=self.effective_batch_size,
            checkpointing=mode.checkpointing,
            chunked_loss=mode.chunked_loss,
            offload=mode.offload,
            tiled_mlp=mode.tiled_mlp,
            predicted_peak=predicted_peak,
            limit=self.limit,
            budget=self.budget,
            margin=self.margin,
            in_use=self.in_use,
            device_type=self.device_type,
            reasons=reasons,
            **found,
        )

    def describe(self) -> str:
        if self.budget is not None and self.in_use is not None and self.in_use >= self.budget:
            return (
                f"budget {format_bytes(self.budget)}, {format_bytes(self.in_use)} in use: "
                "already over the budget before the first pass (the process, its libraries, "
                "the model and the data), so no micro-batch can keep the run within it; set "
                "memory_budget above what is in use"
            )
        return (
            f"budget {format_bytes(self.budget)}, {format_bytes(self.in_use)} in use: the peak "
            f"may reach {format_bytes(self.limit)} ({self.margin:.0%} of the room above what is "
            "in use)"
            + (
                f"; the first optimizer step adds {format_bytes(self.pending)} of optimizer "
                "state, counted in every prediction"
                if self.pending
                else ""
            )
        )


ACCUMULATION = "accumulation "
"""How the reason on accumulation begins (`with_ranks` finds it by this)."""


def accumulation_reason(
    micro_batch_size: int, effective_batch_size: int, world_size: int = 1
) -> str:
    """What one optimizer step runs: its micro-batches, on one process or on each rank of
    `world_size` (each runs its share of the effective batch)."""
    if world_size > 1:
        share = -(-effective_batch_size // world_size)
        steps = -(-share // micro_batch_size)
        runs = f"{steps} micro-batch{'es' if steps > 1 else ''} of {micro_batch_size}"
        return (
            f"{ACCUMULATION}{steps} on each of {world_size} ranks: {runs} of its share of "
            f"{share}, the effective batch stays {effective_batch_size}"
        )
    steps = -(-effective_batch_size // micro_batch_size)
    if steps == 1:
        return f"{ACCUMULATION}1: the whole effective batch {effective_batch_size} in one pass"
    return (
        f"{ACCUMULATION}{steps}: {steps} micro-batches of {micro_batch_size}, the effective "
        f"batch stays {effective_batch_size}"
    )


def with_ranks(reasons: list[str], micro_batch_size: int, effective: int, world: int) -> list[str]:
    """`reasons` with the accumulation reason said for `world` ranks sharing `effective`: a
    rank plans as one process of the whole batch (or, in `steadytrain plan --gpus N`, of its
    share), which its own reason then miscounts."""
    said = accumulation_reason(micro_batch_size, effective, world)
    return [said if r.startswith(ACCUMULATION) else r for r in reasons]
