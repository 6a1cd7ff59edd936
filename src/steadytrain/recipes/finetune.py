"""`steadytrain finetune --config FILE`: LoRA / QLoRA fine-tune of a Hugging Face causal LM,
through the engine's `Trainer` (so out-of-memory shrink, checkpoints, exact resume, signals,
the hang watchdog and telemetry all apply; there is no second loop here).

What it does, top to bottom: read and check the config (docs/finetune.md), resolve the device
and precision, plan how the base loads (a 4-bit request that cannot run is refused before
anything loads), load the tokenizer and the data (printing what tokenising did), estimate the
memory at the data's real lengths (exit 3 where nothing fits), load the base and add the adapter, train, and on a finished run export ``output_dir/final/`` atomically:
the adapter in peft's format, the tokenizer and the resolved config. Rerunning the same command
on the same output_dir resumes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from steadytrain.config import TrainConfig, offload_problem
from steadytrain.device import Device, resolve_device
from steadytrain.engine import resolve_precision
from steadytrain.engine.evaluation import Batching, loss_sums
from steadytrain.entry import entrypoint
from steadytrain.errors import (
    BadInputError,
    ConfigError,
    DoesNotFitError,
    RunDiskFullError,
)
from steadytrain.recipes.artifact import disk_full_in_save, remove_leftovers
from steadytrain.recipes.data import (
    Collator,
    causal_lm_loss,
    load_datasets,
    pad_token_id,
)
from steadytrain.recipes.finetune_config import BNB_OPTIMIZERS, FinetuneConfig
from steadytrain.recipes.finetune_memory import DataLengths, loss_for, memory_line, refusal
from steadytrain.recipes.finetune_resume import resume_changes
from steadytrain.recipes.model import (
    add_lora,
    load_base_model,
    load_tokenizer,
    parameter_counts,
    plan_base_load,
    resolve_model_path,
)
from steadytrain.recipes.options import FinetuneOptions, argparse_options
from steadytrain.recipes.training_log import training_log
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, refuse_link, replace_dir, sync_tree, write_atomic
from steadytrain.run.events import append_event
from steadytrain.run.records import Record
from steadytrain.trainer import FitResult, Trainer

FINAL = run_files.FINAL
TRAINING_CONFIG = run_files.TRAINING_CONFIG


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class FinetuneJob:
    """One fine-tune, built step by step so that tests and callers can reach the model, the
    tokenizer and the data; `run()` trains and exports."""

    def __init__(self, config: FinetuneConfig):
        self.config = config
        self.train_config = config.to_train_config()
        for note in config.notes:
            say(f"note: {note}")
        changes = resume_changes(config, Path(self.train_config.run_dir))
        if changes:
            say(
                "resume: changed since the run started, keeping it the same run: "
                + "; ".join(changes)
            )
        self.device = resolve_device(
            self.train_config.device, self.train_config.budget_bytes_or_fraction()
        )
        self.precision = resolve_precision(self.train_config.precision, self.device).name
        # every problem the config shows, at once, before the model's files are read
        problems = _optimizer_problems(config.optim, self.device.type)
        if config.gradient_checkpointing == "offload" and not self.device.discrete_memory:
            problems.append(offload_problem(self.device.type, "gradient_checkpointing"))
        problems += config.data_file_problems() + config.model_folder_problems()
        if problems:
            raise ConfigError(problems, config._source)
        self.base_load = plan_base_load(config, self.device.type, self.precision)
        self.model_path = resolve_model_path(config.model_name_or_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_data, self.eval_data, stats = load_datasets(
            config.train_file,
            self.tokenizer,
            max_seq_length=config.max_seq_length,
            eval_path=config.eval_file,
            eval_split=config.eval_split,
            packing=config.packing,
            seed=config.seed,
        )
        say(stats.summary())
        _check_one_batch(config, self.train_config, len(self.train_data))
        # priced at what a batch is padded to (the data's longest, where it is shorter than
        # max_seq_length), before the base loads, as --dry-run prices it
        self.lengths = DataLengths.of(stats.train)
        stop = refusal(config, self.device.type, self.device.budget, self.lengths)
        if stop is not None:
            raise DoesNotFitError(f"{stop} (steadytrain finetune --dry-run shows the breakdown)")
        if self.train_config.micro_batch_size != "auto":  # "auto": the planner measures
            say(memory_line(config, self.device.type, self.device.budget, self.lengths))
        if self.base_load.message:
            say(self.base_load.message)
        base = load_base_model(config, self.model_path, self.base_load, self.device)
        self.model = add_lora(base, config)
        trainable, total = parameter_counts(self.model)
        say(
            f"model: {config.model_name_or_path} on {self.device.torch_device}, precision "
            f"{self.precision}, base in {str(self.base_load.dtype).removeprefix('torch.')}"
            f"{' (4-bit)' if self.base_load.load_in_4bit else ''}; LoRA r={config.lora.r} on "
            f"{_targets(config)}: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / total:.2f}%)"
        )
        say(
            f"batch: {config.effective_batch_size} samples per optimizer step "
            f"(per_device_train_batch_size {config.per_device_train_batch_size} × "
            f"gradient_accumulation_steps {config.gradient_accumulation_steps} × "
            f"{config.world_size} process(es))"
        )

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, overrides: list[str] | Mapping[str, Any] | None = None
    ) -> FinetuneJob:
        return cls(FinetuneConfig.load(path, overrides))

    def steps_per_epoch(self) -> int:
        size, batch = len(self.train_data), self.config.effective_batch_size
        return size // batch if self.train_config.drop_last else math.ceil(size / batch)

    def run(self, confirmed: Callable[[Path], Any] | None = None) -> FitResult:
        """Train through `Trainer` and, when it finished (exit 0), export final/. The run's
        training_config.json is written, and `confirmed(run_dir)` called (the training log's
        start), only once the Trainer holds the run directory and found its checkpoint, if
        any, to be this run's: a start refused there (locked, another run) writes nothing."""
        cfg = self.config
        total, warmup = cfg.schedule(self.steps_per_epoch())
        trainer = Trainer(
            self.model,
            optimizer_factory(cfg, self.device.type),
            loss_for(cfg),
            self.train_data,
            self.train_config,
            scheduler=scheduler_factory(cfg.lr_scheduler_type, warmup, total),
            collate_fn=Collator(pad_token_id(self.tokenizer)),
            eval_data=self.eval_data if cfg.evaluates_during_training() else None,
        )
        trainer.after_identity_check.append(lambda run_dir: self._confirmed(run_dir, confirmed))
        result = trainer.fit()
        if result.exit_code != 0 or int(os.environ.get("RANK", "0")) != 0:
            return result  # one process exports; a stopped run has nothing final to export
        final = export_final(self.model, self.tokenizer, cfg, Path(result.run_dir))
        if self.eval_data is not None:
            self.final_evaluation(result.micro_batch_size or cfg.per_device_train_batch_size)
        say(
            f"adapter: {final}\n"
            "next:\n"
            f"  steadytrain generate {final} 'Once upon a time'\n"
            f"  steadytrain evaluate {cfg.eval_file or cfg.train_file} {final}\n"
            f"  steadytrain merge {final} --out {Path(result.run_dir) / 'merged'}\n"
            f"  steadytrain report {result.run_dir}"
        )
        return result

    def _confirmed(self, run_dir: Path, then: Callable[[Path], Any] | None) -> None:
        if then is not None:
            then(run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            record_config(self.config, run_dir)
            record = {"time": time.time(), "event": Record.DATA_LENGTHS, **self.lengths.record()}
            append_event(run_dir, record)  # what the supervisor's advice prices

    def final_evaluation(self, batch_size: int) -> float | None:
        """The loss on the eval data after training, said on the console: the engine's
        evaluation loop, from the micro-batch training ended at; an out-of-memory halves it
        and redoes the same samples. One sample that does not fit is said and skipped (the
        training finished and final/ is written): None then."""
        try:
            loss = eval_loss(
                self.model,
                self.eval_data,
                Collator(pad_token_id(self.tokenizer)),
                batch_size,
                self.device,
            )
        except DoesNotFitError as exc:
            say(f"eval: skipped: {exc}")
            return None
        say(f"eval: loss {loss:.4f} (perplexity {math.exp(min(loss, 50)):.2f})")
        return loss


def run_finetune(
    config_path: str | os.PathLike, overrides: list[str] | Mapping[str, Any] | None = None
) -> FitResult:
    """Fine-tune as `config_path` says (with `--set key=value` overrides) and return the
    result; its `exit_code` is the process exit code (DESIGN.md). What the console shows is
    kept in output_dir/training.log too."""
    config = FinetuneConfig.load(config_path, overrides)
    with training_log() as log:
        job = FinetuneJob(config)  # a refusal here writes nothing
        return job.run(confirmed=log.start)  # nor one before the run is known to be this run


def _check_one_batch(config: FinetuneConfig, train: TrainConfig, samples: int) -> None:
    """Fewer training samples than one optimizer batch, said in this config's own keys."""
    if samples >= train.effective_batch_size or not train.drop_last:
        return
    packed = (
        f" after packing into windows of max_seq_length {config.max_seq_length} tokens"
        if config.packing
        else ""
    )
    raise BadInputError(
        f"train_file: {samples} training sample(s){packed}, fewer than one optimizer batch of "
        f"{train.effective_batch_size} (per_device_train_batch_size "
        f"{config.per_device_train_batch_size} × gradient_accumulation_steps "
        f"{config.gradient_accumulation_steps} × {config.world_size} process(es)); "
        + ("set packing: false or lower max_seq_length, or " if config.packing else "")
        + "lower the batch keys, add records, or set drop_last: false"
    )


# -- optimizer and schedule ----------------------------------------------------------------


def _optimizer_problems(name: str, device_type: str) -> list[str]:
    """An optimizer that cannot run here, with the one that can (a list of at most one line)."""
    import importlib.util

    if name == "adamw_torch_fused" and device_type != "cuda":
        return [
            f"optim: adamw_torch_fused is for CUDA, this run trains on {device_type}; "
            "use adamw_torch"
        ]
    if name in BNB_OPTIMIZERS:
        if device_type != "cuda":
            return [
                f"optim: {name} needs bitsandbytes on CUDA, this run trains on {device_type}; use "
                "adamw_torch (the adapter's optimizer state is small, 8-bit saves little with LoRA)"
            ]
        if importlib.util.find_spec("bitsandbytes") is None:
            return [
                f"optim: {name} needs bitsandbytes, which is not installed; pip install "
                "bitsandbytes, or use adamw_torch"
            ]
    return []


def optimizer_factory(
    config: FinetuneConfig, device_type: str
) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """params -> optimizer, as `Trainer` takes it. Weight decay goes to matrices only (Hugging
    Face's rule: not to biases and norm weights, whose decay pulls them toward 0, not toward
    the pretrained value)."""
    for problem in _optimizer_problems(config.optim, device_type):
        raise BadInputError(problem)

    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.ndim >= 2]
        rest = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}]
        if rest:
            groups.append({"params": rest, "weight_decay": 0.0})
        lr = config.learning_rate
        if config.optim == "sgd":
            return torch.optim.SGD(groups, lr=lr)
        betas, eps = (config.adam_beta1, config.adam_beta2), config.adam_epsilon
        if config.optim in BNB_OPTIMIZERS:
            import bitsandbytes as bnb

            cls = (
                bnb.optim.PagedAdamW8bit
                if config.optim == "paged_adamw_8bit"
                else bnb.optim.AdamW8bit
            )
            return cls(groups, lr=lr, betas=betas, eps=eps)
        fused = True if config.optim == "adamw_torch_fused" else None
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)

    return build


