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

import json
import random
import re
import warnings
from array import array
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from steadytrain.config_files import read_user_text
from steadytrain.errors import BadInputError
from steadytrain.memory import chunked_loss

IGNORE_INDEX = -100
"""Label of a position that is not a target; the value `torch.nn.functional.cross_entropy` and
Hugging Face models skip by default."""

MAX_PROBLEMS = 10
"""Problems listed in one error; the rest are counted. Enough to see a pattern (a whole file in
the wrong format) without burying the first one."""

ROLES = ("system", "user", "assistant")
FORMATS = ("text", "prompt_completion", "messages")
_FORMAT_NAMES = {
    "text": '"text"',
    "prompt_completion": '"prompt" + "completion"',
    "messages": '"messages"',
}
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_ENCODE_CHUNK = 512


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

    def summary(self) -> str:
        lines = [
            f"{self.name}: {self.records:,} {_FORMAT_NAMES[self.format]} records from {self.path}, "
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


# -- reading and checking records ------------------------------------------------------------


class _Problems:
    """Problems of one file, collected so that all of them are reported in one error."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}")

    def raise_if_any(self) -> None:
        if not self.items:
            return
        shown = "\n".join(f"  - {p}" for p in self.items[:MAX_PROBLEMS])
        more = len(self.items) - MAX_PROBLEMS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise BadInputError(
            f"data file {self.path}: {len(self.items)} problem(s):\n{shown}{tail}\n"
            "  See docs/finetune-data.md for the formats."
        )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _read_records(path: Path, problems: _Problems) -> list[tuple[str, dict]]:
    """The records of a ``.jsonl`` (one object per line; blank lines skipped) or ``.json`` file
    (a list of objects, or ``{"data": [...]}``) as ``(where, record)``; `where` names the record
    in errors: "line 7" (1-based) for JSONL, "item [3]" (0-based index) for JSON."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json"):
        raise BadInputError(
            f"data file {path}: expected a .jsonl file (one JSON object per line) or a .json "
            "file (a list of objects); rename it if it is one of these"
        )
    text = read_user_text(path, "data file", "utf-8-sig", "; re-save it as UTF-8")
    records: list[tuple[str, dict]] = []
    if suffix == ".jsonl":
        # Not str.splitlines: it also splits at U+2028 and friends, which JSON allows in strings.
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            where = f"line {number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.add(
                    where,
                    f"invalid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                    "complete JSON object",
                )
                continue
            if not isinstance(value, dict):
                problems.add(where, f"expected a JSON object {{...}}, found {_type_name(value)}")
                continue
            records.append((where, value))
    else:
        try:
            value = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as exc:
            raise BadInputError(
                f"data file {path}: invalid JSON ({exc.msg} at line {exc.lineno}, column "
                f"{exc.colno})"
            ) from None
        if isinstance(value, dict) and isinstance(value.get("data"), list) and len(value) == 1:
            value = value["data"]
        if not isinstance(value, list):
            raise BadInputError(
                f"data file {path}: expected a list of records [{{...}}, ...] or "
                f'{{"data": [...]}}, found {_type_name(value)}'
            )
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                problems.add(
                    f"item [{index}]", f"expected an object {{...}}, found {_type_name(item)}"
                )
                continue
            records.append((f"item [{index}]", item))
    return records


def _record_format(record: dict) -> tuple[str | None, str | None]:
    """(format, None), or (None, the problem) for a record with no format or more than one."""
    found = []
    if "messages" in record:
        found.append("messages")
    if "prompt" in record or "completion" in record:
        found.append("prompt_completion")
    if "text" in record:
        found.append("text")
    if len(found) == 1:
        return found[0], None
    if not found:
        keys = ", ".join(f'"{k}"' for k in list(record)[:8]) or "none"
        return None, (
            'has none of "text", "prompt" + "completion" or "messages" '
            f"(its keys: {keys}); rename the field that holds the training text"
        )
    names = " and ".join(_FORMAT_NAMES[f] for f in found)
    return None, f"has both {names}; keep the fields of one format"


def _string_problem(record: dict, key: str, *, allow_empty: bool) -> str | None:
    if key not in record:
        return None
    value = record[key]
    if not isinstance(value, str):
        return f'"{key}" must be a string, found {_type_name(value)}'
    if not allow_empty and not value.strip():
        return f'"{key}" is empty; there is nothing to learn from this record, remove it'
    return None


