"""`ChangedAfterSave`: the state of `user_state` that a plain callback changes after the step's
checkpoint took it, refused (exit 2) before a resume would lose the change."""

from __future__ import annotations

from typing import Any

import torch

from steadytrain.errors import BadInputError
from steadytrain.events import Callback, TrainState


class ChangedAfterSave:
    """Finds state of `user_state` that one of the program's plain callbacks changes at a step's
    end: those run after the step's checkpoint has taken the state (`steadytrain.trainer.callbacks`), so a
    resume would start from the state before that change. An EMA of the weights updated in
    such a callback's `on_step_end` is the common case: the run went on while every resume lost
    an update. `before` (the first of those callbacks) marks the state as the checkpoint took
    it, `after` (the last) compares; a change stops the run (exit 2), naming the state, the
    callbacks and the fix. The marks are the tensors' version counters (bumped by every
    in-place change) and the other values themselves: a few numbers a tensor, each step."""

    def __init__(self, states: dict[str, Any], callbacks: list[Any]):
        self.states = states
        self.callbacks = [
            type(c).__name__
            for c in callbacks
            if getattr(type(c), "on_step_end", None) is not Callback.on_step_end
        ]
        self.taken: dict[str, Any] = {}
        watched = bool(states and self.callbacks)  # else nothing after the save can change it
        self.before = [_Hook(self._take)] if watched else []
        self.after = [_Hook(self._compare)] if watched else []

    def _marks(self) -> dict[str, Any]:
        return {name: _marks(obj.state_dict()) for name, obj in self.states.items()}

    def _take(self, state: TrainState) -> None:
        self.taken = self._marks()

    def _compare(self, state: TrainState) -> None:
        now = self._marks()
        changed = [name for name, marks in self.taken.items() if now[name] != marks]
        if changed:
            names = ", ".join(repr(name) for name in changed)
            which = ", ".join(self.callbacks)
            raise BadInputError(
                f"user_state: {names} changed at the end of step {state.step} after the "
                f"checkpoint took it, in a callback that runs after the save ({which}): a "
                "resume would start from the state before that change and train otherwise than "
                "the run that went on. Make the code that changes it run before the save: give "
                "that callback state_dict() and load_state_dict() (its state, the EMA's) or pass "
                "it in user_state instead of callbacks; see docs/porting.md, 'State your model "
                "or loss carries across steps'"
            )


def _marks(value: Any) -> Any:
    """What changes when `value` (a state_dict) changes: a tensor's version, a container's
    parts, any other value as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value._version)
    if isinstance(value, dict):
        return {key: _marks(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_marks(item) for item in value]
    return repr(value)


class _Hook(Callback):
    def __init__(self, call):
        self.call = call

    def on_step_end(self, state: TrainState, control: Any, info: dict[str, Any]) -> None:
        self.call(state)
