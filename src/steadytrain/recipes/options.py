"""The options of the commands that run a recipe (`steadytrain finetune`, `demo`, `merge`,
`generate`, `evaluate`): one frozen dataclass per command, whose fields are its arguments and
options, each written once with its default, its flag and its help (`argument` and `option` of
`steadytrain._options`). The command line is generated from them (cli/options.py),
`python -m steadytrain.recipes.finetune` parses with the same one, and each recipe's `*_command`
function and Python API take their defaults from them. Nothing here imports torch: the command
line reads these without loading the recipes."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from steadytrain._options import REQUIRED, argument, flag_of, option

MODEL_HELP = "A run directory, an adapter folder (final/) or a model folder."
DEVICE_HELP = "auto, cpu, mps, cuda or cuda:N."
DTYPE_HELP = "fp32, bf16 or fp16 (default: fp32 on CPU)."
BASE_HELP = "Base model folder for an adapter."


@dataclass(frozen=True)
class FinetuneOptions:
    """LoRA / QLoRA fine-tune of a Hugging Face causal LM; rerun on the same output_dir to resume."""

    config: str = option(
        REQUIRED,
        "A JSON (comments allowed) or YAML fine-tune config (docs/finetune.md).",
        metavar="FILE",
    )
    overrides: list[str] | None = option(  # noqa: RUF009 (a field(), its default None)
        None,
        "Change one key before running; the value is read as YAML (4, true, 2e-4); "
        "lora.r=8 reaches into a block. Repeatable.",
        flag="--set",
        metavar="KEY=VALUE",
    )


@dataclass(frozen=True)
class DemoOptions:
    """Fine-tune a tiny model offline and show every feature: exit 0, 2 bad input.

    A tiny Llama, LoRA on the standard library's docstrings, a SIGKILL and a resume (docs/demo.md).
    """

    run_dir: str = argument(
        "RUN_DIR", "A new or empty folder for the demo's run.", default="runs/demo"
    )
    device: str = option("auto", DEVICE_HELP)
    steps: int = option(150, "LoRA optimizer steps (at least 10).")
    """1.7 passes over the docstrings, about 12 seconds of training on a 2-core CPU with one
    thread, and enough for the held-out perplexity to fall from thousands to under 20."""
    interrupt: bool = option(
        True,
        "SIGKILL the training process after its first checkpoint, to show the restart "
        "and the exact resume.",
        flag="--interrupt/--no-interrupt",
    )
    threads: int = option(
        1,
        "CPU threads for torch: 1 suits a model this small, and OpenMP threads spin "
        "against other busy processes.",
    )
    force: bool = option(False, "Replace an earlier demo's RUN_DIR (only a folder the demo wrote).")


@dataclass(frozen=True)
class MergeOptions:
    """Merge a LoRA adapter into its base, for transformers alone: exit 0 written, 2 bad input."""

    adapter: str = argument(
        "ADAPTER", "The fine-tune's final/ folder (peft adapter) or its run directory."
    )
    out: str = option(REQUIRED, "Folder to write the merged model to.", metavar="DIR")
    base: str | None = option(
        None, "Base model folder (default: the one adapter_config.json names).", metavar="PATH"
    )
    dtype: str | None = option(
        None, "fp32, bf16 or fp16 (default: the dtype the base was saved in)."
    )
    force: bool = option(
        False, "Replace a non-empty --out (removed only after the new one is complete)."
    )


@dataclass(frozen=True)
class GenerateOptions:
    """Text from base + adapter or a merged model, per prompt: exit 0, 2 bad input."""

    model: str = argument("MODEL", MODEL_HELP)
    prompt: str | None = argument("PROMPT", "The prompt.", default=None)
    prompts_file: str | None = option(
        None, 'One prompt per line, or JSONL with "prompt".', metavar="FILE"
    )
    base: str | None = option(None, BASE_HELP, metavar="PATH")
    max_new_tokens: int = option(128, "Tokens to generate at most.")
    temperature: float | None = option(
        None,
        "0 is greedy (argmax). Default: the model's generation_config where it samples, else 0.7.",
    )
    top_p: float | None = option(
        None,
        "Nucleus sampling mass (with temperature > 0). Default: the model's, else 0.9 "
        "(1.0 with --temperature).",
    )
    seed: int = option(0, "Seeded before every prompt, so results repeat.")
    chat: bool = option(False, "Send the prompt as a user message through the chat template.")
    device: str = option("auto", DEVICE_HELP)
    dtype: str | None = option(None, DTYPE_HELP)
    json_output: bool = option(False, "One JSON object per prompt.", flag="--json")


@dataclass(frozen=True)
class EvaluateOptions:
    """Loss and perplexity on EVAL_FILE, base and base + adapter: exit 0, 2 bad input, 3 no fit."""

    eval_file: str = argument("EVAL_FILE", "A .jsonl or .json file in a fine-tune format.")
    model: str = argument("MODEL", MODEL_HELP)
    base: str | None = option(None, BASE_HELP, metavar="PATH")
    max_seq_length: int = option(1024, "Samples are cut to this many tokens.")
    batch_size: int = option(8, "Starting eval batch; halved on out-of-memory.")
    device: str = option("auto", DEVICE_HELP)
    dtype: str | None = option(None, DTYPE_HELP)
    json_output: bool = option(False, "Print the results as JSON.", flag="--json")


def argparse_options(parser: argparse.ArgumentParser, options: type) -> None:
    """Add the options of the dataclass `options` (text options, repeatable where the field is a
    list) to `parser`, for a `python -m` entry that parses as its command does."""
    for f in dataclasses.fields(options):
        repeated = str(f.type).startswith("list")
        parser.add_argument(
            flag_of(f),
            dest=f.name,
            required=f.default is REQUIRED,
            default=None if f.default is REQUIRED else f.default,
            action="append" if repeated else "store",
            metavar=f.metadata["metavar"],
            help=f.metadata["help"],
        )


__all__ = [
    "REQUIRED",
    "DemoOptions",
    "EvaluateOptions",
    "FinetuneOptions",
    "GenerateOptions",
    "MergeOptions",
    "argparse_options",
    "argument",
    "flag_of",
    "option",
]
