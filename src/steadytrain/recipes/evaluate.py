"""`steadytrain evaluate`: loss and perplexity on an eval file, for the base and for base +
adapter side by side (or for one merged / plain model).

The eval file is read by the fine-tune's own data code (`load_datasets`, `Collator`,
`causal_lm_loss`), so the same records, masking and truncation are scored that training used:
a prompt's tokens do not count, only the targets. The loss is token-weighted, the sum of every
target token's loss over the number of target tokens, so a batch of short samples weighs no
more than its tokens and the result does not depend on the batch size. Perplexity is
``exp(loss)``.

Base and base + adapter are both scored with one copy of the weights: peft's
``disable_adapter()`` switches the adapter off for the base pass. An out-of-memory error halves
the eval batch and redoes the same samples, down to one sample per batch, so an evaluation on a
small machine finishes instead of dying at its first long sample: the engine's evaluation loop
(`engine.evaluation.loss_sums`), the one a fine-tune's final evaluation runs too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain.device import Device
from steadytrain.engine.evaluation import Batching, loss_sums
from steadytrain.errors import BadInputError
from steadytrain.recipes.artifact import Loaded, dtype_name, open_model
from steadytrain.recipes.data import (
    Collator,
    SplitStats,
    TokenizedDataset,
    causal_lm_loss,
    load_datasets,
    pad_token_id,
)
from steadytrain.recipes.options import EvaluateOptions

LossFn = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EvalResult:
    """One model's score: `loss` is the mean over target tokens (nats), `perplexity` its exp."""

    model: str  # "base", "base + adapter" or "model"
    path: str
    loss: float
    perplexity: float
    tokens: int


@dataclass(frozen=True)
class EvalReport:
    eval_file: str
    results: tuple[EvalResult, ...]
    samples: int
    max_seq_length: int
    batch_size: int
    final_batch_size: int
    shrinks: tuple[tuple[int, int], ...]  # (from, to) of each out-of-memory halving
    device: str
    dtype: str
    data: SplitStats

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.summary()
        return out


