"""How config problems are put in words: one plain line per problem (the field, what it
accepts, what was found), the closest valid name for an unknown key, and a field's rule written
from its type and bounds. Shared by `TrainConfig` and the fine-tune config."""

from __future__ import annotations

import json
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic.fields import FieldInfo

# What a field accepts, in words, where its type alone does not say it (a string with a format).
# Every other field's rule is written from its type and bounds by `accepts`.
RULES = {
    "device": "'auto', 'cpu', 'mps', 'cuda' or 'cuda:N'",
    "memory_budget": "'auto', a size like '12GiB' or '16GB', or a fraction of usable memory in (0, 1]",
    "target_modules": "'all-linear' or a list of module names, [q_proj, v_proj] (with --set: "
    "'lora.target_modules=[q_proj, v_proj]')",
}


# -- problems --------------------------------------------------------------------------


def explain(exc: ValidationError, model: type[BaseModel], hints: dict | None = None) -> list[str]:
    """One plain line per problem: the field, what is allowed, what was found; an unknown key
    of `hints` (`TRAINER_NAMES`) gets its note."""
    fields = list(model.model_fields)
    by_field: dict[str, list[Any]] = {}
    problems: list[str] = []
    for err in exc.errors():
        if not err["loc"]:  # a rule between fields: its message is already lines of plain text
            if "error" in err.get("ctx", {}):
                problems.extend(str(err["ctx"]["error"]).splitlines())
            else:  # a key pydantic cannot read as text (a lone surrogate)
                problems.append(f"{show_value(err['input'])}: not a field name ({err['msg']})")
            continue
        by_field.setdefault(str(err["loc"][0]), []).append(err)
    lines = []
    for name, errors in by_field.items():
        first = errors[0]
        if first["type"] == "extra_forbidden":
            lines.append(f"{name}: unknown field; {suggestion(name, fields, hints)}")
        elif first["type"] == "missing":
            info = model.model_fields[name]
            lines.append(
                f"{name}: missing, and it has no default; set it to {accepts(model, name)} "
                f"({_first_sentence(info.description)})"
            )
        else:
            # A union reports one error per branch; say once what the field accepts. A rule of
            # our own (a validator's ValueError) is more precise than the type, so it wins.
            own = [e for e in errors if e["type"] == "value_error"]
            rule = str(own[0]["ctx"]["error"]) if own else f"must be {accepts(model, name)}"
            if any(e["type"] == "finite_number" for e in errors):
                rule += "; inf and nan are not accepted"
            strict = {"int_type", "float_type", "bool_type"}  # strict mode: "8" is not 8
            if _quoted_value(first["input"]) and any(e["type"] in strict for e in errors):
                rule += "; text is not read as a number or true/false, write it without quotes"
            line = f"{name}: {rule} (found {show_value(first['input'])})"
            seconds = _seconds(first["input"]) if name in _SECONDS else None
            if seconds is not None:  # "5m", as other tools write a duration
                line += f"; it is a number of seconds: write {seconds:g}"
            lines.append(line)
    return lines + problems


_SECONDS = {"hang_timeout"}
"""Fields that take a number of seconds."""
_DURATION = re.compile(
    r"\s*(\d+(?:\.\d+)?)\s*(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?)\s*", re.I
)


def _seconds(value: Any) -> float | None:
    """'5m' -> 300.0, '300s' -> 300.0, '1.5 h' -> 5400.0; None for anything else."""
    found = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        return None
    scale = {"s": 1, "m": 60, "h": 3600}[found.group(2)[0].lower()]
    return float(found.group(1)) * scale


