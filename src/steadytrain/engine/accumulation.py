"""Exact gradient accumulation: a batch's loss and gradients built one micro-batch at a time,
whatever the split.

A `loss_fn` returning a mean is weighted by its micro-batch's share of the batch; one returning
``(loss_sum, count)`` (token-level losses) contributes its sum, and the summed gradient is divided
by the batch's total count (`divide_and_clip`), so padding and uneven splits do not bias it. What
`loss_fn` may return, and the user's mistake when it returns something else, is checked here too
(`check_loss_output`), for the step and for the planner's trial passes.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from steadytrain.device.core import collective_device
from steadytrain.errors import BadInputError, UserCodeError


class TokenCount:
    """Sum of the counts `loss_fn` returned: Python ints stay on the host (no device copy per
    micro-batch), tensors stay on the device (no sync); int64, exact at any token count."""

    def __init__(self) -> None:
        self.host = 0
        self.device: torch.Tensor | None = None

    def add(self, count: int | torch.Tensor) -> None:
        if isinstance(count, torch.Tensor):
            count = count.detach().to(torch.int64)
            self.device = count if self.device is None else self.device + count
        else:
            self.host += int(count)

    def sum(self) -> int | torch.Tensor:
        return self.host if self.device is None else self.device + self.host

    def total(self) -> int | torch.Tensor:
        """At least 1, so an all-padding batch divides by 1 rather than 0."""
        if self.device is None:
            return max(self.host, 1)
        return (self.device + self.host).clamp(min=1)


class BatchLoss:
    """The batch loss as a step reports it, built one micro-batch at a time. `StepRunner.run()`
    and `StepRunner.evaluate()` both use it, so the resume loss check compares the very same
    arithmetic."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.value: torch.Tensor | float = 0.0
        self.count = TokenCount()
        self.token_mode: bool | None = None

    def add(self, out: Any, size: int) -> torch.Tensor:
        """Account one micro-batch's `loss_fn` output; returns the tensor to backpropagate."""
        is_pair = isinstance(out, (tuple, list))
        if self.token_mode is None:
            self.token_mode = is_pair
        elif self.token_mode != is_pair:
            raise BadInputError(
                "loss_fn: returned a mean on one micro-batch and (loss_sum, "
                "count) on another; return one form always"
            )
        check_loss_output(out)
        if is_pair:
            loss_sum, count = out
            self.count.add(count)
            self.value = self.value + _full(loss_sum)
            return loss_sum
        share = size / self.n
        self.value = self.value + _full(out) * share
        return out * share

    def divisor(self) -> int | torch.Tensor | None:
        """The batch's token count for `(loss_sum, count)` losses; None for mean losses."""
        return self.count.total() if self.token_mode else None

    def mean(self) -> torch.Tensor | float:
        divisor = self.divisor()
        return self.value / divisor if divisor is not None else self.value


def check_loss_output(out: Any) -> None:
    """Refuse, as the user's mistake, what `loss_fn` returned when it is neither one mean loss
    nor a pair (loss_sum, count) of one number each; the step and the planner's trial passes
    both check it before the backward."""
    is_pair = isinstance(out, (tuple, list))
    _check_loss(out[0] if is_pair and len(out) == 2 else out, is_pair, len(out) if is_pair else 2)
    if is_pair:
        _check_count(out[1])


