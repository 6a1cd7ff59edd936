"""Fine-tuning data: JSON/JSONL records to token ids with a loss mask, then padded or packed batches.

A file holds one of three formats, detected from its first record and required of every record:
``{"text": ...}`` (loss on every token), ``{"prompt": ..., "completion": ...}`` (loss on the
completion only) and ``{"messages": [{"role", "content"}, ...]}`` (rendered with the tokenizer's
chat template, loss on the assistant's tokens only). Every problem in a file is collected and
reported in one `BadInputError` (exit 2) naming the file and the line, so a user fixes a file in
one pass rather than one error per run.

Loaded samples are stored flat (one int32 array of ids, one bool array of "is a target"), so
through training a dataset costs five bytes a token, not a Python list per sample. `collate`
pads an optimizer batch to its longest sample and sorts it longest first; the engine then cuts
the batch into micro-batches, and `causal_lm_loss` trims each micro-batch to its own longest sample (from the host-side
``seq_lengths`` list, so without a device sync). Together this is length-grouped batching inside
each optimizer batch without touching the engine's seeded, resumable sampler. With
``packing=True`` whole samples are instead packed into windows of ``max_seq_length`` tokens, with
``position_ids`` restarting at each sample (see docs/finetune-data.md for what attention does).
"""

from __future__ import annotations

import math
import random
import warnings
from array import array
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from steadytrain.errors import BadInputError
from steadytrain.memory import chunked_loss
from steadytrain.recipes.byte_tokenizer import BYTE_CHAT_TEMPLATE, byte_tokenizer
from steadytrain.recipes.records import FORMAT_NAMES, FORMATS, read_file
from steadytrain.recipes.tokens import IGNORE_INDEX, _tokenize, pad_token_id

