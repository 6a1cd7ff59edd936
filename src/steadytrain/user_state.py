"""State a model or loss carries from batch to batch: an RNN's hidden state, an EMA of weights,
a running statistic, a curriculum counter. Give it to the Trainer by name
(``Trainer(..., user_state={"hidden": hidden})``); an object qualifies with two methods::

    state_dict() -> dict          # tensors, numbers, strings, containers (torch.save, weights_only)
    load_state_dict(state: dict)  # puts that state back

and may have these, which the engine calls when they exist::

    select(start, stop, size)     # before each micro-batch's forward: it covers samples
                                  # [start, stop) of a batch of `size` (the batch split on memory)
    reset()                       # at the start of each evaluation, which must not see the
                                  # training's carried state; the training's is put back after
    snapshot() / restore(saved)   # a cheaper copy than state_dict (default: a deep copy of it)

What the engine does with it, and when:

* every checkpoint saves ``state_dict()`` of each (``user_state.pt``); a resume loads it back;
* before each optimizer step it takes a snapshot; when the step runs out of memory and is redone
  at a smaller micro-batch, the snapshot is restored first, so the redo starts from the same state;
* its own extra passes (the planner's trial passes, the resume loss probe) run between a
  snapshot and its restore, so they never advance the state; so does evaluation (after reset).

`CarriedState` implements all of it for tensors with a batch dimension, the common case.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from steadytrain.errors import BadInputError
from steadytrain.events import Callback, Control, TrainState


@runtime_checkable
class UserState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_user_state(states: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `user_state` argument as a dict of name -> object, refused with a reason when an
    object lacks the two methods."""
    states = dict(states or {})
    for name, obj in states.items():
        if not isinstance(name, str) or not isinstance(obj, UserState):
            raise BadInputError(
                f"user_state: {name!r} is a {type(obj).__name__}; each value needs state_dict() "
                "and load_state_dict() (see steadytrain.user_state, or wrap tensors carried "
                "across steps in steadytrain.CarriedState)"
            )
    return states


def snapshot(states: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: obj.snapshot() if hasattr(obj, "snapshot") else _copy(obj.state_dict())
        for name, obj in states.items()
    }


def restore(states: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    for name, obj in states.items():
        if hasattr(obj, "restore"):
            obj.restore(saved[name])
        else:
            obj.load_state_dict(_copy(saved[name]))


def select(states: Mapping[str, Any], start: int, stop: int, size: int) -> None:
    for obj in states.values():
        chooser = getattr(obj, "select", None)
        if chooser is not None:
            chooser(start, stop, size)


def reset(states: Mapping[str, Any]) -> None:
    for obj in states.values():
        clear = getattr(obj, "reset", None)
        if clear is not None:
            clear()


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_copy(v) for v in value)
    return copy.deepcopy(value)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map(fn, v) for v in value)
    if value is None:
        return None
    raise BadInputError(
        f"CarriedState: holds tensors or tuples/lists of tensors, got a {type(value).__name__}"
    )


class CarriedState(Callback):
    """Tensors carried across optimizer steps with a batch dimension, e.g. an LSTM's ``(h, c)``
    of shape ``[layers, batch, hidden]`` (``batch_dim=1``).

    In `loss_fn`: ``hidden = carried.get()`` gives this micro-batch's part (``init(size)`` of
    the whole batch the first time, or after `reset`); ``carried.set(new_hidden)`` stores it,
    detached (truncated backpropagation through time). A batch split into micro-batches gets
    each sample's own state, so the result equals the unsplit batch's.

    `reset_each_epoch`: start each epoch from ``init`` again (a language model's loop that
    calls ``init_hidden`` at the top of each epoch). Give the object to the Trainer in
    ``user_state``; the Trainer also registers it as a callback for that reset.
    """

    def __init__(
        self,
        init: Callable[[int], Any] | None = None,
        batch_dim: int = 0,
        reset_each_epoch: bool = False,
    ):
        self.init, self.batch_dim, self.reset_each_epoch = init, batch_dim, reset_each_epoch
        self.value: Any = None
        self._window: tuple[int, int, int] | None = None

    def select(self, start: int, stop: int, size: int) -> None:
        self._window = (start, stop, size)

    def get(self) -> Any:
        """This micro-batch's part of the carried tensors (None if there is none and no init)."""
        start, stop, size = self._window_or_whole()
        if self.value is None or self._size() != size:
            if self.init is None:
                return None
            self.value = _map(lambda t: t.detach(), self.init(size))
        if (start, stop) == (0, size):
            return self.value
        return _map(lambda t: t.narrow(self.batch_dim, start, stop - start), self.value)

    def set(self, value: Any) -> None:
        """Store this micro-batch's new state (detached from its graph)."""
        value = _map(lambda t: t.detach(), value)
        start, stop, size = self._window_or_whole()
        if (start, stop) == (0, size):
            self.value = value
            return
        if self.value is None or self._size() != size:
            self.value = _map(lambda t: _full(t, self.batch_dim, size), value)
        else:  # out of place: the old tensors may be saved for this step's backward
            self.value = _map(lambda t: t.clone(), self.value)
        _map2(
            lambda full, part: full.narrow(self.batch_dim, start, stop - start).copy_(part),
            self.value,
            value,
        )

    def reset(self) -> None:
        self.value = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]

    def snapshot(self) -> Any:
        return self.value  # `set` never changes a stored tensor in place

    def restore(self, saved: Any) -> None:
        self.value = saved

    def on_epoch_end(self, state: TrainState, control: Control, info: dict) -> None:
        if self.reset_each_epoch:
            self.value = None

    def _window_or_whole(self) -> tuple[int, int, int]:
        if self._window is not None:
            return self._window
        size = self._size()
        if size is None:
            raise BadInputError(
                "CarriedState: get() or set() before any micro-batch; call them inside loss_fn"
            )
        return (0, size, size)

    def _size(self) -> int | None:
        first = self.value
        while isinstance(first, list | tuple):
            first = first[0] if first else None
        return None if first is None else first.shape[self.batch_dim]


def _full(part: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(part.shape)
    shape[dim] = size
    return part.new_zeros(shape)


def _map2(fn: Callable[[torch.Tensor, torch.Tensor], Any], a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        fn(a, b)
        return
    for x, y in zip(a, b, strict=True):
        _map2(fn, x, y)
