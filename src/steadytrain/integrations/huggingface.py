"""steadytrain for `transformers.Trainer`: one line, ``callbacks=[SteadytrainCallback()]``.

What the callback does to the trainer it is given to (at ``on_init_end``, so it must be passed to
the constructor, not added later):

* ``train()`` resumes by itself from the newest ``OUTPUT_DIR/checkpoint-N`` that verifies against
  the manifest this callback wrote after Hugging Face saved it; one without a manifest, or that
  fails it, is skipped with an event. `resume_from_checkpoint` given by the user wins, except a
  ``checkpoint-N`` of ``output_dir`` that fails its manifest while an older one verifies (run_clm
  passes ``get_last_checkpoint(output_dir)``, the newest by number, half-written or not).
* Out of memory, with ``auto_find_batch_size``: Hugging Face retries its loop at 0.9 times the
  batch, and the batch the optimizer sees shrinks with it. Here the retry runs at the largest
  divisor of the asked effective batch at most half the micro-batch that failed, with the
  accumulation raised to match, from the same RNG state, so the run is the one a clean start at
  that size would make. Every out-of-memory error steadytrain recognises (MPS's, oneDNN's, a
  MemoryError) is handed to Hugging Face's retry in the wording it matches. An out-of-memory after
  an optimizer step, or without ``auto_find_batch_size``, exits 76 for `steadytrain run` to
  restart with half the micro-batch from the newest verified checkpoint; at micro-batch 1: exit 3.
* The watchdog, memory watch, run files and SIGINT / SIGTERM of `RunGuard`, in ``output_dir``: a
  signal makes Hugging Face save at the end of the step, then the process exits 130 / 143.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from pathlib import Path
from typing import Any

from steadytrain.checkpoint.manifest import newest_verified, read_library_manifest
from steadytrain.device import get_rng_state, is_oom, oom_kind, set_rng_state
from steadytrain.integrations.core import Options, capped_micro, halve_or_give_up
from steadytrain.integrations.guard import RunGuard, module_sizes
from steadytrain.safety.signals import stop_exit

try:
    from transformers import TrainerCallback as _Base
except ImportError:  # transformers missing: importable, unusable
    _Base = object

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
ACCELERATE_OOM_TEXT = "out of memory."
"""Hugging Face's retry (accelerate `should_reduce_batch_size`) acts on a RuntimeError whose one
argument contains this."""


class SteadytrainCallback(_Base):
    """Pass to ``transformers.Trainer(..., callbacks=[SteadytrainCallback()])``.

    `hang_timeout` / `hang_action` / `memory_watch` / `memory_budget`: as in `RunGuard`.
    `auto_resume`: resume
    ``train()`` from the newest verified checkpoint when the caller names none.
    """

    def __init__(
        self,
        hang_timeout: float | str = Options.hang_timeout,
        hang_action: str = Options.hang_action,
        memory_watch: bool = Options.memory_watch,
        auto_resume: bool = Options.auto_resume,
        memory_budget: str | float = Options.memory_budget,
    ):
        if _Base is object:
            raise ImportError("SteadytrainCallback for Hugging Face needs transformers installed")
        self.options = Options(hang_timeout, hang_action, memory_watch, memory_budget, auto_resume)
        self.trainer = None
        self.guard: RunGuard | None = None
        self.asked_micro = self.asked_accumulation = self.micro = 0
        self._step_loss = None

    # -- attaching ---------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is None or self.trainer is trainer:
            return
        self.trainer = trainer
        self.asked_micro = trainer._train_batch_size
        self.asked_accumulation = args.gradient_accumulation_steps
        trainer.train = _wraps(trainer.train, self._train)
        trainer._inner_training_loop = _wraps(trainer._inner_training_loop, self._inner_loop)
        trainer.training_step = _wraps(trainer.training_step, self._training_step)
        trainer._save_checkpoint = _wraps(trainer._save_checkpoint, self._save_checkpoint)

    @property
    def effective_batch(self) -> int:
        return self.asked_micro * self.asked_accumulation

    def _train(self, original, resume_from_checkpoint=None, *args, **kwargs):
        trainer = self.trainer
        output_dir = Path(trainer.args.output_dir)
        self.guard = RunGuard(output_dir, **self.options.watch(), device=trainer.args.device.type)
        if resume_from_checkpoint in (None, True) and self.options.auto_resume:
            found = newest_verified(_checkpoints(output_dir), self.guard.record)
            resume_from_checkpoint = str(found[1]) if found else None
        else:
            resume_from_checkpoint = _verified_instead(
                resume_from_checkpoint, output_dir, self.guard.record
            )
        self.micro = capped_micro(self.effective_batch, self.asked_micro)
        self.guard.state.micro_batch_size = self.micro
        self.guard.state.effective_batch_size = self.effective_batch
        config = {"library": "transformers", "training_arguments": trainer.args.to_dict()}
        self.guard.start(
            config,
            fit_frame=sys._getframe(),
            resume_from=resume_from_checkpoint,
            micro_batch_size=self.micro,
            effective_batch_size=self.effective_batch,
        )
        if resume_from_checkpoint is not None:
            self.guard.record(
                "resume",
                {"checkpoint": resume_from_checkpoint, "step": _step_of(resume_from_checkpoint)},
            )
        accumulation = self.effective_batch // self.micro
        self.guard.preflight(
            *module_sizes(trainer.model),
            optimizer=str(getattr(trainer.args.optim, "value", trainer.args.optim)),
            batch=f"micro-batch {self.micro} × {accumulation} = effective batch {self.effective_batch}",
        )
        try:
            result = original(resume_from_checkpoint, *args, **kwargs)
        except BaseException as exc:
            self.guard.finish(f"{type(exc).__name__}", getattr(exc, "code", 1) or 1)
            raise
        code = self.guard.exit_code
        self.guard.finish(self.guard.control.stop_reason or "finished", code)
        if code:
            raise stop_exit(code)  # steadytrain.Stopped for 130 / 143
        return result

    # -- the loop Hugging Face retries -------------------------------------------------------

    def _inner_loop(self, original, batch_size=None, *args, **kwargs):
        trainer, guard = self.trainer, self.guard
        trainer._train_batch_size = self.micro
        trainer.args.gradient_accumulation_steps = self.effective_batch // self.micro
        rng, step_before = get_rng_state(), trainer.state.global_step
        guard.set_up()  # until on_train_begin: accelerate's preparation, the optimizer, a resume
        try:
            return original(self.micro, *args, **kwargs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            guard.out_of_memory(exc)
            progressed = trainer.state.global_step != step_before
            self.micro = halve_or_give_up(  # exit 3 at micro-batch 1; exit 76 if not redone here
                guard,
                exc,
                self.micro,
                self.effective_batch,
                redo_here=bool(trainer.args.auto_find_batch_size) and not progressed,
                reason="out of memory; Hugging Face's auto_find_batch_size retries",
            )
            set_rng_state(rng)
            raise RuntimeError(f"{oom_kind(exc)}: {ACCELERATE_OOM_TEXT}") from exc

    def _training_step(self, original, *args, **kwargs):
        loss = original(*args, **kwargs)
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if self.guard is not None:
            self.guard.beat()
        return loss

    def _save_checkpoint(self, original, *args, **kwargs):
        guard = self.guard
        if guard is None:
            return original(*args, **kwargs)
        with guard.allowance("checkpoint save"):
            return original(*args, **kwargs)

    # -- Hugging Face's events ---------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if self.guard is None:
            print(
                "steadytrain: SteadytrainCallback was added after the Trainer was built; pass "
                "it as Trainer(..., callbacks=[SteadytrainCallback()]) for it to work",
                file=sys.stderr,
            )
            return
        self.guard.set_up(False)
        self.guard.state.step = state.global_step
        self.guard.state.max_steps = state.max_steps

    def on_step_begin(self, args, state, control, **kwargs):
        if self.guard is not None:
            self._step_loss = None
            self.guard.start_step()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        guard = self.guard
        if guard is None:
            return
        loss = self._step_loss
        guard.state.epoch = int(state.epoch or 0)
        guard.end_step(
            state.global_step,
            loss=float(loss) if loss is not None else None,
            lr=optimizer.param_groups[0]["lr"] if optimizer is not None else None,
            micro_batch_size=self.micro,
            accumulation=args.gradient_accumulation_steps,
            samples=self.micro * args.gradient_accumulation_steps,
        )
        if guard.stop_requested:
            control.should_save = True
            control.should_training_stop = True

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.guard is not None:
            self.guard.beat()  # each evaluation batch is progress, not a hang

    def on_save(self, args, state, control, **kwargs):
        if self.guard is None:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            self.guard.checkpoint_saved(folder, state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.guard is not None:
            self.guard.end_epoch(max(0, math.ceil(state.epoch or 0) - 1))


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = _CHECKPOINT.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return found


def _step_of(checkpoint: Any) -> int | None:
    """The step Hugging Face resumes `checkpoint` at: the one its manifest was written for (the
    global step of the save), else the N of a ``checkpoint-N`` folder, else None (a
    checkpoint named by the caller, elsewhere)."""
    if not isinstance(checkpoint, (str, Path)):
        return None
    manifest = read_library_manifest(Path(checkpoint))
    step = manifest.get("step") if manifest else None
    if isinstance(step, int):
        return step
    match = _CHECKPOINT.match(Path(checkpoint).name)
    return int(match.group(1)) if match else None


def _verified_instead(given: Any, output_dir: Path, record) -> Any:
    """The checkpoint to resume from when the caller named one. A `checkpoint-N` of
    `output_dir` that fails its manifest (half-written when the process was killed: what
    run_clm's ``get_last_checkpoint`` picks, the newest by number) gives way to the newest older
    one that verifies, each skipped one recorded; with none verified, or any other path, the
    caller's choice stands."""
    if not isinstance(given, (str, Path)):
        return given
    path = Path(given)
    match = _CHECKPOINT.match(path.name)
    if match is None or not path.is_dir() or not _same_folder(path.parent, output_dir):
        return given
    step = int(match.group(1))  # the given one first: verified once, whichever is taken
    found = newest_verified([(s, p) for s, p in _checkpoints(output_dir) if s <= step], record)
    return str(found[1]) if found and found[1].name != path.name else given


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _calling_trainer() -> Any:
    """The `transformers.Trainer` whose constructor is calling us (the ``self`` of a frame)."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _wraps(original, method):
    """An instance attribute that calls ``method(original, ...)`` with the original's signature
    (Hugging Face inspects it)."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return method(original, *args, **kwargs)

    return wrapper