def _check_record(record: dict, fmt: str) -> list[str]:
    """Problems of one record in a file of format `fmt`."""
    if fmt == "text":
        problem = _string_problem(record, "text", allow_empty=False)
        return [problem] if problem else []
    if fmt == "prompt_completion":
        problems = [
            f'missing "{key}"; a prompt + completion record needs both (an empty prompt is "")'
            for key in ("prompt", "completion")
            if key not in record
        ]
        for key, allow_empty in (("prompt", True), ("completion", False)):
            problem = _string_problem(record, key, allow_empty=allow_empty)
            if problem:
                problems.append(problem)
        return problems
    messages = record["messages"]
    if not isinstance(messages, list):
        return [
            f'"messages" must be a list of {{"role", "content"}} objects, found {_type_name(messages)}'
        ]
    if not messages:
        return ['"messages" is empty; a conversation needs a user and an assistant message']
    problems = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            problems.append(
                f'{at} must be an object {{"role", "content"}}, found {_type_name(message)}'
            )
            continue
        role = message.get("role")
        if "role" not in message:
            problems.append(f'{at} has no "role"; use one of {", ".join(ROLES)}')
        elif role not in ROLES:
            shown = json.dumps(role) if isinstance(role, str) else _type_name(role)
            problems.append(f"{at}: role {shown} is not one of {', '.join(ROLES)}")
        if "content" not in message:
            problems.append(f'{at} has no "content"')
        elif not isinstance(message["content"], str):
            problems.append(
                f'{at}: "content" must be a string, found {_type_name(message["content"])}'
            )
        elif role == "assistant" and not message["content"].strip():
            problems.append(f"{at}: the assistant's content is empty; nothing to learn from it")
    roles = [m.get("role") for m in messages if isinstance(m, dict)]
    if "assistant" not in roles:
        problems.append("no assistant message; the loss is on the assistant's replies")
    elif roles and roles[0] == "assistant":
        problems.append(
            "the conversation starts with the assistant; start with a system or user message"
        )
    return problems


def _check_records(records: list[tuple[str, dict]], problems: _Problems) -> str | None:
    """The format of a file's records (from the first that has one); adds every problem."""
    fmt: str | None = None
    first = ""
    for where, record in records:
        found, problem = _record_format(record)
        if problem:
            problems.add(where, problem)
            continue
        if fmt is None:
            fmt, first = found, where
        elif found != fmt:
            problems.add(
                where,
                f"is a {_FORMAT_NAMES[found]} record but the file's first record ({first}) is "
                f"{_FORMAT_NAMES[fmt]}; use one format per file",
            )
            continue
        for problem in _check_record(record, fmt):
            problems.add(where, problem)
    return fmt


def read_file(path: str | Path) -> tuple[list[tuple[str, dict]], str]:
    """The checked records of a data file and its format, or one BadInputError listing every
    problem in it (unreadable lines and bad fields alike)."""
    path = Path(path)
    problems = _Problems(path)
    records = _read_records(path, problems)
    if not records and not problems.items:
        raise BadInputError(
            f"data file {path} is empty: it holds no records; add records such as "
            '{"text": "..."} or {"prompt": "...", "completion": "..."}'
        )
    fmt = _check_records(records, problems)
    problems.raise_if_any()
    return records, fmt or ""


# -- tokenising ------------------------------------------------------------------------------


def pad_token_id(tokenizer: Any) -> int:
    """The id padding uses: the tokenizer's pad token, else its eos token. Padded positions are
    never targets and (with right padding under a causal mask) never attended to, so its value
    does not change the loss."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise BadInputError(
        "tokenizer: has neither a pad_token nor an eos_token; set tokenizer.pad_token"
    )


def _eos_id(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise BadInputError(
            "tokenizer: has no eos_token, so samples cannot teach the model where to stop; set "
            "tokenizer.eos_token to the model's end-of-text token"
        )
    return int(tokenizer.eos_token_id)


def _leading_specials(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts before a text (a BOS for Llama, none for GPT-2).
    Text is encoded without special tokens and these are added once, so a prompt and its
    completion encoded separately do not each get a BOS, and tokenizers that also append an
    EOS do not end a prompt with one."""
    probe = "a"
    with_specials = list(tokenizer(probe)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start : start + len(plain)] == plain:
            return with_specials[:start]
    return []


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), _ENCODE_CHUNK):
        out.extend(tokenizer(texts[i : i + _ENCODE_CHUNK], add_special_tokens=False)["input_ids"])
    return out


def _chat_template(tokenizer: Any, path: Path) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise BadInputError(
            f"data file {path}: the records are chat messages but the tokenizer has no chat "
            "template; set tokenizer.chat_template, use the model's instruct tokenizer, or write "
            "the data as prompt + completion records"
        )
    return template


class _NotPrefixStable(Exception):
    """The template renders a conversation's beginning differently on its own and inside the
    whole (it may hide earlier reasoning, or number the turns), so spans cannot be diffed."""


