"""What the estimate reads off a model: its Hugging Face config (a local directory or a hub id)
and the exact parameter counts of the causal LM built from it on the meta device."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from steadytrain.errors import BadInputError
from steadytrain.memory.layout import Layout, layout_of
from steadytrain.memory.settings import FLAGS, WORDS


@dataclass(frozen=True)
class Shape:
    """What the activation model needs from a config."""

    family: str
    hidden: int
    intermediate: int | None
    layers: int
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    vocab: int
    tied: bool
    layout: Layout | None = None
    """How the family's layer departs from Llama's (`layout.py`); None for Llama's own."""


@dataclass
class Linear:
    name: str
    in_features: int
    out_features: int
    bias: bool
    in_layers: bool


@dataclass
class ParamCounts:
    """Exact counts from the meta-device model; shared (tied) tensors are counted once."""

    total: int
    linear_in_layers: int
    """Weights and biases of nn.Linear modules inside the decoder layers: what 4-bit quantizes
    (biases excepted) and what LoRA wraps."""
    lm_head: int
    """The output projection; 0 when it is tied to the input embedding."""
    embedding: int
    other: int
    tensors: list[int]
    """numel of every parameter tensor (8-bit optimizers keep small tensors in fp32)."""
    linears: list[Linear] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    """The first dimension of every parameter tensor, beside `tensors` (FSDP2 shards along it,
    padding it to a multiple of the ranks)."""
    layer_params: list[int] = field(default_factory=list)
    """Parameters of each decoder layer, in order: the units FSDP shards one by one; the rest
    (embeddings, final norm, output layer) is the root's."""
    layer_tensors: list[list[int]] = field(default_factory=list)
    """The indices (into `tensors`) of each decoder layer's parameters."""

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers: the embeddings, the final norm, the output
        layer (what FSDP's root unit holds)."""
        return self.total - sum(self.layer_params)

    def shard(self, indices: list[int] | None, ranks: int) -> int:
        """The values one rank holds of the tensors at `indices` (None: every tensor) sharded
        over `ranks`: each tensor's first dimension padded to a multiple of the ranks, as
        FSDP2 pads it, then divided."""
        chosen = range(len(self.tensors)) if indices is None else indices
        return sum(_shard(self.tensors[i], self.rows[i], ranks) for i in chosen)


def _shard(numel: int, rows: int, ranks: int) -> int:
    if rows <= 0:
        return numel
    return -(-rows // ranks) * (numel // rows)


def not_a_model(path: Path) -> str | None:
    """What the folder `path`, given where a model belongs, is instead, with the fix: a
    steadytrain run directory (a fine-tune's output_dir, whose config.json is the run's) or a
    LoRA adapter (adapter_config.json, no config.json); None for any other folder."""
    if _json_field(path / "config.json", "model_type") is not None:
        return None  # a model, wherever it was saved
    if (path / "metrics.jsonl").exists() or (path / "events.jsonl").exists():
        base = _json_field(path / "training_config.json", "model_name_or_path")
        adapter = path / "final"
        return (
            "is a steadytrain run directory (a fine-tune's output_dir; its config.json is the "
            f"run's), not a model: give the base model ({base!r})"
            if base
            else "is a steadytrain run directory (its config.json is the run's), not a model: "
            "give the model's own folder or hub id"
        ) + (
            f"; its adapter is in {str(adapter)!r}: steadytrain generate, evaluate and merge "
            "take that folder; to train the run further, keep it as output_dir and raise "
            "max_steps or num_train_epochs"
            if (adapter / "adapter_config.json").is_file()
            else ""
        )
    if (path / "adapter_config.json").is_file() and not (path / "config.json").exists():
        base = _json_field(path / "adapter_config.json", "base_model_name_or_path")
        named = f" ({base!r}, its adapter_config.json's base_model_name_or_path)" if base else ""
        return (
            f"holds a LoRA adapter (adapter_config.json), not a model: give its base model{named}; "
            "steadytrain generate, evaluate and merge take the adapter folder as it is, and "
            f"`steadytrain merge {path} --out DIR` writes base and adapter as one model"
        )
    return None


def _json_field(path: Path, key: str) -> object:
    """`key` of the JSON object in the file `path`; None where there is none."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found.get(key) if isinstance(found, dict) else None


def load_config(model: str):
    """A Hugging Face config from a local directory or a hub id (cache, or online when the
    network is there). Nothing but config.json is read."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "/", "~")) or os.sep + os.sep in model
    if looks_local:
        if path.is_file() and path.name == "config.json":
            raise BadInputError(
                f"model: {model!r} is the model's config file; pass the folder that holds it: "
                f"{str(path.parent)!r}"
            )
        if not path.is_dir():
            raise BadInputError(
                f"model: {model!r} is not a directory; pass a local model directory holding "
                "config.json, or a Hugging Face model id"
            )
        instead = not_a_model(path)
        if instead is not None:
            raise BadInputError(f"model: {model!r} {instead}")
        if not (path / "config.json").is_file():
            raise BadInputError(
                f"model: {model!r} has no config.json; pass the directory the model was saved "
                "to (save_pretrained writes config.json there)"
            )
    if not looks_local:
        with contextlib.suppress(OSError, ValueError, KeyError):  # not in the cache
            return AutoConfig.from_pretrained(model, local_files_only=True)
        offline = hub_unreachable()
        if offline:  # fail now, not after the hub client's retries
            raise BadInputError(
                f"model: hub id {model!r} is not in the local Hugging Face cache, and {offline}. "
                "Point at a local directory holding its config.json instead: one written by "
                "save_pretrained, one downloaded where there is a network (huggingface-cli "
                "download MODEL config.json --local-dir DIR), or its snapshot in the cache "
                "(~/.cache/huggingface/hub/models--ORG--NAME/snapshots/HASH)"
            )
    try:
        return AutoConfig.from_pretrained(str(path) if looks_local else model)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if looks_local:
            raise BadInputError(
                f"model: cannot read the config in {model!r} ({first}); check config.json"
            ) from exc
        raise BadInputError(
            f"model: cannot get the config of hub id {model!r}: it is not in the local Hugging "
            f"Face cache and the hub cannot be reached, or it does not exist ({first}). Pass a "
            "local directory holding its config.json instead (download it where there is a "
            "network: huggingface-cli download MODEL config.json --local-dir DIR)"
        ) from exc


HUB_CHECK_S = 3.0  # how long to wait for the hub's address and a connection before calling it away


def hub_unreachable(timeout: float = HUB_CHECK_S) -> str | None:
    """Why the Hugging Face hub cannot be asked now (offline by setting, or no connection
    within `timeout` seconds), or None when it answers. Name lookup cannot be timed out on its
    own, so the check runs in a thread that is left behind if it hangs."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set (offline mode)"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parsed = urllib.parse.urlsplit(endpoint)
    host, port = parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80)
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as exc:
            result.append(f"the hub ({host}) cannot be reached from here ({exc})")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    if not result:
        return f"the hub ({host}) did not answer within {timeout:.0f} s"
    return result[0]


def text_config(config):
    """Multimodal configs keep the language model's shape in a sub-config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def shape_of(config) -> Shape:
    text = text_config(config)
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else None)
    family = getattr(text, "model_type", "unknown")
    intermediate = getattr(text, "intermediate_size", None)
    if family == "gpt2":  # GPT-2's MLP is n_inner wide, 4 × hidden when unset
        intermediate = getattr(text, "n_inner", None) or 4 * hidden
    return Shape(
        family=family,
        hidden=hidden,
        intermediate=intermediate,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        layout=layout_of(text),
    )


def count_parameters(config) -> ParamCounts:
    """Build the causal LM on the meta device and count, by kind. Tied tensors appear once."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise BadInputError(
            f"model: transformers cannot build a causal LM from this config "
            f"(model_type {getattr(config, 'model_type', '?')!r}): {exc}"
        ) from exc
    seen: set[int] = set()
    counts = {"linear_in_layers": 0, "lm_head": 0, "embedding": 0, "other": 0}
    tensors: list[int] = []
    rows: list[int] = []
    layers: dict[str, list[int]] = {}
    linears: list[Linear] = []
    output = model.get_output_embeddings()
    for module_name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        in_layers = ".layers." in f".{module_name}." or ".h." in f".{module_name}."
        layer = _layer_of(module_name)
        linear = _linear_of(module)
        if linear is not None:
            linears.append(
                Linear(module_name, *linear, in_layers=in_layers and module is not output)
            )
        for p in own:
            seen.add(id(p))
            if layer is not None:
                layers.setdefault(layer, []).append(len(tensors))
            tensors.append(p.numel())
            rows.append(int(p.shape[0]) if p.dim() else 1)
            if module is output:
                kind = "lm_head"
            elif isinstance(module, torch.nn.Embedding):
                kind = "embedding"
            elif linear is not None and in_layers:
                kind = "linear_in_layers"
            else:
                kind = "other"
            counts[kind] += p.numel()
    return ParamCounts(
        total=sum(tensors),
        tensors=tensors,
        linears=linears,
        rows=rows,
        layer_params=[sum(tensors[i] for i in found) for found in layers.values()],
        layer_tensors=list(layers.values()),
        **counts,
    )


def _layer_of(module_name: str) -> str | None:
    """The decoder layer a module belongs to ("model.layers.3" for "model.layers.3.mlp"), or
    None outside the layers."""
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h") and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return None


def _linear_of(module) -> tuple[int, int, bool] | None:
    """(in, out, bias) of a linear layer: nn.Linear, or GPT-2's Conv1D (a linear whose weight
    is stored in × out), which peft wraps as a linear too; None for anything else."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, module.bias is not None
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        fan_in, fan_out = module.weight.shape
        return int(fan_in), int(fan_out), module.bias is not None
    return None


def lora_targets(
    counts: ParamCounts, targets: tuple[str, ...], vocabulary: str = FLAGS
) -> list[Linear]:
    """The nn.Linear modules peft wraps for `target_modules` given as names: a module matches
    when its name is the target or ends with '.' + target. 'all-linear' is every linear in the
    decoder layers (peft leaves the output layer out). A target that matches none is refused
    in `vocabulary`'s words (a config's `lora.target_modules`, or `--lora-targets`)."""
    if targets == ("all-linear",):
        return [m for m in counts.linears if m.in_layers]
    found = [m for m in counts.linears if any(_matches(m.name, t) for t in targets)]
    missing = [t for t in targets if not any(_matches(m.name, t) for m in counts.linears)]
    if missing or not found:
        names = sorted({m.name.rsplit(".", 1)[-1] for m in counts.linears})
        raise BadInputError(
            f"{WORDS[vocabulary]['targets']}: {', '.join(missing or targets)} match no linear "
            f"layer of this model; its linear layers are: {', '.join(names)} (or "
            f"{WORDS[vocabulary]['all_linear']})"
        )
    return found


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


# -- the estimate -----------------------------------------------------------------------------
