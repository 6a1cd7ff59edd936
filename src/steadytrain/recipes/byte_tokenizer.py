"""A tokenizer that needs no download: one token per byte, with BOS, EOS and PAD, and a chat
template with generation marks. The demo and the tests train with it offline."""

from __future__ import annotations

from typing import Any

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
