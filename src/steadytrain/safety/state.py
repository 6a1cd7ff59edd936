# long-module: the format's save and load side by side, one reader for both; the checkpoint
# package (issue 24) splits it by stateful object
"""The whole state of a run at an optimizer-step boundary, as checkpoint files, and back.

model.safetensors   what training changes: every parameter, or only the trainable ones (plus
                    persistent buffers) when the base is frozen; the frozen base is identified
                    by a fingerprint instead of being copied
optimizer.pt        optimizer.state_dict()        (torch.save, loaded with weights_only=True)
scheduler.pt        scheduler.state_dict()        (when there is a scheduler)
scaler.pt           GradScaler.state_dict()       (fp16)
rng.safetensors     torch CPU, every CUDA device and MPS generator states
.metadata, __R_0.distcp, rng-rank-R.safetensors   several ranks (safety/sharded.py)
trainer_state.json  TrainState, python and numpy RNG streams, the run's identity, the loss check

`RunState` is the pair: `capture()` writes all of it into a `Payload`, `load()` reads a payload
back into the same objects (torchtitan's `Stateful` state_dict / load_state_dict idea).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import io
import pickle
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steadytrain.device import get_rng_state, set_rng_state
from steadytrain.errors import BadInputError, CheckpointError, RNGStateError
from steadytrain.safety.checkpoint import Payload
from steadytrain.safety.fingerprint import data_fingerprint

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index, written last: a sharded checkpoint (safety/sharded.py)
holds it and the ranks' shards instead of the model and optimizer files."""
REQUIRED_FILES = ((MODEL_FILE, DCP_METADATA), (OPTIMIZER_FILE, DCP_METADATA), RNG_FILE, STATE_FILE)
"""What every checkpoint of a Trainer holds (scheduler and scaler only when the run has them);
a pair: one of the two."""


