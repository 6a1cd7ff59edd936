"""Next-token cross-entropy for Hugging Face causal LMs, optionally without all logits at once.

A causal LM's loss materialises batch × seq × vocab logits, an fp32 copy of them and the
log-probabilities, and keeps the log-probabilities for backward: 12 bytes per token per vocabulary
entry at the log-softmax backward. With Llama 3's 128,256-entry vocabulary that is 1.47 GiB per
1,024 tokens, more than the whole decoder's activations under checkpointing (docs/estimate.md).

`causal_lm_loss(model, batch, chunk_tokens=N)` runs the model's body once, then takes the output
layer and the loss N tokens at a time. Each chunk runs under `torch.utils.checkpoint`: its logits
are freed as soon as its loss is known, and backward recomputes them one chunk at a time, so at
no moment do more than N tokens' logits exist. The cost is one more output-layer matmul per chunk
in backward (docs/chunked-loss.md measures it).

Why checkpointing rather than only a hand-written fused gradient (Liger's and Apple's
cut-cross-entropy approach, which computes the gradient w.r.t. the hidden states and the output
weight in forward): the chunk calls the model's own output module, so whatever that module is (a
plain Linear, a peft LoRA-wrapped `lm_head`, a tied embedding weight, a quantized layer) and
whatever autocast does to it, the values are those of the plain loss, and autograd accumulates a
tied weight's gradient from both of its uses. A fused gradient has to be rederived for each of
those. So the fused kernel (fused_loss.py) serves the common case it reproduces exactly, a plain
Linear head on CUDA, where it saves the recomputed matmul and holds fewer logits, and the
checkpointed chunks serve every other head and device. torchtune's `CEWithChunkedOutputLoss` and
litgpt's `chunked_cross_entropy` loop over chunks without checkpointing: they avoid the
whole-batch fp32 copy, but every chunk's fp32 log-probabilities stay saved for backward
(4 B × tokens × vocab), so they save less.

Both modes return `(loss_sum, count)`, steadytrain's token-weighted form (engine/step.py): the sum
of the per-token losses over label tokens (labels of -100 are ignored, and position t predicts
label t + 1, as Hugging Face shifts them) and the number of those tokens, an int64 tensor on the
batch's device (no host sync).

A batch with neither `attention_mask` nor `position_ids` (full windows, no padding) runs with no
packed-sequence check: transformers then builds the positions 0…seq-1 itself and asks the GPU
whether they hold several sequences (`find_packed_sequence_indices`, a read of a device value
that waits for all queued work before every forward). For positions it built itself the answer
is always "one sequence", so `causal_lm_loss` gives that answer without the read
(`_default_positions`). Batches that carry `position_ids` (packed windows) keep the check, and
their block-diagonal mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from steadytrain.errors import BadInputError
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.fused_loss import fused_available, fused_loss_sum, supported_head

IGNORE_INDEX = -100

CHUNKED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "cohere",
    "phi3",
    "olmo",
    "olmo2",
)
"""Model types whose causal-LM forward is `lm_head(body(...).last_hidden_state)` followed at most
by the logit transforms `_logit_transform` reproduces (Granite's `logits_scaling`, Cohere's
`logit_scale`, Gemma 2/3's `final_logit_softcapping`). Any other family raises instead of
computing a loss that might silently differ from the model's own."""


def causal_lm_loss(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    chunk_tokens: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over label tokens and their count, `(loss_sum, count)`.

    `batch` holds `input_ids` and `labels` (-100 where a token is not trained on, e.g. the
    prompt or padding) and optionally `attention_mask` and `position_ids`. `model` is a Hugging
    Face causal LM or a peft `PeftModel` wrapping one. `chunk_tokens=None` is the plain loss
    (works for any causal LM); an int computes the output layer and the loss that many tokens at
    a time (see the module docstring), for the families in `CHUNKED_FAMILIES`. `fused=True`
    lets the chunked mode use the fused linear cross-entropy kernel where it runs
    (memory/fused_loss.py: CUDA with Liger Kernel, a plain Linear head), with the same values.
    """
    input_ids, labels, extra = _unpack(batch)
    targets = _shifted(labels)
    count = (targets != IGNORE_INDEX).sum()
    if chunk_tokens is None:
        with _default_positions(not extra):
            logits = model(input_ids=input_ids, use_cache=False, **extra).logits
        return _ce_sum(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), count
    _check_chunk_tokens(chunk_tokens)
    lm = _causal_lm(model)
    chunked = functools.partial(_chunked_sum, lm, input_ids, targets, extra, chunk_tokens, fused)
    return _as_root_forward(model, chunked), count


def _chunked_sum(
    lm: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    extra: dict[str, torch.Tensor],
    chunk_tokens: int,
    fused: bool,
) -> torch.Tensor:
    """The chunked mode's loss sum: the body once, then the head and the loss by chunks."""
    with _default_positions(not extra):
        hidden = lm.get_decoder()(input_ids=input_ids, use_cache=False, **extra).last_hidden_state
    head = lm.get_output_embeddings()
    transform = _logit_transform(lm.config)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if fused:
        total = fused_loss_sum(flat_hidden, flat_targets, head, lm.config)
        if total is not None:
            return total
    differentiable = torch.is_grad_enabled()
    total = None
    for h, t in zip(flat_hidden.split(chunk_tokens), flat_targets.split(chunk_tokens), strict=True):
        if differentiable:
            part = checkpoint(_chunk_loss, h, t, head, transform, use_reentrant=False)
        else:
            part = _chunk_loss(h, t, head, transform)
        total = part if total is None else total + part
    return total


_ROOT_FORWARD = "_steadytrain_chunked_loss"
"""The method a sharded model's root runs the chunked loss as (`_as_root_forward`)."""


def _as_root_forward(model: torch.nn.Module, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()`, run as a forward of `model` where it is an FSDP2 unit (`distributed:
    fsdp`): the chunked loss calls the body and the output layer directly, so the root unit's
    forward, whose hooks gather what it holds (the embedding, the final norm, the output layer)
    before and set up their gradients' reduce-scatter after, would never run, and the embedding
    would meet its weight still sharded. FSDP2's `register_fsdp_forward_method` runs those hooks
    around a method; the method is added to the model once."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # a torch without FSDP2 shards nothing
        return compute()
    if not isinstance(model, FSDPModule):
        return compute()
    if _ROOT_FORWARD not in vars(model):
        setattr(model, _ROOT_FORWARD, types.MethodType(lambda _self, run: run(), model))
        register_fsdp_forward_method(model, _ROOT_FORWARD)
    return getattr(model, _ROOT_FORWARD)(compute)


chunked_causal_lm_loss = functools.partial(causal_lm_loss, chunk_tokens=DEFAULT_CHUNK_TOKENS)
"""`causal_lm_loss` with `DEFAULT_CHUNK_TOKENS` (1,024; estimate.py gives the reason, beside the
loss's bytes per logit it is derived from): pass it as a `Trainer`'s `loss_fn`."""


class CausalLMLoss:
    """`causal_lm_loss` as an object whose chunking can be switched during a run, the way
    `memory.savers.MemorySavers` switches checkpointing: the engine's planner
    (`micro_batch_size: "auto"`) tries the loss both ways and keeps chunking where it lets a
    faster micro-batch fit, and the out-of-memory ladder at micro-batch 1 calls
    `enable_chunking()` and redoes the step, with the same loss and gradients in less memory.
    The engine finds these methods by name (`can_chunk`, `set_chunking`, `enable_chunking`,
    `chunk_tokens`); any loss object that has them takes part.

    `fused=True` (the default) computes the chunked mode with the fused linear cross-entropy
    kernel wherever it runs (fused_loss.py); `chunked_method` says which one a model gets."""

    def __init__(self, chunk_tokens: int | None = None, fused: bool = True) -> None:
        if chunk_tokens is not None:
            _check_chunk_tokens(chunk_tokens)
        self.chunk_tokens = chunk_tokens
        self.fused = fused

    def __call__(
        self, model: torch.nn.Module, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_lm_loss(model, batch, chunk_tokens=self.chunk_tokens, fused=self.fused)

    def chunked_method(self, model: torch.nn.Module, device: torch.device | str) -> str | None:
        """How the chunked mode computes `model`'s loss on `device`: "fused" (the fused kernel),
        "chunked" (checkpointed chunks), or None (no chunked mode for this model)."""
        if not self.can_chunk(model):
            return None
        lm = _causal_lm(model)
        fusable = supported_head(lm.get_output_embeddings(), lm.config) is None
        return "fused" if self.fused and fusable and fused_available(device) else "chunked"

    def can_chunk(self, model: torch.nn.Module) -> bool:
        """Whether the chunked mode supports `model` (a family in `CHUNKED_FAMILIES`, not DDP,
        not a prompt-learning adapter): the planner offers chunking only then."""
        try:
            _causal_lm(model)
        except BadInputError:
            return False
        return True

    def set_chunking(self, chunk_tokens: int | None) -> None:
        """Chunk by `chunk_tokens` from the next call, or compute the plain loss (None). The
        engine's planner tries both ways; `enable_chunking` is the one-way switch of a ladder."""
        if chunk_tokens is not None:
            _check_chunk_tokens(chunk_tokens)
        self.chunk_tokens = chunk_tokens

    def enable_chunking(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> bool:
        """Chunk by `chunk_tokens` from the next call; False when chunks are already that small
        (nothing would change, so a ladder should move on to its next step)."""
        _check_chunk_tokens(chunk_tokens)
        if self.chunk_tokens is not None and self.chunk_tokens <= chunk_tokens:
            return False
        self.chunk_tokens = chunk_tokens
        return True

    def __repr__(self) -> str:
        return f"CausalLMLoss(chunk_tokens={self.chunk_tokens!r}, fused={self.fused!r})"


SKIP_PACKED_CHECK = True
"""Off: every batch runs transformers' packed-sequence check, as the model's own forward does
(the benchmark's switch for the runs before and after)."""

_UNPACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("unpacked", default=False)


@contextlib.contextmanager
def _default_positions(unpacked: bool) -> Iterator[None]:
    """While `unpacked` (the batch has neither an attention mask nor position ids), transformers'
    packed-sequence check answers "not packed" without reading the GPU: the model builds
    the positions 0…seq-1 itself, whose check always finds one sequence a row (module
    docstring). Elsewhere, and for any other caller, the check runs as transformers wrote it."""
    if not (unpacked and SKIP_PACKED_CHECK) or not _install_packed_check():
        yield
        return
    token = _UNPACKED.set(True)
    try:
        yield
    finally:
        _UNPACKED.reset(token)


def _install_packed_check() -> bool:
    """Wrap transformers' `find_packed_sequence_indices` once so that it answers None (one
    sequence a row) inside `_default_positions`; False where the model's transformers (already
    imported, by the model's own module) has none."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:
        return False
    if getattr(check, "steadytrain_wrapped", False):
        return True

    @functools.wraps(check)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if _UNPACKED.get():
            return None
        return check(position_ids)

    find_packed_sequence_indices.steadytrain_wrapped = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    return True


def _check_chunk_tokens(chunk_tokens: Any) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise BadInputError(
            f"chunk_tokens: {chunk_tokens!r} is not a positive number of tokens; use e.g. "
            f"{DEFAULT_CHUNK_TOKENS}, or None for the plain loss"
        )


def _chunk_loss(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, transform
) -> torch.Tensor:
    """One chunk's summed loss: the output layer, the family's logit transform in the logits'
    own dtype (as the model's forward applies it), then fp32 cross-entropy."""
    logits = head(hidden)
    if transform is not None:
        logits = transform(logits)
    return _ce_sum(logits, targets)


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy in fp32 whatever the logits' dtype, as Hugging Face's loss upcasts."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the positions that predict them: position t gets label t + 1, the
    last position -100. Padding at the end (rather than dropping the last hidden state) keeps
    the hidden states a contiguous view, so no copy of them is made."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
        found = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise BadInputError(
            f"batch: a causal LM loss needs a dict with 'input_ids' and 'labels' (-100 where a "
            f"token is not trained on); got {found}. Collate samples into such a dict (labels "
            "are usually a copy of input_ids with the prompt and padding set to -100)"
        )
    input_ids, labels = batch["input_ids"], batch["labels"]
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise BadInputError(
            f"batch: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must "
            "both be (batch, seq)"
        )
    extra = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
    return input_ids, labels, extra


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside `model`: peft's `PeftModel` is unwrapped (its LoRA
    layers are injected into the causal LM's modules, so calling the body runs them); adapters
    that act in `PeftModel.forward` itself (prompt and prefix tuning) cannot be split there."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise BadInputError(
            "chunk_tokens: the model is wrapped in DistributedDataParallel, whose forward must "
            "run for gradients to be synchronised, and the chunked loss calls the model's body "
            "and output layer directly; use chunk_tokens=None (the plain loss) under DDP"
        )
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        config = getattr(model, "active_peft_config", None)
        if config is not None and getattr(config, "is_prompt_learning", False):
            raise BadInputError(
                f"chunk_tokens: peft {config.peft_type} adapters act in the PeftModel's forward, "
                "which a chunked loss bypasses; use chunk_tokens=None (the plain loss) or LoRA"
            )
        model = get_base()
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in CHUNKED_FAMILIES or not callable(getattr(model, "get_decoder", None)):
        raise BadInputError(
            f"chunk_tokens: the chunked loss supports model types {', '.join(CHUNKED_FAMILIES)}; "
            f"this model is {family or type(model).__name__!r}, whose forward may transform the "
            "logits in a way the chunked loss would not reproduce. Use chunk_tokens=None (the "
            "plain loss)"
        )
    return model


def _logit_transform(config):
    """What the family's forward does to `lm_head`'s output before the loss, or None."""
    steps = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        steps.append(lambda x: x / scaling)
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1, 1.0):
        steps.append(lambda x: x * scale)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        steps.append(lambda x: torch.tanh(x / cap) * cap)
    if not steps:
        return None

    def transform(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return transform
