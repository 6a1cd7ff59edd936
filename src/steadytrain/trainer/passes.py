"""`Passes`: the `Trainer`'s passes outside the loop's steps, both on the batch the loop will load
and each a side pass that leaves no trace in the run (`steadytrain.engine.side_pass`): the plan's
trial passes (micro_batch_size "auto", `plan()`) and the resume probe (the next step's loss,
which the resumed run's continuity check compares, `probe_next_loss()`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from steadytrain._units import format_bytes
from steadytrain.config import TrainConfig
from steadytrain.device import OutOfMemory
from steadytrain.engine.batching import batch_len, split_batch, to_device
from steadytrain.engine.side_pass import side_pass, trial_pass
from steadytrain.engine.step import check_loss_output
from steadytrain.errors import RankOutOfMemory
from steadytrain.events import Callback, Control, TrainState
from steadytrain.memory.analytic import Analytic, Sharding, analytic_for
from steadytrain.memory.choice import Mode
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.lockstep import Lockstep
from steadytrain.memory.offload import OFFLOAD
from steadytrain.memory.plan import Plan, compiled_growth, first_step_bytes, plan
from steadytrain.memory.plan_record import with_ranks
from steadytrain.memory.savers import Savers, one_sample_norms
from steadytrain.memory.settings import DEFAULT_TILE_TOKENS
from steadytrain.run import env as run_env
from steadytrain.run.records import Record
from steadytrain.trainer.data import DataSource, batch_at
from steadytrain.trainer.parts import RunParts
from steadytrain.user_state import select


class Passes:
    """The side passes of one fit, on its `parts`, with the program's `loss_fn`, `user_state`
    and `data`; `record` writes a record to this rank's events (a trial's out-of-memory)."""

    def __init__(
        self,
        cfg: TrainConfig,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        user_state: dict[str, Any],
        data: DataSource,
        parts: RunParts,
        record: Callable[[str, dict], None] = lambda name, fields: None,
    ):
        self.cfg, self.loss_fn, self.user_state = cfg, loss_fn, user_state
        self.data, self.parts, self.record = data, parts, record

    def plan(self, compiled: bool = False, eager=None) -> list[tuple]:
        """micro_batch_size 'auto': measure passes on the first optimizer batch and set the micro
        size (and the memory savers) from `steadytrain.memory.plan`. The probe leaves no trace
        in the run: gradients are dropped, buffers (BatchNorm statistics) and every RNG stream
        are put back, so the run's losses are those of a run started at the chosen size.
        Returns the `plan` and `estimate` events (what was chosen and why).

        Under torchrun each rank measures its own share. Sharded (`distributed: fsdp`), the
        trial passes are collectives: they run in lockstep (`memory.lockstep`), rank 0 planning
        on the worst rank's figures, and every rank takes its plan; a rank that runs out of
        memory in one leaves with exit 76 (`_trial_out_of_memory`). Replicated, the passes hold
        no collective: each rank plans alone, then the ranks agree on the smallest micro-batch
        and on every saver any rank chose (`_agreed`)."""
        cfg, run = self.cfg, self.parts
        state, savers, model, group = run.state, run.savers, run.model, run.group
        batch = batch_at(self.data, run.sampler, 0, 0, group)  # planned per rank, its share
        savers.see_batch(batch)  # the ladder's tiled MLP only for samples longer than a piece
        # sharded, the estimate is one rank's: its share of the batch, its shard of the state
        offload = bool(run.distributed.get("offload"))  # the shards in host memory
        sharding = Sharding(group.world_size, batch_len(batch), offload) if group.sharded else None
        analytic, unpriced = analytic_for(
            model,
            batch,
            precision=run.precision.name,
            optimizer=run.optimizer,
            device_type=run.device.type,
            compiled=compiled,
            fused_loss=_chunked_method(self.loss_fn, model, run.device.torch_device) == "fused",
            sharding=sharding,
        )

        def one_pass(size: int) -> None:
            piece = to_device(
                split_batch(batch, size)[0], run.device.torch_device, run.runner.non_blocking
            )
            select(self.user_state, 0, size, batch_len(batch))  # the first `size` samples' state
            with one_sample_norms(model, size):
                trial_pass(model, _checked(self.loss_fn), piece, run.precision.autocast)

        before = savers.snapshot()
        runs = {"plain": savers.trial_run(one_pass, before.chunked_loss)}
        # The chunked loss is a candidate when the loss has a chunked mode for this model and
        # the caller did not choose chunking already.
        if before.chunked_loss is None and savers.can_chunk_loss:
            runs["chunked"] = savers.trial_run(one_pass, DEFAULT_CHUNK_TOKENS)
        # savers in force already (the supervisor's, after an attempt ran out at micro-batch 1)
        # are where the plan starts
        checkpointing = before.checkpointing or cfg.activation_checkpointing
        # The tiled MLP is the planner's to turn on where it is not on already (one process, or
        # replicated ranks: sharded ranks run the leader's passes, and the ladder has it there).
        tile = None
        if before.tiled_mlp is None and savers.can_tile_mlp and not group.sharded:

            def tile(on: bool) -> bool:
                return savers.set_tiled_mlp(DEFAULT_TILE_TOKENS if on else None)

        cap = state.micro_batch_size  # under torchrun no more than this rank's share
        cap = min(cap, batch_len(batch)) if group.active else cap

        def planner(passes: dict, device) -> Plan:
            return plan(
                passes["plain"],
                device,
                effective_batch_size=cfg.effective_batch_size,
                activation_checkpointing=checkpointing,
                can_checkpoint=savers.can_checkpoint,
                can_offload=savers.can_offload,
                chunked_run=passes.get("chunked"),
                plan_margin=None if cfg.plan_margin == "auto" else cfg.plan_margin,
                micro_batch_sizes=cfg.micro_batch_sizes,
                cap=cap,
                analytic=analytic,
                pending=0 if offload else _pending(run.optimizer, group.sharded),
                compiled=compiled_growth(model) if compiled else False,
                eager_passes=eager,
                tile=tile,
            )

        with side_pass(
            rng=True, buffers=model.buffers(), user_state=self.user_state, others=[savers]
        ):
            if group.sharded:
                lockstep = Lockstep(
                    run.device,
                    runs,
                    broadcast=group.broadcast_object,
                    largest=group.largest,
                    out_of_memory=self._trial_out_of_memory,
                )
                chosen = lockstep.leader_plan(planner) if group.is_main else lockstep.follow()
            else:
                chosen = planner(runs, run.device)
        chosen = self._agreed(chosen, unpriced)
        state.micro_batch_size = chosen.micro_batch_size
        savers.restore(
            Savers(
                before.checkpointing or chosen.activation_checkpointing,
                before.chunked_loss or (DEFAULT_CHUNK_TOKENS if chosen.chunked_loss else None),
                before.tiled_mlp or (DEFAULT_TILE_TOKENS if chosen.tiled_mlp else None),
            )
        )
        if savers.snapshot() != before:  # the plan turned savers on: in force from here
            self._savers_in_force()
        estimate = chosen.estimate_event()
        return [(Record.PLAN, chosen.to_event())] + (
            [(Record.ESTIMATE, estimate)] if estimate else []
        )

    def _agreed(self, chosen: Plan, unpriced: str | None = None) -> Plan:
        """One plan for every rank: sharded, rank 0's already (said in its reasons, with how
        the per-rank estimate priced it, or `unpriced`: why there is none); replicated, the
        smallest micro-batch any rank chose, with every saver any rank chose (a rank that
        needed one at its size needs it at a size no larger)."""
        group = self.parts.group
        if not group.active:
            return chosen
        ranks = f"{group.world_size} ranks"
        if group.sharded:
            why = (
                f"{ranks} (distributed: fsdp): the trial passes ran in lockstep on every rank, "
                "with their all-gathers and reduce-scatters, each peak the largest any rank "
                f"reached; micro {chosen.micro_batch_size} on every rank"
            )
            priced = _per_rank_reason(chosen.analytic, unpriced, group.world_size)
            # fsdp_offload, where the per-rank estimate chose it before sharding
            before = self.parts.distributed.get("offload_reason")
            own = with_ranks(
                chosen.reasons,
                chosen.micro_batch_size,
                chosen.effective_batch_size,
                group.world_size,
            )
            return dataclasses.replace(
                chosen,
                reasons=[*own, *([before] if before else []), priced, why],
                world_size=group.world_size,
                fsdp_offload=bool(self.parts.distributed.get("offload")),
            )
        level = _SAVING.index(chosen.activation_checkpointing)
        smallest = group.smallest(chosen.micro_batch_size)
        most, chunked, tiled = group.largest(
            [float(level), float(chosen.chunked_loss), float(chosen.tiled_mlp)]
        )
        checkpointing = _SAVING[int(most)]
        why = (
            f"{ranks} (distributed: replicate): each rank planned its own share; agreed on the "
            f"smallest micro-batch any rank chose, {smallest}, and on every saver any rank chose"
        )
        own = with_ranks(chosen.reasons, smallest, chosen.effective_batch_size, group.world_size)
        return dataclasses.replace(
            chosen,
            micro_batch_size=smallest,
            checkpointing=bool(checkpointing),
            offload=checkpointing == OFFLOAD,
            chunked_loss=bool(chunked),
            tiled_mlp=bool(tiled),
            reasons=[*own, why],
            world_size=group.world_size,
        )

    def _savers_in_force(self) -> None:
        """Supervised, record the savers in force now (`memory_savers`; the supervisor reads
        the newest of this attempt's), so that an out-of-memory at micro-batch 1 after the plan
        turned savers on restarts with the next one, not with one the plan had on already."""
        if run_env.supervised():
            savers = self.parts.savers
            self.record(
                Record.MEMORY_SAVERS,
                {
                    "step": self.parts.state.step,
                    "in_force": savers.in_force(),
                    "left": savers.left(),
                    "asked": run_env.memory_savers() or None,
                },
            )

    def _trial_out_of_memory(self, size: int, checkpointing: bool | str, oom: OutOfMemory):
        """A sharded trial pass ran out of memory on this rank: the other ranks may be inside a
        collective this rank will not reach, so it records its `oom` (the phase "plan", the
        size tried) and leaves with exit 76, as the sharded step does: `steadytrain run`
        restarts the group at half that size, or at micro-batch 1 with the next memory saver
        on. Supervised, it records the savers the pass had on as in force (`memory_savers`,
        which the supervisor reads the newest of): the next start then has one more than the
        pass, rather than the one the start had before its plan chose more (a pass the
        per-rank estimate sent straight to checkpointing must not be retried with
        checkpointing alone)."""
        run = self.parts
        group = run.group
        self._savers_in_force()
        self.record(
            Record.OOM,
            {
                "step": run.state.step,
                "phase": "plan",
                "error": oom.error,
                "requested": oom.requested,
                "micro_batch_size": size,
                "activation_checkpointing": checkpointing,
                "memory": run.device.memory().to_dict(),
                "rank": group.rank,
            },
        )
        next_start = "at half that micro-batch" if size > 1 else "with the next memory saver on"
        raise RankOutOfMemory(
            f"out of memory on rank {group.rank} of {group.world_size} in the plan's trial pass "
            f"at micro-batch {size} (distributed: fsdp): {oom.error}; exiting 76 so that "
            f"`steadytrain run` restarts the group {next_start}"
        )

    def probe_next_loss(self, state: TrainState) -> float | None:
        """The loss the next step will report, computed now without changing anything, so that a
        resume from this checkpoint can prove it restored everything (see ContinuityCheck). It
        computes what the resumed step computes: the next epoch's first batch after the epoch's
        end hooks of the program's state (`CarriedState(reset_each_epoch=True)`), in a
        DataLoader's order for that epoch drawn ahead on copies of its sampler and generator
        from the streams as the epoch's start finds them (put back after), its forward with
        autograd on as the step's (some kernels, nn.LSTM's on the CPU, differ without). The
        batch is this rank's share."""
        run = self.parts
        if state.step >= state.max_steps:
            return None
        epoch, position = state.epoch, state.batch_in_epoch
        new_epoch = position >= state.steps_per_epoch
        if new_epoch:
            epoch, position = epoch + 1, 0
        with side_pass(rng=True, buffers=run.model.buffers(), user_state=self.user_state):
            if new_epoch:  # the state as the epoch's end leaves it (CarriedState resets)
                for obj in self.user_state.values():
                    if isinstance(obj, Callback):
                        obj.on_epoch_end(state, Control(), {"epoch": state.epoch})
            # a DataLoader's next order: drawn now, as the epoch's start will draw it
            batch = batch_at(self.data, run.sampler, epoch, position, run.group, ahead=True)
            if batch is None:
                return None  # its sampler cannot be copied (it holds a lock, a file): no check
            return run.runner.evaluate(batch, autograd=True)  # as the step: same kernels


