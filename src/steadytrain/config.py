"""The one validated config tree. Each field's description is its documentation and its default's
reason; `docs/config.md` is generated from this file (`python -m steadytrain.config > docs/config.md`)
and a test keeps the two equal.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from steadytrain._units import parse_bytes
from steadytrain.errors import BadInputError, ConfigError

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


class TrainConfig(BaseModel):
    """Settings of one training run. Unknown keys are errors; every problem is reported at once."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    run_dir: str = Field(
        "runs/default",
        description="Folder that holds everything the run writes: config.json, metrics.jsonl, "
        "events.jsonl, checkpoints/. Reusing a folder resumes the run in it.",
    )
    effective_batch_size: int = Field(
        ..., ge=1,
        description="Samples per optimizer step. The optimizer always sees this many, whatever "
        "micro-batch memory allows; no default, because it is part of the recipe.",
    )
    micro_batch_size: Literal["auto"] | int = Field(
        "auto",
        description="Samples per forward/backward pass. 'auto' starts from the whole effective batch "
        "and halves on out-of-memory; an int is the starting size and must divide "
        "effective_batch_size. The size that fits is kept for later steps.",
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="Arithmetic of forward and backward. 'auto': bf16 autocast on CUDA where it "
        "works, else fp16 with a grad scaler; fp32 on MPS (fp16 grad scaling there has had "
        "gradient-zeroing bugs, bf16 is slow) and on CPU (bf16 autocast is slow on most CPUs). "
        "A dtype the device cannot run is refused with the alternative.",
    )
    epochs: int = Field(
        1, ge=1,
        description="Passes over the data. Ignored when max_steps is set.",
    )
    max_steps: int | None = Field(
        None, ge=1,
        description="Optimizer steps to run; wins over epochs (the data is repeated as needed).",
    )
    save_every_steps: int = Field(
        250, ge=1,
        description="Optimizer steps between checkpoints: the most work a crash can cost.",
    )
    keep_last: int = Field(
        2, ge=1,
        description="Committed checkpoints to keep; older ones are deleted only after a newer "
        "one is committed.",
    )
    device: str = Field(
        "auto",
        description="'auto' (cuda, then mps, then cpu), 'cuda', 'cuda:N', 'mps' or 'cpu'.",
    )
    memory_budget: Literal["auto"] | str | float = Field(
        "auto",
        description="Memory the run may use: a size ('12GiB', '16GB') or a fraction of the "
        "device's usable memory (0.8). 'auto' is 0.9 of it: CUDA total memory, MPS "
        "recommended_max_memory, CPU available RAM.",
    )
    hang_timeout: Literal["auto"] | float = Field(
        "auto",
        description="Seconds without progress before a hang is declared. 'auto': the larger of "
        "300 s and a multiple of the median step time.",
    )
    seed: int = Field(
        0, ge=0,
        description="Seeds the data order, the RNG streams and the model's random ops.",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0,
        description="Clip the gradient norm to this before each optimizer step; null for no "
        "clipping.",
    )
    drop_last: bool = Field(
        True,
        description="Drop an epoch's last batch when it is smaller than effective_batch_size, so "
        "every step sees the same batch size.",
    )
    shuffle: bool = Field(True, description="Shuffle the data each epoch (seeded).")
    num_workers: int = Field(
        0, ge=0,
        description="DataLoader worker processes that collate batches on the CPU.",
    )
    activation_checkpointing: Literal["auto"] | bool = Field(
        "auto",
        description="Recompute activations in backward to save memory. 'auto' turns it on only "
        "when one sample per micro-batch does not fit; true turns it on from the start.",
    )
    log_every_steps: int = Field(
        10, ge=1,
        description="Optimizer steps between progress lines when not on a terminal.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, type(self))) from None

    @field_validator("device")
    @classmethod
    def _device_spec(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("must be 'auto', 'cpu', 'mps', 'cuda' or 'cuda:N'")
        return value

    @field_validator("memory_budget")
    @classmethod
    def _budget_spec(cls, value: str | float) -> str | float:
        if isinstance(value, str) and value != "auto":
            parse_bytes(value)
        elif isinstance(value, float) and not 0 < value <= 1:
            raise ValueError("a fraction must be in (0, 1]; write a size like '12GiB' for bytes")
        return value

    @field_validator("hang_timeout")
    @classmethod
    def _timeout(cls, value: str | float) -> str | float:
        if isinstance(value, float) and value <= 0:
            raise ValueError("must be positive seconds, or 'auto'")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        problems = []
        eff, micro = self.effective_batch_size, self.micro_batch_size
        if isinstance(micro, int):
            if micro < 1:
                problems.append(f"micro_batch_size: {micro} must be at least 1, or 'auto'")
            elif micro > eff or eff % micro:
                fits = [d for d in range(1, eff + 1) if eff % d == 0]
                problems.append(
                    f"micro_batch_size: {micro} does not divide effective_batch_size {eff}; "
                    f"values that do: {_short(fits)}, or 'auto'"
                )
        if self.max_steps is not None and self.save_every_steps > self.max_steps:
            problems.append(
                f"save_every_steps: {self.save_every_steps} is more than max_steps "
                f"{self.max_steps}, so no checkpoint would be written before the end; set it to "
                f"at most {self.max_steps}"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def budget_bytes_or_fraction(self) -> int | float:
        """memory_budget as bytes (int) or as a fraction of usable memory (float)."""
        if self.memory_budget == "auto":
            return 0.9
        if isinstance(self.memory_budget, str):
            return parse_bytes(self.memory_budget)
        return float(self.memory_budget)

    # -- loading and saving ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> TrainConfig:
        if not isinstance(data, dict):
            raise ConfigError([f"the config must be a mapping of field: value, found "
                               f"{type(data).__name__}"], source)
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(exc.problems, source) from None

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Read a JSON or YAML file (by suffix; anything else is tried as YAML, a JSON superset)."""
        data = load_mapping(path)
        data.update(overrides or {})
        return cls.from_dict(data, source=str(path))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def dump(self, path: str | os.PathLike) -> None:
        """Write the resolved config (every default filled in) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as handle:
            handle.write(self.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON or YAML file as a dict; a missing file or a syntax error is BadInputError."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInputError(f"config file {path} does not exist; check the path") from None
    except OSError as exc:
        raise BadInputError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(f"config file {path} is not valid JSON: {exc.msg} at line "
                            f"{exc.lineno}, column {exc.colno}") from None
    except yaml.YAMLError as exc:
        raise BadInputError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"config file {path} must hold a mapping of field: value, found "
                            f"{type(data).__name__}")
    return data


def _short(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:12]))
    return shown + (", ..." if len(values) > 12 else "")


def _explain(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One plain line per problem: field, what was found, what is allowed."""
    fields = list(model.model_fields)
    problems: list[str] = []
    seen: set[str] = set()
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        # Union fields report one error per branch; the first per field is the useful one.
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(fields)}"
            problems.append(f"{name}: unknown field{hint}")
        elif err["type"] == "missing":
            problems.append(f"{name}: required, no default ({_describe(model, name)})")
        elif err["type"] == "value_error" and not name:
            problems.extend(str(err["ctx"]["error"]).splitlines())
        elif name not in seen:
            found = err.get("input")
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{loc or name}: {message} (found {found!r})")
        seen.add(name)
    return problems


def _describe(model: type[BaseModel], name: str) -> str:
    info = model.model_fields.get(name)
    return (info.description or "").split(".")[0] if info else ""


def reference_markdown() -> str:
    """The config reference page, generated from the field descriptions above."""
    lines = [
        "# Config reference",
        "",
        "Generated from `src/steadytrain/config.py` by `python -m steadytrain.config`; do not edit.",
        "The same fields are accepted as Python keyword arguments (`TrainConfig(...)`), as JSON and",
        "as YAML. Unknown fields are errors, with the closest valid name suggested.",
        "",
        "| field | default | meaning |",
        "| --- | --- | --- |",
    ]
    for name, info in TrainConfig.model_fields.items():
        default = "required" if info.is_required() else json.dumps(info.default)
        lines.append(f"| `{name}` | `{default}` | {info.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
