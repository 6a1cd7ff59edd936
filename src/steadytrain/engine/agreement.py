"""How the ranks agree on a step: one strategy per mode, chosen once from the `Group`.

The step runs this rank's micro-batches and hands them to its agreement in one call
(`passes`); the evaluation's loss goes through the same strategy (`loss`). The modes:

- `OneProcess`: nothing to agree on; an out-of-memory goes straight to the step's redo.
- `Replicated` (`distributed: replicate`, 'ddp'): every rank holds the whole model and
  accumulates its share's gradients with no communication; then one small all-reduce says who
  ran out of memory, which parameters have gradients, the loss and the token count
  (engine/distributed.py). Only when no rank failed are the gradients summed; otherwise every
  rank raises `RanksOutOfMemory` and the step's redo makes them all smaller together. No rank
  is left in a collective another will not reach.
- `Sharded` (`distributed: fsdp`, engine/sharding.py): the forward all-gathers, so the ranks
  cannot agree before a collective. A rank that runs out of memory records its `oom` event and
  raises `RankOutOfMemory` (exit 76: torchrun ends the group, `steadytrain run` restarts it
  smaller from the last checkpoint). Gradients reduce-scatter in the last micro-batch's
  backward only (`micro_batch`).

`Phase` is where the step is ("forward", "backward", "agreement", "gradient sum", "optimizer",
"rank N"): the step and its agreement both move it, and the `oom` record names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from steadytrain.device import OutOfMemory, call_or_oom
from steadytrain.engine.accumulation import BatchLoss, TokenCount
from steadytrain.engine.distributed import Group, RanksOutOfMemory
from steadytrain.engine.sharding import set_gradient_sync
from steadytrain.errors import RankOutOfMemory

RecordOom = Callable[..., dict[str, Any]]
"""`record_oom(oom, **where)`: count and announce an out-of-memory; returns the `oom` record."""


class Phase:
    """Where the step is now, for the `oom` record of a failure there."""

    def __init__(self) -> None:
        self.now = "idle"


class Agreement:
    """The ranks' agreement on one step's passes; `for_group` picks the mode."""

    @staticmethod
    def for_group(
        group: Group,
        *,
        model: torch.nn.Module,
        params: list[torch.Tensor],
        free: Callable[[], None],
        phase: Phase,
        record_oom: RecordOom,
    ) -> Agreement:
        """The strategy for `group`. `params`: the trainable parameters, whose gradients are
        summed; `free`: empties the device's cache after an out-of-memory; `record_oom`: the
        step's `oom` record (a sharded rank writes it before it leaves)."""
        if not group.active:
            return OneProcess()
        if group.sharded:
            return Sharded(group, free, phase, model, record_oom)
        return Replicated(group, free, phase, params)

    def micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward; `last`: the step's last micro-batch."""

    def passes(self, run: Callable[[], BatchLoss]) -> BatchLoss:
        """`run()` (this rank's forwards and backwards), then the ranks' agreement: the loss
        returned is the global batch's and the gradients are ready for the optimizer."""
        raise NotImplementedError

    def loss(self, loss: BatchLoss | None, oom: OutOfMemory | None) -> float | None:
        """An evaluation's loss (`StepRunner.evaluate`) over the ranks: None when a rank ran
        out of memory (`oom` here, or `loss` None)."""
        raise NotImplementedError


class OneProcess(Agreement):
    """The group of one: no collective; the passes' own out-of-memory reaches the redo."""

    def passes(self, run: Callable[[], BatchLoss]) -> BatchLoss:
        return run()

    def loss(self, loss: BatchLoss | None, oom: OutOfMemory | None) -> float | None:
        return None if loss is None else float(loss.mean())


class _AcrossRanks(Agreement):
    """Several ranks: what the replicated and sharded modes share."""

    def __init__(self, group: Group, free: Callable[[], None], phase: Phase):
        self.group, self.free, self.phase = group, free, phase

    def loss(self, loss: BatchLoss | None, oom: OutOfMemory | None) -> float | None:
        count = None if loss is None or not loss.token_mode else loss.count.sum()
        agreed = self.group.agree(oom is not None, [], None if loss is None else loss.value, count)
        if agreed.failed:
            return None
        if agreed.count is None:
            return float(agreed.loss)
        return float(agreed.loss / max(int(agreed.count), 1))


class Replicated(_AcrossRanks):
    """Every rank the whole model: agree on who failed, then sum the gradients in place."""

    def __init__(
        self, group: Group, free: Callable[[], None], phase: Phase, params: list[torch.Tensor]
    ):
        super().__init__(group, free, phase)
        self.params = params

    def passes(self, run: Callable[[], BatchLoss]) -> BatchLoss:
        """An out-of-memory on any rank makes every rank redo the step; none waits in a
        collective."""
        loss, oom = call_or_oom(run, self.free)
        phase, self.phase.now = self.phase.now, "agreement"
        agreed = self.group.agree(
            oom is not None,
            self.params,
            None if loss is None else loss.value,
            None if loss is None or not loss.token_mode else loss.count.sum(),
        )
        if agreed.failed:
            ranks = ", ".join(str(r) for r in agreed.failed)
            self.phase.now = phase if oom is not None else f"rank {ranks}"
            mine = f": {oom.error}" if oom is not None else ""
            raise RanksOutOfMemory(
                f"out of memory on rank {ranks} of {self.group.world_size}{mine}"
            )
        self.phase.now = "gradient sum"
        self.group.sum_gradients(self.params, agreed.has_grad)
        loss.value = agreed.loss
        if agreed.count is not None:
            loss.count = TokenCount()
            loss.count.add(agreed.count)  # the global token count divides the summed gradients
        return loss


class Sharded(_AcrossRanks):
    """FSDP: a rank out of memory leaves (exit 76); otherwise sum the loss and token count."""

    def __init__(
        self,
        group: Group,
        free: Callable[[], None],
        phase: Phase,
        model: torch.nn.Module,
        record_oom: RecordOom,
    ):
        super().__init__(group, free, phase)
        self.model, self.record_oom = model, record_oom

    def micro_batch(self, last: bool) -> None:
        set_gradient_sync(self.model, last)  # reduce-scatter in the last backward only

    def passes(self, run: Callable[[], BatchLoss]) -> BatchLoss:
        loss, oom = call_or_oom(run, self.free)
        if oom is not None:
            record = self.record_oom(oom, rank=self.group.rank)
            raise RankOutOfMemory(
                f"out of memory on rank {self.group.rank} of {self.group.world_size} in "
                f"{record['phase']} at micro-batch {record['micro_batch_size']} (distributed: "
                f"fsdp): {oom.error}; exiting 76 so that `steadytrain run` restarts the group "
                "smaller from the last checkpoint"
            )
        self.phase.now = "agreement"
        count = loss.count.sum() if loss.token_mode else None
        agreed = self.group.agree(False, [], loss.value, count)
        loss.value = agreed.loss
        if agreed.count is not None:
            loss.count = TokenCount()
            loss.count.add(int(agreed.count))  # a host number: the gradients are DTensors
        return loss
