"""The run's optimizer and scheduler, built from what the program gave (an object, a factory or a
scheduler class) on the model as placed, and refused where they cannot train it as meant: several
optimizers, one built on another model, one that needs a closure, a scheduler built on another
optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from steadytrain.errors import BadInputError


def build_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer: `optimizer` itself, or built by the factory from the parameters
    that require grad; refused when it is several, or steps with a closure."""
    return _one_step_per_batch(_make_optimizer(optimizer, model))


def _make_optimizer(given: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    if isinstance(given, torch.optim.Optimizer):
        _check_holds_the_model(given, model)
        return given
    if isinstance(given, list | tuple | Mapping):  # a GAN's {'g': .., 'd': ..}
        raise BadInputError(
            f"optimizer: {len(given)} optimizers given; steadytrain takes one "
            "optimizer step per batch. Parameters that step together belong in one optimizer "
            "(param groups for their own lr); alternating updates (a GAN's generator and "
            "discriminator) need your own loop: see docs/porting.md, 'Several optimizers'"
        )
    if callable(given):
        optimizer = given([p for p in model.parameters() if p.requires_grad])
        if isinstance(optimizer, torch.optim.Optimizer | list | tuple | Mapping):
            return _make_optimizer(optimizer, model)  # checked as if given itself
        found = f"the function returned {type(optimizer).__name__}"
    else:
        found = f"got {type(given).__name__}"
    raise BadInputError(
        f"optimizer: expected a torch.optim.Optimizer or a function params -> optimizer; {found}"
    )


def _check_holds_the_model(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Refuse an optimizer that holds none of the model's trainable parameters (built on another
    instance of the model): every step would update that one, and this model would not train."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not held or not trainable or any(id(p) in held for p in trainable):
        return
    raise BadInputError(
        f"optimizer: this {type(optimizer).__name__} holds {len(held)} parameter tensor(s), none "
        f"of them the model's ({len(trainable)} trainable): it was built on another instance of "
        "the model, so the run would update that one and this model would not train. Build it "
        "on this model's parameters, or pass a function: "
        f"optimizer=lambda params: {type(optimizer).__name__}(params, ...)"
    )


def make_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler, built here where `scheduler` is a factory `optimizer -> scheduler` or
    a scheduler class (`scheduler=MySchedule`, called with the optimizer alone)."""
    factory = isinstance(scheduler, type) or (
        callable(scheduler) and not hasattr(scheduler, "state_dict")
    )
    if not factory:
        _check_same_optimizer(scheduler, optimizer)
        return scheduler
    try:
        return scheduler(optimizer)
    except TypeError as error:
        if not isinstance(scheduler, type):
            raise  # the user's own factory failed: their traceback says where
        name = scheduler.__name__
        raise BadInputError(
            f"scheduler: {name}(optimizer) cannot be built from the optimizer alone ({error}); "
            f"pass a function, e.g. scheduler=lambda opt: {name}(opt, ...), or a scheduler "
            "built on the same optimizer"
        ) from None


def _check_same_optimizer(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler built on another optimizer than the run's (a loop's own optimizer,
    with a function given for the Trainer's): it would set that one's learning rate, and the
    run would train at the first one throughout, silently."""
    own = getattr(scheduler, "optimizer", None)
    if not isinstance(own, torch.optim.Optimizer) or own is optimizer:
        return
    name = type(scheduler).__name__
    raise BadInputError(
        f"scheduler: this {name} was built on an optimizer ({type(own).__name__}) that is not "
        f"the run's ({type(optimizer).__name__}, from `optimizer`): stepping it would change "
        "that one's learning rate and the run would keep its first learning rate throughout. "
        "Pass the optimizer it was built on as `optimizer`, or the scheduler as a function of "
        f"the run's optimizer: scheduler=lambda opt: {name}(opt, ...)"
    )


def _one_step_per_batch(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, refused when its step() needs a closure (LBFGS): it would evaluate the loss
    several times per step, and the engine's step computes the gradients once, then steps."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a readable signature takes no closure
        return optimizer
    if closure is None or closure.default is not inspect.Parameter.empty:
        return optimizer
    name = type(optimizer).__name__
    raise BadInputError(
        f"optimizer: {name}.step() needs a closure (it evaluates the loss several times per "
        "step); steadytrain computes the gradients of each batch once, then calls step() "
        "without one. Use an optimizer whose closure is optional (SGD, Adam, AdamW), or keep "
        f"your own loop for {name}: see docs/porting.md, 'Optimizers that need a closure'"
    )
