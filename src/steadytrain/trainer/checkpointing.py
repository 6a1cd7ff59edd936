"""`Checkpointing`: what a run keeps in a checkpoint and how a fit starts from one, the way
torchtitan's trainer builds its checkpointer and hands it its parts. Built once from the config,
the program and the run's parts, it holds the run's stateful objects by name and its identity
(`steadytrain.checkpoint.RunState`) and the run's store; `resume()` loads the newest verified
checkpoint (or starts fresh) and applies the supervisor's micro-batch cap; `writer()` is the
checkpoint writer the loop's callbacks call."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steadytrain.checkpoint.host import HostBuffers
from steadytrain.checkpoint.identity import run_identity
from steadytrain.checkpoint.ranks import Ranks, RankStore, RngState
from steadytrain.checkpoint.run_state import Resumed, RunState
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
from steadytrain.config import TrainConfig
from steadytrain.engine.sampler import SeededFetch
from steadytrain.errors import CheckpointError
from steadytrain.events import TrainState
from steadytrain.run import files as run_files
from steadytrain.run.records import Record
from steadytrain.safety.supervised import micro_cap_from_supervisor
from steadytrain.safety.watchdog import allowance, startup_phase
from steadytrain.trainer.data import order_identity
from steadytrain.trainer.parts import RunParts
from steadytrain.trainer.program import Program

RecordFn = Callable[[str, dict], None]


class Checkpointing:
    """The checkpoints of one fit. Building it reads the run's identity (its data fingerprint
    reads samples); what that fingerprint checks by type only is in `notes`. `record` writes
    the resume's records into events.jsonl."""

    def __init__(self, cfg: TrainConfig, program: Program, parts: RunParts, record: RecordFn):
        self.cfg, self.program, self.parts, self.record = cfg, program, parts, record
        self.notes: list[str] = []
        self.run_state = self._run_state()
        self.store = CheckpointStore(
            cfg.run_dir, cfg.keep_last, log=record, required=REQUIRED_FILES
        )

    def resume(self) -> Resumed | None:
        """The newest verified checkpoint loaded into the fresh objects, if there is one (None:
        a fresh start); the memory savers in force; the supervisor's micro-batch cap applied."""
        parts, record = self.parts, self.record
        with startup_phase("checkpoint load"):
            found = self.run_state.resume(self.store, self.cfg.resume_overrides, record)
        if found is not None:
            for difference in found.overridden:
                record(Record.RESUME_OVERRIDE, {"step": found.step, "change": difference})
            if self.run_state.ranks.rng_note is not None:
                record(Record.NOTE, {"step": found.step, "message": self.run_state.ranks.rng_note})
            record(
                Record.RESUME,
                {
                    "step": found.step,
                    "checkpoint": found.path.name,
                    "micro_batch_size": parts.state.micro_batch_size,
                },
            )
        parts.savers.start(resumed=found is not None)
        cap = micro_cap_from_supervisor()
        if cap is not None and cap < parts.state.micro_batch_size:
            reason = f"{run_files.ENV_MAX_MICRO_BATCH}={cap} (supervisor)"
            record(
                Record.MICRO_BATCH_CAP,
                {"old": parts.state.micro_batch_size, "new": cap, "reason": reason},
            )
            parts.state.micro_batch_size = cap
        return found

    def writer(
        self, record: RecordFn, probe_next_loss: Callable[[TrainState], float | None]
    ) -> CheckpointWriter:
        """The checkpoint writer: every save_every_steps, in the background where it may. Each
        checkpoint holds the next step's loss from `probe_next_loss`, which a resume from it
        must reproduce (`ContinuityCheck`)."""
        cfg, parts, host = self.cfg, self.parts, HostBuffers()

        def capture(state: TrainState, copy: bool = True) -> Payload:
            # Sharded, a probe's forward gathers: an out-of-memory in it would strand the ranks.
            next_loss = None if parts.group.sharded else probe_next_loss(state)
            return self.run_state.capture(next_loss, host, copy)

        async_save = cfg.async_save if cfg.async_save != "auto" else cfg.keep_last >= 2
        async_save = async_save and not parts.group.active  # every rank writes: collective saves
        main = parts.group.is_main  # rank 0 commits; the others write into its staging folder
        best = None
        if cfg.keep_best:
            best = (
                CheckpointStore(Path(cfg.run_dir) / "best", 1, log=record) if main else RankStore()
            )
        return CheckpointWriter(
            self.store if main else RankStore(),
            capture,
            cfg.save_every_steps,
            async_save,
            record,
            best=best,
            room=copy_room(parts.device, lambda: _copy_bytes(parts.model, parts.optimizer)),
            allowance=allowance,
        )

    def _run_state(self) -> RunState:
        """What a checkpoint holds: the run's stateful objects by name (checkpoint/state.py),
        one rank or many, and the run's identity (its data fingerprint reads samples)."""
        parts, program = self.parts, self.program
        identity = self._identity()
        ranks = Ranks(parts.group.rank, parts.group.world_size, parts.group.sharded)
        device = parts.device.torch_device
        states = {
            "model": ModelState(parts.model),
            "optimizer": ObjectState(OPTIMIZER_FILE, parts.optimizer, "opt", buffered=True),
            "scheduler": ObjectState(SCHEDULER_FILE, parts.scheduler, "scheduler"),
            "scaler": ObjectState(SCALER_FILE, parts.precision.scaler, "scaler", optional=True),
            "train_state": TrainStateState(parts.state),
            "rng": RngState(ranks),
            "data_order": DataOrderState(parts.sampler),
            "user_state": UserStates(program.user_state, device),
            "callbacks": UserStates(
                stateful_callbacks(program.callbacks),
                device,
                "your callbacks' state (callbacks=)",
                CALLBACKS_FILE,
            ),
        }
        if parts.scheduler is None:
            del states["scheduler"]
        if parts.precision.scaler is None:
            del states["scaler"]
        return RunState(states, identity, ranks)

    def _identity(self) -> dict[str, Any]:
        """The run's identity; what the data fingerprint checks by type only goes to notes."""
        cfg, program, parts = self.cfg, self.program, self.parts
        settings = {"effective_batch_size": cfg.effective_batch_size, "seed": cfg.seed}
        settings |= order_identity(program.data, cfg)
        settings["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        if program.user_state:
            settings["user_state"] = sorted(program.user_state)
        data = SeededFetch(program.data.dataset)
        return run_identity(
            parts.model, parts.optimizer, parts.scheduler, data, settings, self.notes
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


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """Where a rerun of the run in `run_dir` starts: the step of its newest committed checkpoint,
    0 when none was saved yet; None when its checkpoints folder cannot be read."""
    try:
        committed = CheckpointStore(run_dir).committed()
    except (CheckpointError, OSError):
        return None
    return committed[-1][0] if committed else 0
