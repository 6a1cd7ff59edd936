"""steadytrain for Keras 3: one line, ``model.fit(..., callbacks=[SteadytrainCallback("runs/x")])``.

On every backend (TensorFlow on a Mac, JAX, torch):

* checkpoints through Keras's own ``save_weights`` (model and optimizer variables) with the epoch,
  the step and every RNG stream beside them (Python's, numpy's, the state of every Keras
  ``SeedGenerator`` of the model and Keras's global one, which Dropout and ``keras.random`` draw
  from; TensorFlow's global generator and op seeds where TensorFlow is loaded; torch's where torch
  is), committed atomically with a manifest of hashes
  (``RUN_DIR/checkpoints/step-N/``) at each ``save_every_epochs``-th epoch end and on a signal;
  ``fit`` resumes by itself from the newest one that verifies, where the uninterrupted run would
  go on: from a checkpoint taken mid-epoch (on a signal) Keras would restart the epoch from its
  first batch, so the callback draws that epoch's order again from the streams the epoch began
  with and skips the batches trained before the stop (`_skip_done_batches`).
* the watchdog (exit 75), memory watch, run files of `RunGuard`; SIGINT / SIGTERM save at the
  end of the batch, stop ``fit`` and exit 130 / 143.
* a metrics line per batch with the batch's own loss and size (from Keras's loss tracker: the
  running mean's sum and sample count before and after the batch), not the epoch's running mean.
* no torch on TensorFlow or JAX: memory readings come from the host (`HostDevice`).

On the torch backend, also the promise of steadytrain's own engine: an out-of-memory in a step
drops the partial gradients, halves the micro-batch and redoes the same batch in pieces whose
gradients add up to the whole batch's (same RNG state), so the optimizer still sees the batch
asked for; at micro-batch 1 it exits 3. ``STEADYTRAIN_MAX_MICRO_BATCH`` (set by `steadytrain run`)
caps the piece size from the start. Other backends compile the step: an out-of-memory there
(TensorFlow's ``ResourceExhaustedError``, XLA's ``RESOURCE_EXHAUSTED``) is recorded as an ``oom``
event and ends the process with exit 76, so that `steadytrain run` restarts it from the newest
checkpoint with ``STEADYTRAIN_MAX_MICRO_BATCH`` at half the batch (`max_micro_batch()`: the
program passes it to ``fit`` as ``batch_size``).

On every backend, an out-of-memory anywhere else in ``fit`` (its validation, a callback's own
work, the data pipeline) is one too: Keras lets it leave ``fit`` without ``on_train_end``, so
the callback catches it where it would end the program (`_watch_uncaught_oom`: a
``sys.excepthook`` installed as ``fit`` starts), records it and exits 76 the same way.
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from steadytrain.checkpoint.manifest import (
    newest_verified,
    read_library_manifest,
    write_library_manifest,
)
from steadytrain.device.host import HostDevice
from steadytrain.device.oom import is_oom, oom_kind
from steadytrain.events import divisor_at_most
from steadytrain.integrations.core import (
    SHRINK,
    Options,
    capped_micro,
    halve_or_give_up,
    max_micro_batch,
    restart_smaller,
)
from steadytrain.integrations.guard import RunGuard, library_frame
from steadytrain.integrations.keras_state import plain, rng_state, set_rng_state, unplain
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, sync_dir, write_atomic
from steadytrain.safety.signals import stop_exit

try:
    from keras.callbacks import Callback as _Base
except ImportError as exc:  # keras, or the backend KERAS_BACKEND names, missing
    _Base, _MISSING = object, f"{type(exc).__name__}: {exc}"

WEIGHTS_FILE = "model.weights.h5"
STATE_FILE = "state.json"


class SteadytrainCallback(_Base):
    """`run_dir`: where metrics, events, hangs and checkpoints go. `save_every_epochs`: how
    often a checkpoint is committed; `keep_last`: how many are kept. `hang_timeout`,
    `hang_action`, `memory_watch`, `memory_budget`: as in `RunGuard`."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        save_every_epochs: int = 1,
        keep_last: int = 2,
        hang_timeout: float | str = Options.hang_timeout,
        hang_action: str = Options.hang_action,
        memory_watch: bool = Options.memory_watch,
        auto_resume: bool = Options.auto_resume,
        memory_budget: str | float = Options.memory_budget,
    ):
        if _Base is object:
            raise ImportError(
                f"SteadytrainCallback for Keras needs keras 3 and the backend KERAS_BACKEND names "
                f"({_MISSING})"
            )
        super().__init__()
        self.run_dir = Path(run_dir)
        self.save_every_epochs, self.keep_last = save_every_epochs, keep_last
        self.options = Options(hang_timeout, hang_action, memory_watch, memory_budget, auto_resume)
        self.guard = RunGuard(
            self.run_dir,
            **self.options.watch(),
            device="auto" if _backend() == "torch" else "cpu",
        )
        if _backend() != "torch":  # the host's memory, read without torch
            self.guard.device_spec = HostDevice(self.guard.budget_spec)
        self.micro: int | None = None
        self.batch: int | None = None
        self._sums: tuple[float, float] | None = None  # the loss tracker's before the batch
        self._batches = 0  # in this epoch
        self._mean: float | None = None  # logs' running mean after the previous batch
        self._epoch_rng: dict | None = None  # every stream as the epoch began (its order's)
        self._done = 0  # batches of this epoch trained before this process resumed it
        self._resuming: tuple[int, dict] | None = None  # a mid-epoch checkpoint's (done, rng)
        self._cut = (
            False  # stopped mid-epoch: Keras still calls on_epoch_end, the epoch did not end
        )
        self._validating = False  # between fit's on_test_begin and on_test_end

    # -- start and end -----------------------------------------------------------------------

    def on_train_begin(self, logs=None) -> None:
        max_micro_batch()  # a cap set by hand that is no micro-batch: exit 2 before the start
        guard = self.guard
        params = self.params or {}
        guard.state.steps_per_epoch = params.get("steps") or 0
        guard.state.max_steps = guard.state.steps_per_epoch * params.get("epochs", 0)
        self._resume()
        fit_frame = library_frame(("keras",), ("fit",))
        if self._resuming is not None:
            _skip_done_batches(self, fit_frame)
        if _backend() == "torch":
            self.model.train_step = _SplitStep(self, self.model.train_step)
        elif getattr(self.model, "train_function", None) is not None:
            self.model.train_function = _OOMExit(self, self.model.train_function)
            self.batch = _fit_batch_size(fit_frame)
            guard.state.micro_batch_size = self.batch or 0
        config = {"library": "keras", "backend": _backend(), "fit": plain(params)}
        # the batch the first step runs at: what `steadytrain run` halves after a crash in it
        start = {"micro_batch_size": self.batch} if self.batch else {}
        guard.start(config, fit_frame=fit_frame, **start)
        _watch_uncaught_oom(self)
        model = self.model
        sizes = [(int(np.prod(w.shape)), np.dtype(w.dtype).itemsize) for w in model.weights]
        trainable = [
            (int(np.prod(w.shape)), np.dtype(w.dtype).itemsize) for w in model.trainable_weights
        ]
        guard.preflight(
            sum(n for n, _ in sizes),
            sum(n * b for n, b in sizes),
            sum(n * b for n, b in trainable),
            optimizer=type(model.optimizer).__name__ if model.optimizer else "none",
            batch=f"{guard.state.steps_per_epoch} steps per epoch",
        )

    def on_train_end(self, logs=None) -> None:
        guard = self.guard
        if isinstance(self.model.train_step, _SplitStep):
            self.model.train_step = self.model.train_step.original
        if isinstance(getattr(self.model, "train_function", None), _OOMExit):
            self.model.train_function = self.model.train_function.original
        code = guard.exit_code
        guard.finish(guard.control.stop_reason or "finished", code)
        if code:
            raise stop_exit(code)  # steadytrain.Stopped for 130 / 143

    # -- steps -------------------------------------------------------------------------------

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.guard.start_step()
        self._sums = _loss_sums(self.model)

    def on_train_batch_end(self, batch, logs=None) -> None:
        guard, logs = self.guard, logs or {}
        loss, samples = self._batch_loss(logs.get("loss"))
        micro = divisor_at_most(samples, self.micro) if self.micro and samples else samples
        guard.end_step(
            loss=loss,
            lr=_learning_rate(self.model),
            micro_batch_size=micro,
            micro_steps=(samples // micro) if micro and samples else None,
            accumulation=(samples // micro) if micro and samples else None,
            samples=samples,
        )
        if guard.stop_requested and not self.model.stop_training:
            self._save(self.guard.state.epoch, self._done + self._batches)  # mid-epoch
            self.model.stop_training = self._cut = True

    def on_test_begin(self, logs=None) -> None:
        self._validating = True

    def on_test_end(self, logs=None) -> None:
        self._validating = False

    def on_test_batch_end(self, batch, logs=None) -> None:
        self.guard.beat()  # each validation batch of fit() is progress, not a hang

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.guard.state.epoch = epoch
        self._batches, self._mean = 0, None
        if self._resuming is not None:  # resumed mid-epoch: the streams it began with, saved
            (self._done, self._epoch_rng), self._resuming = self._resuming, None
        else:  # the order is drawn right after this, when Keras makes the epoch's iterator
            self._done, self._epoch_rng = 0, rng_state(self.model)

    def _batch_loss(self, mean: Any) -> tuple[float | None, int | None]:
        """The batch's own loss and size: the change of Keras's loss tracker (a sample-weighted
        running sum) over the batch; where the tracker cannot be read, the loss from the running
        mean and the batch count (equal batches assumed) and the size this callback saw."""
        self._batches += 1
        before, after = self._sums, _loss_sums(self.model)
        mean = float(mean) if mean is not None else None
        previous, self._mean = self._mean, mean
        if before is not None and after is not None and after[1] > before[1]:
            count = after[1] - before[1]
            return (after[0] - before[0]) / count, round(count)
        if mean is None:
            return None, self.batch
        if previous is None or self._batches == 1:
            return mean, self.batch
        k = self._batches
        return k * mean - (k - 1) * previous, self.batch

    def _out_of_memory(self, exc: BaseException, where: tuple[str, str] | None = None) -> None:
        """Out of memory in ``fit``: in the compiled step (TensorFlow, JAX), or elsewhere
        (`where`: its phase and words, `_where`, for an error that left ``fit``). Record it and
        exit 76, so that `steadytrain run` restarts from the newest checkpoint with half the
        batch as the cap."""
        phase, words = where or ("", "the compiled step")
        self.guard.out_of_memory(exc, **({"phase": phase} if phase else {}))
        batch = f"batch {self.batch or self.guard.state.micro_batch_size or '?'}"
        also = "" if where is None else ", and to validation_batch_size and your callbacks"
        restart_smaller(
            self.guard,
            exc,
            f"steadytrain: out of memory in {words} ({_backend()}, {oom_kind(exc)}) at "
            f"{batch}; exiting {SHRINK} so that `steadytrain run` restarts from the newest "
            "verified checkpoint with STEADYTRAIN_MAX_MICRO_BATCH at half of it (pass "
            f"`max_micro_batch()` to fit as batch_size{also})",
        )

    def _where(self, trace: TracebackType | None) -> tuple[str, str]:
        """Where in ``fit`` an error that left it arose, as the ``oom`` event's phase and in
        words: the innermost callback method on its traceback (Keras filters its own frames
        out; a callback's stay), else fit's validation when it was running, else fit."""
        found = None
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_code.co_name.startswith("on_") and isinstance(
                frame.f_locals.get("self"), _Base
            ):
                found = f"callback {type(frame.f_locals['self']).__name__}.{frame.f_code.co_name}"
            trace = trace.tb_next
        if found is not None:
            return found, f"the {found}"
        if self._validating:
            return "evaluation", "fit's validation"
        return "fit", "fit, outside the compiled step"

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._cut:
            return
        self.guard.end_epoch(epoch)
        if (epoch + 1) % self.save_every_epochs == 0 and not self.guard.stop_requested:
            self._save(epoch + 1)

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / run_files.CHECKPOINTS

    def _save(self, next_epoch: int, batches: int = 0) -> Path:
        """Keras's own save_weights, the epoch to resume at and the RNG streams into a staging
        folder (mid-epoch also the `batches` of it done and the streams it began with, so the
        resume draws its order again and skips those); the manifest last; then the rename that
        commits it."""
        step = self.guard.state.step
        final = self.checkpoints / f"step-{step:08d}"
        staging = self.checkpoints / f".staging-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        make_folder(staging, root=run_files.top(self.run_dir))  # never through a link
        with self.guard.allowance("checkpoint save"):
            sync = getattr(self.model, "jax_state_sync", None)
            if sync is not None:  # JAX keeps the variables outside the model during fit
                sync()
            self.model.save_weights(str(staging / WEIGHTS_FILE))
            state = {"epoch": next_epoch, "step": step, **plain(rng_state(self.model))}
            if batches:
                state.update(batches=batches, epoch_start=plain(self._epoch_rng))
            write_atomic(staging / STATE_FILE, json.dumps(state), root=staging)
            write_library_manifest(staging, step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging, final)
            sync_dir(self.checkpoints)
        self.guard.record("checkpoint", {"step": step, "checkpoint": str(final)})
        self._prune(final)
        return final

    def _prune(self, kept: Path) -> None:
        committed = sorted(p for p in self.checkpoints.glob("step-*") if p.is_dir())
        for old in committed[: max(0, len(committed) - self.keep_last)]:
            if old != kept:
                shutil.rmtree(old, ignore_errors=True)

    def _resume(self) -> None:
        if not self.options.auto_resume or not self.checkpoints.is_dir():
            return
        candidates = []
        for path in self.checkpoints.glob("step-*"):
            manifest = read_library_manifest(path) if path.is_dir() else None
            step = manifest.get("step") if manifest else None
            candidates.append((step if isinstance(step, int) else -1, path))
        found = newest_verified(candidates, self.guard.record)
        if found is None:
            return
        step, path = found
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(str(path / WEIGHTS_FILE))
        state = json.loads((path / STATE_FILE).read_text())
        set_rng_state(self.model, unplain(state))
        model._initial_epoch = state["epoch"]  # what Keras's BackupAndRestore sets
        self.guard.state.step, self.guard.state.epoch = step, state["epoch"]
        self.guard.record("resume", {"checkpoint": str(path), "epoch": state["epoch"]})
        epochs, done = (self.params or {}).get("epochs"), state["epoch"]
        batches = state.get("batches", 0)
        if batches and state.get("epoch_start") is not None:
            self._resuming = (batches, unplain(state["epoch_start"]))
        print(
            f"steadytrain: resuming from {path} (step {step}): "
            + (
                f"all {epochs} epochs are done, fit() trains nothing (raise epochs to go on)"
                if epochs and done >= epochs
                else f"fit() goes on at epoch {done + 1}"
                + (f" of {epochs}" if epochs else "")
                + (f", after its batch {batches}" if self._resuming else "")
            ),
            file=sys.stderr,
            flush=True,
        )


class _SplitStep:
    """Keras's torch ``train_step``, run in micro-batches whose gradients add up to the whole
    batch's, redone at half the size on an out-of-memory. Mirrors
    ``keras.src.backend.torch.trainer.TorchTrainer.train_step`` (Keras 3)."""

    def __init__(self, callback: SteadytrainCallback, original):
        self.callback, self.original = callback, original

    def __call__(self, data):
        from keras.src import tree
        from keras.src.trainers.data_adapters import data_adapter_utils

        callback = self.callback
        x, y, weights = data_adapter_utils.unpack_x_y_sample_weight(data)
        size = next(i for i in tree.flatten(x) if i is not None).shape[0]
        callback.batch = size
        if callback.micro is None:
            callback.micro = capped_micro(size)
        from steadytrain.device.rng import get_rng_state

        rng = get_rng_state()
        while True:
            micro = divisor_at_most(size, callback.micro)
            try:
                return self._run(x, y, weights, size, micro, tree)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self._redo(exc, micro, size, rng)

    def _redo(self, exc: BaseException, micro: int, size: int, rng: dict) -> None:
        callback, guard = self.callback, self.callback.guard
        guard.state.micro_batch_size = micro
        guard.out_of_memory(exc)
        self.model.zero_grad()
        gc.collect()
        callback.micro = halve_or_give_up(guard, exc, micro, size, redo_here=True)  # or exit 3
        from steadytrain.device.rng import set_rng_state

        set_rng_state(rng)

    @property
    def model(self):
        return self.callback.model

    def _run(self, x, y, weights, size: int, micro: int, tree):
        import torch

        model = self.model
        model.zero_grad()
        result = None
        for start in range(0, size, micro):
            part = tree.map_structure(
                lambda t, s=start: None if t is None else t[s : s + micro], (x, y, weights)
            )
            px, py, pw = part
            y_pred = model(px, training=True) if model._call_has_training_arg else model(px)
            loss = model._compute_loss(x=px, y=py, y_pred=y_pred, sample_weight=pw, training=True)
            share = micro / size
            if model.trainable_weights:
                scaled = model.optimizer.scale_loss(loss) if model.optimizer else loss
                (scaled * share).backward()
            model._loss_tracker.update_state(loss, sample_weight=micro)
            result = model.compute_metrics(px, py, y_pred, sample_weight=pw)
            self.callback.guard.beat()
        if model.trainable_weights:
            variables = model.trainable_weights[:]
            with torch.no_grad():
                model.optimizer.apply([v.value.grad for v in variables], variables)
        return result


class _OOMExit:
    """The compiled ``train_function`` of TensorFlow / JAX, with its out-of-memory turned into
    exit 76 (a smaller restart) instead of a crash that `steadytrain run` would repeat."""

    def __init__(self, callback: SteadytrainCallback, original):
        self.callback, self.original = callback, original

    def __call__(self, *args, **kwargs):
        try:
            return self.original(*args, **kwargs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self.callback._out_of_memory(exc)
            raise  # not reached: _out_of_memory exits


def _skip_done_batches(callback: SteadytrainCallback, fit_frame) -> None:
    """Make the next epoch of ``fit`` the rest of the epoch a mid-epoch checkpoint stopped in.

    Keras has no resume inside an epoch: ``fit`` starts at `initial_epoch` with a new iterator
    over its data, whose order is drawn from the random streams as the epoch begins. Wrapped
    once, fit's epoch iterator sets the streams to those the stopped epoch began with, makes
    the iterator (the same order), draws the batches trained before the stop from it unseen (no
    step, no callback), puts the streams back as the checkpoint left them, and hands fit the
    rest; Keras's own step numbers go on from there. Where fit's iterator cannot be found, the
    epoch is repeated from its first batch, as Keras does."""
    done, epoch_rng = callback._resuming
    iterator = fit_frame.f_locals.get("epoch_iterator") if fit_frame is not None else None
    original = getattr(iterator, "_enumerate_iterator", None)
    if original is None:
        callback._resuming = None
        print(
            f"steadytrain: fit's epoch iterator not found; the resumed epoch repeats its first "
            f"{done} batch(es)",
            file=sys.stderr,
            flush=True,
        )
        return
    model = callback.model

    def rest_of_the_epoch():
        del iterator._enumerate_iterator  # once: the next epochs are Keras's own
        now = rng_state(model)
        set_rng_state(model, epoch_rng)
        steps = original()
        for _ in range(done):
            _begin, _end, data = next(steps)
            for _ in range(iterator.steps_per_execution):
                next(data)
        set_rng_state(model, now)
        yield from steps

    iterator._enumerate_iterator = rest_of_the_epoch


_fitting: SteadytrainCallback | None = None
"""The callback whose ``fit`` started last in this process (`_watch_uncaught_oom`)."""


def _watch_uncaught_oom(callback: SteadytrainCallback) -> None:
    """Make an out-of-memory that leaves `callback`'s ``fit`` (fit's validation, a callback's
    own work, the data pipeline: anything but the compiled step, which `_OOMExit` wraps) end the
    program as the step's does: an ``oom`` event and exit 76. Keras calls no callback when an
    error leaves ``fit``, so the place to catch it is where it ends the program: a
    ``sys.excepthook``, chained before the one there was, installed once."""
    global _fitting
    _fitting = callback
    if getattr(sys.excepthook, "_steadytrain_keras_oom", False):
        return
    previous = sys.excepthook

    def _uncaught_oom(
        kind: type[BaseException], error: BaseException, trace: TracebackType | None
    ) -> None:
        fitting, interactive = _fitting, sys.flags.interactive or hasattr(sys, "ps1")
        if fitting is not None and fitting.guard.started and is_oom(error) and not interactive:
            where = fitting._where(trace or error.__traceback__)
            fitting._out_of_memory(error, where)  # raises SystemExit(76)
        previous(kind, error, trace)

    _uncaught_oom._steadytrain_keras_oom = True  # type: ignore[attr-defined]
    sys.excepthook = _uncaught_oom


def _backend() -> str:
    import keras

    return keras.backend.backend()


def _fit_batch_size(fit_frame) -> int | None:
    """The batch size ``fit`` batches its data with (its data adapter's), when it says."""
    iterator = fit_frame.f_locals.get("epoch_iterator") if fit_frame is not None else None
    size = getattr(getattr(iterator, "data_adapter", None), "batch_size", None)
    return size if isinstance(size, int) and size >= 1 else None


def _loss_sums(model) -> tuple[float, float] | None:
    """(sum of loss × samples, samples) of Keras's loss tracker now, None where unreadable. On
    JAX the tracker's variables live in the trainer's state during ``fit``."""
    import keras

    tracker = getattr(model, "_loss_tracker", None)
    try:
        total, count = tracker.total, tracker.count
        jax_state = getattr(model, "_jax_state", None)
        if jax_state and jax_state.get("metrics_variables") is not None:
            ids = [id(v) for v in model.metrics_variables]
            values = jax_state["metrics_variables"]
            total, count = values[ids.index(id(total))], values[ids.index(id(count))]
        return (
            float(keras.ops.convert_to_numpy(total)),
            float(keras.ops.convert_to_numpy(count)),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _learning_rate(model) -> float | None:
    try:
        return float(model.optimizer.learning_rate)
    except (AttributeError, TypeError, ValueError):
        return None
