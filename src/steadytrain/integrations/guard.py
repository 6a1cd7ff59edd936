"""`RunGuard`: steadytrain's guarantees around a training loop it does not own.

The callbacks for Hugging Face, Lightning and Keras are thin translations of their library's hooks
onto this object; a program that keeps its own loop uses it directly::

    from steadytrain.integrations import RunGuard

    with RunGuard("runs/my-run", config=vars(args)) as guard:
        for step, batch in enumerate(loader, start=1):
            with guard.step(step) as row:     # heartbeat; an out-of-memory is recorded
                loss = train_step(batch)      # guard.beat() inside, per micro-batch, if long
                row.update(loss=loss.item(), lr=scheduler.get_last_lr()[0])
            if step % 100 == 0 or guard.stop_requested:
                save_checkpoint(step)         # then guard.checkpoint_saved(path, step)
            if guard.stop_requested:
                break                         # leaving the block exits 130 / 143

What it gives: the hang watchdog (a step without a beat for ``hang_timeout`` seconds: stacks in
``RUN_DIR/hangs/``, exit 75, and ``RUN_DIR/heartbeat`` for ``steadytrain run``); the memory watch
(leaks, swap); ``metrics.jsonl``, ``events.jsonl`` and ``config.json`` that ``steadytrain report``
reads; SIGINT / SIGTERM turned into `stop_requested` (save, then exit 130 / 143); and an
out-of-memory that escapes the block recorded and turned into exit 76, which `steadytrain run`
answers with a restart under half the micro-batch (`max_micro_batch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from steadytrain._units import budget_spec, format_bytes
from steadytrain.checkpoint.manifest import (
    LIBRARY_MANIFEST,
    newest_verified,
    read_library_manifest,
    write_library_manifest,
)
from steadytrain.device.oom import OOM_MESSAGES, exception_chain, is_oom, oom_kind
from steadytrain.errors import BadInputError
from steadytrain.events import Control, Dispatcher, Event, Metric, StepMetrics, TrainState
from steadytrain.integrations.core import (
    DEFAULTS,
    DOES_NOT_FIT,
    SHRINK,
    max_micro_batch,
    restart_count,
    restart_smaller,
)
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, write_atomic
from steadytrain.safety import watchdog as watchdog_module
from steadytrain.safety.memory_watch import MemoryWatch
from steadytrain.safety.signals import stop_exit
from steadytrain.safety.supervised import announce_run_dir
from steadytrain.trainer.callbacks import DefaultCallbacks, watch_settings

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2, "adafactor": 1, "lion": 1, "rmsprop": 1}
"""Parameter-sized tensors of state per trainable parameter (SGD: its momentum; Adam: two
moments); an optimizer not listed counts as Adam."""


def module_sizes(module) -> tuple[int, int, int]:
    """(parameters, bytes of every parameter, bytes of the trainable ones) of a torch module."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    size = sum(p.numel() * p.element_size() for p in params)
    return (
        sum(p.numel() for p in params),
        size,
        sum(p.numel() * p.element_size() for p in trainable),
    )


def oom_line(exc: BaseException) -> str:
    """The line of `exc`'s chain that says out of memory (libraries wrap the allocator's error
    in their own first line), else its first line; with the type of the error that holds it."""
    for err in exception_chain(exc):
        for line in str(err).splitlines():
            if any(needle in line for needle, _ in OOM_MESSAGES):
                return f"{type(err).__name__}: {line.strip()}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


