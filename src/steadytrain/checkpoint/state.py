"""What a checkpoint holds: named stateful objects, each saving its part into a `Payload` and
loading it back (torchtitan's `Stateful` idea: one `save` / `load` pair per object).

    name         file (or key of trainer_state.json)   what
    model        model.safetensors   what training changes: the trainable parameters, the
                                     persistent buffers and the buffers outside the state_dict
                                     (persistent=False) that the run changed; a frozen parameter
                                     (a LoRA base, the output layer tied to frozen embeddings) is
                                     never saved, the base is identified by its fingerprint
    optimizer    optimizer.pt        optimizer.state_dict()   (loaded with weights_only=True)
    scheduler    scheduler.pt        scheduler.state_dict()   (when there is a scheduler)
    scaler       scaler.pt           GradScaler.state_dict()  (fp16)
    train_state  "state"             the loop's TrainState
    rng          rng.safetensors     torch CPU, CUDA and MPS generators; python's and numpy's
                 "rng"               streams as JSON (no pickle); each rank's: ranks.py
    data_order   data_order.safetensors   a DataLoader's drawn epoch orders (int64)
    user_state   user_state.pt       state_dict() of each object the program carries
                                     (user_state: CarriedState, a stateful callback)
    callbacks    callbacks.pt        state_dict() of each Trainer(callbacks=...) callback that
                                     has state_dict() and load_state_dict()

trainer_state.json also holds the run's identity and the loss check (run_state.py); several
ranks add .metadata, __R_0.distcp and rng-rank-R.safetensors (ranks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from steadytrain.checkpoint.host import HostBuffers, to_host
from steadytrain.checkpoint.store import Payload
from steadytrain.device import get_rng_state
from steadytrain.device.batches import to_device
from steadytrain.errors import BadInputError, CheckpointError, RNGStateError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
DATA_ORDER_FILE = "data_order.safetensors"
USER_STATE_FILE = "user_state.pt"
CALLBACKS_FILE = "callbacks.pt"
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index, written last: a sharded checkpoint (ranks.py) holds it
and the ranks' shards instead of the model and optimizer files."""
REQUIRED_FILES = ((MODEL_FILE, DCP_METADATA), (OPTIMIZER_FILE, DCP_METADATA), RNG_FILE, STATE_FILE)
"""What every checkpoint of a Trainer holds (scheduler and scaler only when the run has them);
a pair: one of the two."""


@dataclasses.dataclass
class Host:
    """How a save copies tensors to host memory: into reused `buffers` for a background write,
    or (`copy` false, a synchronous save) tensors already there are written from where they are."""

    buffers: HostBuffers | None = None
    copy: bool = True


class State(Protocol):
    """One named stateful object of a checkpoint."""

    what: str
    """Its part of the checkpoint, as a message names it ("optimizer.pt")."""

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        """Put this object's state into `out` (a file) or `doc` (trainer_state.json)."""

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        """Take back what `save` put there."""


# -- the model: trainable tensors only ---------------------------------------------------------


