"""Load a Hugging Face causal LM and its tokenizer for a LoRA fine-tune, and wrap it in peft.

The dtype of the frozen base follows the precision (fp32, bf16, fp16): the base is only read, so
it costs half the memory in a 16-bit dtype, while peft keeps the adapter in fp32. A 4-bit base
(QLoRA) needs bitsandbytes, which runs on CUDA only; elsewhere the config decides between a
refusal before anything loads and an unquantized base in a dtype it names, and the message says
which happened and why. Activation checkpointing is left to the engine, which turns on the
model's own switch (`activation_checkpointing: true`, or when one sample does not fit).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain.errors import BadInputError
from steadytrain.memory.model_shape import hub_unreachable, not_a_model
from steadytrain.recipes.finetune_config import FinetuneConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BaseLoad:
    """How the base model is loaded: its dtype, whether in 4 bits, and why (a line to print)."""

    dtype: torch.dtype
    load_in_4bit: bool
    message: str | None = None


def plan_base_load(
    config: FinetuneConfig, device_type: str, precision: str, bnb_available: bool | None = None
) -> BaseLoad:
    """Decide the base's dtype and quantization for `device_type` before anything loads, so a
    4-bit request that cannot run is refused at once (exit 2), not after minutes of loading."""
    dtype = DTYPES[precision]
    quant = config.quantization
    if not quant.load_in_4bit:
        return BaseLoad(dtype, False)
    if bnb_available is None:
        bnb_available = importlib.util.find_spec("bitsandbytes") is not None
    why = None
    if device_type != "cuda":
        why = f"this run trains on {device_type}"
    elif not bnb_available:
        why = "bitsandbytes is not installed (pip install bitsandbytes)"
    if why is None:
        return BaseLoad(
            dtype, True, f"quantization: loading the base in 4 bits ({quant.bnb_4bit_quant_type})"
        )
    if quant.fallback == "refuse":
        raise BadInputError(
            f"quantization.load_in_4bit: 4-bit needs CUDA and bitsandbytes; {why}. Set "
            "quantization.load_in_4bit to false, or quantization.fallback to 'bf16', 'fp16' or "
            "'fp32' to load the base unquantized in that dtype instead (about 4× the memory of "
            "4 bits for 16-bit dtypes, 8× for fp32)"
        )
    return BaseLoad(
        DTYPES[quant.fallback],
        False,
        f"quantization: 4-bit is not possible here ({why}); loading the base unquantized in "
        f"{quant.fallback} instead (quantization.fallback: {quant.fallback})",
    )


def resolve_model_path(name_or_path: str) -> str:
    """A local folder as an absolute path (so the adapter's base_model_name_or_path still finds
    it from another directory), or a hub id unchanged. Something that looks like a path but
    does not exist is refused here, before transformers turns it into a confusing hub lookup."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        instead = not_a_model(path)
        if instead is not None:
            raise BadInputError(f"model_name_or_path: {name_or_path!r} {instead}")
        if not (path / "config.json").is_file():
            raise BadInputError(
                f"model_name_or_path: {name_or_path} has no config.json; give the folder that "
                "save_pretrained wrote (config.json plus the weights)"
            )
        return str(path.resolve())
    if path.is_file():
        raise BadInputError(
            f"model_name_or_path: {name_or_path!r} is a file; give the folder that holds it: "
            f"{str(path.parent)!r} (config.json plus the weights, as save_pretrained wrote them)"
        )
    looks_local = (
        name_or_path.startswith((".", "/", "~"))
        or name_or_path.count("/") > 1
        or "\\" in name_or_path
        or path.exists()
    )
    if looks_local:
        raise BadInputError(
            f"model_name_or_path: folder {name_or_path} does not exist; check the path, or give "
            "a Hugging Face hub id like 'meta-llama/Llama-3.2-1B'"
        )
    _cached_or_reachable(name_or_path)
    return name_or_path


def _cached_or_reachable(hub_id: str) -> None:
    """A hub id that is not in the local cache, where the hub cannot be reached, is refused now
    rather than after the hub client's retries (about a minute)."""
    from huggingface_hub import try_to_load_from_cache

    with contextlib.suppress(ValueError):  # an id the cache cannot hold: transformers says why
        if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
            return
    why = hub_unreachable()
    if why is not None:
        raise BadInputError(
            f"model_name_or_path: hub id {hub_id!r} is not in the local Hugging Face cache, and "
            f"{why}; give a local folder (one save_pretrained wrote, or the model downloaded "
            "where there is a network), or run once where the hub can be reached"
        )


