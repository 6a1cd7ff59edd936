"""The public `Trainer` and its `fit()`: the assembly of a run, readable in one sequence.

The Trainer builds each component of a run once, from the config and what the program gave, and
hands it its parts: the run's parts (`build_parts`), the checkpointing, the side passes, the
default callbacks, the loop. No component reads another's attributes; the order in which they
are called is `_fit_locked`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from steadytrain.checkpoint.continuity import ContinuityCheck
from steadytrain.checkpoint.run_state import Resumed
from steadytrain.checkpoint.state import stateful_callbacks
from steadytrain.checkpoint.writer import CheckpointWriter, full_disk_ends_the_run
from steadytrain.config import TrainConfig
from steadytrain.engine import Loop
from steadytrain.engine.compiling import (
    check_compiler,
    compile_blocks,
    compile_wanted,
    eager_stance,
)
from steadytrain.engine.distributed import Group, name_waits
from steadytrain.engine.evaluation import EvalFn, loss_metrics
from steadytrain.errors import (
    BadInputError,
    RankOutOfMemory,
    SteadytrainError,
    Stopped,
    UserCodeError,
)
from steadytrain.events import Callback
from steadytrain.run import files as run_files
from steadytrain.run.records import Record
from steadytrain.safety.failure_record import keep_traceback, record_exit, record_failure
from steadytrain.safety.lock import RunLock
from steadytrain.safety.supervised import announce_run_dir, savers_from_supervisor
from steadytrain.safety.watchdog import startup_phase, waiting_in
from steadytrain.telemetry.console import console_callback
from steadytrain.telemetry.cpu import CpuContention
from steadytrain.telemetry.tensorboard import TensorBoardLog
from steadytrain.trainer.as_found import AsFound
from steadytrain.trainer.callbacks import DefaultCallbacks, RecordAtStart, record_and_show
from steadytrain.trainer.changed_after_save import ChangedAfterSave
from steadytrain.trainer.checkpointing import Checkpointing, newest_checkpoint_step
from steadytrain.trainer.data import loader_at
from steadytrain.trainer.evaluation import make_evaluation
from steadytrain.trainer.notes import start_events
from steadytrain.trainer.parts import RunParts, build_parts
from steadytrain.trainer.passes import Passes
from steadytrain.trainer.program import Program
from steadytrain.trainer.result import (
    FitResult,
    already_finished,
    fit_result,
    stopped_before_the_loop,
)

OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class Trainer:
    """Train `model` on `train_data` with `loss_fn(model, micro_batch)` so that the run finishes.

    `loss_fn` returns a mean loss tensor, or ``(loss_sum, count)`` for token-weighted losses.
    `optimizer` is an optimizer or a factory ``params -> optimizer`` (params: those that require
    grad); `scheduler` likewise a scheduler or a factory ``optimizer -> scheduler``, stepped once
    per optimizer step, or after each evaluation with eval_metric when its ``step()`` takes a
    metric (ReduceLROnPlateau). `train_data` is a map-style dataset or a DataLoader over one (its
    dataset, sampler order, drop_last, collate_fn and workers are used; the optimizer batch is
    effective_batch_size). `eval_data` (same kinds) is evaluated at the config's cadence with
    `eval_fn(model, micro_batches) -> {name: value}` or, without one, loss_fn's mean
    (``eval_loss``). `user_state` names objects with state_dict()/load_state_dict() that the model
    or loss carries across steps (`steadytrain.user_state`, `steadytrain.CarriedState`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerLike,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        train_data: Dataset | DataLoader,
        config: TrainConfig | dict,
        scheduler: Any = None,
        callbacks: Iterable[Callback] = (),
        collate_fn: Callable | None = None,
        eval_data: Dataset | DataLoader | None = None,
        eval_fn: EvalFn | None = None,
        user_state: Mapping[str, Any] | None = None,
    ):
        self.config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
        try:
            self.program = Program.check(
                self.config,
                model=model,
                optimizer=optimizer,
                loss_fn=loss_fn,
                train_data=train_data,
                scheduler=scheduler,
                callbacks=callbacks,
                collate_fn=collate_fn,
                eval_data=eval_data,
                eval_fn=eval_fn,
                user_state=user_state,
            )
        except UserCodeError as exc:
            exc.resumes_at = newest_checkpoint_step(Path(self.config.run_dir))
            raise
        self._stopped_by: str | None = None  # the signal that stopped the last fit ("SIGTERM")
        self.after_identity_check: list[Callable[[Path], None]] = []
        """Called with the run directory once it is locked and its checkpoint, if any, is known
        to be this run's (loaded), before the run writes anything else: a caller's own files
        (the fine-tune's training_config.json and training.log) are written only then."""

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained: after `fit()` it holds the trained weights (on the run's
        device; sharded under `distributed: fsdp`)."""
        return self.program.model

    def fit(self) -> FitResult:
        """Train to the end (or a stop request) and return what happened.

        Stopped by SIGINT or SIGTERM, it finishes the optimizer step, commits a checkpoint and
        raises `steadytrain.Stopped` (a `SystemExit` with code 130 / 143, its `result` this
        FitResult): uncaught, the process ends with that code, so the lines after `fit()` do not
        run as if training had finished. Rerunning resumes from the checkpoint."""
        run_dir = Path(self.config.run_dir)
        self._stopped_by = None
        announce_run_dir(run_dir)  # to a supervising `steadytrain run` that asked for it
        try:
            group = Group.from_env()
        except SteadytrainError:
            raise
        except Exception as exc:  # the process group's rendezvous failed (torch's own error)
            record_failure(run_dir, exc)
            raise
        own_dir = group.own_dir(run_dir)  # rank 0 holds RUN_DIR; rank N its own folder
        try:
            result = self._fit(run_dir, group)
        except (SteadytrainError, KeyboardInterrupt) as exc:
            if isinstance(exc, UserCodeError):  # raised as theirs by the loop, with its step
                exc.resumes_at = newest_checkpoint_step(run_dir)
                record_failure(own_dir, exc)
            record_exit(own_dir, exc, group.describe())
            if isinstance(exc, RankOutOfMemory):
                group.leave(exc)  # at once: the other ranks wait in a collective
            if isinstance(exc, KeyboardInterrupt):  # before the loop took SIGINT over
                raise stopped_before_the_loop(run_dir, self.config) from None
            raise
        except Exception as exc:
            ran_out = group.out_of_memory_before_steps(exc)  # under torchrun: exit 76, named
            if ran_out is not None:
                keep_traceback(own_dir, exc)
                record_exit(own_dir, ran_out, group.describe())
                group.leave(ran_out)  # at once: the other ranks wait in a collective
            theirs = record_failure(own_dir, exc)  # theirs before the loop: planning, a batch
            record_exit(own_dir, theirs or exc, group.describe())
            if theirs is None:
                raise
            theirs.resumes_at = newest_checkpoint_step(run_dir)
            raise theirs from exc
        finally:
            group.close()
        if self._stopped_by is not None:  # the checkpoint is committed, the lock released
            raise Stopped(self._stopped_by, result)
        return result

    def _fit(self, run_dir: Path, group: Group) -> FitResult:
        as_found = AsFound(group.own_dir(run_dir))
        try:  # RunLock creates its folder or says why it cannot; a full disk anywhere is exit 6
            with (
                full_disk_ends_the_run(run_dir, self.config.keep_last),
                RunLock(group.own_dir(run_dir)) as lock,
            ):
                try:
                    result = self._fit_locked(run_dir, group, as_found)
                except BadInputError:
                    as_found.unlock(lock)
                    raise
        except BadInputError:
            as_found.put_back()
            raise
        group.settle()  # a fit that ended well: no rank tears down mid-collective
        return result

    def _fit_locked(self, run_dir: Path, group: Group, as_found: AsFound) -> FitResult:
        """The run assembled and run: each component built once, handed its parts, called in
        this order."""
        cfg, program = self.config, self.program
        console = console_callback(cfg, errors_only=not group.is_main)  # one progress display
        defaults = DefaultCallbacks(
            cfg,
            group.own_dir(run_dir),
            lambda files: record_and_show(files, console),
            rank=group.rank,
            world_size=group.world_size,
        )
        files, record, watchdog = defaults.files, defaults.record, defaults.watchdog
        # Watched from here: the set-up (the parameters' broadcast, where a communicator is set
        # up) and each start-up phase have a heartbeat, a name and a limit; a rank's report
        # names it and the collective it waits in (name_waits)
        watchdog.say = lambda text: console.note("hang_watch", {"message": text})
        name_waits(waiting_in)
        watchdog.start(None, "set-up")
        try:
            parts = build_parts(cfg, program, group)
            watchdog.set_up_done(parts.state, parts.device, "data fingerprint")
            tensorboard = TensorBoardLog.from_config(cfg, run_dir) if group.is_main else None
            compiled = compile_wanted(cfg.compile, parts.device.type)
            if compiled:
                check_compiler(parts.device.type)
            checkpointing = Checkpointing(cfg, program, parts, files.record)
            passes = Passes(
                cfg, program.loss_fn, program.user_state, program.data, parts, files.record
            )
            resumed = checkpointing.resume()
            for confirmed in self.after_identity_check:  # locked; the checkpoint is this run's
                confirmed(run_dir)
            if resumed and parts.state.step >= parts.state.max_steps:
                return already_finished(parts.state, checkpointing.store, run_dir)
            if group.is_main:
                cfg.dump(run_dir / run_files.CONFIG)
            planned = RecordAtStart(record)
            notes = list(checkpointing.notes)
            eager = eager_stance() if compiled else None
            if eager:  # before the plan: its probe runs eager, its finalists compiled
                with startup_phase("compile"):
                    compile_event = compile_blocks(parts.model, parts.device.type)
            # the savers the supervisor asks for after an attempt ran out of memory at
            # micro-batch 1 (an OS kill, a rank's exit 76): in force before the plan measures
            savers_from_supervisor(parts.savers, files.record, parts.state.step)
            if not resumed and cfg.micro_batch_size == "auto":
                with startup_phase("plan"):  # under torchrun: every rank, in lockstep if sharded
                    planned.events = passes.plan(compiled, eager)
            if compiled and not eager:  # after the plan: its probe measures eager passes
                with startup_phase("compile"):
                    compile_event = compile_blocks(parts.model, parts.device.type)
            if compiled:
                planned.events.append((Record.COMPILE, compile_event))
            planned.events += start_events(cfg, program.data, parts, notes)
            writer = checkpointing.writer(record, passes.probe_next_loss)
            display = [console, tensorboard]
            parts.emit.callbacks[:] = _callbacks(
                cfg, program, parts, defaults, writer, resumed, display, planned
            )
            as_found.started = True
            reason, code = _loop(cfg, program, parts, resumed is not None).run()
            self._stopped_by = defaults.stopped_by(code)
            return fit_result(parts.state, reason, code, run_dir, checkpointing.store)
        finally:  # both ended at fit_end already; this covers a refusal before it
            watchdog.stop()
            files.close()


def _callbacks(
    cfg: TrainConfig,
    program: Program,
    parts: RunParts,
    defaults: DefaultCallbacks,
    writer: CheckpointWriter,
    resumed: Resumed | None,
    display: list,
    planned: RecordAtStart,
) -> list[Callback]:
    """The default callbacks and the user's, in the dispatch order of
    `steadytrain.trainer.callbacks` (which says why): those that keep state in the
    checkpoint (the program's `user_state` that are callbacks, then the callbacks with
    state, `stateful_callbacks`) just before the checkpoint writer, so a save holds their
    state after the step it saves; the others last, after the save is committed. A resumed
    run's first step must reproduce the loss its checkpoint expects (`ContinuityCheck`)."""
    continuity = None
    if resumed is not None and resumed.expected_loss is not None:
        continuity = ContinuityCheck(
            resumed.expected_loss,
            parts.state.micro_batch_size,
            parts.device.type,
            defaults.record,
            strict=cfg.continuity_strict,
        )
    stateful = [*program.carried_callbacks, *stateful_callbacks(program.callbacks).values()]
    user = [c for c in program.callbacks if all(c is not s for s in stateful)]
    watch = ChangedAfterSave(program.user_state, user)
    defaults.watch_memory(parts.device)
    return defaults.in_order(
        cpu=CpuContention.from_config(cfg, parts.device, defaults.record),
        before_save=stateful,
        writer=writer,
        continuity=continuity,
        display=display,
        at_start=planned,
        user=[*watch.before, *user, *watch.after],
    )


def _loop(cfg: TrainConfig, program: Program, parts: RunParts, resumed: bool) -> Loop:
    """The loop over the run's steps, with its batches, its evaluation and what fit_start
    records."""
    return Loop(
        runner=parts.runner,
        emit=parts.emit,
        batches=lambda epoch, start: loader_at(
            program.data, parts.sampler, epoch, start, parts.device, parts.group, cfg.seed
        ),
        time_every=cfg.log_every_steps,
        evaluation=make_evaluation(
            cfg,
            parts.runner,
            parts.scheduler,
            program.eval_data,
            program.eval_fn or loss_metrics(program.loss_fn),
        ),
        fit_info={
            "device": str(parts.device.torch_device),
            "device_skipped": list(parts.device.skipped),
            "precision": parts.precision.name,
            "budget": parts.device.budget,
            "micro_batch_size": parts.state.micro_batch_size,
            "resumed_from": parts.state.step if resumed else None,
            "process_group": parts.group.describe(),
            "distributed": parts.distributed,
            "config": cfg.model_dump(mode="json"),
        },
    )