def library_frame(modules: tuple[str, ...], names: tuple[str, ...]) -> FrameType | None:
    """The innermost frame on this thread's stack running one of `names` in a module under one
    of `modules` (the library's ``fit`` / ``train``): its return is the end of the fit."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name in names and module.startswith(modules):
            return frame
        frame = frame.f_back
    return None


class RunGuard:
    """The watchdog, memory watch, run files and signal handling of one run directory.

    `hang_timeout`: seconds a step may go without a beat ("auto": 300 s, or 10 median steps,
    and 600 s for the first step of a process; a number bounds the first step too). `hang_action`: "exit" (75) or "report".
    `device`: where the memory readings come from ("auto", "cuda", "mps", "cpu"), or a device
    object already made (`HostDevice` for a framework other than torch: no torch is imported).
    `micro_batch_size`: the samples per forward the loop uses now (a metrics line's
    ``micro_batch_size`` updates it): an out-of-memory exit asks for half of it.
    `memory_budget`: "auto" (90 % of what this process may use), a size ("12GiB") or a fraction.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        config: dict[str, Any] | None = None,
        hang_timeout: float | str = DEFAULTS["hang_timeout"],
        hang_action: str = DEFAULTS["hang_action"],
        device: Any = "auto",
        memory_watch: bool = DEFAULTS["memory_watch"],
        handle_signals: bool = True,
        micro_batch_size: int = 0,
        memory_budget: str | float = DEFAULTS["memory_budget"],
    ):
        self.run_dir = Path(run_dir)
        self.config = dict(config or {})
        self.device_spec = device
        self.budget_spec = _budget_spec(memory_budget)
        self.state, self.control = TrainState(micro_batch_size=micro_batch_size), Control()
        settings = watch_settings(
            hang_timeout=hang_timeout, hang_action=hang_action, memory_watch=memory_watch
        )
        # the Trainer's default callbacks, in its dispatch order (steadytrain.trainer.callbacks)
        self.defaults = DefaultCallbacks(
            settings, self.run_dir, lambda files: self.record, signals=handle_signals
        )
        self.files, self.watchdog = self.defaults.files, self.defaults.watchdog
        self.signals = self.defaults.signals
        self.memory_watch: MemoryWatch | None = None
        self.emit = Dispatcher(self.defaults.in_order(), self.state, self.control)
        self.device = None
        self.started = False
        self._step_started = 0.0
        self._rows = 0
        self._recorded_oom: BaseException | None = None  # the out-of-memory already recorded

    # -- start and end -----------------------------------------------------------------------

    def __enter__(self) -> RunGuard:
        return self.start(fit_frame=sys._getframe(1))

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and is_oom(exc):
            self.out_of_memory(exc)
            restart_smaller(self, exc)  # exit 76
        if exc is not None:
            first = (str(exc).strip().splitlines() or [""])[0]
            self.finish(f"{type(exc).__name__}: {first}", getattr(exc, "code", 1) or 1)
            return
        code = self.exit_code
        self.finish(self.control.stop_reason or "finished", code)
        if code:
            raise stop_exit(code)  # steadytrain.Stopped for 130 / 143

    def start(
        self,
        config: dict[str, Any] | None = None,
        fit_frame: FrameType | None = None,
        **fit_info: Any,
    ) -> RunGuard:
        """Write config.json, record ``fit_start``, install the signal handlers, start watching.
        A config.json a model saved there (Hugging Face's ``save_model()`` writes its own into
        ``output_dir``) is kept: the run's config is then in the ``fit_start`` event alone.
        `fit_frame`: the frame whose return ends the run (the watchdog stands down then)."""
        if self.started:
            return self
        self.started = True
        self.config.update(config or {})
        make_folder(self.run_dir, root=run_files.top(self.run_dir))  # no link on the way
        announce_run_dir(self.run_dir)  # to a supervising `steadytrain run` that asked for it
        if isinstance(self.device_spec, str):
            from steadytrain.device import resolve_device  # torch

            self.device = resolve_device(self.device_spec, self.budget_spec)
        else:
            self.device = self.device_spec
        self.watchdog.device = self.device
        if not _saved_model_config(self.run_dir / run_files.CONFIG):
            write_atomic(
                self.run_dir / run_files.CONFIG,
                json.dumps(self.config, indent=1, default=str),
                root=run_files.top(self.run_dir),
            )
        reading = self.device.memory().to_dict()
        info = {
            "device": str(self.device.torch_device),
            "config": self.config,
            "budget": reading.get("budget"),
            "restart": restart_count(),
            **fit_info,
        }
        self.defaults.watch_memory(self.device)
        self.memory_watch = self.defaults.memory_watch
        self.emit.callbacks[:] = self.defaults.in_order()
        self.defaults.watch_from(self.state, self.control, fit_frame or sys._getframe(1))
        self.emit(Event.FIT_START, info)
        return self

    def finish(self, reason: str = "finished", exit_code: int = 0) -> None:
        """Stop watching, restore the signal handlers, record ``fit_end``. Idempotent."""
        if not self.started:
            return
        self.started = False
        self.emit(Event.FIT_END, {"reason": reason, "exit_code": exit_code})

    # -- steps -------------------------------------------------------------------------------

    def set_up(self, on: bool = True) -> None:
        """The library's own set-up before its first step (model placement, the optimizer, a
        checkpoint's load) starts (`on`) or is done: in it the hang watching allows what
        `fit()`'s set-up gets (600 s, whatever `hang_timeout` says), not the first step's limit."""
        self.watchdog.library_set_up(on)

    def beat(self) -> None:
        """A sign of life inside a step (after each micro-batch): one integer increment."""
        self.watchdog.beats += 1

    def start_step(self) -> None:
        self._step_started = time.perf_counter()
        self.emit(Event.STEP_START)

    def end_step(self, step: int | None = None, **values: Any) -> None:
        """Record one optimizer step: `values` (loss, lr, micro_batch_size, ...) become its line
        of metrics.jsonl, with the step time and the memory reading."""
        self.state.step = self.state.step + 1 if step is None else step
        row = {
            Metric.TIME: time.time(),
            Metric.STEP: self.state.step,
            Metric.EPOCH: self.state.epoch,
            Metric.STEP_TIME: time.perf_counter() - self._step_started,
            **values,
        }
        if Metric.MICRO_BATCH_SIZE in values:
            self.state.micro_batch_size = values[Metric.MICRO_BATCH_SIZE]
        if values.get(Metric.LOSS) is not None:
            self.state.last_loss = values[Metric.LOSS]
        # one line of metrics.jsonl: the row, then the reading as mem_* (the run files')
        row[Metric.MEMORY] = self.device.memory().to_dict()
        self.emit(Event.STEP_END, {"metrics": StepMetrics(row).resolve()})
        self._rows += 1

    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator[dict[str, Any]]:
        """One optimizer step (number `step`, else the one after the last): yields the dict that
        becomes its metrics line (fill in loss, lr, ...). An out-of-memory inside is recorded
        (with the memory reading) and re-raised."""
        self.start_step()
        row: dict[str, Any] = {}
        try:
            yield row
        except BaseException as exc:
            if is_oom(exc):
                self.out_of_memory(exc)
            raise
        self.end_step(step, **row)

    def end_epoch(self, epoch: int) -> None:
        self.emit(Event.EPOCH_END, {"epoch": epoch, "memory": self.device.memory().to_dict()})
        self.state.epoch = epoch + 1

    # -- events ------------------------------------------------------------------------------

    def record(self, name: str, info: dict) -> None:
        """One line of events.jsonl (any thread)."""
        self.files.record(name, {"step": self.state.step, **info})

    def out_of_memory(self, exc: BaseException, **info: Any) -> None:
        """Record the out-of-memory `exc` as an ``oom`` event, once: the same error passing a
        second handler on its way out (`step()`, then the ``with`` block's end; a library that
        re-raises it wrapped in its own, ``raise ... from exc``) is the same out-of-memory, not
        another."""
        err: BaseException | None = exc
        while err is not None:
            if err is self._recorded_oom:
                return
            err = err.__cause__
        self._recorded_oom = exc
        self.state.oom_count += 1
        self.record(
            "oom",
            {
                "kind": oom_kind(exc),
                "error": oom_line(exc)[:500],
                "micro_batch_size": self.state.micro_batch_size,
                "memory": self.device.memory().to_dict() if self.device is not None else None,
                **info,
            },
        )

    def shrink_message(self) -> str:
        return (
            f"steadytrain: out of memory at micro-batch {self.state.micro_batch_size}; exiting "
            f"{SHRINK} so that `steadytrain run` restarts with half of it and twice the "
            "accumulation, from the newest verified checkpoint"
        )

    def checkpoint_saved(self, path: str | os.PathLike, step: int) -> None:
        """Hash the checkpoint the program just wrote (a folder or a file) into its manifest,
        and record a ``checkpoint`` event; only such checkpoints are resumed from."""
        with watchdog_module.allowance("checkpoint manifest"):
            write_library_manifest(Path(path), step)
        self.record("checkpoint", {"step": step, "checkpoint": str(path)})

    def newest_checkpoint(self, pattern: str = f"{run_files.CHECKPOINTS}/*") -> Path | None:
        """The newest checkpoint (by the step in its manifest) among RUN_DIR/`pattern` that
        verifies; each newer one that does not is recorded as ``checkpoint_skipped``."""
        candidates = []
        for path in self.run_dir.glob(pattern):
            if path.name.endswith(LIBRARY_MANIFEST) or path.name.startswith("."):
                continue  # a manifest, or a save in progress
            manifest = read_library_manifest(path)
            step = manifest.get("step") if manifest else None
            candidates.append((step if isinstance(step, int) else -1, path))
        found = newest_verified(candidates, self.record)
        return None if found is None else found[1]

    def preflight(
        self,
        parameters: int,
        weights_bytes: int,
        trainable_bytes: int,
        optimizer: str,
        batch: str,
    ) -> dict[str, Any]:
        """Before the first step: what the model holds before any activation (weights, their
        gradients, the optimizer's state), against the budget; printed once and recorded as a
        ``preflight`` event. Exit 3 when that alone exceeds the budget: it does not fit even at
        micro-batch 1. Activations are not estimated here (that needs the model's family or a
        probe: `steadytrain plan`)."""
        states = OPTIMIZER_STATES.get(optimizer.lower().split("_")[0], 2)
        static = weights_bytes + trainable_bytes + states * trainable_bytes
        budget = self.device.memory().budget
        info = {
            "parameters": parameters,
            "weights": weights_bytes,
            "gradients": trainable_bytes,
            "optimizer_state": states * trainable_bytes,
            "optimizer": optimizer,
            "before_activations": static,
            "budget": budget,
            "batch": batch,
        }
        self.record("preflight", info)
        line = (
            f"steadytrain: before the start: {parameters:,} parameters; weights "
            f"{format_bytes(weights_bytes)}, gradients {format_bytes(trainable_bytes)}, "
            f"{optimizer} state {format_bytes(states * trainable_bytes)}: "
            f"{format_bytes(static)} before activations, budget {format_bytes(budget)}; {batch}"
        )
        print(line, file=sys.stderr, flush=True)
        if budget and static > budget:
            self.finish("does not fit even at micro-batch 1", DOES_NOT_FIT)
            print(
                f"steadytrain: does not fit: {format_bytes(static)} before any activation is "
                f"more than the budget of {format_bytes(budget)}; a smaller model, LoRA (fewer "
                "trainable parameters), SGD instead of Adam or lower precision would help",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(DOES_NOT_FIT)
        return info

    def allowance(self, phase: str):
        """`with guard.allowance("checkpoint save"):` a long operation gets the save limit."""
        return watchdog_module.allowance(phase)

    @property
    def stop_requested(self) -> bool:
        """A SIGINT or SIGTERM arrived: save, then leave (exit 130 / 143)."""
        return self.control.stop_requested

    @property
    def exit_code(self) -> int:
        return self.control.stop_exit_code if self.control.stop_requested else 0

    max_micro_batch = staticmethod(max_micro_batch)


def _budget_spec(value: str | float) -> int | float:
    """`memory_budget` in the one grammar every setting of it uses (`12GiB`, `0.8`, `auto`)."""
    try:
        return budget_spec(value)
    except ValueError as exc:
        raise BadInputError(f"memory_budget: {exc}") from None


def _saved_model_config(path: Path) -> bool:
    """True when `path` is a model's config.json (a plain file naming a ``model_type``), as
    Hugging Face's ``save_model()`` leaves in ``output_dir``: not the guard's to replace."""
    if path.is_symlink() or not path.is_file():
        return False  # a link is refused by the writer, naming it
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("model_type"), str)
