"""The memory savers, in one place: activation checkpointing (the model recomputes activations
in the backward instead of keeping them) and the chunked loss (the loss is computed a few
thousand tokens at a time, so the logits of a large vocabulary never exist all at once).

`MemorySavers` is their one owner. It switches them on the model and the loss, and records what
is in force in the run's `TrainState` (`activation_checkpointing`, `chunked_loss`), which the
checkpoint saves. Three users, one object:

* the engine's out-of-memory ladder at micro-batch 1 asks for the `next_rung` and announces it
  (a `memory_saver` event);
* the planner switches them without events, to measure each mode (`trial_run`), and puts them
  back (`snapshot` / `restore`);
* the trainer puts in force what the config asks, or what a resumed checkpoint's run had
  (`start`).

`trial_pass` is the one forward and backward the planner measures: the trainer's `auto`
micro-batch and the `steadytrain plan --probe` command both use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from steadytrain.errors import BadInputError
from steadytrain.events import TrainState
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS

CHECKPOINTING = "activation_checkpointing"
CHUNKED_LOSS = "chunked_loss"


def checkpointing_switch(model: Any, on: bool) -> Callable[[], None] | None:
    """The model's own activation checkpointing switch, non-reentrant, or None: transformers 5
    names it `activation_checkpointing_enable` (the `gradient_checkpointing_*` names still work
    there, with a deprecation warning, and are all that older versions and other libraries
    have)."""
    for prefix in ("activation", "gradient"):
        method = getattr(model, f"{prefix}_checkpointing_{'enable' if on else 'disable'}", None)
        if callable(method):
            if not on:
                return method
            kwargs = {f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
            return lambda method=method, kwargs=kwargs: method(**kwargs)
    return None


@dataclass(frozen=True)
class Savers:
    """Which savers are in force: checkpointing on or off, the chunked loss's tokens per chunk
    (None: the plain loss)."""

    checkpointing: bool = False
    chunked_loss: int | None = None


class MemorySavers:
    """Switches the savers of `model` and `loss_fn` and records them in `state`.

    `checkpointing` is the config's `activation_checkpointing`: ``False`` keeps it off for good
    (neither the ladder nor the planner turns it on), ``True`` turns it on at the start,
    ``"auto"`` leaves it to the ladder and the planner. The chunked loss needs a loss with a
    chunked mode (`memory.chunked_loss.CausalLMLoss`, or any object with its `can_chunk` /
    `set_chunking` / `chunk_tokens`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Any,
        state: TrainState | None = None,
        checkpointing: str | bool = "auto",
    ):
        self.model, self.loss_fn = model, loss_fn
        self.state = state if state is not None else TrainState()
        self.checkpointing = checkpointing

    # -- what can be switched --------------------------------------------------------------

    @property
    def can_checkpoint(self) -> bool:
        """The model has its own switch both ways (Hugging Face models) and the config allows
        it: the planner may try it and turn it back off."""
        return self.checkpointing is not False and all(
            checkpointing_switch(self.model, on) is not None for on in (True, False)
        )

    @property
    def can_chunk_loss(self) -> bool:
        """The loss has a chunked mode that supports this model."""
        can = getattr(self.loss_fn, "can_chunk", None)
        return (
            callable(can)
            and callable(getattr(self.loss_fn, "set_chunking", None))
            and bool(can(self.model))
        )

    # -- switching, without events -----------------------------------------------------------

    def set_checkpointing(self, on: bool) -> bool:
        """Switch the model's activation checkpointing. False when it has no such switch."""
        switch = checkpointing_switch(self.model, on)
        if switch is None:
            return False
        switch()
        self.state.activation_checkpointing = on
        return True

    def set_chunked_loss(self, chunk_tokens: int | None) -> bool:
        """Compute the loss `chunk_tokens` tokens at a time (None: the plain loss). False when
        the loss has no such mode for this model."""
        if not self.can_chunk_loss:
            return False
        self.loss_fn.set_chunking(chunk_tokens)
        self.state.chunked_loss = chunk_tokens
        return True

    def snapshot(self) -> Savers:
        return Savers(self.state.activation_checkpointing, self.state.chunked_loss)

    def restore(self, savers: Savers) -> None:
        """Switch to `savers`, touching only what differs from what is in force."""
        if savers.checkpointing != self.state.activation_checkpointing:
            self.set_checkpointing(savers.checkpointing)
        if savers.chunked_loss != self.state.chunked_loss:
            self.set_chunked_loss(savers.chunked_loss)

    # -- the run's uses ------------------------------------------------------------------------

    def start(self, resumed: bool) -> None:
        """At the start of a run: checkpointing on when the config says ``True`` or a resumed
        checkpoint's run had it on; the chunked loss as the checkpoint's run computed it (its
        arithmetic must be restored exactly), or as `loss_fn` comes on a fresh run."""
        on = self.state.activation_checkpointing or self.checkpointing is True
        self.state.activation_checkpointing = False
        if on:
            self.set_checkpointing(True)
        chunk = getattr(self.loss_fn, "chunk_tokens", None)
        if not resumed:
            self.state.chunked_loss = chunk
        elif self.state.chunked_loss != chunk and not self.set_chunked_loss(
            self.state.chunked_loss
        ):
            raise BadInputError(
                f"resume: the checkpoint's run computed its loss in chunks of "
                f"{self.state.chunked_loss} tokens, and this loss_fn has no chunked mode for "
                "this model; use the loss of that run (memory.chunked_loss."
                "CausalLMLoss) or start a new run_dir"
            )

    def next_rung(self, reason: str) -> dict[str, Any] | None:
        """Turn on the next saver of the out-of-memory ladder (checkpointing, then the chunked
        loss) and return the `memory_saver` event's info; None when none is left."""
        if (
            self.checkpointing is not False
            and not self.state.activation_checkpointing
            and self.set_checkpointing(True)
        ):
            return {"saver": CHECKPOINTING, "reason": reason}
        if self.state.chunked_loss is None and self.set_chunked_loss(DEFAULT_CHUNK_TOKENS):
            return {"saver": CHUNKED_LOSS, "chunk_tokens": DEFAULT_CHUNK_TOKENS, "reason": reason}
        return None

    def describe(self) -> str:
        """The savers in force, for a does-not-fit message."""
        if self.state.activation_checkpointing:
            text = "activation checkpointing on"
        elif self.checkpointing is False:
            text = "activation checkpointing off by the config"
        else:
            text = "the model has no activation checkpointing to turn on"
        if self.state.chunked_loss is not None:
            text += f", the loss chunked by {self.state.chunked_loss} tokens"
        return text

    def trial_run(
        self, one_pass: Callable[[int], None], chunked_loss: int | None
    ) -> Callable[[int, bool], None]:
        """The planner's ``run(size, checkpointing)`` (`memory.probe.RunPass`): switch to that
        mode with the loss chunked by `chunked_loss`, then `one_pass(size)`. Its `method` says
        how the loss is computed in that mode ("plain", "chunked", "fused"), for the plan's
        reasons."""

        def run(size: int, checkpointing: bool) -> None:
            self.restore(Savers(checkpointing, chunked_loss))
            one_pass(size)

        run.method = "plain" if chunked_loss is None else self.chunked_method()
        return run

    def chunked_method(self) -> str:
        """How the loss's chunked mode computes: "fused" (the fused linear cross-entropy kernel,
        memory/fused_loss.py) or "chunked" (checkpointed chunks, any loss without the method)."""
        method = getattr(self.loss_fn, "chunked_method", None)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return (method(self.model, device) if callable(method) else None) or "chunked"


def trial_pass(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    batch: Any,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> None:
    """One forward and backward of `batch` (already on the device) as a training step runs a
    micro-batch (under `autocast()`, through `loss_fn`), then the gradients are dropped: the
    optimizer never sees them, so the model is unchanged. The planner's probe measures the
    memory and time of a micro-batch with it. Out-of-memory propagates to the caller."""
    try:
        with autocast():
            out = loss_fn(model, batch)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        del out, loss
    finally:
        for param in model.parameters():
            param.grad = None
