"""What a fine-tune leaves behind, found and loaded the same way by `merge`, `generate` and
`evaluate`.

A user points these commands at one of four things: a checkpoint folder (exported as an adapter
first, `checkpoint_export`), a run directory (``RUN_DIR``, whose
``final/`` holds the export), a peft adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``, whose config names the base model), or a plain model folder (a
merged model, or any Hugging Face causal LM). `resolve_artifact` decides which it is once, so the
three commands cannot disagree about it, and every path problem becomes a `BadInputError` (exit 2)
naming the file and the flag that fixes it, before any weights are read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steadytrain.device import Device
from steadytrain.errors import BadInputError, RunDiskFullError, is_disk_full
from steadytrain.run import files as run_files

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_QUANTIZED_NAMES = ("4bit", "nf4", "fp4", "int4", "8bit", "int8")


@dataclass(frozen=True)
class Artifact:
    """A resolved model or adapter folder. `base` is the base model (a folder, or a Hugging Face
    id) an adapter applies to; None for a plain model."""

    path: Path
    kind: str  # "adapter" or "model"
    base: str | None = None
    adapter_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_adapter(self) -> bool:
        return self.kind == "adapter"

    @property
    def model_path(self) -> str:
        """Where the (base) model's weights are."""
        return self.base if self.is_adapter and self.base is not None else str(self.path)

    def describe(self) -> str:
        if self.is_adapter:
            return f"base {self.base} + adapter {self.path}"
        return f"model {self.path}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path}: cannot be read as JSON ({exc}); re-export it") from None
    if not isinstance(value, dict):
        raise BadInputError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _locate(path: Path, what: str) -> Path:
    """`path`, or its ``final/`` when `path` is a run directory."""
    if not path.exists():
        raise BadInputError(f"{what}: {path} does not exist; check the path")
    if not path.is_dir():
        raise BadInputError(
            f"{what}: {path} is a file; give the folder that holds {ADAPTER_CONFIG} (an adapter) "
            f"or {MODEL_CONFIG} (a model), or a run directory"
        )
    has_own = (path / ADAPTER_CONFIG).is_file() or _is_model_config(path / MODEL_CONFIG)
    if not has_own and (path / run_files.FINAL).is_dir():
        return path / run_files.FINAL
    return path


def _is_model_config(path: Path) -> bool:
    """A model's config.json (it names its model_type); a run directory's config.json is the
    training config and does not."""
    if not path.is_file():
        return False
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True  # let the model loader say what is wrong with it
    return not isinstance(value, dict) or "model_type" in value or "run_dir" not in value


def resolve_base(adapter_dir: Path, adapter_config: dict[str, Any], base: str | None) -> str:
    """The base model of an adapter: `base` when given (``--base``), else the adapter config's
    ``base_model_name_or_path``, tried as written (relative to the working directory, which is
    how peft records it) and then relative to the adapter folder. A name that is not a local
    folder and looks like a Hugging Face id (``org/name``) is returned as is."""
    config_file = adapter_dir / ADAPTER_CONFIG
    if base is not None:
        base_path = Path(base).expanduser()
        if (base_path / MODEL_CONFIG).is_file():
            return str(base_path)
        if base_path.exists():
            raise BadInputError(
                f"--base: {base_path} has no {MODEL_CONFIG}; give the folder of the base model "
                "the adapter was trained on"
            )
        if _looks_like_hub_id(base):
            return base
        raise BadInputError(f"--base: {base_path} does not exist; check the path")
    name = adapter_config.get("base_model_name_or_path")
    if not isinstance(name, str) or not name.strip():
        raise BadInputError(
            f"{config_file}: names no base_model_name_or_path, so the base model is unknown; "
            "pass it with --base PATH"
        )
    tried = [Path(name).expanduser(), adapter_dir / name]
    for candidate in tried:
        if (candidate / MODEL_CONFIG).is_file():
            return str(candidate)
    if _looks_like_hub_id(name) and not any(c.exists() for c in tried):
        return name
    looked = " and ".join(str(c) for c in dict.fromkeys(tried))
    raise BadInputError(
        f"base model: {config_file} says base_model_name_or_path {name!r}, but no model folder "
        f"({MODEL_CONFIG}) is there (looked in {looked}); pass the base model's folder with "
        "--base PATH"
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not name.startswith((".", "~"))
        and not Path(name).is_absolute()
    )