def perplexity(loss: float) -> float:
    """``exp(loss)``, or infinity where that overflows a float (a loss above ~709 nats)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def token_loss(
    model: Any,
    dataset: TokenizedDataset,
    collate: Callable[[list[Any]], dict[str, Any]],
    device: Device,
    batching: Batching,
    loss_fn: LossFn = causal_lm_loss,
    on_shrink: Callable[[int, int], None] | None = None,
    advance: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """(sum of target-token losses, number of target tokens) of `model` over `dataset`: the
    engine's evaluation loop (`engine.evaluation.loss_sums`: longest samples first, an
    out-of-memory halves ``batching.size`` and redoes the same samples); at one sample per batch
    `DoesNotFitError` (exit 3) names the knobs that help. Any other error propagates."""

    def too_big(tokens: int) -> str:
        elsewhere = "" if device.type == "cpu" else ", or evaluate on CPU (--device cpu)"
        return (
            f"evaluate: one sample of {tokens:,} tokens does not fit in memory on "
            f"{device.torch_device}; lower --max-seq-length or use --dtype bf16{elsewhere}"
        )

    return loss_sums(
        model,
        dataset,
        dataset.lengths(),
        collate,
        device,
        batching,
        loss_fn,
        too_big=too_big,
        on_shrink=on_shrink,
        advance=advance,
    )


def _passes(loaded: Loaded) -> Iterator[tuple[str, str, contextlib.AbstractContextManager]]:
    """(label, path, context) of each model to score: the base with the adapter switched off,
    then base + adapter; or the one plain model."""
    artifact = loaded.artifact
    if artifact.is_adapter:
        yield "base", str(artifact.base), loaded.model.disable_adapter()
        yield "base + adapter", str(artifact.path), contextlib.nullcontext()
    else:
        yield "model", str(artifact.path), contextlib.nullcontext()


def check_settings(max_seq_length: int, batch_size: int) -> None:
    problems = []
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        problems.append(f"--batch-size: must be a whole number >= 1, found {batch_size!r}")
    if (
        isinstance(max_seq_length, bool)
        or not isinstance(max_seq_length, int)
        or max_seq_length < 2
    ):
        problems.append(f"--max-seq-length: must be a whole number >= 2, found {max_seq_length!r}")
    if problems:
        raise BadInputError("; ".join(problems))


def score(
    loaded: Loaded,
    eval_file: str | Path,
    *,
    max_seq_length: int = EvaluateOptions.max_seq_length,
    batch_size: int = EvaluateOptions.batch_size,
    loss_fn: LossFn = causal_lm_loss,
    on_shrink: Callable[[int, int], None] | None = None,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> EvalReport:
    """Score `loaded` on `eval_file`. The file is read and checked before the weights are loaded
    (when they are not yet), so a bad file costs seconds, not a model load. `progress(label,
    samples)` may return an ``advance(n)`` callback per pass; `loss_fn` is the per-batch loss
    (the default is training's)."""
    check_settings(max_seq_length, batch_size)
    dataset, _, stats = load_datasets(eval_file, loaded.tokenizer, max_seq_length=max_seq_length)
    data = dataclasses.replace(stats.train, name="eval")
    loaded.load_weights()
    collate = Collator(pad_token_id(loaded.tokenizer))
    batching = Batching(batch_size)
    results = []
    for label, path, context in _passes(loaded):
        advance = progress(label, len(dataset)) if progress is not None else None
        with context:
            loss_sum, tokens = token_loss(
                loaded.model, dataset, collate, loaded.device, batching, loss_fn, on_shrink, advance
            )
        loss = loss_sum / tokens
        results.append(EvalResult(label, path, loss, perplexity(loss), tokens))
    return EvalReport(
        eval_file=str(eval_file),
        results=tuple(results),
        samples=len(dataset),
        max_seq_length=max_seq_length,
        batch_size=batch_size,
        final_batch_size=batching.size,
        shrinks=tuple(batching.shrinks),
        device=str(loaded.device.torch_device),
        dtype=dtype_name(loaded.dtype),
        data=data,
    )


def evaluate(
    eval_file: str | Path,
    model: str | Path,
    *,
    base: str | None = None,
    max_seq_length: int = EvaluateOptions.max_seq_length,
    batch_size: int = EvaluateOptions.batch_size,
    device: str = EvaluateOptions.device,
    dtype: str | None = None,
) -> EvalReport:
    """Load `model` (run directory, adapter folder or model folder) and score it on `eval_file`:
    base and base + adapter for an adapter, the model alone otherwise."""
    check_settings(max_seq_length, batch_size)
    check_eval_file(eval_file, model)
    loaded = open_model(model, base, device, dtype, weights=False)
    return score(loaded, eval_file, max_seq_length=max_seq_length, batch_size=batch_size)


def check_eval_file(eval_file: str | os.PathLike, model: str | os.PathLike) -> None:
    """EVAL_FILE must be a data file; a folder there is most often the two arguments swapped
    (`evaluate MODEL EVAL_FILE`), which the message says when MODEL is a file."""
    path = Path(eval_file).expanduser()
    if path.is_file():
        return
    if not path.is_dir():
        raise BadInputError(f"EVAL_FILE: {eval_file} does not exist or is not a file")
    swapped = (
        f": steadytrain evaluate {model} {eval_file}" if Path(model).expanduser().is_file() else ""
    )
    raise BadInputError(
        f"EVAL_FILE: {eval_file} is a folder, not a data file; the data file comes first, then "
        f"the model (steadytrain evaluate EVAL_FILE MODEL){swapped}"
    )


def table(report: EvalReport) -> Any:
    from rich.table import Table

    view = Table(title=f"{report.eval_file}: {report.samples:,} samples")
    view.add_column("model")
    view.add_column("path", overflow="fold")
    view.add_column("loss", justify="right")
    view.add_column("perplexity", justify="right")
    view.add_column("target tokens", justify="right")
    for r in report.results:
        view.add_row(r.model, r.path, f"{r.loss:.4f}", f"{r.perplexity:,.2f}", f"{r.tokens:,}")
    return view


def comparison(report: EvalReport) -> str | None:
    """One line on what the adapter changed, when there are two results."""
    if len(report.results) != 2:
        return None
    before, after = report.results
    if math.isinf(before.perplexity):
        return f"adapter vs base: loss {after.loss - before.loss:+.4f}"
    change = (after.perplexity / before.perplexity - 1) * 100
    return (
        f"adapter vs base: loss {after.loss - before.loss:+.4f}, perplexity "
        f"{before.perplexity:,.2f} -> {after.perplexity:,.2f} ({change:+.1f}%)"
    )


def _progress_bar(err_console: Any) -> tuple[Any, Callable[[str, int], Callable[[int], None]]]:
    """A progress bar on stderr (shown only on a terminal) and the callback `score` reports to."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )

    def progress(label: str, samples: int) -> Callable[[int], None]:
        task = bar.add_task(f"eval {label}", total=samples)
        return lambda n: bar.advance(task, n)

    return bar, progress


def evaluate_command(
    *args: Any, console: Any = None, err_console: Any = None, **options: Any
) -> int:
    """`steadytrain evaluate`: print the table (or JSON with ``--json``); exit 0. Progress and
    out-of-memory notes go to stderr, the progress bar only on a terminal. The arguments and
    options are `EvaluateOptions`' (EVAL_FILE and MODEL may be positional)."""
    from rich.console import Console

    o = EvaluateOptions(*args, **options)
    console = console or Console(highlight=False)
    err_console = err_console or Console(stderr=True, highlight=False, soft_wrap=True)
    check_settings(o.max_seq_length, o.batch_size)
    check_eval_file(o.eval_file, o.model)
    loaded = open_model(o.model, o.base, o.device, o.dtype, weights=False)
    err_console.print(
        f"{loaded.artifact.describe()} on {loaded.device.torch_device} ({dtype_name(loaded.dtype)})",
        markup=False,
    )

    def on_shrink(old: int, new: int) -> None:
        err_console.print(
            f"out of memory at eval batch size {old}; redoing the same samples at {new}",
            markup=False,
        )

    bar, progress = _progress_bar(err_console)
    with bar:
        report = score(
            loaded,
            o.eval_file,
            max_seq_length=o.max_seq_length,
            batch_size=o.batch_size,
            on_shrink=on_shrink,
            progress=progress,
        )
    if o.json_output:
        console.print(json.dumps(report.to_dict(), indent=2), markup=False, soft_wrap=True)
        return 0
    err_console.print(report.data.summary(), markup=False, soft_wrap=True)
    console.print(table(report))
    line = comparison(report)
    if line is not None:
        console.print(line, markup=False, soft_wrap=True)
    return 0


__all__ = [
    "Batching",
    "EvalReport",
    "EvalResult",
    "check_settings",
    "comparison",
    "evaluate",
    "evaluate_command",
    "perplexity",
    "score",
    "table",
    "token_loss",
]
