"""`steadytrain generate`: text from a fine-tuned model (base + adapter, or merged) for one
prompt or a file of prompts.

The RNGs are seeded before every prompt, so a prompt's completion depends on the prompt and the
seed only, not on where it stands in the file: rerunning one line of a prompts file reproduces
what the whole file gave (on the same device and library versions).

Sampling settings (`choose_sampling`): without `--temperature`, the model's own
`generation_config` where it samples (its temperature, top_p, top_k), else temperature 0.7 and
top_p 0.9 (greedy decoding of a small model repeats itself: "the the the"). Temperature 0 is
greedy decoding, the argmax at every step. The settings used are printed on stderr.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain.config.files import read_user_text
from steadytrain.device import seed_everything
from steadytrain.errors import BadInputError
from steadytrain.recipes.artifact import Loaded, dtype_name, open_model
from steadytrain.recipes.options import GenerateOptions


@dataclass(frozen=True)
class Generation:
    prompt: str
    completion: str
    prompt_tokens: int
    new_tokens: int
    stopped: str  # "eos": the model ended its text; "length": max_new_tokens was reached


DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.7, 0.9  # where neither the user nor the model says


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: temperature 0 is greedy; `source` says where the numbers came
    from. `top_k` None is off."""

    temperature: float
    top_p: float
    top_k: int | None
    source: str

    def describe(self, seed: int) -> str:
        if self.temperature == 0:
            return f"greedy ({self.source}), seed {seed}"
        k = f", top_k {self.top_k}" if self.top_k else ""
        return (
            f"sampling at temperature {self.temperature:g}, top_p {self.top_p:g}{k} "
            f"({self.source}), seed {seed}"
        )

    def generation_settings(self) -> dict[str, Any]:
        if self.temperature == 0:
            # Greedy: clear the model's own sampling defaults, which would only trigger warnings.
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {
            "do_sample": True,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k or 0,
        }