def scheduler_factory(name: str, warmup: int, total: int) -> Callable[[Any], Any]:
    """optimizer -> scheduler (transformers.get_scheduler), stepped once per optimizer step,
    so warmup and total count optimizer steps, as in Hugging Face's Trainer."""

    def build(optimizer: torch.optim.Optimizer) -> Any:
        from transformers import get_scheduler

        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)

    return build


# -- after training ------------------------------------------------------------------------


def export_final(model: Any, tokenizer: Any, config: FinetuneConfig, run_dir: Path) -> Path:
    """Write RUN_DIR/final/ (adapter_model.safetensors, adapter_config.json, tokenizer files,
    training_config.json), atomically: see `export_adapter`."""
    return export_adapter(model, tokenizer, config, run_dir / FINAL, root=run_dir)


def export_adapter(
    model: Any, tokenizer: Any, config: FinetuneConfig, target: Path, root: Path | None = None
) -> Path:
    """Write the adapter, the tokenizer and the resolved config into a staging folder beside
    `target`, fsync it, and swap it into place (`replace_dir`), so a kill during export leaves
    either the old folder or the new one at `target`, never half of one nor none. `root`, the run directory (default: the folder
    of `target`): no link on the way from it is followed (exit 2). A full disk is exit 6 naming
    the file being written and the space left."""
    root = root if root is not None else target.parent
    make_folder(target.parent, root=root)
    refuse_link(target)
    remove_leftovers(target)
    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    if staging.is_symlink():
        staging.unlink()
    shutil.rmtree(staging, ignore_errors=True)
    make_folder(staging, root=root)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        text = json.dumps(config.resolved(), indent=2) + "\n"
        write_atomic(staging / TRAINING_CONFIG, text, durable=False, root=root)
        sync_tree(staging)
        replace_dir(staging, target)
    except BaseException as exc:
        full = _export_disk_full(exc, model, staging, target)
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
    return target