# -- statistics ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitStats:
    """What tokenising one split did; `summary()` is what the CLI prints."""

    name: str
    path: str
    format: str
    records: int
    samples: int
    truncated: int
    tokens_cut: int
    dropped: int
    tokens: int
    target_tokens: int
    max_seq_length: int
    windows: int | None = None
    longest: int = 0
    """Tokens in the longest item as trained: a sample cut to max_seq_length, or with packing
    the longest window. A batch is padded to its own longest item, so this, not
    max_seq_length, is the longest sequence a step sees."""
    longest_sample: int = 0
    """Tokens in the longest sample before truncation."""
    p95: int = 0
    """95 % of the samples have at most this many tokens, before truncation."""

    def summary(self) -> str:
        lines = [
            f"{self.name}: {self.records:,} {FORMAT_NAMES[self.format]} records from {self.path}, "
            f"{self.tokens:,} tokens ({self.target_tokens:,} in the loss)"
        ]
        if self.truncated:
            lines.append(
                f"truncated {self.truncated:,} of {self.records:,} samples "
                f"({self.tokens_cut:,} tokens cut) to max_seq_length {self.max_seq_length:,}"
            )
        if self.dropped:
            lines.append(
                f"dropped {self.dropped:,} samples with no loss tokens left within "
                f"max_seq_length {self.max_seq_length:,} (the prompt or earlier turns filled it)"
            )
        if self.windows is not None:
            lines.append(
                f"packed {self.samples:,} samples into {self.windows:,} windows of up to "
                f"{self.max_seq_length:,} tokens"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class DataStats:
    train: SplitStats
    eval: SplitStats | None

    def summary(self) -> str:
        return "\n".join(s.summary() for s in (self.train, self.eval) if s is not None)


# -- datasets --------------------------------------------------------------------------------


class TokenizedDataset(Dataset):
    """Map-style dataset of tokenised samples, or of packed windows of them.

    An item is ``{"input_ids", "labels"}`` (int64; labels are IGNORE_INDEX where a token is not
    a target), plus ``"position_ids"`` for packed windows, restarting at 0 at each sample.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        targets: torch.Tensor,
        starts: torch.Tensor,
        windows: torch.Tensor | None = None,
    ):
        self.ids, self.targets, self.starts, self.windows = ids, targets, starts, windows

    @property
    def packed(self) -> bool:
        return self.windows is not None

    @property
    def num_samples(self) -> int:
        return len(self.starts) - 1

    def __len__(self) -> int:
        return len(self.windows) - 1 if self.windows is not None else self.num_samples

    def lengths(self) -> list[int]:
        """Tokens per item."""
        bounds = self.starts if self.windows is None else self.starts[self.windows]
        return (bounds[1:] - bounds[:-1]).tolist()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        index %= len(self)
        if self.windows is None:
            first, last = index, index + 1
        else:
            first, last = int(self.windows[index]), int(self.windows[index + 1])
        start, stop = int(self.starts[first]), int(self.starts[last])
        input_ids = self.ids[start:stop].long()
        labels = input_ids.masked_fill(~self.targets[start:stop], IGNORE_INDEX)
        if self.windows is None:
            return {"input_ids": input_ids, "labels": labels}
        bounds = self.starts[first : last + 1] - start
        sizes = bounds[1:] - bounds[:-1]
        position_ids = torch.arange(stop - start) - torch.repeat_interleave(bounds[:-1], sizes)
        # The last token of one sample must not be trained to predict the next sample's first.
        labels[bounds[:-1]] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sample, longest first, goes to the window with the least room
    that still holds it. Samples are never split, so none loses its context to a window edge.
    Deterministic (ties broken by index), so the same data gives the same windows on resume."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    windows: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for i in order:
        size = lengths[i]
        at = bisect_left(room, (size, -1))
        if at < len(room):
            left, w = room.pop(at)
        else:
            left, w = capacity, len(windows)
            windows.append([])
        windows[w].append(i)
        if left - size > 0:
            insort(room, (left - size, w))
    return windows


def _build(
    name: str,
    path: Path,
    fmt: str,
    samples: list[tuple[list[int], list[bool]]],
    max_seq_length: int,
    packing: bool,
) -> tuple[TokenizedDataset, SplitStats]:
    kept: list[tuple[list[int], list[bool]]] = []
    truncated = tokens_cut = dropped = 0
    raw = sorted(len(ids) + getattr(ids, "more", 0) for ids, _ in samples)
    for ids, mask in samples:
        if len(ids) > max_seq_length:
            truncated += 1
            tokens_cut += len(ids) - max_seq_length + getattr(ids, "more", 0)
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
        if not any(mask[1:]):  # position 0 is never predicted, so it is never a target
            dropped += 1
            continue
        kept.append((ids, mask))
    if not kept:
        raise BadInputError(
            f"data file {path}: no sample has a completion or assistant token within "
            f"max_seq_length {max_seq_length}; raise max_seq_length or shorten the prompts"
        )
    windows = None
    if packing:
        groups = _pack([len(ids) for ids, _ in kept], max_seq_length)
        kept = [kept[i] for group in groups for i in group]
        windows = torch.tensor([0] + [len(g) for g in groups], dtype=torch.int64).cumsum(0)
    ids_flat, mask_flat = array("i"), array("b")
    starts = [0]
    for ids, mask in kept:
        ids_flat.extend(ids)
        mask_flat.extend(mask)
        starts.append(starts[-1] + len(ids))
    dataset = TokenizedDataset(
        torch.frombuffer(ids_flat, dtype=torch.int32).clone(),
        torch.frombuffer(mask_flat, dtype=torch.int8).clone().bool(),
        torch.tensor(starts, dtype=torch.int64),
        windows,
    )
    stats = SplitStats(
        name=name,
        path=str(path),
        format=fmt,
        records=len(samples),
        samples=len(kept),
        truncated=truncated,
        tokens_cut=tokens_cut,
        dropped=dropped,
        tokens=len(ids_flat),
        target_tokens=sum(sum(mask[1:]) for _, mask in kept),
        max_seq_length=max_seq_length,
        windows=len(dataset) if packing else None,
        longest=max(dataset.lengths()),
        longest_sample=raw[-1],
        p95=raw[min(len(raw) - 1, math.ceil(0.95 * len(raw)) - 1)],
    )
    return dataset, stats


def _check_arguments(max_seq_length: Any, eval_path: Any, eval_split: Any, packing: bool) -> None:
    """`load_datasets`'s arguments, refused with the fix; packing without per-sample attention
    is a warning (it trains, with samples of a window seeing each other)."""
    if (
        isinstance(max_seq_length, bool)
        or not isinstance(max_seq_length, int)
        or max_seq_length < 2
    ):
        raise BadInputError(
            f"max_seq_length: must be a whole number of at least 2 tokens, found {max_seq_length!r}"
        )
    if eval_path is not None and eval_split is not None:
        raise BadInputError(
            "eval_path and eval_split: give one; eval_split takes a share of the training file "
            "when there is no separate eval file"
        )
    if eval_split is not None and (
        isinstance(eval_split, bool)
        or not isinstance(eval_split, (int, float))
        or not 0 < eval_split < 1
    ):
        raise BadInputError(
            f"eval_split: must be a fraction between 0 and 1 (e.g. 0.05), found {eval_split!r}"
        )
    if packing and not packing_keeps_samples_apart():
        warnings.warn(
            "packing: this transformers version builds per-sample attention masks from "
            "position_ids only for flash-attention; with sdpa or eager attention each packed "
            "sample also attends to the samples before it in its window. Upgrade transformers, "
            "load the model with attn_implementation='flash_attention_2', or set packing: false.",
            PackingAttentionWarning,
            stacklevel=3,
        )


def load_datasets(
    train_path: str | Path,
    tokenizer: Any,
    *,
    max_seq_length: int,
    eval_path: str | Path | None = None,
    eval_split: float | None = None,
    packing: bool = False,
    seed: int = 0,
) -> tuple[TokenizedDataset, TokenizedDataset | None, DataStats]:
    """Read, check and tokenise the training data (and an eval file or a seeded share of the
    training records), truncate to `max_seq_length`, and pack if asked.

    Returns ``(train, eval or None, stats)``. Batch them with ``Collator(pad_token_id(tok))``
    and train with `causal_lm_loss`."""
    _check_arguments(max_seq_length, eval_path, eval_split, packing)
    train_path = Path(train_path)
    records, fmt = read_file(train_path)
    eval_records: list[tuple[str, dict]] | None = None
    eval_fmt = fmt
    if eval_split is not None:
        count = max(1, round(len(records) * eval_split))
        if count >= len(records):
            raise BadInputError(
                f"eval_split: {eval_split} of {len(records)} record(s) in {train_path} leaves "
                "none to train on; lower eval_split or give an eval file"
            )
        order = list(range(len(records)))
        random.Random(seed).shuffle(order)
        chosen = set(order[:count])
        eval_records = [r for i, r in enumerate(records) if i in chosen]
        records = [r for i, r in enumerate(records) if i not in chosen]
    elif eval_path is not None:
        eval_path = Path(eval_path)
        eval_records, eval_fmt = read_file(eval_path)

    train, train_stats = _build(
        "train",
        train_path,
        fmt,
        _tokenize(train_path, fmt, records, tokenizer, max_seq_length),
        max_seq_length,
        packing,
    )
    evaluation, eval_stats = None, None
    if eval_records is not None:
        source = Path(eval_path) if eval_path is not None else train_path
        evaluation, eval_stats = _build(
            "eval",
            source,
            eval_fmt,
            _tokenize(source, eval_fmt, eval_records, tokenizer, max_seq_length),
            max_seq_length,
            packing,
        )
    return train, evaluation, DataStats(train_stats, eval_stats)


class PackingAttentionWarning(UserWarning):
    """Packed samples may attend to each other with the installed transformers."""


def packing_keeps_samples_apart() -> bool:
    """Whether the installed transformers turns per-sample `position_ids` (with no
    attention_mask) into a block-diagonal causal mask for every attention implementation
    (`masking_utils.find_packed_sequence_indices`); older versions do so only for
    flash-attention, and with sdpa or eager a packed sample attends to the samples before it."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


# -- batches and the loss --------------------------------------------------------------------


def collate(samples: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, Any]:
    """Pad samples (right side) to the longest, longest first.

    Keys: ``input_ids`` (pad_id on padding), ``attention_mask`` (unpacked samples) or
    ``position_ids`` (packed windows; padding counts up from 0 as a sequence of its own),
    ``labels`` (IGNORE_INDEX on padding) and ``seq_lengths``, a plain list of each sample's
    length. The engine splits the batch into micro-batches along dim 0 and `lm_inputs` trims
    each to its own longest sample; sorting puts samples of similar length in the same
    micro-batch, so a micro-batch pays for its own longest sample, not the batch's. The
    gradient is a sum over samples, so the order does not change it."""
    if not samples:
        raise ValueError("collate: no samples")
    samples = sorted(samples, key=lambda s: -len(s["input_ids"]))
    lengths = [len(s["input_ids"]) for s in samples]
    rows, width = len(samples), lengths[0]
    input_ids = torch.full((rows, width), pad_id, dtype=torch.int64)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.int64)
    packed = "position_ids" in samples[0]
    extra = (
        torch.arange(width).repeat(rows, 1)
        if packed
        else torch.zeros(rows, width, dtype=torch.int64)
    )
    for row, (sample, size) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[row, :size] = sample["input_ids"]
        labels[row, :size] = sample["labels"]
        if packed:
            extra[row, :size] = sample["position_ids"]
            extra[row, size:] = torch.arange(width - size)
        else:
            extra[row, :size] = 1
    key = "position_ids" if packed else "attention_mask"
    return {"input_ids": input_ids, key: extra, "labels": labels, "seq_lengths": lengths}


