"""`Passes`: the `Trainer`'s passes outside the loop's steps, both on the batch the loop will load
and each a side pass that leaves no trace in the run (`steadytrain.engine.side_pass`): the plan's
trial passes (micro_batch_size "auto", `plan()`) and the resume probe (the next step's loss,
which the resumed run's continuity check compares, `probe_next_loss()`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from steadytrain.config import TrainConfig
from steadytrain.engine.batching import batch_len, split_batch, to_device
from steadytrain.engine.side_pass import side_pass, trial_pass
from steadytrain.engine.step import check_loss_output
from steadytrain.events import Callback, Control, TrainState
from steadytrain.memory.analytic import analytic_for
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.plan import compiled_growth, first_step_bytes, plan
from steadytrain.memory.savers import Savers, one_sample_norms
from steadytrain.run.records import Record
from steadytrain.trainer.data import DataSource, batch_at
from steadytrain.trainer.parts import RunParts
from steadytrain.user_state import select


class Passes:
    """The side passes of one fit, on its `parts`, with the program's `loss_fn`, `user_state`
    and `data`."""

    def __init__(
        self,
        cfg: TrainConfig,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        user_state: dict[str, Any],
        data: DataSource,
        parts: RunParts,
    ):
        self.cfg, self.loss_fn, self.user_state = cfg, loss_fn, user_state
        self.data, self.parts = data, parts

    def plan(self, compiled: bool = False, eager=None) -> list[tuple]:
        """micro_batch_size 'auto': measure passes on the first optimizer batch and set the micro
        size (and the memory savers) from `steadytrain.memory.plan`. The probe leaves no trace
        in the run: gradients are dropped, buffers (BatchNorm statistics) and every RNG stream
        are put back, so the run's losses are those of a run started at the chosen size.
        Returns the `plan` and `estimate` events (what was chosen and why)."""
        cfg, run = self.cfg, self.parts
        state, savers, model = run.state, run.savers, run.model
        batch = batch_at(self.data, run.sampler, 0, 0, run.group)  # planned per rank, its share
        analytic, _ = analytic_for(
            model,
            batch,
            precision=run.precision.name,
            optimizer=run.optimizer,
            device_type=run.device.type,
            compiled=compiled,
            fused_loss=_chunked_method(self.loss_fn, model, run.device.torch_device) == "fused",
        )

        def one_pass(size: int) -> None:
            piece = to_device(
                split_batch(batch, size)[0], run.device.torch_device, run.runner.non_blocking
            )
            select(self.user_state, 0, size, batch_len(batch))  # the first `size` samples' state
            with one_sample_norms(model, size):
                trial_pass(model, _checked(self.loss_fn), piece, run.precision.autocast)

        before = savers.snapshot()
        # The chunked loss is a candidate when the loss has a chunked mode for this model and
        # the caller did not choose chunking already.
        offer_chunked = before.chunked_loss is None and savers.can_chunk_loss
        with side_pass(
            rng=True, buffers=model.buffers(), user_state=self.user_state, others=[savers]
        ):
            chosen = plan(
                savers.trial_run(one_pass, before.chunked_loss),
                run.device,
                effective_batch_size=cfg.effective_batch_size,
                activation_checkpointing=cfg.activation_checkpointing,
                can_checkpoint=savers.can_checkpoint,
                can_offload=savers.can_offload,
                chunked_run=savers.trial_run(one_pass, DEFAULT_CHUNK_TOKENS)
                if offer_chunked
                else None,
                plan_margin=None if cfg.plan_margin == "auto" else cfg.plan_margin,
                micro_batch_sizes=cfg.micro_batch_sizes,
                cap=state.micro_batch_size,
                analytic=analytic,
                pending=first_step_bytes(run.optimizer),
                compiled=compiled_growth(model) if compiled else False,
                eager_passes=eager,
            )
        state.micro_batch_size = run.group.smallest(chosen.micro_batch_size)  # one size for all
        savers.restore(
            Savers(
                before.checkpointing or chosen.activation_checkpointing,
                before.chunked_loss or (DEFAULT_CHUNK_TOKENS if chosen.chunked_loss else None),
            )
        )
        estimate = chosen.estimate_event()
        return [(Record.PLAN, chosen.to_event())] + (
            [(Record.ESTIMATE, estimate)] if estimate else []
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