def _export_disk_full(
    exc: BaseException, model: Any, staging: Path, target: Path
) -> RunDiskFullError | None:
    """RunDiskFullError (exit 6) when `exc` says the disk is full (`disk_full_in_save`). It
    names the file and the space left while the partial export still takes its room."""
    found = disk_full_in_save(exc, model, staging, target)
    if found is None:
        return None
    error, path = found
    if isinstance(error, RunDiskFullError):
        return error
    full = RunDiskFullError(path, error, kept=f"the checkpoints (the export of {target} is not)")
    full.detail = str(full)  # the space left now, before the partial export is removed
    return full


def record_config(config: FinetuneConfig, run_dir: Path) -> None:
    """RUN_DIR/training_config.json: the resolved config, written before training (once the run
    directory is locked and known to be this run's), so a checkpoint can be exported as an
    adapter while the run is still going."""
    text = json.dumps(config.resolved(), indent=2) + "\n"
    write_atomic(run_dir / TRAINING_CONFIG, text, root=run_files.top(run_dir))


def eval_loss(
    model: Any,
    dataset: Any,
    collate: Collator,
    batch_size: int,
    device: Device,
    on_shrink: Callable[[int, int], None] | None = None,
) -> float:
    """Mean loss per target token over `dataset` (the same weighting as training), by the
    engine's evaluation loop (`engine.evaluation.loss_sums`): batches of `batch_size`, halved on
    out-of-memory; `DoesNotFitError` when one sample does not fit."""

    def too_big(tokens: int) -> str:
        return (
            f"one eval sample of {tokens:,} tokens does not fit in memory on "
            f"{device.torch_device}; lower max_seq_length, or evaluate later with `steadytrain "
            "evaluate` on a machine with more memory"
        )

    def said(old: int, new: int) -> None:
        say(f"eval: out of memory at batch size {old}; redoing the same samples at {new}")

    total, count = loss_sums(
        model,
        dataset,
        dataset.lengths(),
        collate,
        device,
        Batching(batch_size),
        causal_lm_loss,
        too_big=too_big,
        on_shrink=on_shrink or said,
    )
    return total / max(count, 1)


def _targets(config: FinetuneConfig) -> str:
    targets = config.lora.target_modules
    return targets if isinstance(targets, str) else ",".join(targets)


# -- python -m steadytrain.recipes.finetune ------------------------------------------------


@entrypoint
def main(argv: list[str] | None = None) -> FitResult:
    parser = argparse.ArgumentParser(
        prog="python -m steadytrain.recipes.finetune",
        description=FinetuneOptions.__doc__,
    )
    argparse_options(parser, FinetuneOptions)  # as `steadytrain finetune` has them
    args = parser.parse_args(argv)
    return run_finetune(args.config, args.overrides or [])


if __name__ == "__main__":
    main()