SECOND_BACKWARD = "Trying to backward through the graph a second time"
"""The start of autograd's error for a graph an earlier backward freed."""


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` of what `loss_fn` returned. A graph an earlier backward freed is the
    user's code: a loop's ``loss.backward()`` moved into `loss_fn` with the rest of its body,
    or a tensor kept from an earlier step that still carries its graph (a recurrent hidden state
    not detached). Either failed in steadytrain's own frame, as an internal error."""
    try:
        loss.backward()
    except RuntimeError as exc:
        if SECOND_BACKWARD not in str(exc):
            raise
        raise UserCodeError(
            "the loss's graph was freed by an earlier backward before steadytrain's: loss_fn "
            "called loss.backward() itself (return the loss and nothing more: steadytrain runs "
            "backward, the optimizer step and zero_grad), or it uses a tensor kept from an "
            "earlier step that still carries that step's graph (detach it, e.g. a recurrent "
            "hidden state: CarriedState in docs/porting.md)",
            where="loss_fn",
        ) from None


def check_callable(fn: Any, params: tuple[str, ...], where: str) -> None:
    """Refuse, before training, something given where a function belongs (a name, 'mse', as
    other libraries take one): it would fail at its first call, inside steadytrain's frame."""
    if not callable(fn):
        raise UserCodeError(
            f"{where} is {fn!r} ({type(fn).__name__}), not a function: steadytrain calls "
            f"{where}({', '.join(params)})",
            where=where,
        )


def check_takes(fn: Any, params: tuple[str, ...], where: str) -> None:
    """Refuse, before training, a function the engine calls with `params` (positionally) that
    cannot take them: ``loss_fn(batch)`` for ``loss_fn(model, batch)``. Such a call fails
    inside steadytrain's frame, where the error would not read as the user's."""
    check_callable(fn, params, where)
    if isinstance(fn, torch.nn.modules.loss._Loss) and params[:1] == ("model",):
        name = type(fn).__name__
        raise UserCodeError(
            f"{where} is torch's {name}(), a loss of (output, target), but steadytrain calls "
            f"{where}({', '.join(params)}) and trains on what it returns: write "
            f"def {where}(model, batch): inputs, targets = batch; return "
            f"{name}()(model(inputs), targets)",
            where=where,
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object inspect cannot read: used as it is
        return
    try:
        signature.bind(*params)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        code = getattr(fn, "__code__", None)
        if code is not None:
            name += f" ({Path(code.co_filename).name}:{code.co_firstlineno})"
        wanted = ", ".join(params)
        raise UserCodeError(
            f"{where} {name} takes {signature}, but steadytrain calls {where}({wanted}) "
            f"({exc}): give it the parameters ({wanted}), in that order",
            where=where,
        ) from None


def _check_count(count: Any) -> None:
    """The second item of a pair is the number of samples or tokens the loss sums over; a
    (loss, outputs) pair, as Hugging Face's compute_loss(return_outputs=True) returns, is not."""
    if isinstance(count, torch.Tensor):
        if count.numel() == 1:
            return
        found = f"a tensor of shape {tuple(count.shape)}"
    elif isinstance(count, numbers.Real) and not isinstance(count, bool):
        return  # a weighted count (the sum of the weights) may be fractional
    else:
        found = type(count).__name__
    raise UserCodeError(
        f"loss_fn returned a pair whose second item is {found}, not one number: a pair is "
        "(loss_sum, count), the summed loss and the number of samples or tokens it sums over. "
        "Return the mean loss alone (not (loss, outputs)), or (loss.sum(), count)",
        where="loss_fn",
    )


def _check_loss(loss: Any, is_pair: bool, length: int) -> None:
    """A loss that cannot be backpropagated as one number is the user's mistake: say which
    form was expected instead of failing later inside autograd."""
    form = "(loss_sum, count)" if is_pair else "the loss"
    if is_pair and length != 2:
        problem = f"returned a {length}-tuple; a pair (loss_sum, count) or one mean loss tensor"
    elif not isinstance(loss, torch.Tensor):
        found = type(loss).__name__
        if loss is None:
            found = "None (is its `return` missing?)"
        elif isinstance(loss, numbers.Real):
            found += f" ({loss:.6g})"
        problem = f"returned {form} as {found}, not a tensor" + (
            _held_loss(loss)
            or ": return the loss tensor itself (a 0-dim tensor that backward() runs on, as "
            "`F.cross_entropy(...)` gives; not `loss.item()`), or a pair (loss_sum, count)"
        )
    elif loss.numel() != 1:
        problem = (
            f"returned {form} as a tensor of shape {tuple(loss.shape)}, not one number: reduce "
            'it to a 0-dim tensor (e.g. `reduction="mean"` or `.mean()`'
            + (", or `.sum()` for loss_sum)" if is_pair else ")")
        )
    elif torch.is_grad_enabled() and not loss.requires_grad:  # a training pass: backward next
        problem = (
            f"returned {form} as a tensor that does not require grad (no grad_fn), so "
            "backward() cannot compute gradients from it: it was detached (`.detach()`, "
            "`torch.tensor(loss.item())`) or computed under `torch.no_grad()`. Return the loss "
            "as the model's forward computed it"
        )
    else:
        return
    raise UserCodeError(f"loss_fn {problem}", where="loss_fn")


def _held_loss(out: Any) -> str:
    """How to take the loss out of a model output that holds one (a Hugging Face ModelOutput,
    a dict with a "loss" entry), or nothing."""
    held = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(held, torch.Tensor):
        return ""
    return (
        f': the {type(out).__name__} holds a "loss" tensor; return that '
        '(`model(**batch).loss`, or `outputs["loss"]`)'
    )


def divide_and_clip(
    params: list[torch.Tensor], divisor: int | torch.Tensor | None, max_norm: float | None
) -> torch.Tensor | None:
    """Divide the summed gradients by the token count and clip them by norm in one pass over
    the gradients; returns the norm before clipping (of the divided gradients), or None."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or (divisor is None and max_norm is None):
        return None
    sharded = any(type(g).__name__ == "DTensor" for g in grads)  # FSDP: norms over the ranks
    if sharded or len({(g.device, g.dtype) for g in grads}) > 1:  # torch's grouping
        if divisor is not None:
            for g in grads:
                g.div_(divisor)
        if max_norm is None:
            return None
        if sharded:
            return _clip_shards(grads, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(grads[0].dtype)
    norm = None
    if max_norm is not None:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if divisor is not None:
            norm = norm / divisor
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
        if divisor is not None:
            scale = scale / divisor
    else:
        scale = 1.0 / divisor if isinstance(divisor, int) else divisor.reciprocal()
    if isinstance(scale, torch.Tensor):
        scale = scale.to(grads[0].dtype)
    torch._foreach_mul_(grads, scale)
    return norm


def _clip_shards(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip FSDP's sharded gradients (DTensors over a 1-D mesh: every element on one rank) by
    their global 2-norm, as `clip_grad_norm_` does, and return that norm. Each rank sums its
    shards' squares; one all-reduce sums them over the ranks, on a device the group serves:
    with the shards in host memory (`fsdp_offload`) the gradients are CPU tensors, which an
    NCCL group does not take, and DTensor's own norm would all-reduce them there."""
    import torch.distributed as dist

    local = [g.to_local() for g in grads]
    norms = torch._foreach_norm(local)
    squares = torch.stack([n.to(torch.float32) for n in norms]).square().sum()
    group = grads[0].device_mesh.get_group()
    total = squares.to(collective_device(squares.device, str(dist.get_backend_config(group))))
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault((t.device, t.dtype), []).append(t)
    for (where, dtype), tensors in by_device.items():
        torch._foreach_mul_(tensors, scale.to(where, dtype))
    return norm


def _full(loss: torch.Tensor) -> torch.Tensor:
    """A detached loss in at least float32, for the reported value."""
    loss = loss.detach()
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