class HostBuffers:
    """Host copies of device tensors, allocated once and reused by every save.

    Fresh host memory for each save costs a page fault per page (a 1 GB checkpoint copied at
    about 1.2 GB/s on an H100 host); reused buffers, pinned on CUDA, copy at bus speed. The
    buffers of one save must not be overwritten while it is written: the caller waits for an
    async save in flight before capturing the next (`CheckpointSaver` does).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending = False

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            return tensor.clone()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        self._pending = self._pending or buffer.is_pinned()
        return buffer

    def finish(self) -> None:
        """Wait for the non-blocking copies to land."""
        if self._pending:
            torch.cuda.synchronize()
            self._pending = False


def to_host(obj: Any, buffers: HostBuffers | None = None, key: str = "", copy: bool = True) -> Any:
    """A copy of `obj` whose tensors live in host memory (the async writer's snapshot). With
    `buffers`, call `buffers.finish()` before reading the copies. `copy=False` (a synchronous
    save, written before training goes on): tensors already in host memory are not copied."""
    if isinstance(obj, torch.Tensor):
        if not copy and obj.device.type == "cpu":
            return obj.detach()
        if buffers is None:
            return obj.detach().to("cpu", copy=True)
        return buffers.copy(key, obj)
    if isinstance(obj, dict):
        return {k: to_host(v, buffers, f"{key}/{k}", copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_host(v, buffers, f"{key}/{i}", copy) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(to_host(v, buffers, f"{key}/{i}", copy) for i, v in enumerate(obj))
    if type(obj) not in _LOADABLE and not _loads_back(obj):
        raise BadInputError(_not_loadable(obj, key))
    return obj


_LOADABLE = {int, float, complex, bool, str, bytes, type(None), torch.Size, torch.dtype}
_OWNERS = {"opt": "optimizer", "scheduler": "scheduler", "scaler": "grad scaler"}


def _loads_back(obj: Any) -> bool:
    """Whether torch.load(weights_only=True), as a resume reads a checkpoint, accepts `obj`."""
    file = io.BytesIO()
    try:
        torch.save(obj, file)
        file.seek(0)
        torch.load(file, weights_only=True)
    except (pickle.PickleError, TypeError, AttributeError, ValueError, RuntimeError):
        # torch's refusal (UnpicklingError), or an object that does not pickle at all
        return False
    return True


def _not_loadable(obj: Any, key: str) -> str:
    owner, *path = key.split("/")
    where = "".join(f"[{int(p)}]" if p.isdigit() else f"[{p!r}]" for p in path)
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}".removeprefix("builtins.")
    return (
        f"{_OWNERS.get(owner, owner)}: its state_dict() holds a {kind} at {where or 'its top'}; "
        "checkpoints are read back with torch.load(weights_only=True), which refuses it, so no "
        "checkpoint of this run could be resumed. Keep tensors, numbers, strings and lists, "
        "tuples and dicts of them in the state (float(x) for a numpy number, list(d) for a deque)"
    )


def frozen_base(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def model_tensors(
    model: torch.nn.Module, buffers: HostBuffers | None = None, copy: bool = True
) -> dict[str, torch.Tensor]:
    """What training changes, in host memory (copied unless `copy` is false and it is there)."""
    names = set(model_tensors_names(model))
    return {
        k: to_host(v, buffers, f"model/{k}", copy)
        for k, v in model.state_dict().items()
        if k in names
    }


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
            whole = whole.full_tensor()
        sample = whole.flatten()[:: max(1, param.numel() // 64)][:64]
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        digest.update(sample.to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()


def model_shape(model: torch.nn.Module) -> str:
    """A fingerprint of the model's parameter names, shapes, dtypes and trainability."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
    return digest.hexdigest()[:16]


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = set(model_tensors_names(model))
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise BadInputError(
            f"{MODEL_FILE}: does not match the model (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}); resume with the model that wrote it, or use a new run_dir"
        )
    model.load_state_dict(tensors, strict=not frozen_base(model))


def model_tensors_names(model: torch.nn.Module) -> list[str]:
    if not frozen_base(model):
        return list(model.state_dict())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    params = {n for n, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k in trainable or k not in params]


# -- RNG streams: tensors to safetensors, the rest to JSON (no pickle) ------------------------


def rng_to_files() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = get_rng_state()
    tensors = {"torch": state["torch"].clone()}
    for i, cuda in enumerate(state.get("cuda", [])):
        tensors[f"cuda.{i}"] = cuda.clone()
    if "mps" in state:
        tensors["mps"] = state["mps"].clone()
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    plain = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, plain


def rng_from_files(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    version, internal, gauss = plain["python"]
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    state: dict[str, Any] = {
        "python": (version, tuple(internal), gauss),
        "numpy": (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
        "torch": tensors["torch"],
    }
    cuda = sorted((int(k.split(".")[1]), v) for k, v in tensors.items() if k.startswith("cuda."))
    if cuda:
        state["cuda"] = [v for _, v in cuda]
    if "mps" in tensors:
        state["mps"] = tensors["mps"]
    return state


# -- the run's identity: what must not change across a resume ---------------------------------


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
        if old != new:
            detail = _detail(old, new)
            lines += [f"{key}: {d}" for d in detail] if detail else [f"{key}: {old!r} -> {new!r}"]
    return lines


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


def capture_payload(
    state: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    identity: dict[str, Any],
    next_loss: float | None,
    buffers: HostBuffers | None = None,
    copy: bool = True,
) -> Payload:
    """Everything a resume needs, in host memory at this step boundary: copied for a background
    write; for a synchronous one (`copy=False`) tensors already in host memory are written from
    where they are, so the save needs no second copy of the state."""
    rng_tensors, rng_plain = rng_to_files()
    objects: dict[str, Any] = {
        OPTIMIZER_FILE: to_host(optimizer.state_dict(), buffers, "opt", copy)
    }
    if scheduler is not None:
        objects[SCHEDULER_FILE] = to_host(scheduler.state_dict(), key="scheduler")
    if scaler is not None:
        objects[SCALER_FILE] = to_host(scaler.state_dict(), key="scaler")
    model_copy = model_tensors(model, buffers, copy)
    if buffers is not None:
        buffers.finish()
    document = {
        "state": state.to_dict(),
        "rng": rng_plain,
        "identity": identity,
        "next_loss": next_loss,
        "torch": torch.__version__,
    }
    return Payload(
        tensors={MODEL_FILE: model_copy, RNG_FILE: rng_tensors},
        objects=objects,
        json={STATE_FILE: document},
    )


def load_train_state(state: Any, saved: dict[str, Any]) -> None:
    """Put a checkpoint's `TrainState` (``state.to_dict()``) into `state`, field by field of the
    dataclass. Fields that follow from this run's config (metadata ``from_config``) keep their
    fresh values; a field the checkpoint lacks (written before the field existed, e.g.
    ``chunked_loss``) takes its default."""
    for spec in dataclasses.fields(state):
        if not spec.metadata.get("from_config"):
            setattr(state, spec.name, saved.get(spec.name, spec.default))


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
    if refused:
        raise BadInputError(
            f"resume: {source} belongs to a different run; what changed (old -> new):\n  "
            + "\n  ".join(refused)
            + "\nUse the settings, model, optimizer and data of that run, start a new run_dir, "
            f"or allow these changes explicitly in the config: {override_hint(refused)}"
        )
    return overridden


# -- a checkpoint that verifies but does not load: damaged, skipped for the one before ---------


_COUNTERS = ("step", "epoch", "batch_in_epoch")


def checked_document(payload: Payload, source: Any) -> dict[str, Any]:
    """`trainer_state.json` of the checkpoint at `source` (a folder step-NNNNNNNN), refused as a
    `CheckpointError` when its shape is not the one `capture` writes or its step is not the
    folder's: a checkpoint whose hashes match (re-signed by hand or by a bug) but whose state
    would not load, or would load as another step."""
    doc = payload.json.get(STATE_FILE)
    problems = []
    if not isinstance(doc, dict):
        problems.append("not a JSON object")
        doc = {}
    state, rng = doc.get("state"), doc.get("rng")
    if not isinstance(state, dict):
        problems.append('"state" is missing or not an object')
    else:
        for name in _COUNTERS:
            value = state.get(name)
            if type(value) is not int or value < 0:
                problems.append(f'"state.{name}" is {value!r}, not a count')
        folder_step = _folder_step(source)
        if type(state.get("step")) is int and folder_step not in (None, state["step"]):
            problems.append(
                f'"state.step" is {state["step"]}, but the folder is step {folder_step}'
            )
    if not isinstance(rng, dict) or not {"python", "numpy"} <= set(rng):
        problems.append('"rng" lacks the python and numpy streams')
    if not isinstance(doc.get("identity"), dict):
        problems.append('"identity" is missing or not an object')
    next_loss = doc.get("next_loss")
    if next_loss is not None and type(next_loss) not in (int, float):
        problems.append(f'"next_loss" is {next_loss!r}, not a number')
    if problems:
        raise CheckpointError(f"{source}/{STATE_FILE}: {'; '.join(problems)}")
    return doc


def _folder_step(source: Any) -> int | None:
    name = Path(str(source)).name
    digits = name[len("step-") :]
    return int(digits) if name.startswith("step-") and digits.isdigit() else None


@contextlib.contextmanager
def loading(source: Any, what: Callable[[], str]) -> Iterator[None]:
    """A checkpoint's content that the objects refuse as they load it (a malformed RNG stream,
    an optimizer state of another shape) is a `CheckpointError` naming the checkpoint and the
    part (`what()`), not an internal error: the caller skips it for the one before."""
    try:
        yield
    except (BadInputError, RNGStateError):
        raise  # a different run or machine: the same for every checkpoint, said as it is
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(
            f"{source}: {what()} does not load ({type(exc).__name__}: {text})"
        ) from exc


@dataclasses.dataclass
class RunState:
    """Everything a checkpoint holds, as one save/load pair over the run's live objects."""

    state: Any
    """The loop's `TrainState`."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    identity: dict[str, Any]
    """`run_identity` of this run."""

    def capture(
        self, next_loss: float | None, buffers: HostBuffers | None = None, copy: bool = True
    ) -> Payload:
        """`copy=False`: for a synchronous save, host tensors are written from where they are."""
        return capture_payload(
            self.state,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.identity,
            next_loss,
            buffers,
            copy=copy,
        )

    def load(
        self, payload: Payload, source: Any, allowed: Collection[str] = ()
    ) -> tuple[list[str], float | None]:
        """Read `payload` (written by `capture`) back into the objects, after checking that it
        belongs to this run. Returns the identity differences `allowed` let through, and the
        loss the first resumed step must reproduce (None when it cannot be checked). Content
        that does not load is a `CheckpointError` (see `loading`)."""
        doc = checked_document(payload, source)
        overridden = check_identity(doc["identity"], self.identity, allowed, source)
        part = MODEL_FILE
        with loading(source, lambda: part):
            load_model_tensors(self.model, payload.tensors[MODEL_FILE])
            part = OPTIMIZER_FILE
            self.optimizer.load_state_dict(payload.objects[OPTIMIZER_FILE])
            part = SCHEDULER_FILE
            if self.scheduler is not None:
                self.scheduler.load_state_dict(payload.objects[SCHEDULER_FILE])
            part = SCALER_FILE
            if self.scaler is not None and SCALER_FILE in payload.objects:
                self.scaler.load_state_dict(payload.objects[SCALER_FILE])
            part = f"{STATE_FILE} (state)"
            load_train_state(self.state, doc["state"])
            part = f"the RNG streams ({RNG_FILE}, {STATE_FILE})"
            set_rng_state(rng_from_files(payload.tensors[RNG_FILE], doc["rng"]))
        return overridden, None if overridden else doc.get("next_loss")
