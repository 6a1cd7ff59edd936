"""The memory savers' implementations: activation checkpointing (the model recomputes activations
in the backward instead of keeping them; on a GPU with memory of its own it may also keep the
layers' inputs in host memory, `memory.offload`), the chunked loss (the loss is computed a few
thousand tokens at a time, so the logits of a large vocabulary never exist all at once) and the
tiled MLP (each decoder layer's MLP over a piece of the tokens at a time, `memory.tiled_mlp`). They
are registered in `steadytrain.run.savers` (names, the ladder's order, needs, config keys, flags,
docs); each entry there names its `Rung` here, and the ladder (`next_rung`, `in_force`, `left`)
climbs the registry's order.

`MemorySavers` is their one owner. It switches them on the model and the loss, and records what
is in force in the run's `TrainState` (`activation_checkpointing`, `chunked_loss`, `tiled_mlp`), which the
checkpoint saves. Three users, one object:

* the engine's out-of-memory ladder at micro-batch 1 asks for the `next_rung` and announces it
  (a `memory_saver` event);
* the planner switches them without events, to measure each mode (`trial_run`), and puts them
  back (`snapshot` / `restore`);
* the trainer puts in force what the config asks, or what a resumed checkpoint's run had
  (`start`).

The planner measures the passes its caller gives it (`trial_run` wraps the caller's
`one_pass(size)`; the engine's `engine.side_pass.trial_pass` is the forward and backward the
trainer's `auto` micro-batch and `steadytrain plan --probe` build it from); `one_sample_norms`
lets a BatchNorm model run the planner's pass of a single sample.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from steadytrain.errors import BadInputError
from steadytrain.events import TrainState
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.offload import OFFLOAD, use_offload
from steadytrain.memory.tiled_mlp import DEFAULT_TILE_TOKENS, set_tiling, token_wise_mlps
from steadytrain.run import savers as run_savers
from steadytrain.run.savers import Saver


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
    """Which savers are in force: checkpointing off, on or "offload" (on, its kept inputs in host
    memory), the chunked loss's tokens per chunk (None: the plain loss), the tiled MLP's tokens
    per piece (None: each MLP over the whole input)."""

    checkpointing: bool | str = False
    chunked_loss: int | None = None
    tiled_mlp: int | None = None


class MemorySavers:
    """Switches the savers of `model` and `loss_fn` and records them in `state`.

    `checkpointing` is the config's `activation_checkpointing`: ``False`` keeps it off for good
    (neither the ladder nor the planner turns it on), ``True`` turns it on at the start,
    ``"offload"`` turns it on with offloaded inputs at the start, ``"auto"`` leaves it to the
    ladder and the planner. `discrete_memory`: the device has memory of its own (CUDA), so
    offload may be used (the config's "offload", the planner's candidate, the ladder's rung
    after checkpointing); never elsewhere. The chunked loss needs a loss with a
    chunked mode (`memory.chunked_loss.CausalLMLoss`, or any object with its `can_chunk` /
    `set_chunking` / `chunk_tokens`). `tiled_mlp` is the config's: ``False`` never tiles the
    MLPs (`memory.tiled_mlp`), ``True`` or a number of tokens tiles them from the start (by
    `DEFAULT_TILE_TOKENS` or that many), ``"auto"`` leaves it to the planner and the ladder."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Any,
        state: TrainState | None = None,
        checkpointing: str | bool = "auto",
        discrete_memory: bool = False,
        tiled_mlp: str | bool | int = "auto",
    ):
        self.model, self.loss_fn = model, loss_fn
        self.state = state if state is not None else TrainState()
        self.checkpointing = checkpointing
        self.discrete_memory = discrete_memory
        self.tiled_mlp = tiled_mlp
        self.sample_tokens: int | None = None
        """Tokens of one sample where the run's batch showed them (its `input_ids`' second
        dimension, set by the plan), None where unknown: the ladder offers the tiled MLP only
        where one sample is longer than a piece, since shorter samples run in one piece
        anyway."""

    def see_batch(self, batch: Any) -> None:
        """Take one sample's tokens from a batch of `input_ids` (batch, seq), the shape the
        token-wise MLPs' families take; another batch leaves them unknown."""
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self.sample_tokens = int(ids.shape[1])

    # -- what can be switched --------------------------------------------------------------

    @property
    def can_checkpoint(self) -> bool:
        """The model has its own switch both ways (Hugging Face models) and the config allows
        it: the planner may try it and turn it back off."""
        return self.checkpointing is not False and all(
            checkpointing_switch(self.model, on) is not None for on in (True, False)
        )

    @property
    def can_offload(self) -> bool:
        """Checkpointing can be switched, the device has memory of its own, and the model has
        layers that take a checkpoint function (a Hugging Face `gradient_checkpointing` flag)."""
        return (
            self.discrete_memory
            and self.can_checkpoint
            and any(hasattr(m, "gradient_checkpointing") for m in self.model.modules())
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

    @property
    def can_tile_mlp(self) -> bool:
        """The config allows the tiled MLP and the model has token-wise MLPs to tile."""
        return self.tiled_mlp is not False and bool(token_wise_mlps(self.model))

    # -- switching, without events -----------------------------------------------------------

    def set_checkpointing(self, on: bool | str) -> bool:
        """Switch the model's activation checkpointing (`on`: False, True or "offload"). False
        when it has no such switch, or no layer took the offloaded checkpoint (plain
        checkpointing is then in force)."""
        switch = checkpointing_switch(self.model, bool(on))
        if switch is None:
            return False
        switch()  # turning it on puts the model's plain checkpoint function back
        self.state.activation_checkpointing = bool(on)
        if on == OFFLOAD:
            if not use_offload(self.model):
                return False
            self.state.activation_checkpointing = OFFLOAD
        return True

    def set_chunked_loss(self, chunk_tokens: int | None) -> bool:
        """Compute the loss `chunk_tokens` tokens at a time (None: the plain loss). False when
        the loss has no such mode for this model."""
        if not self.can_chunk_loss:
            return False
        self.loss_fn.set_chunking(chunk_tokens)
        self.state.chunked_loss = chunk_tokens
        return True

    def set_tiled_mlp(self, tokens: int | None) -> bool:
        """Run the model's MLPs `tokens` tokens at a time (None: whole). False when the config
        forbids it or the model has no token-wise MLP."""
        if tokens is not None and not self.can_tile_mlp:
            return False
        set_tiling(self.model, tokens)
        self.state.tiled_mlp = tokens
        return True

    def snapshot(self) -> Savers:
        return Savers(
            self.state.activation_checkpointing, self.state.chunked_loss, self.state.tiled_mlp
        )

    def restore(self, savers: Savers) -> None:
        """Switch to `savers`, touching only what differs from what is in force."""
        if savers.checkpointing != self.state.activation_checkpointing:
            self.set_checkpointing(savers.checkpointing)
        if savers.chunked_loss != self.state.chunked_loss:
            self.set_chunked_loss(savers.chunked_loss)
        if savers.tiled_mlp != self.state.tiled_mlp:
            self.set_tiled_mlp(savers.tiled_mlp)

    @property
    def can_switch_checkpointing_on(self) -> bool:
        """The config allows checkpointing and the model has a switch to turn it on."""
        return (
            self.checkpointing is not False and checkpointing_switch(self.model, True) is not None
        )

    # -- the run's uses ------------------------------------------------------------------------

    def start(self, resumed: bool) -> None:
        """At the start of a run: checkpointing on when the config says ``True`` or a resumed
        checkpoint's run had it on, offloaded when the config says "offload" or that run had
        it so (plain where this device cannot: the values are the same); the chunked loss as
        the checkpoint's run computed it (its arithmetic must be restored exactly), or as
        `loss_fn` comes on a fresh run; the tiled MLP as the checkpoint's run had it, or as the
        config asks (True or a number of tokens)."""
        on = self.state.activation_checkpointing or self.checkpointing in (True, OFFLOAD)
        if OFFLOAD in (self.state.activation_checkpointing, self.checkpointing):
            on = OFFLOAD if self.can_offload else True
        self.state.activation_checkpointing = False
        if on:
            self.set_checkpointing(on)
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
        tiles = self.state.tiled_mlp if resumed else None
        if tiles is None and self.tiled_mlp not in ("auto", False):
            tiles = DEFAULT_TILE_TOKENS if self.tiled_mlp is True else int(self.tiled_mlp)
        self.state.tiled_mlp = None
        self.set_tiled_mlp(tiles)  # None: untiled, even where a run before tiled this model

    def next_rung(self, reason: str) -> dict[str, Any] | None:
        """Turn on the next saver of the out-of-memory ladder (`run_savers.SAVERS`' order:
        checkpointing, then, on a device with memory of its own, its inputs offloaded, then the
        chunked loss) and return the `memory_saver` event's info; None when none is left."""
        implementations = rungs()
        for saver, rung in ladder():
            waits = saver.after is not None and not implementations[saver.after].on(self)
            if rung.on(self) or waits:
                continue
            info = rung.turn_on(self)
            if info is not None:
                return {"saver": saver.name, **info, "reason": reason}
        return None

    def in_force(self) -> list[str]:
        """The rungs of the ladder in force, by their `memory_saver` event names."""
        return [saver.name for saver, rung in ladder() if rung.on(self)]

    def left(self) -> list[str]:
        """The rungs `next_rung` could still turn on, in its order, without switching any."""
        names: list[str] = []
        implementations = rungs()
        for saver, rung in ladder():
            after = saver.after is None or saver.after in names
            after = after or implementations[saver.after].on(self)
            if not rung.on(self) and after and rung.can(self):
                names.append(saver.name)
        return names

    def climb_to(self, count: int, reason: str) -> list[dict[str, Any]]:
        """Turn on rungs of the ladder until `count` of them are in force or none is left (the
        supervisor's escalation after the OS killed a run at micro-batch 1); returns the
        `memory_saver` events' infos."""
        turned = []
        while len(self.in_force()) < count:
            rung = self.next_rung(reason)
            if rung is None:
                break
            turned.append(rung)
        return turned

    def describe(self) -> str:
        """The savers in force, for a does-not-fit message."""
        if self.state.activation_checkpointing == OFFLOAD:
            text = "activation checkpointing on, its inputs offloaded to host memory"
        elif self.state.activation_checkpointing:
            text = "activation checkpointing on"
        elif self.checkpointing is False:
            text = "activation checkpointing off by the config"
        else:
            text = "the model has no activation checkpointing to turn on"
        if self.state.chunked_loss is not None:
            text += f", the loss chunked by {self.state.chunked_loss} tokens"
        if self.state.tiled_mlp is not None:
            text += f", the MLPs tiled by {self.state.tiled_mlp} tokens"
        return text

    def trial_run(
        self, one_pass: Callable[[int], None], chunked_loss: int | None
    ) -> Callable[[int, bool | str], None]:
        """The planner's ``run(size, checkpointing)`` (`memory.probe.RunPass`, checkpointing
        False, True or "offload"): switch to that mode with the loss chunked by `chunked_loss`,
        then `one_pass(size)`; the tiled MLP stays as it is (the planner switches it for every
        mode at once, `plan(tile=...)`). Its `method` says how the loss is computed in that mode ("plain",
        "chunked", "fused"), for the plan's reasons."""

        def run(size: int, checkpointing: bool | str) -> None:
            self.restore(Savers(checkpointing, chunked_loss, self.state.tiled_mlp))
            one_pass(size)

        run.method = "plain" if chunked_loss is None else self.chunked_method()
        return run

    def chunked_method(self) -> str:
        """How the loss's chunked mode computes: "fused" (the fused linear cross-entropy kernel,
        memory/fused_loss.py) or "chunked" (checkpointed chunks, any loss without the method)."""
        method = getattr(self.loss_fn, "chunked_method", None)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return (method(self.model, device) if callable(method) else None) or "chunked"


@dataclass(frozen=True)
class Rung:
    """A saver's implementation, as the ladder uses it (`run_savers.Saver.switch` names it):
    `on(savers)`, it is in force; `can(savers)`, it could be turned on (switching nothing);
    `turn_on(savers)` turns it on and returns what its `memory_saver` event adds to the saver's
    name and the reason (None: it could not be)."""

    on: Callable[[MemorySavers], bool]
    can: Callable[[MemorySavers], bool]
    turn_on: Callable[[MemorySavers], dict[str, Any] | None]


def _on_or_none(done: bool, info: dict[str, Any] | None = None) -> dict[str, Any] | None:
    return (info or {}) if done else None


CHECKPOINTING_RUNG = Rung(
    on=lambda s: bool(s.state.activation_checkpointing),
    can=lambda s: s.can_switch_checkpointing_on,
    turn_on=lambda s: _on_or_none(s.checkpointing is not False and s.set_checkpointing(True)),
)
OFFLOAD_RUNG = Rung(
    on=lambda s: s.state.activation_checkpointing == OFFLOAD,
    can=lambda s: s.can_offload,
    turn_on=lambda s: _on_or_none(s.can_offload and s.set_checkpointing(OFFLOAD)),
)
TILED_MLP_RUNG = Rung(
    on=lambda s: s.state.tiled_mlp is not None,
    can=lambda s: (
        s.can_tile_mlp and (s.sample_tokens is None or s.sample_tokens > DEFAULT_TILE_TOKENS)
    ),
    turn_on=lambda s: _on_or_none(
        s.set_tiled_mlp(DEFAULT_TILE_TOKENS), {"tile_tokens": DEFAULT_TILE_TOKENS}
    ),
)
CHUNKED_LOSS_RUNG = Rung(
    on=lambda s: s.state.chunked_loss is not None,
    can=lambda s: s.can_chunk_loss,
    turn_on=lambda s: _on_or_none(
        s.set_chunked_loss(DEFAULT_CHUNK_TOKENS), {"chunk_tokens": DEFAULT_CHUNK_TOKENS}
    ),
)


def rungs() -> dict[str, Rung]:
    """Each registered saver's `Rung`, from the module its `switch` names (read at each use:
    the registry is the one list)."""
    found = {}
    for saver in run_savers.SAVERS:
        module, _, name = saver.switch.partition(":")
        found[saver.name] = getattr(importlib.import_module(module), name)
    return found


def ladder() -> list[tuple[Saver, Rung]]:
    """The registered savers in the ladder's order, each with its implementation."""
    found = rungs()
    return [(saver, found[saver.name]) for saver in run_savers.SAVERS]


@contextlib.contextmanager
def one_sample_norms(model: torch.nn.Module, size: int):
    """For a trial pass of `size` samples: at one sample, the model's BatchNorm layers that are
    training run as in evaluation (running statistics instead of the batch's), because training
    BatchNorm refuses a batch of one value per channel. The pass keeps the same tensors for the
    backward, so its memory is the one measured, and the planner's sizes above one run as the
    training will. The layers are put back in training afterwards."""
    norms = [
        m
        for m in model.modules()
        if size == 1 and isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    for norm in norms:
        norm.train(False)
    try:
        yield
    finally:
        for norm in norms:
            norm.train(True)