def choose_sampling(
    generation_config: Any, temperature: float | None, top_p: float | None
) -> Sampling:
    """The settings a generation uses: the temperature given (0: greedy), else the model's
    `generation_config` where it samples (do_sample), else DEFAULT_TEMPERATURE and
    DEFAULT_TOP_P. A `top_p` given wins over either."""
    if temperature is not None:
        given = 1.0 if top_p is None else top_p
        return Sampling(
            temperature, given, None, "--temperature 0 given" if temperature == 0 else "given"
        )
    if getattr(generation_config, "do_sample", False):
        own_p = getattr(generation_config, "top_p", None) or 1.0
        return Sampling(
            float(getattr(generation_config, "temperature", None) or 1.0),
            own_p if top_p is None else top_p,
            getattr(generation_config, "top_k", None) or None,
            "the model's generation_config",
        )
    return Sampling(
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_P if top_p is None else top_p,
        None,
        "the default where the model sets none; --temperature 0 is greedy",
    )


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: a ``.jsonl`` file holds one object with a ``"prompt"`` string per
    line; any other file holds one prompt per line (blank lines skipped). A prompt that needs
    line breaks goes in JSONL, where ``\\n`` keeps it one record."""
    path = Path(path).expanduser()
    text = read_user_text(path, "--prompts-file:", "utf-8-sig")
    prompts: list[str] = []
    problems: list[str] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if path.suffix.lower() != ".jsonl":
            prompts.append(line.rstrip("\r"))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            problems.append(f'line {number}: expected an object with a "prompt" string')
            continue
        prompts.append(prompt)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise BadInputError(f"--prompts-file {path}: {len(problems)} problem(s):\n{listed}{more}")
    if not prompts:
        raise BadInputError(f"--prompts-file: {path} holds no prompts")
    return prompts


def check_settings(max_new_tokens: int, temperature: float | None, top_p: float | None) -> None:
    problems = []
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        problems.append(f"--max-new-tokens: must be a whole number >= 1, found {max_new_tokens!r}")
    if temperature is not None and not temperature >= 0:
        problems.append(f"--temperature: must be >= 0 (0 is greedy), found {temperature!r}")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"--top-p: must be in (0, 1], found {top_p!r}")
    if problems:
        raise BadInputError("; ".join(problems))


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: as plain text (with the tokenizer's BOS), or with ``chat`` as one
    user message rendered by the chat template with the assistant's header after it, which is
    how the fine-tune's ``messages`` records were rendered."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise BadInputError(
            "--chat: the tokenizer has no chat template; drop --chat to send the prompt as "
            "plain text"
        )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    # The template writes its own BOS: adding special tokens again would double it.
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def complete(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 128,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chat: bool = False,
    device: torch.device | str = "cpu",
    on_sampling: Callable[[Sampling], None] | None = None,
) -> list[Generation]:
    """Generate a completion for each prompt with an already loaded model, one prompt at a time
    (no padding, so a prompt's result does not depend on its neighbours). `temperature` None:
    `choose_sampling` decides; `on_sampling` is told the settings before the first prompt."""
    from steadytrain.recipes.data import pad_token_id

    check_settings(max_new_tokens, temperature, top_p)
    config = copy.deepcopy(model.generation_config)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    sampling = choose_sampling(model.generation_config, temperature, top_p)
    if on_sampling is not None:
        on_sampling(sampling)
    config.update(
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_token_id(tokenizer)
    )
    config.update(**sampling.generation_settings())
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    results = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, chat)
        input_ids = torch.tensor([ids], device=device)
        seed_everything(seed)
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
            )
        new = output[0, len(ids) :].tolist()
        stopped = "eos" if new and new[-1] in stops else "length"
        text = tokenizer.decode(new, skip_special_tokens=True)
        results.append(Generation(prompt, text, len(ids), len(new), stopped))
    return results


def generate(
    model: str | Path,
    prompts: list[str],
    *,
    base: str | None = None,
    max_new_tokens: int = GenerateOptions.max_new_tokens,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int = GenerateOptions.seed,
    chat: bool = False,
    device: str = GenerateOptions.device,
    dtype: str | None = None,
    on_loaded: Callable[[Loaded], None] | None = None,
    on_sampling: Callable[[Sampling], None] | None = None,
) -> list[Generation]:
    """Load `model` (run directory, adapter folder or model folder) and complete `prompts`.
    Every input is checked before the weights load; `on_loaded` is told what will be loaded
    just before they do, `on_sampling` the sampling settings (`choose_sampling`) after."""
    check_settings(max_new_tokens, temperature, top_p)
    loaded = open_model(model, base, device, dtype, weights=False)
    for prompt in prompts:
        encode_prompt(loaded.tokenizer, prompt, chat)
    if on_loaded is not None:
        on_loaded(loaded)
    return complete(
        loaded.load_weights(),
        loaded.tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        chat=chat,
        device=loaded.device.torch_device,
        on_sampling=on_sampling,
    )


def describe(loaded: Loaded) -> str:
    return (
        f"{loaded.artifact.describe()} on {loaded.device.torch_device} ({dtype_name(loaded.dtype)})"
    )


def generate_command(
    *args: Any, console: Any = None, err_console: Any = None, **options: Any
) -> int:
    """`steadytrain generate`: print each prompt and its completion (or one JSON line each with
    ``--json``); exit 0. What was loaded goes to stderr so that stdout is only the text. The
    arguments and options are `GenerateOptions`' (MODEL and PROMPT may be positional)."""
    from rich.console import Console

    o = GenerateOptions(*args, **options)
    console = console or Console(highlight=False)
    err_console = err_console or Console(stderr=True, highlight=False, soft_wrap=True)
    if (o.prompt is None) == (o.prompts_file is None):
        raise BadInputError(
            "PROMPT and --prompts-file: give exactly one, a prompt (steadytrain generate MODEL "
            '"Once upon a time") or a file of prompts (--prompts-file prompts.txt)'
        )
    prompts = [o.prompt] if o.prompt is not None else read_prompts(o.prompts_file)
    results = generate(
        o.model,
        prompts,
        base=o.base,
        max_new_tokens=o.max_new_tokens,
        temperature=o.temperature,
        top_p=o.top_p,
        seed=o.seed,
        chat=o.chat,
        device=o.device,
        dtype=o.dtype,
        on_loaded=lambda loaded: err_console.print(describe(loaded), markup=False, soft_wrap=True),
        on_sampling=lambda sampling: err_console.print(
            sampling.describe(o.seed), markup=False, soft_wrap=True
        ),
    )
    for number, result in enumerate(results, 1):
        if o.json_output:
            console.print(
                json.dumps(asdict(result), ensure_ascii=False), markup=False, soft_wrap=True
            )
            continue
        console.rule(f"prompt {number} of {len(results)}", style="dim")
        console.print(result.prompt, markup=False, style="bold", soft_wrap=True)
        console.rule(
            f"completion ({result.new_tokens} tokens, stopped at {result.stopped})", style="dim"
        )
        console.print(result.completion, markup=False, soft_wrap=True)
    return 0


__all__ = [
    "Generation",
    "check_settings",
    "complete",
    "encode_prompt",
    "generate",
    "generate_command",
    "read_prompts",
]