_SAVING = (False, True, OFFLOAD)
"""activation_checkpointing values, each saving more than the one before."""


def _per_rank_reason(analytic: Analytic | None, unpriced: str | None, world_size: int) -> str:
    """How the per-rank estimate priced a sharded plan, or why it could not."""
    problem = unpriced or (analytic.problem if analytic is not None else None)
    totals = None if analytic is None else [analytic.total(1, m) for m in (Mode(), Mode(True))]
    if totals is None or None in totals:
        return (
            f"per-rank estimate: none ({problem or 'not made'}); the trial passes alone price "
            "the plan"
        )
    plain, checkpointed = (format_bytes(t) for t in totals)
    where = " in host memory (fsdp_offload)" if analytic.settings.fsdp_offload else ""
    return (
        f"per-rank estimate (fsdp over {world_size} ranks: each rank's shard of the weights, "
        f"gradients and optimizer state{where}, the root and two decoder layers gathered whole, its "
        f"own micro-batch's activations): one sample {plain} plain, {checkpointed} with "
        "activation checkpointing; a mode it puts over the limit is not tried when one with "
        "more savers is estimated lower"
    )


def _pending(optimizer: torch.optim.Optimizer, sharded: bool) -> int:
    """The optimizer state the first step creates (`first_step_bytes`), on this rank: a sharded
    parameter's state is the size of its local shard."""
    pending = first_step_bytes(optimizer)
    if not sharded or not pending:
        return pending
    params = [p for g in optimizer.param_groups for p in g["params"]]
    whole = sum(p.numel() for p in params)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return pending * local // max(whole, 1)


def _checked(loss_fn: Callable[[torch.nn.Module, Any], Any]) -> Callable[..., Any]:
    """`loss_fn` whose output is refused as the step refuses it, before the plan measures it."""

    def checked(model: torch.nn.Module, batch: Any) -> Any:
        out = loss_fn(model, batch)
        check_loss_output(out)
        return out

    return checked


def _chunked_method(loss_fn: Any, model: torch.nn.Module, device: torch.device) -> str | None:
    """How the loss's chunked mode computes on `device` ("fused", "chunked"), None for a loss
    without one."""
    method = getattr(loss_fn, "chunked_method", None)
    return method(model, device) if callable(method) else None
