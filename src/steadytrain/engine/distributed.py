"""Several processes through torchrun: the process group as the engine sees it.

One process is the group of one, and then every method is free (no collective). Under
``torchrun --nproc_per_node N`` each rank takes a contiguous share of every optimizer batch and
accumulates its micro-batches' gradients locally, with no communication. Then the ranks agree in
one small all-reduce: which rank ran out of memory, which parameters have gradients, the step's
loss and token count. Only when no rank failed are the gradients summed across ranks (in place,
one all-reduce per gradient, no extra buffer); otherwise every rank drops its partial gradients,
shrinks to the same micro-batch and redoes the same global batch. So no rank is ever left in a
collective that another rank will not reach.

DDP's reducer is not used for the gradients: it communicates inside the last micro-batch's
backward, where an out-of-memory on one rank would leave the others waiting in an all-reduce,
and its buckets hold a second copy of the gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from steadytrain.device.core import collective_device, wait_on_host
from steadytrain.errors import BadInputError, RankOutOfMemory, SteadytrainError
from steadytrain.run import files as run_files


def _unwatched(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


_waiting_in: Callable[[str], contextlib.AbstractContextManager] = _unwatched


def name_waits(hook: Callable[[str], contextlib.AbstractContextManager]) -> None:
    """Tell a watcher which collective this rank is waiting in: `hook(name)` is entered around
    each collective ("all-reduce (agreement)", ...). The trainer gives the hang watchdog's
    `waiting_in`, so a hang report names the collective (another rank never reached it)."""
    global _waiting_in
    _waiting_in = hook


class RanksOutOfMemory(MemoryError):
    """One or more ranks ran out of memory in this step: every rank redoes it, smaller."""


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed after their micro-batches (`Group.agree`; the step's strategy that
    asks is engine/agreement.py)."""

    failed: list[int]
    """The ranks that ran out of memory (none: the step goes on to the gradient sum)."""
    has_grad: list[bool]
    """Per parameter: some rank has a gradient for it, so every rank takes part in its sum."""
    loss: torch.Tensor | None
    """The step's loss value summed over the ranks (each rank's is already weighted)."""
    count: torch.Tensor | None
    """The step's token count summed over the ranks (int64); None for mean losses."""


