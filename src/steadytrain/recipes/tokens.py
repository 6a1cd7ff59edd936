"""Records to token ids with a loss mask: plain text, prompt + completion (loss on the
completion), and chat messages through the tokenizer's chat template (loss on the assistant's
turns, from `{% generation %}` marks or, without them, from rendering prefix by prefix)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError
from steadytrain.recipes.records import _Problems

IGNORE_INDEX = -100
"""Label of a position that is not a target; the value `torch.nn.functional.cross_entropy` and
Hugging Face models skip by default."""

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_ENCODE_CHUNK = 512


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


_CUT_MARGIN = 64
"""Tokens read past max_seq_length in a text cut before tokenizing: the piece's last word may be
split differently than in the whole text, and the margin keeps that edge out of the kept tokens."""
_CHARS_PER_TOKEN = 8
"""The first piece of a long text is this many characters per token needed (tokens average 3 to 5
characters); a piece that yields too few tokens is doubled until it has enough."""


class _Prefix(list):
    """Token ids of the beginning of a text too long to tokenize whole (a 10 MB line once cost
    2.3 GB). `more` estimates the tokens of the rest, for the truncation count."""

    more: int = 0


def _encode_capped(tokenizer: Any, texts: list[str], limit: int) -> list[list[int]]:
    """Token ids of each text, as `_encode`; a text longer than `limit` tokens can need is
    tokenized from its beginning only (a `_Prefix`), so memory per record follows `limit`, not
    the length of the line."""
    need = limit + _CUT_MARGIN
    budget = need * _CHARS_PER_TOKEN
    short = [i for i, text in enumerate(texts) if len(text) <= budget]
    out: list[list[int] | None] = [None] * len(texts)
    for i, ids in zip(short, _encode(tokenizer, [texts[i] for i in short]), strict=True):
        out[i] = ids
    for i, text in enumerate(texts):
        if out[i] is None:
            out[i] = _encode_prefix(tokenizer, text, need, budget)
    return out  # type: ignore[return-value]


def _encode_prefix(tokenizer: Any, text: str, need: int, cut: int) -> list[int]:
    while True:
        ids = list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
        if len(ids) >= need or cut >= len(text):
            break
        cut *= 2
    if cut >= len(text):
        return ids
    prefix = _Prefix(ids[:need])
    prefix.more = len(ids) - need + round((len(text) - cut) * len(ids) / cut)
    return prefix


def _joined(before: list[int], ids: list[int], after: list[int]) -> list[int]:
    """before + ids + after; when `ids` is a cut `_Prefix`, `after` lies beyond the cut and only
    counts in `more`."""
    if not isinstance(ids, _Prefix):
        return before + ids + after
    out = _Prefix(before + ids)
    out.more = ids.more + len(after)
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
    path: Path, fmt: str, records: list[tuple[str, dict]], tokenizer: Any, limit: int
) -> list[tuple[list[int], list[bool]]]:
    """(ids, is_target) per record, before truncation to `limit` tokens; a text far longer than
    `limit` tokens is cut before it is tokenized (`_encode_capped`)."""
    eos = _eos_id(tokenizer)
    if fmt == "messages":
        encode = _ChatEncoder(tokenizer, path)
        problems = _Problems(path)
        out = []
        chars = (limit + _CUT_MARGIN) * _CHARS_PER_TOKEN
        for where, record in records:
            messages = [{**m, "content": m["content"][:chars]} for m in record["messages"]]
            try:
                ids, mask = encode(messages)
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
        bodies = _encode_capped(tokenizer, [r["text"] for _, r in records], limit)
        samples = [_joined(head, ids, [eos]) for ids in bodies]
        return [(ids, [True] * len(ids)) for ids in samples]
    prompts = _encode_capped(tokenizer, [r["prompt"] for _, r in records], limit)
    completions = _encode_capped(tokenizer, [r["completion"] for _, r in records], limit)
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        context = _joined(head, prompt, [])
        if isinstance(context, _Prefix):  # the prompt alone fills max_seq_length
            context.more += len(completion) + getattr(completion, "more", 0) + 1
            out.append((context, [False] * len(context)))
            continue
        ids = _joined(context, completion, [eos])
        out.append((ids, [False] * len(context) + [True] * (len(ids) - len(context))))
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