def frozen_base(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def model_tensors_names(model: torch.nn.Module) -> list[str]:
    """The state_dict keys a checkpoint holds: every trainable parameter and every persistent
    buffer. A frozen parameter is left out under each of its names: one tied to another module
    (an output layer sharing frozen embeddings) is listed once by named_parameters() but twice
    in the state_dict."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in model.state_dict() if k not in frozen]


def model_tensors(
    model: torch.nn.Module, buffers: HostBuffers | None = None, copy: bool = True
) -> dict[str, torch.Tensor]:
    """What training changes, in host memory (copied unless `copy` is false and it is there);
    nothing frozen is copied."""
    names = set(model_tensors_names(model))
    return {
        k: to_host(v, buffers, f"model/{k}", copy)
        for k, v in model.state_dict().items()
        if k in names
    }


UNSAVED_BUFFER = "buffer-outside-state-dict/"
"""The key prefix of a buffer registered with persistent=False that the run changed: the
state_dict leaves it out, so a resume would start from its initial value (a step counter, a
running statistic kept out of the model's files) and train another run."""


def unsaved_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the state_dict leaves out (registered with persistent=False), by name; read
    from each module's own list of them (a sharded model's state_dict is not called)."""
    return {
        f"{prefix}.{name}" if prefix else name: module._buffers[name]
        for prefix, module in model.named_modules()
        for name in sorted(module._non_persistent_buffers_set)
        if module._buffers.get(name) is not None
    }


def load_unsaved_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Each saved buffer outside the state_dict back into `model`: in place where the model's
    buffer has its shape and dtype, else in its place (on the model buffer's device)."""
    present = unsaved_buffers(model)
    unknown = sorted(set(saved) - set(present))
    if unknown:
        raise BadInputError(
            f"{MODEL_FILE}: holds buffers this model does not have ({unknown[:5]}); resume "
            "with the model that wrote it, or use a new run_dir"
        )
    for name, value in saved.items():
        current = present[name]
        if current.shape == value.shape and current.dtype == value.dtype:
            with torch.no_grad():
                current.copy_(value)
        else:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = value.to(current.device)


def _digest(tensor: torch.Tensor) -> str:
    """A digest of `tensor`'s dtype, shape and bytes."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), digest_size=16)
    digest.update(data.tobytes())
    return digest.hexdigest()


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The saved trainable tensors into `model`, and the buffers outside the state_dict that
    the run changed (`UNSAVED_BUFFER`). A frozen parameter a checkpoint of an older version
    holds (the tied output layer) is left as the model has it: the base is the one the frozen
    fingerprint identified."""
    unsaved = {
        k.removeprefix(UNSAVED_BUFFER): v
        for k, v in tensors.items()
        if k.startswith(UNSAVED_BUFFER)
    }
    tensors = {k: v for k, v in tensors.items() if not k.startswith(UNSAVED_BUFFER)}
    expected = set(model_tensors_names(model))
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    tensors = {k: v for k, v in tensors.items() if k not in frozen}
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise BadInputError(
            f"{MODEL_FILE}: does not match the model (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}); resume with the model that wrote it, or use a new run_dir"
        )
    model.load_state_dict(tensors, strict=not frozen_base(model))
    load_unsaved_buffers(model, unsaved)


@dataclasses.dataclass
class ModelState:
    """The model's part (`model_tensors`), and each buffer outside its state_dict that the run
    has changed since this object was made (an in-place update, or a new tensor in its place),
    under `UNSAVED_BUFFER`: one the run never changes (rotary frequencies, a causal mask) is not
    saved again."""

    model: torch.nn.Module
    what: str = MODEL_FILE

    def __post_init__(self) -> None:
        self.start = {
            n: (weakref.ref(b), b._version, _digest(b))
            for n, b in unsaved_buffers(self.model).items()
        }

    def changed_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers outside the state_dict whose value is not the one they had when this
        object was made: the same tensor at the same version is unchanged; another tensor, or
        one written since (a restore after the plan's trial passes writes every buffer with
        its own value), is compared by a digest of its bytes."""
        changed = {}
        for name, buffer in unsaved_buffers(self.model).items():
            ref, version, digest = self.start.get(name, (None, None, None))
            if ref is not None and ref() is buffer and buffer._version == version:
                continue
            if _digest(buffer) != digest:
                changed[name] = buffer
        return changed

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        tensors = model_tensors(self.model, host.buffers, host.copy)
        for name, buffer in self.changed_buffers().items():
            key = f"{UNSAVED_BUFFER}{name}"
            tensors[key] = to_host(buffer, host.buffers, f"model/{key}", host.copy)
        out.tensors[MODEL_FILE] = tensors

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        load_model_tensors(self.model, saved.tensors[MODEL_FILE])


@dataclasses.dataclass
class ObjectState:
    """An object with state_dict() / load_state_dict(), pickled into `file` (optimizer,
    scheduler, scaler). `buffered`: its tensors go through the host buffers (the optimizer's,
    as large as the model's); `optional`: a checkpoint without the file loads (the scaler)."""

    file: str
    obj: Any
    key: str
    buffered: bool = False
    optional: bool = False

    @property
    def what(self) -> str:
        return self.file

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        state = self.obj.state_dict()
        if self.buffered:
            out.objects[self.file] = to_host(state, host.buffers, self.key, host.copy)
        else:
            out.objects[self.file] = to_host(state, key=self.key)

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        if self.optional and self.file not in saved.objects:
            return
        self.obj.load_state_dict(saved.objects[self.file])


@dataclasses.dataclass
class TrainStateState:
    state: Any
    what: str = f"{STATE_FILE} (state)"

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        doc["state"] = self.state.to_dict()

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        load_train_state(self.state, doc["state"])


def load_train_state(state: Any, saved: dict[str, Any]) -> None:
    """Put a checkpoint's `TrainState` (``state.to_dict()``) into `state`, field by field of the
    dataclass. Fields that follow from this run's config (metadata ``from_config``) keep their
    fresh values; a field the checkpoint lacks (written before the field existed, e.g.
    ``chunked_loss``) takes its default."""
    for spec in dataclasses.fields(state):
        if not spec.metadata.get("from_config"):
            setattr(state, spec.name, saved.get(spec.name, spec.default))


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


# -- the program's state: a DataLoader's order, the objects it carries -------------------------


@dataclasses.dataclass
class DataOrderState:
    """The drawn epoch orders of a DataLoader's sampler (nothing for a dataset: its order is
    the seed's): key "e" the indices of epoch e, an int64 tensor; "range-e" [its length] for a
    sequential epoch."""

    sampler: Any
    what: str = "the data order"

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        """An order held as a tensor is written from where it is, without a copy: a new epoch
        replaces it (`LoaderOrder`) rather than changing it, so a background write reads it
        while training goes on."""
        order = self.sampler.loader_order
        if order is None or not order.drawn:
            return
        out.tensors[DATA_ORDER_FILE] = {
            f"range-{e}" if isinstance(o, range) else str(e): _order_tensor(o)
            for e, o in order.drawn.items()
        }

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        """A sequential epoch was saved as its length, others as indices (a tensor back)."""
        if self.sampler.loader_order is not None:
            self.sampler.loader_order.drawn = {
                int(e.removeprefix("range-")): range(int(t[0])) if e.startswith("range-") else t
                for e, t in saved.tensors.get(DATA_ORDER_FILE, {}).items()
            }


def _order_tensor(order: Any) -> torch.Tensor:
    if isinstance(order, range):
        return torch.tensor([len(order)], dtype=torch.int64)
    if isinstance(order, torch.Tensor) and order.dtype == torch.int64:
        return order
    return torch.tensor(order, dtype=torch.int64)  # a list (a key past int64 fails, as it did)


@dataclasses.dataclass
class UserStates:
    """state_dict() of each object the program carries across steps (`user_state`: an RNN's
    hidden state, an EMA, a callback that keeps state), by name; loaded onto `device`."""

    objects: dict[str, Any]
    device: torch.device | str = "cpu"
    what: str = "the program's state (user_state)"
    file: str = USER_STATE_FILE
    """callbacks.pt for the `Trainer(callbacks=...)` that keep state (`stateful_callbacks`)."""

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        if self.objects:
            out.objects[self.file] = {
                name: to_host(obj.state_dict(), key=f"{self.file} {name!r}")
                for name, obj in self.objects.items()
            }

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        kept = saved.objects.get(self.file, {})
        for name, obj in self.objects.items():
            if name in kept:
                obj.load_state_dict(to_device(kept[name], self.device))


def stateful_callbacks(callbacks: list[Any]) -> dict[str, Any]:
    """The callbacks that keep state in the checkpoint (both `state_dict()` and
    `load_state_dict()`), by a name their class and place give: `StepCounter`, a second one
    `StepCounter#2`. Resuming with the same callbacks list finds each one's state again."""
    named: dict[str, Any] = {}
    for callback in callbacks:
        if callable(getattr(callback, "state_dict", None)) and callable(
            getattr(callback, "load_state_dict", None)
        ):
            base = type(callback).__qualname__
            name, n = base, 1
            while name in named:
                n += 1
                name = f"{base}#{n}"
            named[name] = callback
    return named


# -- a checkpoint that verifies but does not load: damaged, skipped for the one before ---------


_COUNTERS = ("step", "epoch", "batch_in_epoch")


def checked_document(payload: Payload, source: Any) -> dict[str, Any]:
    """`trainer_state.json` of the checkpoint at `source` (a folder step-NNNNNNNN), refused as a
    `CheckpointError` when its shape is not the one a capture writes or its step is not the
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