_ACCUMULATION = (
    ["effective_batch_size", "micro_batch_size"],
    "accumulation is not set on its own: effective_batch_size is what the optimizer sees in "
    "each step and micro_batch_size what one pass holds, so 64 and 16 accumulate 4 passes; "
    "an out-of-memory halves micro_batch_size while the effective batch stays",
)
_OPTIMIZER = (
    [],
    "the optimizer and its settings are given in Python: "
    "Trainer(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))",
)
_SCHEDULE = ([], "a learning-rate schedule is given in Python: Trainer(scheduler=...)")
_LOADER = (
    [],
    "steadytrain builds each DataLoader itself, from a DataLoader given as train_data too: "
    "memory is pinned on CUDA, where it helps, and the worker processes are num_workers (or "
    "the given DataLoader's, the larger)",
)
_MEMORY = (
    ["memory_budget"],
    "the memory the run may use: a size with its unit, '16GiB', or a fraction of usable memory, "
    "0.8",
)
MEMORY_NAMES: dict[str, tuple[list[str], str]] = {
    name: _MEMORY
    for name in ("max_memory", "memory_limit", "mem_limit", "memory_cap", "gpu_memory_limit")
}
"""Names a memory cap is written with elsewhere (accelerate's max_memory, guides)."""
TRAINER_NAMES: dict[str, tuple[list[str], str]] = {
    **MEMORY_NAMES,
    "gradient_accumulation_steps": _ACCUMULATION,
    "accumulation_steps": _ACCUMULATION,
    "grad_accum_steps": _ACCUMULATION,
    "per_device_train_batch_size": (["micro_batch_size"], "the micro-batch the run starts with"),
    "output_dir": (["run_dir"], "checkpoints, metrics and events are all written there"),
    "checkpoint_dir": (["run_dir"], "checkpoints go to run_dir/checkpoints/"),
    "save_dir": (["run_dir"], "checkpoints go to run_dir/checkpoints/"),
    "checkpoint_frequency": (["save_every_steps"], "counted in optimizer steps"),
    "save_total_limit": (["keep_last"], "how many checkpoints are kept"),
    "logging_steps": (["log_every_steps"], "how often a step line is printed"),
    "gradient_checkpointing": (["activation_checkpointing"], "true, false, 'auto' or 'offload'"),
    "fp16": (["precision"], "precision: fp16 (or bf16, fp32, auto)"),
    "bf16": (["precision"], "precision: bf16 (or fp16, fp32, auto)"),
    "amp": (["precision"], "precision: fp16 or bf16 (or fp32, auto)"),
    "lr": _OPTIMIZER,
    "learning_rate": _OPTIMIZER,
    "weight_decay": _OPTIMIZER,
    "optimizer": _OPTIMIZER,
    "optim": _OPTIMIZER,
    "warmup_steps": _SCHEDULE,
    "lr_scheduler_type": _SCHEDULE,
    "scheduler": _SCHEDULE,
    "pin_memory": _LOADER,
    "persistent_workers": _LOADER,
    "prefetch_factor": _LOADER,
}
"""Names users bring from other trainers' configs (Hugging Face `TrainingArguments`, the
DataLoader, guides) -> the fields that hold the setting here and a note: what `TrainConfig`
says for such a key instead of a list of every field."""


def _quoted_value(value: Any) -> bool:
    """True for text that reads as a number or true/false ("8", "0.5", "true"): a value written
    in quotes. Other text ('5m') is no number at all, and the quotes are not what is wrong."""
    if not isinstance(value, str):
        return False
    if value.strip().lower() in ("true", "false"):
        return True
    try:
        float(value)
    except ValueError:
        return False
    return True


def suggestion(key: str, fields: list[str], hints: dict | None = None) -> str:
    """What to say about the unknown `key`: a hint of `hints` where it has one (its fields and
    note), else the closest fields, else every field."""
    hinted, note = (hints or {}).get(key.strip().lower(), ([], ""))
    hinted = [name for name in hinted if name in fields]
    if hinted:
        return "did you mean " + _join_or([f"'{name}'" for name in hinted]) + f"? ({note})"
    if note:
        close = _closest(key, fields)
        if close:
            return "did you mean " + _join_or([f"'{name}'" for name in close]) + f"? ({note})"
        return "the fields are: " + ", ".join(fields) + f"; {note}"
    close = _closest(key, fields)
    if close:
        return "did you mean " + _join_or([f"'{name}'" for name in close]) + "?"
    return "the fields are: " + ", ".join(fields)


