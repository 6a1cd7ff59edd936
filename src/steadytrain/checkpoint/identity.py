"""The run's identity: what must not change across a resume (the config values that define the
run, the model's parameter shapes, the frozen base's fingerprint, the optimizer and schedule,
the data fingerprint). A checkpoint of another run is refused before anything loads, naming
each change, old and new, and the override that lets it through, or a new run_dir."""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Collection
from typing import Any

import torch

from steadytrain.checkpoint.fingerprint import data_fingerprint
from steadytrain.errors import BadInputError


def frozen_fingerprint(model: torch.nn.Module) -> str | None:
    """Names, shapes, dtypes and a sample of the values of the frozen parameters: enough to tell
    that a checkpoint of trainable parts belongs to this base model, without hashing all of it."""
    digest = hashlib.sha256()
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    for name, param in frozen:
        whole = param.detach()
        if hasattr(whole, "full_tensor"):  # sharded (FSDP): the plain model's fingerprint
            whole = _gathered(whole)
        sample = whole.flatten()[:: max(1, param.numel() // 64)][:64]
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        digest.update(sample.to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()


def _gathered(shard: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard. Shards kept in host memory (`fsdp_offload`) travel
    to the mesh's device first: an NCCL group gathers no CPU tensors."""
    mesh_type = shard.device_mesh.device_type
    if shard.device.type != mesh_type:
        shard = shard.to(mesh_type)
    return shard.full_tensor()


def model_shape(model: torch.nn.Module) -> str:
    """A fingerprint of the model's parameter names, shapes, dtypes and trainability."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
    return digest.hexdigest()[:16]


def parameter_table(model: torch.nn.Module) -> dict[str, list]:
    """Each parameter's shape, dtype and trainability by name: what `model_shape` fingerprints,
    kept whole so that a refused resume names the parameter that changed, and whether the
    checkpoint could load into it at all (a shape can not; a dtype or trainability can)."""
    return {
        name: [list(param.shape), str(param.dtype).removeprefix("torch."), param.requires_grad]
        for name, param in model.named_parameters()
    }


def optimizer_identity(optimizer: torch.optim.Optimizer) -> str:
    """Class and hyperparameters of a freshly built optimizer, per parameter group."""
    groups = [
        {k: v for k, v in group.items() if k != "params"} | {"size": len(group["params"])}
        for group in optimizer.param_groups
    ]
    return f"{type(optimizer).__name__}{groups}"


def schedule_identity(scheduler: Any) -> str | None:
    if scheduler is None:
        return None
    state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    return f"{type(scheduler).__name__}{sorted(state.items(), key=lambda kv: kv[0])}"


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per changed value, `field: old -> new`; an optimizer's or a schedule's change
    is broken down to the hyperparameter (`optimizer: lr: 0.003 -> 0.001`)."""
    lines = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if key == "parameters":  # said in the model's line (a checkpoint before it has none)
            continue
        if key == "model" and old != new and saved.get("parameters") and now.get("parameters"):
            lines += [
                f"model: {c}" for c in parameter_changes(saved["parameters"], now["parameters"])
            ]
        elif old != new and key in _FINGERPRINTS:
            lines.append(f"{key}: {_FINGERPRINTS[key]} (fingerprint {old} -> {new})")
        elif old != new:
            detail = _as_the_user_set_it(key, _detail(old, new))
            if detail is None:  # only what follows the optimizer's rate: said in its line
                continue
            lines += [f"{key}: {d}" for d in detail] if detail else [f"{key}: {old!r} -> {new!r}"]
    return lines


def _as_the_user_set_it(key: str, detail: list[str]) -> list[str] | None:
    """A changed optimizer or schedule in the values a program sets. A scheduled optimizer's
    `initial_lr` is the `lr` it was built with (its `lr` is where the schedule has taken it),
    so that is its `lr` line; a schedule's place and the rates it copies from the optimizer
    (`_PROGRESS`) follow from the optimizer's line, so a schedule with no other change has no
    line (None) and the optimizer's override lets it through."""

    def name(line: str) -> str:  # "group 1 lr: 0.1 -> 0.01" -> "lr"
        return line.split(": ", 1)[0].split()[-1]

    if key == "optimizer" and any(name(d) == "initial_lr" for d in detail):
        shown = [d for d in detail if name(d) != "lr"]
        return [d.replace("initial_lr: ", "lr: ", 1) for d in shown]
    if key == "schedule" and detail:
        return [d for d in detail if name(d) not in _PROGRESS] or None
    return detail


_FINGERPRINTS = {
    "model": "the names, shapes, dtypes or trainability of the model's parameters differ",
    "frozen_base": "the frozen parameters (the base model) hold other values",
    "data": "the dataset's length or samples differ",
}
"""Identity fields kept as a fingerprint: what a change of one means, said with it."""


def parameter_changes(old: dict[str, list], new: dict[str, list]) -> list[str]:
    """One line per parameter whose shape, dtype or trainability differs (`a.weight: shape
    (16, 6) -> (32, 6)`), or that is new or gone; at most 8, then how many more."""
    lines = []
    for name in [*old, *(n for n in new if n not in old)]:
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if before is None:
            lines.append(f"{name}: {_SHAPE_CHANGE} new, shape {tuple(after[0])}")
        elif after is None:
            lines.append(f"{name}: {_SHAPE_CHANGE} gone (shape {tuple(before[0])})")
        elif before[0] != after[0]:
            lines.append(f"{name}: {_SHAPE_CHANGE} {tuple(before[0])} -> {tuple(after[0])}")
        else:
            lines += [f"{name}: dtype {before[1]} -> {after[1]}"] if before[1] != after[1] else []
            trainable = {True: "trainable", False: "frozen"}
            if before[2] != after[2]:
                lines.append(f"{name}: {trainable[before[2]]} -> {trainable[after[2]]}")
    if len(lines) > 8:
        lines = [*lines[:8], f"and {len(lines) - 8} more parameter(s)"]
    return lines or [_FINGERPRINTS["model"]]


_SHAPE_CHANGE = "shape"
"""The word a parameter's line starts with when the checkpoint cannot load into it at all."""


def _cannot_load(difference: str) -> bool:
    """A difference no override can let through: a parameter of another shape, new or gone
    (the saved tensors do not fit the model's)."""
    field, _, rest = difference.partition(": ")
    return field == "model" and rest.partition(": ")[2].startswith(_SHAPE_CHANGE + " ")


def override_hint(refused: list[str]) -> str:
    """The `resume_overrides` entry that would let exactly these differences through."""
    fields = dict.fromkeys(
        "model" if d.split(":", 1)[0] == "frozen_base" else d.split(":", 1)[0] for d in refused
    )
    return f"resume_overrides: {list(fields)}"


def _parsed(identity: Any) -> tuple[str, list] | None:
    """`optimizer_identity` / `schedule_identity` text back into (class name, values)."""
    if not isinstance(identity, str) or "[" not in identity:
        return None
    name, _, rest = identity.partition("[")
    try:
        values = ast.literal_eval("[" + rest)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None  # a value without a literal form (a tensor lr): shown whole
    return name, values


def _detail(old: Any, new: Any) -> list[str]:
    before, after = _parsed(old), _parsed(new)
    if before is None or after is None:
        return []
    if before[0] != after[0]:
        return [f"{before[0]} -> {after[0]}"]
    groups_a, groups_b = ([_as_dict(g) for g in x[1]] for x in (before, after))
    if None in groups_a or None in groups_b:  # a schedule: one list of (key, value) pairs
        groups_a, groups_b = [_as_dict(before[1])], [_as_dict(after[1])]
        if None in groups_a + groups_b:
            return []
    if len(groups_a) != len(groups_b):
        return [f"parameter groups: {len(groups_a)} -> {len(groups_b)}"]
    lines = []
    for i, (a, b) in enumerate(zip(groups_a, groups_b, strict=True)):
        prefix = f"group {i} " if len(groups_a) > 1 else ""
        lines += [
            f"{prefix}{k}: {a.get(k)!r} -> {b.get(k)!r}"
            for k in sorted(set(a) | set(b), key=str)
            if a.get(k) != b.get(k)
        ]
    return lines


def _as_dict(value: Any) -> dict | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return dict(value)
    return None


def run_identity(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: Any,
    settings: dict[str, Any],
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """What defines a run (`settings`: the config values that do, model, optimizer, schedule,
    data); a checkpoint of a different run must not be resumed into it. What the data
    fingerprint checks by type only is described in `notes`."""
    return {
        **settings,
        "model": model_shape(model),
        "parameters": parameter_table(model),
        "frozen_base": frozen_fingerprint(model),
        "optimizer": optimizer_identity(optimizer),
        "schedule": schedule_identity(scheduler),
        "data": data_fingerprint(data, notes),
    }


def check_identity(
    saved: dict[str, Any], now: dict[str, Any], allowed: Collection[str], source: Any
) -> list[str]:
    """The differences `allowed` lets through (``resume_overrides``; ``model`` also allows a
    changed ``frozen_base``; a changed ``world_size`` always goes through: after a lost GPU
    each rank's share changes, the global batch and the update do not). Any other difference
    is a `BadInputError` naming them."""
    changed = differences({"world_size": 1, **saved}, {"world_size": 1, **now})

    def field_of(difference: str) -> str:
        return difference.split(":", 1)[0]

    overridden = [
        d
        for d in changed
        if field_of(d) in allowed
        or field_of(d) == "world_size"
        or (field_of(d) == "frozen_base" and "model" in allowed)
    ]
    refused = [d for d in changed if d not in overridden]
    unloadable = [d for d in changed if _cannot_load(d)]
    if unloadable:
        raise BadInputError(
            f"resume: {source} holds parameters of other shapes than this model's (old -> "
            "new):\n  "
            + "\n  ".join(d.partition(": ")[2] for d in unloadable)
            + "\nA checkpoint cannot load into parameters of another shape, so no "
            "resume_overrides lets this through. Build the model as that run did to resume it, "
            "or train the changed model in a new run_dir (load what still fits from "
            f"{source} yourself first if you want to keep it)"
        )
    if refused:
        raise BadInputError(
            f"resume: {source} belongs to a different run; what changed (old -> new):\n  "
            + "\n  ".join(refused)
            + "\nUse the settings, model, optimizer and data of that run, start a new run_dir, "
            f"or allow these changes explicitly in the config: {override_hint(refused)}"
        )
    return overridden


_PROGRESS = ("base_lrs", "_last_lr", "last_epoch", "_step_count", "_get_lr_called_within_step")
"""A schedule's state that is where it is (or follows the learning rate), not a setting."""


def reapply_overrides(
    saved: dict[str, Any],
    now: dict[str, Any],
    allowed: Collection[str],
    optimizer: Any,
    schedule: Any,
) -> None:
    """After a resume that `resume_overrides` let through with the optimizer's or the
    schedule's hyperparameters changed: the states just loaded hold the saved values, so each
    changed one is set again to this run's, where the run goes on from. A learning rate a
    schedule drives keeps its place in the schedule: the current rate and the schedule's base
    rates scaled by new / old (StepLR's 0.025 of 0.1 is 0.0025 of 0.01)."""
    if "optimizer" in allowed and optimizer is not None:
        _reapply_optimizer(saved.get("optimizer"), now.get("optimizer"), optimizer, schedule)
    if "schedule" in allowed and schedule is not None:
        before, after = _parsed(saved.get("schedule")), _parsed(now.get("schedule"))
        if before is None or after is None or before[0] != after[0]:
            return
        old, new = _as_dict(before[1]) or {}, _as_dict(after[1]) or {}
        changed = [k for k, v in new.items() if k not in _PROGRESS and old.get(k) != v]
        for key in changed:
            if hasattr(schedule, key):
                setattr(schedule, key, new[key])
        if changed and hasattr(schedule, "_get_closed_form_lr"):
            _rate_at_this_step(schedule, optimizer)


def _rate_at_this_step(schedule: Any, optimizer: Any) -> None:
    """The learning rate the changed schedule gives at the step the run resumes from (a
    cosine's T_max raised to train longer: its rate there, not the old one's end, which its
    step-by-step form would carry on from)."""
    try:
        rates = list(schedule._get_closed_form_lr())
    except Exception:  # noqa: BLE001 - a schedule without a closed form goes on as loaded
        return
    if optimizer is not None and len(rates) == len(optimizer.param_groups):
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        schedule._last_lr = rates


def _reapply_optimizer(saved: Any, now: Any, optimizer: Any, schedule: Any) -> None:
    before, after = _parsed(saved), _parsed(now)
    if before is None or after is None or before[0] != after[0]:
        return  # another class loads nothing of the old one's; a value without a literal form
    groups = optimizer.param_groups
    if not len(before[1]) == len(after[1]) == len(groups):
        return
    for i, (old, new, group) in enumerate(zip(before[1], after[1], groups, strict=True)):
        if not isinstance(old, dict) or not isinstance(new, dict):
            return
        scheduled = "initial_lr" in new and "initial_lr" in group
        for key, value in new.items():
            if key in ("size", "lr") or old.get(key) == value or key not in group:
                continue
            group[key] = value
        if scheduled and old.get("initial_lr") != new["initial_lr"] and old.get("initial_lr"):
            group["lr"] = group["lr"] * new["initial_lr"] / old["initial_lr"]
            if len(getattr(schedule, "base_lrs", ())) == len(groups):
                schedule.base_lrs[i] = new["initial_lr"]
            if len(getattr(schedule, "_last_lr", ())) == len(groups):
                schedule._last_lr[i] = group["lr"]
        elif not scheduled and old.get("lr") != new.get("lr") and "lr" in new:
            group["lr"] = new["lr"]
