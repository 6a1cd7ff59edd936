"""A side pass leaves no trace: what a pass outside the training (the planner's trial passes, the
resume probe, an evaluation) or a failed attempt of a step may change is put back afterwards.

`Saved` takes a copy of each thing when made and `put_back()` restores it (as often as needed:
the step puts it back before each redo after an out-of-memory); `side_pass` puts it back when
its block ends, however it ends. What there is to save:

- ``rng``: every random stream (Python, NumPy, torch on the CPU and the device), as drawn by
  dropout and data augmentation;
- ``buffers``: tensors a forward updates in place (BatchNorm's running statistics);
- ``user_state``: the state the program carries across steps (`steadytrain.user_state`);
- ``others``: objects with ``snapshot()`` and ``restore(saved)`` (the memory savers);
- and, for `side_pass`, the model's training mode (``eval_mode``: in eval mode meanwhile).

`trial_pass` is the forward and backward of the planner's trial passes: the gradients it makes
are dropped, so the optimizer never sees them. The planner (`steadytrain.memory`) measures the
passes it is given; its callers build them from this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from steadytrain.device import get_rng_state, set_rng_state
from steadytrain.engine.accumulation import backward
from steadytrain.user_state import restore, snapshot


class Saved:
    """A copy of what a pass may change; `put_back()` restores it."""

    def __init__(
        self,
        *,
        rng: bool = False,
        buffers: Iterable[torch.Tensor] = (),
        user_state: Mapping[str, Any] | None = None,
        others: Iterable[Any] = (),
    ):
        self.rng = get_rng_state() if rng else None
        self.buffers = list(buffers)
        self.values = [b.detach().clone() for b in self.buffers]
        self.user_state = user_state
        self.carried = snapshot(user_state) if user_state else None
        self.others = [(obj, obj.snapshot()) for obj in others]

    def put_back(self) -> None:
        if self.carried is not None:
            restore(self.user_state, self.carried)
        if self.rng is not None:
            set_rng_state(self.rng)
        with torch.no_grad():
            for buffer, value in zip(self.buffers, self.values, strict=True):
                buffer.copy_(value)
        for obj, saved in self.others:
            obj.restore(saved)


@contextlib.contextmanager
def side_pass(
    *, model: torch.nn.Module | None = None, eval_mode: bool = False, **what: Any
) -> Iterator[Saved]:
    """``with side_pass(rng=True, buffers=..., user_state=..., others=...):`` the block runs,
    then what it may have changed is put back (`Saved`). `model` with `eval_mode`: in eval mode
    inside the block, back in the mode it was in after it."""
    saved = Saved(**what)
    training = model.training if model is not None else False
    if model is not None and eval_mode:
        model.eval()
    try:
        yield saved
    finally:
        saved.put_back()
        if model is not None:
            model.train(training)


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
        backward(loss)
        del out, loss
    finally:
        for param in model.parameters():
            param.grad = None


__all__ = ["Saved", "side_pass", "trial_pass"]