def _hub_error(name: str, exc: Exception) -> BadInputError:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    hint = (
        "HF_HUB_OFFLINE is set, so only the local cache is read: download it once online, or "
        "give a local folder"
        if offline
        else "check the id and your network, or give a local folder"
    )
    return BadInputError(
        f"model_name_or_path: cannot load {name!r} ({str(exc).splitlines()[0]}); {hint}"
    )


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except OSError as exc:
        raise _hub_error(name_or_path, exc) from None


def load_base_model(config: FinetuneConfig, name_or_path: str, load: BaseLoad, device) -> Any:
    """`AutoModelForCausalLM` with the config's attention kernel and the planned dtype; a 4-bit
    base is placed on `device` while loading (bitsandbytes quantizes on the GPU)."""
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"attn_implementation": config.attn_implementation}
    dtype_key = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    kwargs[dtype_key] = load.dtype
    if load.load_in_4bit:
        from transformers import BitsAndBytesConfig

        quant = config.quantization
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=quant.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=load.dtype,
        )
        kwargs["device_map"] = {"": device.torch_device}
    from steadytrain.recipes.artifact import quiet_transformers

    try:
        with quiet_transformers():  # its per-load progress bar would interleave with ours
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        raise _hub_error(name_or_path, exc) from None
    except ValueError as exc:
        if "attn_implementation" in str(exc) or "attention" in str(exc).lower():
            raise BadInputError(
                f"attn_implementation: {config.attn_implementation} cannot be used with this model "
                f"here ({str(exc).splitlines()[0]}); use 'sdpa' or 'eager'"
            ) from None
        raise
    if load.load_in_4bit:
        model = prepare_4bit(model, load.dtype)
    return model


def prepare_4bit(model: Any, dtype: torch.dtype) -> Any:
    """A 4-bit base made ready for LoRA: every base parameter frozen. In bf16 the parameters
    bitsandbytes did not quantize (the embedding, the norms, an untied output layer) stay bf16,
    as an unquantized bf16 base keeps them: peft's `prepare_model_for_kbit_training` would cast
    them to fp32, which holds the 1B Llama's 263M-value embedding twice over (1.55 GiB on the
    device for the base against 1.02 in bf16) and makes every norm and the output layer's
    autocast cast per pass, the measured speed lever of issue 43's QLoRA. bf16 has fp32's
    exponent range, so nothing overflows there; in fp16 peft's preparation stays (norms in fp32,
    where fp16 overflows), and the estimate prices those parameters at 4 bytes."""
    if dtype == torch.bfloat16:
        for param in model.parameters():
            param.requires_grad = False
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def add_lora(model: Any, config: FinetuneConfig) -> Any:
    """The model wrapped by peft with the config's adapter; the base is frozen. Seeded, so two
    runs of one config start from the same adapter."""
    from peft import LoraConfig, get_peft_model

    lora = config.lora
    check_target_modules(model, lora.target_modules)
    peft_config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(config.seed)
    try:
        with warnings.catch_warnings():
            # peft reads a property transformers 5 deprecated; the warning is not the user's.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
            )
            return get_peft_model(model, peft_config)
    except ValueError as exc:
        raise BadInputError(
            f"lora.target_modules: {str(exc).splitlines()[0]}; use 'all-linear' or names of this "
            "model's linear layers (e.g. q_proj, v_proj)"
        ) from None


def check_target_modules(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Refuse a `lora.target_modules` entry that matches no module of `model` (peft matches a
    name by its last dotted parts), naming it and the closest real names: peft itself is
    silent when another entry matches, and a typo would train fewer layers than asked."""
    if isinstance(targets, str):
        return  # "all-linear" (a pattern is peft's to read)
    names = [name for name, _ in model.named_modules() if name]
    leaves = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
    )
    problems = []
    for entry in targets:
        if any(name == entry or name.endswith(f".{entry}") for name in names):
            continue
        close = difflib.get_close_matches(entry, leaves, n=3, cutoff=0.5) or leaves[:6]
        problems.append(
            f"lora.target_modules: {entry!r} matches no module of this model; did you mean "
            f"{' or '.join(repr(name) for name in close)}? (its linear layers: {', '.join(leaves)})"
        )
    if problems:
        raise BadInputError("; ".join(problems))


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _version(text: str) -> tuple[int, int]:
    parts = [int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2]]
    return parts[0], parts[1] if len(parts) > 1 else 0


__all__ = [
    "DTYPES",
    "BaseLoad",
    "add_lora",
    "check_target_modules",
    "load_base_model",
    "load_tokenizer",
    "parameter_counts",
    "plan_base_load",
    "resolve_model_path",
]