def resolve_artifact(path: str | Path, base: str | None = None, what: str = "MODEL") -> Artifact:
    """Decide what `path` is (run directory, adapter folder or model folder) and check that the
    files each needs are there. `what` names the argument in errors. A checkpoint folder of a
    fine-tune (RUN_DIR/checkpoints/step-N) is exported as an adapter first."""
    from steadytrain.recipes.checkpoint_export import export_checkpoint_folder, is_checkpoint_folder

    given = Path(path).expanduser()
    if is_checkpoint_folder(given):
        given = export_checkpoint_folder(given)
    folder = _locate(given, what)
    config_file = folder / ADAPTER_CONFIG
    if config_file.is_file():
        adapter_config = _read_json(config_file)
        if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
            raise BadInputError(
                f"{what}: {folder} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS[0]}; the export "
                "is incomplete: re-export the adapter, or point at a checkpoint that has both"
            )
        return Artifact(
            folder, "adapter", resolve_base(folder, adapter_config, base), adapter_config
        )
    if (folder / MODEL_CONFIG).is_file():
        if base is not None:
            raise BadInputError(
                f"--base: {folder} is a complete model ({MODEL_CONFIG}, no {ADAPTER_CONFIG}), so "
                "there is no adapter to apply to a base; drop --base"
            )
        return Artifact(folder, "model")
    raise BadInputError(
        f"{what}: {folder} holds neither {ADAPTER_CONFIG} (a LoRA adapter) nor {MODEL_CONFIG} "
        "(a model) nor a final/ folder (a run directory); give one of those"
    )


def quantization_of(config: Any) -> str | None:
    """How the weights of a model config are quantized on disk ("bitsandbytes 4-bit"), or None
    for plain floating-point weights."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    if hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    if not isinstance(quant, dict):
        return "quantized"
    method = str(quant.get("quant_method", "quantized"))
    if quant.get("load_in_4bit"):
        return f"{method} 4-bit"
    if quant.get("load_in_8bit"):
        return f"{method} 8-bit"
    bits = quant.get("bits")
    return f"{method} {bits}-bit" if bits else method


def parse_dtype(value: str | None, what: str = "--dtype") -> torch.dtype | None:
    """A dtype name (fp32, bf16, fp16) as a torch dtype; None stays None (the default rule)."""
    if value is None or value == "auto":
        return None
    key = value.lower()
    if key in DTYPES:
        return DTYPES[key]
    if key in _QUANTIZED_NAMES:
        raise BadInputError(
            f"{what}: {value!r} is a quantized format; these commands load weights in fp32, "
            "bf16 or fp16 (a 4-bit base is for training, not for merging or exact evaluation)"
        )
    raise BadInputError(f"{what}: unknown dtype {value!r}; use fp32, bf16, fp16 or auto")


def saved_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model config says its weights were saved in, if it says."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return DTYPES.get(value)
    return None


def load_dtype(device: Device, config: Any, requested: torch.dtype | None) -> torch.dtype:
    """fp32 on CPU (low-precision matmuls there are slow and some ops are missing); on an
    accelerator the weights' own bf16/fp16 when autocast really runs in it there (a model
    trained in bf16 can overflow in fp16), else fp32. An explicit `requested` wins."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return torch.float32
    saved = saved_dtype(config)
    if saved in (torch.bfloat16, torch.float16) and saved in device.autocast_dtypes:
        return saved
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-load progress bars, which would interleave with our own output;
    restores the setting afterwards, since it is process-wide."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_config(artifact: Artifact) -> Any:
    """The (base) model's config, read before any weights so that refusals cost nothing."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(artifact.model_path)
    except (OSError, ValueError) as exc:
        if not artifact.is_adapter:
            raise BadInputError(
                f"MODEL: cannot read the config of {artifact.path} ({_first_line(exc)})"
            ) from None
        named = artifact.adapter_config.get("base_model_name_or_path")
        if named == artifact.base:
            source = f"{artifact.path / ADAPTER_CONFIG} says base_model_name_or_path {named!r}"
            looked = f"{Path(named).absolute()} and {artifact.path / named}"
        else:
            source, looked = f"--base {artifact.base!r}", str(Path(str(artifact.base)).absolute())
        raise BadInputError(
            f"base model: {source}, which is neither a local model folder (looked in {looked}) "
            f"nor a Hugging Face model that could be loaded ({_first_line(exc)}); pass the base "
            "model's folder with --base PATH"
        ) from None


def load_tokenizer(artifact: Artifact) -> Any:
    """The adapter folder's tokenizer when it has one (the fine-tune saves the tokenizer it
    trained with, chat template included), else the model's."""
    from transformers import AutoTokenizer

    source = artifact.model_path
    if artifact.is_adapter and any((artifact.path / n).is_file() for n in TOKENIZER_FILES):
        source = str(artifact.path)
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise BadInputError(
            f"tokenizer: cannot load one from {source} ({_first_line(exc)}); save the "
            "tokenizer into that folder (tokenizer.save_pretrained)"
        ) from None


