"""The public `Trainer`: puts the device, precision, data, step runner, loop and the default
callbacks together from the config, and runs them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from steadytrain import run_files
from steadytrain.checkpoint.continuity import ContinuityCheck
from steadytrain.checkpoint.state import (
    stateful_callbacks,
)
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.checkpoint.writer import full_disk_ends_the_run
from steadytrain.config import TrainConfig, offload_problem
from steadytrain.default_callbacks import DefaultCallbacks, RecordAtStart, record_and_show
from steadytrain.device import Device, resolve_device, seed_everything
from steadytrain.engine import Loop, OptimizerBatchSampler, StepRunner, resolve_precision
from steadytrain.engine.accumulation import check_takes
from steadytrain.engine.compiling import (
    check_compiler,
    compile_blocks,
    compile_wanted,
    eager_stance,
)
from steadytrain.engine.distributed import Group, name_waits
from steadytrain.engine.evaluation import EvalFn, loss_metrics, takes_metric
from steadytrain.engine.sampler import SeededFetch
from steadytrain.engine.sharding import choose, shard
from steadytrain.engine.workers import owned_worker_init
from steadytrain.errors import (
    BadInputError,
    ConfigError,
    RankOutOfMemory,
    SteadytrainError,
    Stopped,
    UserCodeError,
)
from steadytrain.events import Callback, Control, Dispatcher, TrainState, check_callbacks
from steadytrain.memory.savers import MemorySavers
from steadytrain.safety.failure_record import keep_traceback, record_exit, record_failure
from steadytrain.safety.lock import RunLock
from steadytrain.safety.supervised import announce_run_dir, savers_from_supervisor
from steadytrain.safety.watchdog import startup_phase, waiting_in
from steadytrain.telemetry.console import console_callback
from steadytrain.telemetry.cpu import CpuContention
from steadytrain.telemetry.tensorboard import TensorBoardLog
from steadytrain.trainer_checkpoint import ChangedAfterSave, TrainerCheckpoint
from steadytrain.trainer_passes import TrainerPasses
from steadytrain.trainer_program import BatchDependentModelWarning as BatchDependentModelWarning
from steadytrain.trainer_program import (
    RunParts,
    arithmetic_event,
    budget_note,
    build_optimizer,
    check_evaluation,
    check_model,
    check_order_fits,
    data_source,
    dropout_note,
    make_evaluation,
    make_sampler,
    make_scheduler,
    warn_if_batch_dependent,
)
from steadytrain.user_state import check_user_state

OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class FitResult:
    """What `fit()` did. `exit_code` follows DESIGN.md (0 finished, 130/143 stopped by a signal:
    then `fit()` raises `steadytrain.Stopped` carrying this result)."""

    steps: int
    final_loss: float | None
    micro_batch_size: int
    reason: str
    exit_code: int
    run_dir: str
    checkpoint: str | None = None
    oom_count: int = 0


class Trainer(TrainerCheckpoint, TrainerPasses):
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
        self.model, self.loss_fn, self.scheduler = check_model(model), loss_fn, scheduler
        self._optimizer = optimizer
        self.user_callbacks = list(callbacks)
        self.data = data_source(train_data, collate_fn, self.config)
        self.dataset, self.collate_fn = self.data.dataset, self.data.collate_fn
        self.workers, self.worker_init_fn = self.data.workers, self.data.worker_init_fn
        self.eval_data = (
            None if eval_data is None else data_source(eval_data, collate_fn, None, "eval_data")
        )
        self.eval_fn = eval_fn
        check_takes(loss_fn, ("model", "batch"), "loss_fn")
        if eval_fn is not None:
            check_takes(eval_fn, ("model", "batches"), "eval_fn")
        self.user_state = check_user_state(user_state)
        carried = [s for s in self.user_state.values() if isinstance(s, Callback)]
        check_callbacks([*self.user_callbacks, *carried])  # each on_* method names an event
        self._notes: list[str] = []
        self._distributed: dict[str, Any] = {}  # the mode `_set_up` chose (engine/sharding.py)
        self._stopped_by: str | None = None  # the signal that stopped the last fit ("SIGTERM")
        self.after_identity_check: list[Callable[[Path], None]] = []
        """Called with the run directory once it is locked and its checkpoint, if any, is known
        to be this run's (loaded), before the run writes anything else: a caller's own files
        (the fine-tune's training_config.json and training.log) are written only then."""

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
                record_failure(own_dir, exc)
            record_exit(own_dir, exc, group.describe())
            if isinstance(exc, RankOutOfMemory):
                group.leave(exc)  # at once: the other ranks wait in a collective
            if isinstance(exc, KeyboardInterrupt):  # before the loop took SIGINT over
                raise self._stopped_before_the_loop(run_dir, FitResult) from None
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
            raise theirs from exc
        finally:
            group.close()
        if self._stopped_by is not None:  # the checkpoint is committed, the lock released
            raise Stopped(self._stopped_by, result)
        return result

    def _fit(self, run_dir: Path, group: Group) -> FitResult:
        as_found = _AsFound(group.own_dir(run_dir))
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

    def _fit_locked(self, run_dir: Path, group: Group, as_found: _AsFound) -> FitResult:
        cfg = self.config
        console = console_callback(cfg, errors_only=not group.is_main)  # one progress display
        defaults = DefaultCallbacks(
            cfg, group.own_dir(run_dir), lambda files: record_and_show(files, console),
            rank=group.rank, world_size=group.world_size,
        )  # fmt: skip
        files, record, watchdog = defaults.files, defaults.record, defaults.watchdog
        # Watched from here: the set-up (the parameters' broadcast, where a communicator is set
        # up) and each start-up phase have a heartbeat, a name and a limit; a rank's report
        # names it and the collective it waits in (name_waits)
        watchdog.say = lambda text: console.note("hang_watch", {"message": text})
        name_waits(waiting_in)
        watchdog.start(None, "set-up")
        try:
            run = self._set_up(group)
            watchdog.set_up_done(run.state, run.device, "data fingerprint")
            tensorboard = TensorBoardLog.from_config(cfg, run_dir) if group.is_main else None
            compiled = compile_wanted(cfg.compile, run.device.type)
            if compiled:
                check_compiler(run.device.type)
            store, expected_loss = self._resume_or_start(run, files)
            if run.resumed and run.state.step >= run.state.max_steps:
                return _already_finished(run.state, store, run_dir)
            if group.is_main:
                cfg.dump(run_dir / run_files.CONFIG)
            planned = RecordAtStart(record)
            eager = eager_stance() if compiled else None
            if eager:  # before the plan: its probe runs eager, its finalists compiled
                with startup_phase("compile"):
                    compile_event = compile_blocks(run.model, run.device.type)
            if not run.resumed and cfg.micro_batch_size == "auto" and not run.group.sharded:
                with startup_phase("plan"):
                    planned.events = self._plan(run, compiled, eager)
            elif not run.resumed and cfg.micro_batch_size == "auto":
                self._notes.append(_UNPLANNED_SHARDS)
            # the savers the supervisor asks for after an OS kill (after the plan: fewer there)
            savers_from_supervisor(run.savers, files.record, run.state.step)
            if compiled and not eager:  # after the plan: its probe measures eager passes
                with startup_phase("compile"):
                    compile_event = compile_blocks(run.model, run.device.type)
            if compiled:
                planned.events.append(("compile", compile_event))
            notes = [*self._notes, dropout_note(run.model, cfg), budget_note(run.device)]
            planned.events += [("note", {"message": n}) for n in notes if n is not None]
            arithmetic = arithmetic_event(
                cfg, self.data, run.sampler, run.state, run.precision.name, run.group.world_size
            )
            planned.events.append(("arithmetic", arithmetic))
            run.emit.callbacks[:] = self._callbacks(
                run, defaults, store, expected_loss, [console, tensorboard], planned
            )
            as_found.started = True
            reason, code = self._loop(run).run()
            self._stopped_by = defaults.stopped_by(code)
            return _result(run.state, reason, code, run_dir, store)
        finally:  # both ended at fit_end already; this covers a refusal before it
            watchdog.stop()
            files.close()

    def _set_up(self, group: Group) -> RunParts:
        """Device, precision, model, optimizer, scheduler, sampler, the fresh state, the memory
        savers and the step runner: everything before a checkpoint is looked for."""
        cfg = self.config
        device = _resolve_device(cfg, group)
        group = group.on(device.torch_device)
        precision = resolve_precision(cfg.precision, device)
        if cfg.seed is not None:  # null: the RNG streams as the program left them
            seed_everything(cfg.seed + group.rank)  # each rank its own dropout masks
        model = self.model.to(device.torch_device)
        group = self._place(model, group, device.budget)
        model.train()
        optimizer = build_optimizer(self._optimizer, model)
        scheduler = make_scheduler(self.scheduler, optimizer)
        check_evaluation(cfg, scheduler, self.eval_data, self.eval_fn)
        sampler = self._sampler()
        check_order_fits(self.data, sampler, device.budget)
        group.check_batches(sampler)
        warn_if_batch_dependent(model, cfg)
        state = TrainState(
            steps_per_epoch=sampler.steps_per_epoch,
            max_steps=cfg.max_steps or cfg.epochs * sampler.steps_per_epoch,
            effective_batch_size=cfg.effective_batch_size,
            micro_batch_size=(
                cfg.effective_batch_size if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
            ),
        )
        savers = MemorySavers(
            model, self.loss_fn, state, cfg.activation_checkpointing, device.discrete_memory
        )
        emit = Dispatcher([], state, Control())
        runner = StepRunner(
            model=model,
            optimizer=optimizer,
            loss_fn=self.loss_fn,
            device=device,
            precision=precision,
            state=state,
            emit=emit,
            scheduler=None if takes_metric(scheduler) else scheduler,  # evaluation steps it
            max_grad_norm=cfg.max_grad_norm,
            savers=savers,
            user_state=self.user_state,
            group=group,
        )
        return RunParts(
            device,
            precision,
            model,
            optimizer,
            sampler,
            state,
            savers,
            runner,
            emit,
            group,
            scheduler=scheduler,
        )

    def _place(self, model: torch.nn.Module, group: Group, budget: int | None) -> Group:
        """Every rank starts from rank 0's model; then it is replicated or sharded (the
        `distributed` field, engine/sharding.py), before the optimizer takes its parameters."""
        group.broadcast_module(model)
        self._distributed = choose(self.config.distributed, model, group, budget)
        if self._distributed["mode"] != "fsdp":
            return group
        self._distributed |= shard(model, group)
        return dataclasses.replace(group, sharded=True)

    def _sampler(self) -> OptimizerBatchSampler:
        cfg = self.config
        sampler = make_sampler(self.data, cfg)
        if sampler.steps_per_epoch == 0:
            raise BadInputError(
                f"train_data: {len(self.dataset)} sample(s), fewer than one optimizer batch of "
                f"effective_batch_size {cfg.effective_batch_size}; lower effective_batch_size "
                "or set drop_last: false"
            )
        return sampler

    def _callbacks(
        self,
        run: RunParts,
        defaults: DefaultCallbacks,
        store: CheckpointStore,
        expected_loss: float | None,
        display: list,
        planned: RecordAtStart,
    ) -> list[Callback]:
        """The default callbacks and the user's, in the dispatch order of
        `steadytrain.default_callbacks` (which says why): those that keep state in the
        checkpoint (the program's `user_state` that are callbacks, then the callbacks with
        state, `stateful_callbacks`) just before the checkpoint writer, so a save holds their
        state after the step it saves; the others last, after the save is committed."""
        cfg, state, record = self.config, run.state, defaults.record
        continuity = None
        if expected_loss is not None:
            continuity = ContinuityCheck(
                expected_loss,
                state.micro_batch_size,
                run.device.type,
                record,
                strict=cfg.continuity_strict,
            )
        carried = [s for s in self.user_state.values() if isinstance(s, Callback)]
        stateful = [*carried, *stateful_callbacks(self.user_callbacks).values()]
        user = [c for c in self.user_callbacks if all(c is not s for s in stateful)]
        watch = ChangedAfterSave(self.user_state, user)
        defaults.watch_memory(run.device)
        return defaults.in_order(
            cpu=CpuContention.from_config(cfg, run.device, record),
            before_save=stateful,
            writer=self._writer(run, store, record),
            continuity=continuity,
            display=display,
            at_start=planned,
            user=[*watch.before, *user, *watch.after],
        )

    def _loop(self, run: RunParts) -> Loop:
        cfg = self.config
        return Loop(
            runner=run.runner,
            emit=run.emit,
            batches=lambda epoch, start: self._batches(
                run.sampler, epoch, start, run.device, run.group
            ),
            time_every=cfg.log_every_steps,
            evaluation=make_evaluation(
                cfg,
                run.runner,
                run.scheduler,
                self.eval_data,
                self.eval_fn or loss_metrics(self.loss_fn),
            ),
            fit_info={
                "device": str(run.device.torch_device),
                "device_skipped": list(run.device.skipped),
                "precision": run.precision.name,
                "budget": run.device.budget,
                "micro_batch_size": run.state.micro_batch_size,
                "resumed_from": run.state.step if run.resumed else None,
                "process_group": run.group.describe(),
                "distributed": self._distributed,
                "config": cfg.model_dump(mode="json"),
            },
        )

    def _batches(
        self, sampler: OptimizerBatchSampler, epoch: int, start: int, device, group: Group
    ) -> DataLoader:
        sampler.set_position(epoch, start)
        return DataLoader(
            SeededFetch(self.dataset),
            batch_sampler=group.shares(sampler),
            collate_fn=self.collate_fn,
            num_workers=self.workers,
            worker_init_fn=owned_worker_init(self.worker_init_fn),  # they outlive a stop signal
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed((self.config.seed or 0) * 7919 + epoch),
        )


_UNPLANNED_SHARDS = (
    "micro_batch_size auto under distributed: fsdp starts at each rank's whole share without "
    "trial passes (their all-gathers would need every rank to try the same sizes); an "
    "out-of-memory exits 76 and `steadytrain run` restarts the group at a smaller micro-batch"
)


class _AsFound:
    """What a start refused for bad input (exit 2) puts back before the loop has started: the
    lock file and the folders the start made (the run directory, those on the way to it,
    hangs/) while they are empty, so a fresh run directory is not left behind and one with an
    earlier run is as it was."""

    def __init__(self, run_dir: Path):
        self.lock_path = run_dir / run_files.LOCK
        self.had_lock = os.path.lexists(self.lock_path)
        on_the_way = [run_dir / run_files.HANGS, run_dir, *run_dir.parents]
        self.made = [f for f in on_the_way if not os.path.lexists(f)]  # the deepest first
        self.started = False  # the loop has started: what the run did is its record

    def unlock(self, lock: RunLock) -> None:
        """The lock file this start made, removed while it is still held (POSIX: released
        after; elsewhere the release removes it)."""
        if not self.started and not self.had_lock and os.name == "posix":
            with contextlib.suppress(OSError):
                os.unlink(lock.path)

    def put_back(self) -> None:
        for folder in [] if self.started else self.made:
            with contextlib.suppress(OSError):  # not empty: left as it is
                os.rmdir(folder)


def _resolve_device(cfg: TrainConfig, group: Group) -> Device:
    """This rank's device, refusing what the config asks that it cannot do: offloaded
    checkpointing where host memory is the device's memory."""
    device = resolve_device(group.device_name(cfg.device), cfg.budget_bytes_or_fraction())
    if cfg.activation_checkpointing == "offload" and not device.discrete_memory:
        raise ConfigError([offload_problem(device.type)])
    return device


def _result(
    state: TrainState, reason: str, code: int, run_dir: Path, store: CheckpointStore
) -> FitResult:
    committed = store.committed()
    checkpoint = str(committed[-1][1]) if committed else None
    return FitResult(
        state.step, state.last_loss, state.micro_batch_size, reason, code, str(run_dir),
        checkpoint, state.oom_count,
    )  # fmt: skip


def _already_finished(state: TrainState, store: CheckpointStore, run_dir: Path) -> FitResult:
    """A run whose checkpoint is already at max_steps: nothing to train, and it says so."""
    print(
        f"steadytrain: {run_dir} is already finished: its checkpoint {store.committed()[-1][1].name}"
        f" is at step {state.step} of {state.max_steps}; nothing to train (the model holds its "
        "weights). To train further, raise max_steps or epochs (the run resumes from there); to "
        "start over, use a new run_dir.",
        file=sys.stderr,
        flush=True,
    )
    return _result(state, "already finished", 0, run_dir, store)
