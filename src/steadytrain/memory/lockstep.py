"""The plan's trial passes on several ranks in lockstep (`distributed: fsdp`).

A sharded model's forward all-gathers each block's parameters and its backward reduce-scatters
the gradients: a trial pass is a collective, which every rank must enter with the same size and
mode, in the same order. So one rank decides and every rank runs. Rank 0 (the leader) runs the
planner as one process would (`plan.plan`); each pass the planner asks for is first announced to
every rank (a broadcast), then run by every rank on its own share of the first optimizer batch,
and the peak the planner reads is the largest growth any rank had above its own memory in use
before the plan (an all-reduce), counted from the leader's. The room the planner is given is the
smallest any rank has. The other ranks (the followers) serve passes until the leader announces
its plan, which every rank then takes. So the plan is one that fits on every rank, measured with
the all-gathers and reduce-scatters the steps will run, and every rank takes the same.

An out-of-memory in a trial pass is not agreed on here: the rank that ran out may be outside a
collective the others are inside of. The caller's `out_of_memory(size, checkpointing, oom)`
decides (the trainer records it and leaves with exit 76, as the sharded step does).

The memory layer knows no process group: the caller hands over `broadcast(obj)` (rank 0's object,
on every rank) and `largest(values)` (each value the largest over the ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from steadytrain.device import Device, OutOfMemory, call_or_oom
from steadytrain.device.reading import PeakReading
from steadytrain.memory.probe import RunPass, in_use

Broadcast = Callable[[Any], Any]
"""broadcast(obj): rank 0's `obj` on every rank (what the other ranks pass is ignored)."""
Largest = Callable[[list[float]], list[float]]
"""largest(values): each value the largest any rank passed."""
OutOfMemoryAt = Callable[[int, "bool | str", OutOfMemory], NoReturn]
"""out_of_memory(size, checkpointing, oom): a trial pass ran out of memory on this rank; it
raises (the other ranks cannot be told: see the module's docstring)."""

_PASS, _DONE = "pass", "done"


class Lockstep:
    """One lockstep planning: built on every rank (its constructor is a collective), then
    `leader_plan` on rank 0 and `follow` on the others. `runs` names the passes the planner may
    ask for ("plain", and "chunked" where the loss has a chunked mode), the same on every rank."""

    def __init__(
        self,
        device: Device,
        runs: dict[str, RunPass],
        *,
        broadcast: Broadcast,
        largest: Largest,
        out_of_memory: OutOfMemoryAt,
    ):
        self.device, self.runs = device, runs
        self.broadcast, self.largest, self.out_of_memory = broadcast, largest, out_of_memory
        base, budget = in_use(device), device.budget
        unknown = base is None or budget is None
        room = 0 if unknown else budget - base
        worst = largest([float(unknown), float(-room)])
        self.base = base or 0
        self.room = None if worst[0] else int(-worst[1])
        """The least room above its memory in use that any rank has; None where a rank
        cannot tell (no budget, no reading)."""
        self.peak: PeakReading | None = None

    # -- rank 0 ----------------------------------------------------------------------------

    def leader_plan(self, planner: Callable[[dict[str, RunPass], Device], Any]) -> Any:
        """`planner(runs, device)` with passes every rank runs and a device whose budget and peak
        are the worst rank's; then its plan announced to every rank and returned."""
        announced = {name: self._announcing(name) for name in self.runs}
        chosen = planner(announced, AgreedDevice(self))
        self.broadcast((_DONE, chosen))
        return chosen

    def _announcing(self, name: str) -> RunPass:
        def run(size: int, checkpointing: bool | str) -> None:
            self.broadcast((_PASS, name, size, checkpointing))
            self._serve(name, size, checkpointing)

        run.method = getattr(self.runs[name], "method", None)
        return run

    # -- every rank ------------------------------------------------------------------------

    def follow(self) -> Any:
        """On the other ranks: run each pass rank 0 announces, until it announces its plan;
        returns that plan."""
        while True:
            message = self.broadcast(None)
            if message[0] == _DONE:
                return message[1]
            _, name, size, checkpointing = message
            self._serve(name, size, checkpointing)

    def _serve(self, name: str, size: int, checkpointing: bool | str) -> None:
        """One pass on this rank, then the largest growth above each rank's memory in use."""
        device = self.device
        device.synchronize()
        device.reset_peak_reading()
        _, oom = call_or_oom(lambda: self.runs[name](size, checkpointing), device.empty_cache)
        if oom is not None:
            self.out_of_memory(size, checkpointing, oom)
        device.synchronize()
        reading = device.peak_reading()
        growth = None if reading.bytes is None else max(reading.bytes - self.base, 0)
        worst = self.largest([float(growth is None), float(growth or 0)])
        bytes_ = None if worst[0] else self.base + int(worst[1])
        self.peak = PeakReading(bytes_, reading.kind if bytes_ is not None else "none")


class AgreedDevice:
    """The leader's device as its planner sees it: the worst rank's room and peaks (`Lockstep`),
    everything else this rank's own."""

    def __init__(self, lockstep: Lockstep):
        self._lockstep = lockstep
        self._device = lockstep.device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    @property
    def budget(self) -> int | None:
        """This rank's memory in use before the plan plus the least room any rank has."""
        room = self._lockstep.room
        return None if room is None else self._lockstep.base + room

    def reset_peak_reading(self) -> None:
        self._lockstep.peak = None
        self._device.reset_peak_reading()

    def peak_reading(self) -> PeakReading:
        """The last pass's peak: the largest growth any rank had, counted from this rank's
        memory in use before the plan."""
        peak = self._lockstep.peak
        return peak if peak is not None else self._device.peak_reading()


__all__ = ["AgreedDevice", "Lockstep"]