def _closest(key: str, fields: list[str]) -> list[str]:
    """Fields the unknown `key` was probably meant to be, best kind of match first.

    In order: the same name spelled another way (camelCase, dashes, capitals); a typo (one or two
    edits, fewer for short names); the start of a field name, maybe with a typo (`efective`);
    the words of a field inside the key or the key's words inside a field (`save_steps`,
    `dataloader_num_workers`). Matches that share only a generic word like `steps` are not made.
    """
    wanted = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key.strip())
    wanted = re.sub(r"[-\s.]+", "_", wanted).lower()
    if wanted in fields:
        return [wanted]
    distance = {name: _edits(wanted, name) for name in fields}
    best = min(distance.values())
    typos = [n for n in fields if distance[n] == best <= max(1, round(len(n) / 4))]
    if typos:
        return typos

    def starts(name: str) -> bool:
        if len(wanted) >= 3 and name.startswith(wanted):
            return True
        widths = (len(wanted) - 1, len(wanted), len(wanted) + 1)
        return len(wanted) >= 5 and min(_edits(wanted, name[:w]) for w in widths) <= 1

    prefixed = [name for name in fields if starts(name)]
    if prefixed:
        return prefixed[:3]
    words = wanted.split("_")

    def shares_words(name: str) -> bool:
        theirs = name.split("_")
        if _in_order(words, theirs):
            return True
        # A field's words at the start or end of the key: keep_last_k, num_train_epochs.
        return words[: len(theirs)] == theirs or words[-len(theirs) :] == theirs

    return [name for name in fields if shares_words(name)][:3]


def _edits(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two neighbours) that turn a into b."""
    before, previous = [0] * (len(b) + 1), list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, previous = previous, current
    return previous[-1]


def _in_order(part: list[str], whole: list[str]) -> bool:
    rest = iter(whole)
    return all(word in rest for word in part)


def accepts(model: type[BaseModel], name: str) -> str:
    """What field `name` accepts, in words, from its type and bounds ('a whole number ≥ 1')."""
    if name in RULES:
        return RULES[name]
    info = model.model_fields[name]
    return _join_or(_type_words(info.annotation, info.metadata))


def _type_words(annotation: Any, bounds: list[Any]) -> list[str]:
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *metadata = get_args(annotation)
        return _type_words(inner, [*bounds, *metadata])
    if origin in (Union, types.UnionType):
        return [word for arg in get_args(annotation) for word in _type_words(arg, bounds)]
    if origin is Literal:
        return [show_value(value) for value in get_args(annotation)]
    if annotation is type(None):
        return ["null"]
    if annotation is bool:
        return ["true", "false"]
    if annotation is int:
        return ["a whole number" + _bounds_words(bounds)]
    if annotation is float:
        return ["a number" + _bounds_words(bounds)]
    if annotation is str:
        return ["text"]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):  # a block: lora
        names = [f'"{name}": ...' for name in list(annotation.model_fields)[:2]]
        return ["a mapping of its settings, {" + ", ".join([*names, "..."]) + "}"]
    return [getattr(annotation, "__name__", str(annotation))]


def _bounds_words(bounds: list[Any]) -> str:
    words = []
    for bound in bounds:
        for item in bound.metadata if isinstance(bound, FieldInfo) else [bound]:
            if isinstance(item, annotated_types.Ge):
                words.append(f" ≥ {item.ge}")
            elif isinstance(item, annotated_types.Gt):
                words.append(f" > {item.gt}")
            elif isinstance(item, annotated_types.Le):
                words.append(f" ≤ {item.le}")
            elif isinstance(item, annotated_types.Lt):
                words.append(f" < {item.lt}")
    return " and".join(words)


def flat_types(annotation: Any) -> set[Any]:
    origin = get_origin(annotation)
    if origin is Annotated:
        return flat_types(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return {t for arg in get_args(annotation) for t in flat_types(arg)}
    if origin is Literal:
        return {type(value) for value in get_args(annotation)}
    return {annotation}


def _join_or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def show_value(value: Any) -> str:
    """A value as the user wrote it in JSON or YAML: 'text', 12, true, null; long ones cut."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        shown = repr(value)
    else:
        try:
            shown = json.dumps(value, default=str)
        except ValueError:
            shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def is_text(value: str) -> bool:
    """Whether `value` can be written as UTF-8 (a lone surrogate such as '\\ud800' cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def key_problem(key: Any) -> str:
    """Why `key` (not text, or text with a lone surrogate) cannot name a field."""
    if not isinstance(key, str):
        return f"{show_value(key)}: not a field name (field names are text)"
    return (
        f"{show_value(key)}: not a field name (it holds a lone surrogate, which is not text; "
        "check the file's escapes like \\ud800)"
    )


def type_name(value: Any) -> str:
    return {
        list: "a list",
        str: "text",
        int: "a number",
        float: "a number",
        bool: "true/false",
    }.get(type(value), type(value).__name__)


def _first_sentence(text: str | None) -> str:
    first = (text or "").split(". ")[0].rstrip(".")
    return first[:1].lower() + first[1:]