@dataclass(frozen=True)
class Collator:
    """`collate` with the pad id bound; picklable, so DataLoader workers can use it."""

    pad_id: int

    def __call__(self, samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, Any]:
        return collate(samples, self.pad_id)


def lm_inputs(batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the model's keyword inputs, labels) of a (micro-)batch from `collate`, trimmed to its
    longest sample. Any loss over such batches should start here, so that a micro-batch of short
    samples does not pay for the padding of the longest one in its optimizer batch."""
    width = batch["input_ids"].shape[1]
    lengths = batch.get("seq_lengths")
    keep = min(width, max(lengths)) if lengths else width
    inputs = {
        key: batch[key][:, :keep]
        for key in ("input_ids", "attention_mask", "position_ids")
        if key in batch
    }
    return inputs, batch["labels"][:, :keep]


def unmasked(inputs: dict[str, torch.Tensor], batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`inputs` (from `lm_inputs`) without the attention mask when the batch's `seq_lengths`
    (a host list) say every sample fills the trimmed width: the mask is then all ones, and the
    model attends causally as it does with none, without reading the mask on the GPU to find
    that out (transformers' all-ones check, a wait for the queued work before every forward)."""
    lengths = batch.get("seq_lengths")
    if "attention_mask" not in inputs or not lengths:
        return inputs
    rows, width = inputs["input_ids"].shape
    if len(lengths) != rows or min(lengths) < width:  # padding in a row, or lengths of others
        return inputs
    return {key: value for key, value in inputs.items() if key != "attention_mask"}


def causal_lm_loss(
    model: torch.nn.Module,
    batch: dict[str, Any],
    *,
    chunk_tokens: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of target tokens)`` of a Hugging Face causal LM on a batch
    from `collate`: the engine divides the summed gradient by the batch's total count, so every
    target token weighs the same however the batch is split or padded.

    The batch is first trimmed to its longest sample (`lm_inputs`); the loss itself is
    `steadytrain.memory.chunked_loss.causal_lm_loss` (position t predicts label t+1,
    `use_cache=False` so packed windows keep their per-sample `position_ids`), chunked over the
    tokens when `chunk_tokens` is given, with the fused linear cross-entropy kernel where it runs
    when `fused` is true (memory/fused_loss.py)."""
    inputs, labels = lm_inputs(batch)
    return chunked_loss.causal_lm_loss(
        model, {**unmasked(inputs, batch), "labels": labels}, chunk_tokens=chunk_tokens, fused=fused
    )


class LMLoss(chunked_loss.CausalLMLoss):
    """`causal_lm_loss` as the engine's switchable loss (`CausalLMLoss`): the fine-tune's
    `loss_fn`, so that the planner and the out-of-memory ladder can chunk it. Only the batch
    differs (trimmed by `lm_inputs`): the call is `CausalLMLoss`'s own, so every mode the
    planner switches and measures (`chunk_tokens`, `fused`: the kernel on CUDA) is the one the
    run trains with, as in a `Trainer` given `CausalLMLoss`."""

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = lm_inputs(batch)
        return super().__call__(model, {**unmasked(inputs, batch), "labels": labels})


__all__: list[str] = [
    "BYTE_CHAT_TEMPLATE",
    "FORMATS",
    "IGNORE_INDEX",
    "Collator",
    "DataStats",
    "PackingAttentionWarning",
    "SplitStats",
    "TokenizedDataset",
    "byte_tokenizer",
    "causal_lm_loss",
    "collate",
    "lm_inputs",
    "load_datasets",
    "packing_keeps_samples_apart",
    "pad_token_id",
    "read_file",
]
