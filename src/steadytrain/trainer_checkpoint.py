"""What the `Trainer` keeps in a checkpoint and how a fit starts from one: the run's stateful
objects by name and its identity (`steadytrain.checkpoint.RunState`), the newest verified
checkpoint loaded (or a fresh start) with the supervisor's micro-batch cap, and the checkpoint
writer."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steadytrain import run_files
from steadytrain.checkpoint.host import HostBuffers
from steadytrain.checkpoint.identity import run_identity
from steadytrain.checkpoint.ranks import Ranks, RankStore, RngState
from steadytrain.checkpoint.run_state import RunState
from steadytrain.checkpoint.state import (
    CALLBACKS_FILE,
    OPTIMIZER_FILE,
    REQUIRED_FILES,
    SCALER_FILE,
    SCHEDULER_FILE,
    DataOrderState,
    ModelState,
    ObjectState,
    TrainStateState,
    UserStates,
    model_tensors_names,
    stateful_callbacks,
)
from steadytrain.checkpoint.store import CheckpointStore, Payload
from steadytrain.checkpoint.writer import CheckpointWriter, copy_room
from steadytrain.engine.sampler import SeededFetch
from steadytrain.errors import SIGNAL_EXITS, BadInputError, Stopped
from steadytrain.events import Callback, TrainState
from steadytrain.safety.supervised import (
    micro_cap_from_supervisor,
)
from steadytrain.safety.watchdog import allowance, startup_phase
from steadytrain.telemetry.files import RunFiles
from steadytrain.trainer_program import (
    RunParts,
    order_identity,
)


class TrainerCheckpoint:
    """These methods of `Trainer`, in their own module: they read its config, data,
    user_state, callbacks and after_identity_check (and the resume probe, `TrainerPasses`)."""

    def _stopped_before_the_loop(self, run_dir: Path, fit_result: Callable[..., Any]) -> Stopped:
        """Ctrl-C while the loop's handler is not in place (the set-up, the resume, the plan's
        probes, compiling; or the end, after it): nothing of a step to save. It ends `fit()` as a
        Ctrl-C in the loop does, with `steadytrain.Stopped` (130), so a program's own
        `except KeyboardInterrupt` does not carry on as if training had finished; its result
        names the checkpoint the next start resumes from, if any."""
        committed: list[tuple[int, Path]] = []
        with contextlib.suppress(OSError):  # a folder it cannot read: said as a new start
            committed = CheckpointStore(run_dir).committed()
        step, folder = committed[-1] if committed else (0, None)
        print(
            f"\nsteadytrain: SIGINT outside the training steps: nothing new to save; the next "
            f"start begins at step {step}; exiting with {SIGNAL_EXITS['SIGINT']}",
            file=sys.stderr,
            flush=True,
        )
        size = self.config.micro_batch_size
        result = fit_result(
            step, None, size if isinstance(size, int) else 0, "stopped by SIGINT outside the "
            "training steps", SIGNAL_EXITS["SIGINT"], str(run_dir), folder and str(folder),
        )  # fmt: skip
        return Stopped("SIGINT", result, saved=False)

    def _run_state(self, run: RunParts) -> RunState:
        """What a checkpoint holds: the run's stateful objects by name (checkpoint/state.py),
        one rank or many, and the run's identity (its data fingerprint reads samples)."""
        identity = self._identity(run.model, run.optimizer, run.scheduler)
        ranks = Ranks(run.group.rank, run.group.world_size, run.group.sharded)
        states = {
            "model": ModelState(run.model),
            "optimizer": ObjectState(OPTIMIZER_FILE, run.optimizer, "opt", buffered=True),
            "scheduler": ObjectState(SCHEDULER_FILE, run.scheduler, "scheduler"),
            "scaler": ObjectState(SCALER_FILE, run.precision.scaler, "scaler", optional=True),
            "train_state": TrainStateState(run.state),
            "rng": RngState(ranks),
            "data_order": DataOrderState(run.sampler),
            "user_state": UserStates(self.user_state, run.device.torch_device),
            "callbacks": UserStates(
                stateful_callbacks(self.user_callbacks),
                run.device.torch_device,
                "your callbacks' state (callbacks=)",
                CALLBACKS_FILE,
            ),
        }
        if run.scheduler is None:
            del states["scheduler"]
        if run.precision.scaler is None:
            del states["scaler"]
        return RunState(states, identity, ranks)

    def _identity(self, model, optimizer, scheduler) -> dict[str, Any]:
        """The run's identity; what the data fingerprint checks by type only goes to _notes."""
        cfg = self.config
        settings = {"effective_batch_size": cfg.effective_batch_size, "seed": cfg.seed}
        settings |= order_identity(self.data, cfg)
        settings["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        if self.user_state:
            settings["user_state"] = sorted(self.user_state)
        self._notes = []
        data = SeededFetch(self.dataset)
        return run_identity(model, optimizer, scheduler, data, settings, self._notes)

    def _resume_or_start(
        self, run: RunParts, files: RunFiles
    ) -> tuple[CheckpointStore, float | None]:
        """The run's checkpoint states (`_run_state`) and store; the newest verified checkpoint
        loaded into the fresh objects, if there is one; the memory savers in force; the
        supervisor's micro-batch cap applied; then `after_identity_check`. Returns the store
        and the loss the first resumed step must reproduce (None: nothing to check)."""
        cfg = self.config
        run.checkpoint = self._run_state(run)
        store = CheckpointStore(
            cfg.run_dir, cfg.keep_last, log=files.record, required=REQUIRED_FILES
        )
        with startup_phase("checkpoint load"):
            found = run.checkpoint.resume(store, cfg.resume_overrides, files.record)
        if found is not None:
            for difference in found.overridden:
                files.record("resume_override", {"step": found.step, "change": difference})
            if run.checkpoint.ranks.rng_note is not None:
                files.record("note", {"step": found.step, "message": run.checkpoint.ranks.rng_note})
            files.record(
                "resume",
                {
                    "step": found.step,
                    "checkpoint": found.path.name,
                    "micro_batch_size": run.state.micro_batch_size,
                },
            )
        run.resumed = found is not None
        run.savers.start(resumed=run.resumed)
        cap = micro_cap_from_supervisor()
        if cap is not None and cap < run.state.micro_batch_size:
            reason = f"{run_files.ENV_MAX_MICRO_BATCH}={cap} (supervisor)"
            files.record(
                "micro_batch_cap", {"old": run.state.micro_batch_size, "new": cap, "reason": reason}
            )
            run.state.micro_batch_size = cap
        for confirmed in self.after_identity_check:  # locked, and the checkpoint is this run's
            confirmed(Path(cfg.run_dir))
        return store, found.expected_loss if found is not None else None

    def _writer(self, run: RunParts, store: CheckpointStore, record) -> CheckpointWriter:
        """The checkpoint writer: every save_every_steps, in the background where it may."""
        cfg, host = self.config, HostBuffers()

        def capture(state: TrainState, copy: bool = True) -> Payload:
            # Sharded, a probe's forward gathers: an out-of-memory in it would strand the ranks.
            next_loss = None if run.group.sharded else self._probe_next_loss(run, state)
            return run.checkpoint.capture(next_loss, host, copy)

        async_save = cfg.async_save if cfg.async_save != "auto" else cfg.keep_last >= 2
        async_save = async_save and not run.group.active  # every rank writes: collective saves
        main = run.group.is_main  # rank 0 commits; the others write into its staging folder
        return CheckpointWriter(
            store if main else RankStore(),
            capture,
            cfg.save_every_steps,
            async_save,
            record,
            best=(
                CheckpointStore(Path(cfg.run_dir) / "best", 1, log=record) if main else RankStore()
            )
            if cfg.keep_best
            else None,
            room=copy_room(run.device, lambda: _copy_bytes(run.model, run.optimizer)),
            allowance=allowance,
        )


def _copy_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What a background save adds to the next step's memory: the copy of what a checkpoint
    holds (the model's saved tensors, the optimizer state), held while that step allocates its
    gradients again."""
    names = set(model_tensors_names(model))
    tensors = [v for k, v in model.state_dict().items() if k in names]
    for slot in optimizer.state.values():
        tensors += [v for v in slot.values() if isinstance(v, torch.Tensor)]
    tensors += [p for p in model.parameters() if p.requires_grad]  # the gradients
    return sum(t.numel() * t.element_size() for t in tensors)


class ChangedAfterSave:
    """Finds state of `user_state` that one of the program's plain callbacks changes at a step's
    end: those run after the step's checkpoint has taken the state (default_callbacks.py), so a
    resume would start from the state before that change. An EMA of the weights updated in
    such a callback's `on_step_end` is the common case: the run went on while every resume lost
    an update. `before` (the first of those callbacks) marks the state as the checkpoint took
    it, `after` (the last) compares; a change stops the run (exit 2), naming the state, the
    callbacks and the fix. The marks are the tensors' version counters (bumped by every
    in-place change) and the other values themselves: a few numbers a tensor, each step."""

    def __init__(self, states: dict[str, Any], callbacks: list[Any]):
        self.states = states
        self.callbacks = [
            type(c).__name__
            for c in callbacks
            if getattr(type(c), "on_step_end", None) is not Callback.on_step_end
        ]
        self.taken: dict[str, Any] = {}
        watched = bool(states and self.callbacks)  # else nothing after the save can change it
        self.before = [_Hook(self._take)] if watched else []
        self.after = [_Hook(self._compare)] if watched else []

    def _marks(self) -> dict[str, Any]:
        return {name: _marks(obj.state_dict()) for name, obj in self.states.items()}

    def _take(self, state: TrainState) -> None:
        self.taken = self._marks()

    def _compare(self, state: TrainState) -> None:
        now = self._marks()
        changed = [name for name, marks in self.taken.items() if now[name] != marks]
        if changed:
            names = ", ".join(repr(name) for name in changed)
            which = ", ".join(self.callbacks)
            raise BadInputError(
                f"user_state: {names} changed at the end of step {state.step} after the "
                f"checkpoint took it, in a callback that runs after the save ({which}): a "
                "resume would start from the state before that change and train otherwise than "
                "the run that went on. Make the code that changes it run before the save: give "
                "that callback state_dict() and load_state_dict() (its state, the EMA's) or pass "
                "it in user_state instead of callbacks; see docs/porting.md, 'State your model "
                "or loss carries across steps'"
            )


def _marks(value: Any) -> Any:
    """What changes when `value` (a state_dict) changes: a tensor's version, a container's
    parts, any other value as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value._version)
    if isinstance(value, dict):
        return {key: _marks(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_marks(item) for item in value]
    return repr(value)


class _Hook(Callback):
    def __init__(self, call):
        self.call = call

    def on_step_end(self, state: TrainState, control: Any, info: dict[str, Any]) -> None:
        self.call(state)
