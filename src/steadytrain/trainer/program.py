"""What a user's own program brings to the `Trainer`, taken as its author meant it and checked once,
when the Trainer is built: the model, the loss, the optimizer and scheduler as given, the data, the
state it carries across steps, its evaluation and its callbacks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from steadytrain.config import TrainConfig
from steadytrain.engine.accumulation import check_takes
from steadytrain.engine.evaluation import EvalFn
from steadytrain.errors import BadInputError, UserCodeError
from steadytrain.events import Callback, check_callbacks
from steadytrain.trainer.data import DataSource, data_source
from steadytrain.user_state import check_user_state


@dataclass(frozen=True)
class Program:
    """The `Trainer`'s arguments, checked: `optimizer` and `scheduler` as given (an object or a
    factory, built at each fit on the placed model), the data read as `DataSource`s."""

    model: torch.nn.Module
    optimizer: Any
    loss_fn: Callable[[torch.nn.Module, Any], Any]
    scheduler: Any
    data: DataSource
    eval_data: DataSource | None
    eval_fn: EvalFn | None
    user_state: dict[str, Any]
    callbacks: list[Callback]

    @classmethod
    def check(
        cls,
        config: TrainConfig,
        *,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        train_data: Any,
        scheduler: Any,
        callbacks: Iterable[Callback],
        collate_fn: Callable | None,
        eval_data: Any,
        eval_fn: EvalFn | None,
        user_state: Mapping[str, Any] | None,
    ) -> Program:
        """The program, each argument refused as it is read when it cannot be trained."""
        model = check_model(model)
        callbacks = list(callbacks)
        data = data_source(train_data, collate_fn, config)
        if eval_data is not None:
            eval_data = data_source(eval_data, collate_fn, None, "eval_data")
        check_takes(loss_fn, ("model", "batch"), "loss_fn")
        if eval_fn is not None:
            check_takes(eval_fn, ("model", "batches"), "eval_fn")
        states = check_user_state(user_state)
        carried = [s for s in states.values() if isinstance(s, Callback)]
        check_callbacks([*callbacks, *carried])  # each on_* method names an event
        return cls(
            model, optimizer, loss_fn, scheduler, data, eval_data, eval_fn, states, callbacks
        )

    @property
    def carried_callbacks(self) -> list[Callback]:
        """The objects of `user_state` that are callbacks too (`CarriedState`)."""
        return [s for s in self.user_state.values() if isinstance(s, Callback)]


def check_model(model: Any) -> Any:
    """`model`; its class given for it (`Trainer(Net, ...)`) is refused, which failed deep in
    the device placement ('torch.device' object has no attribute '_apply')."""
    if isinstance(model, type):
        raise UserCodeError(
            f"model is the class {model.__name__}, not a model: build it first, "
            f"model={model.__name__}(...)",
            where="model",
        )
    if isinstance(model, torch.nn.Module):
        check_not_meta(model)
    return model


def check_not_meta(model: torch.nn.Module) -> None:
    """Refuse a model whose parameters or buffers are on the meta device (built under
    ``with torch.device("meta")``): they have shapes but no values, so there is nothing to move
    to the device or to train; placing it failed with torch's "Cannot copy out of meta tensor"."""
    named = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, tensor in named if tensor.is_meta]
    if not on_meta:
        return
    shown = ", ".join(on_meta[:5]) + (f" and {len(on_meta) - 5} more" if len(on_meta) > 5 else "")
    raise BadInputError(
        f"model: {len(on_meta)} of its {len(named)} parameters and buffers are on the meta "
        f"device ({shown}): they have shapes but no values, so there is nothing to train. "
        "Give them memory and load the weights before the Trainer gets the model: "
        'model.to_empty(device="cpu") then model.load_state_dict(weights) (or build the '
        'model outside `with torch.device("meta")` so that it is initialised).'
    )