def load_model(artifact: Artifact, dtype: torch.dtype, device: Device | None = None) -> Any:
    """The model in eval mode, in `dtype`, on `device` (CPU when None): the base with the adapter
    applied (a peft ``PeftModel``, whose ``disable_adapter()`` gives the base back without a
    second copy in memory), or the plain model."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                artifact.model_path, **{_dtype_keyword(): dtype}
            )
    except (OSError, ValueError) as exc:
        where = "base model" if artifact.is_adapter else "MODEL"
        raise BadInputError(
            f"{where}: cannot load the weights of {artifact.model_path} ({_first_line(exc)})"
        ) from None
    if artifact.is_adapter:
        from peft import PeftModel

        try:
            with warnings.catch_warnings():
                # peft reads a property transformers 5 deprecated; the warning is not the user's.
                warnings.filterwarnings(
                    "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
                )
                model = PeftModel.from_pretrained(model, str(artifact.path))
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise BadInputError(
                f"MODEL: cannot apply the adapter {artifact.path} to {artifact.base} "
                f"({_first_line(exc)}); check that --base is the model it was trained on"
            ) from None
    if device is not None:
        model = model.to(device.torch_device)
    return model.eval()


@dataclass
class Loaded:
    """A model for inference and everything needed to say what it is. Opened in two steps
    (`open_model`, then `load_weights`) so that a command can check its inputs against the
    tokenizer (a bad eval file, a prompt that needs a chat template) before reading weights that
    may take minutes and most of the machine's memory."""

    artifact: Artifact
    tokenizer: Any
    device: Device
    dtype: torch.dtype
    model: Any = None

    def load_weights(self) -> Any:
        if self.model is None:
            self.model = load_model(self.artifact, self.dtype, self.device)
        return self.model


def open_model(
    path: str | Path,
    base: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    weights: bool = True,
) -> Loaded:
    """Resolve `path`, pick the device and dtype, load the tokenizer and (with `weights`) the
    model (see `load_model`)."""
    from steadytrain.device import resolve_device

    requested = parse_dtype(dtype)
    artifact = resolve_artifact(path, base)
    resolved = resolve_device(device)
    load_as = load_dtype(resolved, load_config(artifact), requested)
    loaded = Loaded(artifact, load_tokenizer(artifact), resolved, load_as)
    if weights:
        loaded.load_weights()
    return loaded


def _dtype_keyword() -> str:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype``; the old name warns from then on."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "Artifact",
    "Loaded",
    "dtype_name",
    "load_config",
    "load_dtype",
    "load_model",
    "load_tokenizer",
    "open_model",
    "parse_dtype",
    "quantization_of",
    "quiet_transformers",
    "resolve_artifact",
    "resolve_base",
    "saved_dtype",
]


def disk_full_in_save(
    exc: BaseException, model: Any, staging: Path, target: Path
) -> tuple[OSError, Path] | None:
    """When `exc` (raised while `model` was saved into `staging`, the folder that becomes
    `target`) says the disk is full: the OS error and the file of `target` it was writing; else
    None. The error is an OSError (ENOSPC, EDQUOT; a RunDiskFullError of steadytrain's own
    writer comes back as it is), or the error safetensors raises, whose text carries the OS
    error ("os error 28") but no file name: the weights file is named after the model, peft's
    adapter or a whole model. An OSError without its file names the newest file in `staging`."""
    seen, error, name = exc, None, None
    while seen is not None and error is None:
        text = str(seen)
        if isinstance(seen, RunDiskFullError):
            return seen, Path(seen.path) if seen.path else target
        if is_disk_full(seen):
            error = seen
            name = getattr(seen, "filename", None)
        elif type(seen).__name__ == "SafetensorError" and (
            "os error 28" in text or "StorageFull" in text or "No space left" in text
        ):
            error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            name = "adapter_model" if hasattr(model, "peft_config") else "model"
            name += ".safetensors"
        seen = seen.__cause__ or seen.__context__
    if error is None:
        return None
    if not name:
        files = [p for p in staging.glob("*") if p.is_file()] if staging.is_dir() else []
        newest = max(files, key=lambda p: p.stat().st_mtime_ns, default=None)
        name = newest.name if newest is not None else ""
    return error, (target / Path(name).name if name else target)


def remove_leftovers(target: Path) -> None:
    """What an export or a merge killed mid-way left beside `target` (its process no longer
    runs): its staging folder (.NAME.staging-PID, after a swap the earlier folder) is removed;
    the earlier folder it had set aside (.NAME.old-PID, where a file system that cannot swap
    two folders in one step had it renamed aside and the kill came before the second rename) is
    put back at `target` when nothing is there, else removed. A link under such a name is left
    alone."""
    import re

    import psutil

    pattern = re.compile(rf"\.{re.escape(target.name)}\.(staging|old)-(\d+)")
    with os.scandir(target.parent) as listing:
        entries = list(listing)
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(found.group(2))
        if pid == os.getpid() or psutil.pid_exists(pid):
            continue  # in flight
        if found.group(1) == "old" and not os.path.lexists(target):
            os.rename(entry.path, target)
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