class _ChatEncoder:
    """Token ids and the assistant mask of one conversation.

    A template with ``{% generation %}`` markers says itself which characters are the
    assistant's (`return_assistant_tokens_mask`). Without markers the conversation is rendered
    before each assistant message (with the generation prompt) and up to its end: the characters
    between the two renderings are that message, its end-of-turn token included, so the model
    learns to stop. The full rendering is tokenised once and a token is a target when its first
    character lies in such a span, so tokens are exactly those inference will see.
    """

    def __init__(self, tokenizer: Any, path: Path):
        self.tokenizer = tokenizer
        self.marked = bool(_GENERATION_TAG.search(_chat_template(tokenizer, path)))
        if not getattr(tokenizer, "is_fast", False):
            raise BadInputError(
                f"data file {path}: the assistant's tokens of chat records are located by "
                "character offsets, which need a fast tokenizer; load it with "
                "AutoTokenizer.from_pretrained(..., use_fast=True), or write the data as "
                "prompt + completion records"
            )

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.marked:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        full = self._render(messages, generation_prompt=False)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:k], generation_prompt=True)
            through = self._render(messages[: k + 1], generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise _NotPrefixStable(
                    f"the chat template renders messages[:{k}] differently inside the whole "
                    "conversation, so the assistant's tokens cannot be located; add "
                    "{% generation %} ... {% endgeneration %} around the assistant's content in "
                    "the template"
                )
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [
            any(lo <= start < hi for lo, hi in spans) and end > start
            for start, end in encoded["offset_mapping"]
        ]
        return list(encoded["input_ids"]), mask

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )


def _template_errors() -> tuple[type[Exception], ...]:
    from jinja2.exceptions import TemplateError

    return (TemplateError, ValueError, TypeError, KeyError, IndexError)


def _tokenize(
    path: Path, fmt: str, records: list[tuple[str, dict]], tokenizer: Any
) -> list[tuple[list[int], list[bool]]]:
    """(ids, is_target) per record, before truncation."""
    eos = _eos_id(tokenizer)
    if fmt == "messages":
        encode = _ChatEncoder(tokenizer, path)
        problems = _Problems(path)
        out = []
        for where, record in records:
            try:
                ids, mask = encode(record["messages"])
            except _NotPrefixStable as exc:
                problems.add(where, str(exc))
                continue
            except _template_errors() as exc:
                problems.add(where, f"the chat template failed: {exc}")
                continue
            if not any(mask):
                problems.add(where, "the chat template marked no assistant tokens")
                continue
            out.append((ids, mask))
        problems.raise_if_any()
        return out
    head = _leading_specials(tokenizer)
    if fmt == "text":
        bodies = _encode(tokenizer, [r["text"] for _, r in records])
        return [(head + ids + [eos], [True] * (len(head) + len(ids) + 1)) for ids in bodies]
    prompts = _encode(tokenizer, [r["prompt"] for _, r in records])
    completions = _encode(tokenizer, [r["completion"] for _, r in records])
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        context = head + prompt
        out.append(
            (context + completion + [eos], [False] * len(context) + [True] * (len(completion) + 1))
        )
    return out


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
    for ids, mask in samples:
        if len(ids) > max_seq_length:
            truncated += 1
            tokens_cut += len(ids) - max_seq_length
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
    )
    return dataset, stats


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
            stacklevel=2,
        )
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
        _tokenize(train_path, fmt, records, tokenizer),
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
            _tokenize(source, eval_fmt, eval_records, tokenizer),
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


def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, Any], *, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of target tokens)`` of a Hugging Face causal LM on a batch
    from `collate`: the engine divides the summed gradient by the batch's total count, so every
    target token weighs the same however the batch is split or padded.

    The batch is first trimmed to its longest sample (`lm_inputs`); the loss itself is
    `steadytrain.memory.chunked_loss.causal_lm_loss` (position t predicts label t+1,
    `use_cache=False` so packed windows keep their per-sample `position_ids`), chunked over the
    tokens when `chunk_tokens` is given."""
    inputs, labels = lm_inputs(batch)
    return chunked_loss.causal_lm_loss(
        model, {**inputs, "labels": labels}, chunk_tokens=chunk_tokens
    )


class LMLoss(chunked_loss.CausalLMLoss):
    """`causal_lm_loss` as the engine's switchable loss (`CausalLMLoss`): the fine-tune's
    `loss_fn`, so that the planner and the out-of-memory ladder can chunk it."""

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_lm_loss(model, batch, chunk_tokens=self.chunk_tokens)


# -- an offline tokenizer --------------------------------------------------------------------

BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The chat template of `byte_tokenizer`: role tokens, the assistant's turn ended by EOS, and
``{% generation %}`` markers so the assistant mask comes from the template itself."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map: each byte as a printable character, which is the alphabet
    the `tokenizers` ByteLevel pre-tokenizer produces."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def byte_tokenizer(chat_template: str | None = BYTE_CHAT_TEMPLATE) -> Any:
    """A Hugging Face fast tokenizer built offline: ids 0-255 are the bytes of UTF-8 text, then
    ``<bos>`` (256, prepended to every text), ``<eos>`` (257), ``<pad>`` (258) and the role
    tokens ``<|system|>``, ``<|user|>``, ``<|assistant|>``. Any text round-trips; nothing is
    downloaded, so tests and the offline demo can fine-tune a tiny model from scratch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    roles = ["<|system|>", "<|user|>", "<|assistant|>"]
    backend.add_special_tokens(["<bos>", "<eos>", "<pad>", *roles])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 256)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


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