@dataclass(frozen=True)
class Group:
    """The ranks of this run; the default is the group of one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: str = "cpu"
    """Where the collectives' small tensors live (the training device: NCCL needs CUDA)."""
    owned: bool = False
    """This group was initialised here (not by the script), so `close` destroys it."""
    sharded: bool = False
    """The model is sharded over the ranks (`distributed: fsdp`, engine/sharding.py)."""

    @classmethod
    def from_env(cls) -> Group:
        """The process group torchrun describes in the environment (RANK, WORLD_SIZE, ...),
        initialised here when the script did not do it; the group of one otherwise."""
        if dist.is_available() and dist.is_initialized():
            return cls._of_initialized()
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise BadInputError(
                f"WORLD_SIZE: {os.environ['WORLD_SIZE']!r} is not a whole number; start several "
                "processes with torchrun, which sets it"
            ) from None
        if world <= 1:
            return cls()
        if not dist.is_available():
            raise BadInputError(
                f"WORLD_SIZE={world}, but this torch build has no torch.distributed; "
                "install a torch build with distributed support or run one process"
            )
        # No backend named: gloo for CPU tensors and, where CUDA is there, NCCL for CUDA ones.
        dist.init_process_group()
        return dataclasses.replace(cls._of_initialized(), owned=True)

    def close(self) -> None:
        """Destroy the process group if it was initialised here: a group left to interpreter
        exit can abort the process (std::terminate in the backend's threads)."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()

    def leave(self, error: SteadytrainError) -> NoReturn:
        """End this rank now with `error`'s exit code (its events are written). Sharded, the
        other ranks wait in an all-gather this rank will not join, and FSDP keeps the process
        group alive: an orderly interpreter exit aborts in gloo's threads (SIGABRT, not the
        code). torchrun then ends the other ranks."""
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(error.exit_code)

    def out_of_memory_before_steps(self, exc: BaseException) -> RankOutOfMemory | None:
        """An out-of-memory that ended this rank's `fit()` before its steps (the model's move,
        the optimizer a factory builds, the start-up), as `RankOutOfMemory` naming this rank
        (exit 76: `steadytrain run` restarts the group, and names the rank that ran out); None
        for a group of one, for an error that is not an out-of-memory, or for one from the
        steps, which the loop has classified already (`steadytrain_step`)."""
        from steadytrain.device import is_oom

        if not self.active or getattr(exc, "steadytrain_step", None) is not None:
            return None
        if not isinstance(exc, Exception) or isinstance(exc, SteadytrainError) or not is_oom(exc):
            return None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return RankOutOfMemory(
            f"out of memory on rank {self.rank} of {self.world_size} before the first step (the "
            f"model's placement, the optimizer or the start-up): {type(exc).__name__}: {first}; "
            "exiting 76 so that `steadytrain run` restarts the group"
        )

    def settle(self) -> None:
        """Wait until every rank is here (a fit that ended well), and leave gloo's worker
        threads holding only tensors that live to the end (see `rendezvous`)."""
        if self.active and dist.is_initialized():
            with _waiting_in("all-reduce (end of fit)"):
                for _ in range(2):  # one for each of gloo's two worker threads
                    rendezvous(self.collective_device())
            released(RELEASE_S)

    def collective_device(self) -> str:
        """Where this group's collectives can take a tensor: its device, or where that is the
        CPU (the group as `from_env` made it, before the rank's device) and the backend serves
        no CPU tensors (a script's NCCL-only group), this rank's GPU (device/core.py
        `collective_device`)."""
        if not self.backend:
            return self.device
        device = torch.device(self.device)
        found = collective_device(device, self.backend)
        return self.device if found == device else str(found)

    @classmethod
    def _of_initialized(cls) -> Group:
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            backend=str(dist.get_backend_config()),  # "cpu:gloo", "cpu:gloo,cuda:nccl"
        )

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def on(self, device: torch.device) -> Group:
        return dataclasses.replace(self, device=str(device))

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend}

    def own_dir(self, run_dir: Path) -> Path:
        """Where this rank writes its metrics, events, lock and hang dumps: rank 0 owns RUN_DIR
        (config, checkpoints, its metrics and events) as a single process does."""
        return run_dir if self.is_main else run_dir / run_files.RANKS / f"rank-{self.rank}"

    def device_name(self, configured: str) -> str:
        """The configured device, made this rank's own GPU under torchrun (cuda:LOCAL_RANK)."""
        if self.active and configured in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return configured

    # -- data ----------------------------------------------------------------------------------

    def share(self, indices: list) -> list:
        """This rank's contiguous share of one optimizer batch's indices (sizes differ by at
        most one); the batch's loading seed goes with it."""
        base, extra = divmod(len(indices), self.world_size)
        start = self.rank * base + min(self.rank, extra)
        part = indices[start : start + base + (self.rank < extra)]
        if hasattr(indices, "seed"):
            part = type(indices)(part)
            part.seed = indices.seed
        return part

    def shares(self, sampler: Any) -> _Shares:
        """A batch sampler yielding this rank's share of each of `sampler`'s batches."""
        return _Shares(sampler, self)

    def check_batches(self, sampler: Any) -> None:
        """Every rank must have at least one sample of every optimizer batch."""
        size = sampler.batch_size
        smallest = min(size, sampler.num_samples - (sampler.steps_per_epoch - 1) * size)
        if smallest < self.world_size:
            last = "" if smallest == size else " (the epoch's last batch)"
            raise BadInputError(
                f"effective_batch_size: an optimizer batch of {smallest} sample(s){last} cannot "
                f"be shared by {self.world_size} ranks; raise effective_batch_size to at least "
                f"{self.world_size}, or set drop_last: true"
            )

    # -- collectives ---------------------------------------------------------------------------

    def broadcast_module(self, model: torch.nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP's constructor does)."""
        if not self.active:
            return
        with torch.no_grad(), _waiting_in("broadcast (parameters)"):
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def total(self, n: int) -> int:
        """`n` summed over the ranks (the global batch's sample count)."""
        if not self.active:
            return n
        value = torch.tensor([n], dtype=torch.int64, device=self.device)
        with _waiting_in("all-reduce (sample count)"):
            dist.all_reduce(value)
        return int(value.item())

    def smallest(self, n: int) -> int:
        """The smallest `n` of any rank (the micro-batch every rank can run)."""
        if not self.active:
            return n
        value = torch.tensor([n], dtype=torch.int64, device=self.device)
        with _waiting_in("all-reduce (micro-batch)"):
            dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    def largest(self, values: list[float]) -> list[float]:
        """Each of `values` the largest any rank has (float64, one all-reduce)."""
        if not self.active:
            return list(values)
        value = torch.tensor(values, dtype=torch.float64, device=self.device)
        with _waiting_in("all-reduce (plan)"):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled: small objects only, the plan's messages)."""
        if not self.active:
            return obj
        box = [obj]
        with _waiting_in("broadcast (plan)"):
            dist.broadcast_object_list(box, src=0, device=torch.device(self.collective_device()))
        return box[0]

    def agree(
        self,
        failed: bool,
        params: Sequence[torch.Tensor],
        loss: torch.Tensor | float | None,
        count: torch.Tensor | int | None,
    ) -> Agreed:
        """One all-reduce after this rank's micro-batches: who failed, which parameters have
        gradients anywhere, the loss and token count summed (float64: counts stay exact)."""
        world, n_params = self.world_size, len(params)
        local = torch.zeros(world + n_params + 2, dtype=torch.float64, device=self.device)
        local[self.rank] = float(failed)
        if not failed:
            has = [p.grad is not None for p in params]
            local[world : world + n_params] = torch.tensor(has, dtype=torch.float64)
            local[-2] = torch.as_tensor(loss, dtype=torch.float64, device=self.device).reshape(())
            if count is not None:
                local[-1] = torch.as_tensor(count, dtype=torch.float64, device=self.device)
        with _waiting_in("all-reduce (agreement)"):
            dist.all_reduce(local)
        flags = local.tolist()
        return Agreed(
            failed=[r for r in range(world) if flags[r]],
            has_grad=[bool(f) for f in flags[world : world + n_params]],
            loss=local[-2].float(),
            count=local[-1].to(torch.int64) if count is not None else None,
        )

    def sum_gradients(self, params: Sequence[torch.Tensor], has_grad: Sequence[bool]) -> None:
        """Sum each gradient over the ranks, in place. A parameter some rank has no gradient for
        takes part with zeros there; one no rank has a gradient for stays None everywhere."""
        with _waiting_in("all-reduce (gradient sum)"):
            for param, has in zip(params, has_grad, strict=True):
                if not has:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad)


_KEPT: dict[str, torch.Tensor] = {}


def rendezvous(device: str | torch.device = "cpu") -> None:
    """A barrier that holds no other work's tensors. gloo's barrier keeps the works queued
    before it, and a gloo worker thread releases a finished work after its caller has moved on;
    when FSDP keeps the process group alive past `destroy_process_group`, a work released
    during interpreter exit frees tensors that need the interpreter, and the process aborts.
    This one all-reduces a tensor kept for the life of the process (on `device`: NCCL needs
    CUDA)."""
    kept = _KEPT.get(str(device))
    if kept is None:  # made once: setdefault would allocate a new one at every call
        kept = _KEPT[str(device)] = torch.zeros(1, device=device)
    dist.all_reduce(kept)
    wait_on_host(device)


RELEASE_S = 2.0
"""The longest `settle` waits for gloo's worker threads to let go of the last collectives."""


def released(timeout: float) -> bool:
    """Wait (at most `timeout` seconds) until no collective's work holds a kept tensor any more:
    a gloo worker thread lets go of a finished work a moment after its caller moved on, and one
    that lets go during interpreter exit needs the interpreter to drop the tensor's Python
    object; it cannot have it then, and the process aborts ("terminate called without an active
    exception", SIGABRT after a run that finished). A worker takes its works in order, so once
    the last rendezvous's work is let go, so are the ones before it on that thread. False when
    the time ran out or this torch cannot count a tensor's holders."""
    if not hasattr(torch.Tensor, "_use_count"):
        return False
    deadline = time.monotonic() + timeout
    while any(kept._use_count() > 1 for kept in _KEPT.values()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class _Shares:
    """`OptimizerBatchSampler` as one rank loads it: its share of each batch."""

    def __init__(self, sampler: Any, group: Group):
        self.sampler, self.group = sampler, group

    def __iter__(self) -> Iterator[list]:
        for indices in self.sampler:
            yield self.group.share(indices)

    def __len__(self) -> int:
        return len(self.sampler)
