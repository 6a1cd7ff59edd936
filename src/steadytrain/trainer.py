"""The public `Trainer`: puts the device, precision, data, step runner, loop and the default
callbacks together from the config, and runs them."""
# long-module: the one place every part of a fit meets (start-up watching, disk-full); the program's own data, state and evaluation glue is in trainer_program.py

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from steadytrain import run_files
from steadytrain.checkpoint.continuity import ContinuityCheck
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
from steadytrain.checkpoint.writer import CheckpointWriter, copy_room, full_disk_ends_the_run
from steadytrain.config import TrainConfig, offload_problem
from steadytrain.default_callbacks import DefaultCallbacks
from steadytrain.device import Device, resolve_device, seed_everything
from steadytrain.engine import Loop, OptimizerBatchSampler, Precision, StepRunner, resolve_precision
from steadytrain.engine.batching import batch_len, split_batch, to_device
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
from steadytrain.engine.side_pass import side_pass
from steadytrain.engine.step import check_loss_output
from steadytrain.errors import (
    SIGNAL_EXITS,
    BadInputError,
    ConfigError,
    RankOutOfMemory,
    SteadytrainError,
    Stopped,
    UserCodeError,
)
from steadytrain.events import Callback, Control, Dispatcher, TrainState, check_callbacks
from steadytrain.memory.analytic import analytic_for
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.plan import compiled_growth, first_step_bytes, plan
from steadytrain.memory.savers import MemorySavers, Savers, one_sample_norms, trial_pass
from steadytrain.safety.failure_record import keep_traceback, record_exit, record_failure
from steadytrain.safety.lock import RunLock
from steadytrain.safety.signals import SignalStop
from steadytrain.safety.supervised import (
    announce_run_dir,
    micro_cap_from_supervisor,
    savers_from_supervisor,
)
from steadytrain.safety.watchdog import allowance, startup_phase, waiting_in
from steadytrain.telemetry.console import console_callback
from steadytrain.telemetry.cpu import CpuContention
from steadytrain.telemetry.files import RunFiles
from steadytrain.telemetry.tensorboard import TensorBoardLog
from steadytrain.trainer_program import (
    arithmetic_event,
    check_evaluation,
    data_source,
    dropout_note,
    make_evaluation,
    make_sampler,
    order_identity,
)
from steadytrain.user_state import check_user_state, select

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
        self.model, self.loss_fn, self.scheduler = model, loss_fn, scheduler
        self._optimizer = optimizer
        self.user_callbacks = list(callbacks)
        self.data = data_source(train_data, collate_fn, self.config)
        self.dataset, self.collate_fn = self.data.dataset, self.data.collate_fn
        self.workers, self.worker_init_fn = self.data.workers, self.data.worker_init_fn
        self.eval_data = (
            None if eval_data is None else data_source(eval_data, collate_fn, None, "eval_data")
        )
        self.eval_fn = eval_fn
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
            cfg, group.own_dir(run_dir), lambda files: _recorder(files, console),
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
            notes = [*self._notes, dropout_note(run.model, cfg)]
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
            self._stopped_by = _signal_that_stopped(run, code)
            return _result(run.state, reason, code, run_dir, store)
        finally:  # both ended at fit_end already; this covers a refusal before it
            watchdog.stop()
            files.close()

    def _set_up(self, group: Group) -> _Run:
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
        optimizer = self._build_optimizer(model)
        scheduler = self._make_scheduler(optimizer)
        check_evaluation(cfg, scheduler, self.eval_data, self.eval_fn)
        sampler = self._sampler()
        group.check_batches(sampler)
        _warn_if_batch_dependent(model, cfg)
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
        return _Run(
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

    def _run_state(self, run: _Run) -> RunState:
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

    def _resume_or_start(self, run: _Run, files: RunFiles) -> tuple[CheckpointStore, float | None]:
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

    def _callbacks(
        self,
        run: _Run,
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
        defaults.watch_memory(run.device)
        return defaults.in_order(
            cpu=CpuContention.from_config(cfg, run.device, record),
            before_save=stateful,
            writer=self._writer(run, store, record),
            continuity=continuity,
            display=display,
            at_start=planned,
            user=[c for c in self.user_callbacks if all(c is not s for s in stateful)],
        )

    def _writer(self, run: _Run, store: CheckpointStore, record) -> CheckpointWriter:
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

    def _loop(self, run: _Run) -> Loop:
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

    def _plan(self, run: _Run, compiled: bool = False, eager=None) -> list[tuple]:
        """micro_batch_size 'auto': measure passes on the first optimizer batch and set the micro
        size (and the memory savers) from `steadytrain.memory.plan`. The probe leaves no trace
        in the run: gradients are dropped, buffers (BatchNorm statistics) and every RNG stream
        are put back, so the run's losses are those of a run started at the chosen size.
        Returns the `plan` and `estimate` events (what was chosen and why)."""
        cfg, state, savers, model = self.config, run.state, run.savers, run.model
        batch = self._batch_at(run.sampler, 0, 0, run.group)  # planned per rank, on its share
        analytic, _ = analytic_for(
            model,
            batch,
            precision=run.precision.name,
            optimizer=run.optimizer,
            device_type=run.device.type,
            compiled=compiled,
            fused_loss=_chunked_method(self.loss_fn, model, run.device.torch_device) == "fused",
        )

        def one_pass(size: int) -> None:
            piece = to_device(
                split_batch(batch, size)[0], run.device.torch_device, run.runner.non_blocking
            )
            select(self.user_state, 0, size, batch_len(batch))  # the first `size` samples' state
            with one_sample_norms(model, size):
                trial_pass(model, _checked(self.loss_fn), piece, run.precision.autocast)

        before = savers.snapshot()
        # The chunked loss is a candidate when the loss has a chunked mode for this model and
        # the caller did not choose chunking already.
        offer_chunked = before.chunked_loss is None and savers.can_chunk_loss
        with side_pass(
            rng=True, buffers=model.buffers(), user_state=self.user_state, others=[savers]
        ):
            chosen = plan(
                savers.trial_run(one_pass, before.chunked_loss),
                run.device,
                effective_batch_size=cfg.effective_batch_size,
                activation_checkpointing=cfg.activation_checkpointing,
                can_checkpoint=savers.can_checkpoint,
                can_offload=savers.can_offload,
                chunked_run=savers.trial_run(one_pass, DEFAULT_CHUNK_TOKENS)
                if offer_chunked
                else None,
                plan_margin=None if cfg.plan_margin == "auto" else cfg.plan_margin,
                micro_batch_sizes=cfg.micro_batch_sizes,
                cap=state.micro_batch_size,
                analytic=analytic,
                pending=first_step_bytes(run.optimizer),
                compiled=compiled_growth(model) if compiled else False,
                eager_passes=eager,
            )
        state.micro_batch_size = run.group.smallest(chosen.micro_batch_size)  # one size for all
        savers.restore(
            Savers(
                before.checkpointing or chosen.activation_checkpointing,
                before.chunked_loss or (DEFAULT_CHUNK_TOKENS if chosen.chunked_loss else None),
            )
        )
        estimate = chosen.estimate_event()
        return [("plan", chosen.to_event())] + ([("estimate", estimate)] if estimate else [])

    def _probe_next_loss(self, run: _Run, state: TrainState) -> float | None:
        """The loss the next step will report, computed now without changing anything, so that a
        resume from this checkpoint can prove it restored everything (see ContinuityCheck). It
        computes what the resumed step computes: the next epoch's first batch after the epoch's
        end hooks of the program's state (`CarriedState(reset_each_epoch=True)`), its forward
        with autograd on as the step's (some kernels, nn.LSTM's on the CPU, differ without)."""
        if state.step >= state.max_steps:
            return None
        epoch, position = state.epoch, state.batch_in_epoch
        new_epoch = position >= state.steps_per_epoch
        if new_epoch:
            epoch, position = epoch + 1, 0
        if not run.sampler.has_order(epoch):  # a DataLoader draws it when the epoch starts
            return None
        batch = self._batch_at(run.sampler, epoch, position, run.group)  # its share; summed
        with side_pass(rng=True, buffers=run.model.buffers(), user_state=self.user_state):
            if new_epoch:  # the state as the epoch's end leaves it (CarriedState resets)
                for obj in self.user_state.values():
                    if isinstance(obj, Callback):
                        obj.on_epoch_end(state, Control(), {"epoch": state.epoch})
            return run.runner.evaluate(batch, autograd=True)  # as the step: same kernels

    def _batch_at(
        self, sampler: OptimizerBatchSampler, epoch: int, position: int, group: Group | None = None
    ) -> Any:
        """The collated optimizer batch at (`epoch`, `position`), as the loop will load it
        (with `group`: as its rank loads it, its share)."""
        indices = sampler.batch_at(epoch, position)
        indices = group.share(indices) if group is not None else indices
        return self.collate_fn(SeededFetch(self.dataset).__getitems__(indices))

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return _one_step_per_batch(self._make_optimizer(model))

    def _make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if isinstance(self._optimizer, torch.optim.Optimizer):
            return self._optimizer
        if isinstance(self._optimizer, list | tuple | Mapping):  # a GAN's {'g': .., 'd': ..}
            raise BadInputError(
                f"optimizer: {len(self._optimizer)} optimizers given; steadytrain takes one "
                "optimizer step per batch. Parameters that step together belong in one optimizer "
                "(param groups for their own lr); alternating updates (a GAN's generator and "
                "discriminator) need your own loop: see docs/porting.md, 'Several optimizers'"
            )
        if callable(self._optimizer):
            optimizer = self._optimizer([p for p in model.parameters() if p.requires_grad])
            if isinstance(optimizer, torch.optim.Optimizer):
                return optimizer
            found = f"the function returned {type(optimizer).__name__}"
        else:
            found = f"got {type(self._optimizer).__name__}"
        raise BadInputError(
            f"optimizer: expected a torch.optim.Optimizer or a function params -> optimizer; {found}"
        )

    def _make_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """The scheduler, built here where `scheduler` is a factory `optimizer -> scheduler` or
        a scheduler class (`scheduler=MySchedule`, called with the optimizer alone)."""
        scheduler = self.scheduler
        factory = isinstance(scheduler, type) or (
            callable(scheduler) and not hasattr(scheduler, "state_dict")
        )
        if not factory:
            return scheduler
        try:
            return scheduler(optimizer)
        except TypeError as error:
            if not isinstance(scheduler, type):
                raise  # the user's own factory failed: their traceback says where
            name = scheduler.__name__
            raise BadInputError(
                f"scheduler: {name}(optimizer) cannot be built from the optimizer alone ({error}); "
                f"pass a function, e.g. scheduler=lambda opt: {name}(opt, ...), or a scheduler "
                "built on the same optimizer"
            ) from None

    def _batches(
        self, sampler: OptimizerBatchSampler, epoch: int, start: int, device, group: Group
    ) -> DataLoader:
        sampler.set_position(epoch, start)
        return DataLoader(
            SeededFetch(self.dataset),
            batch_sampler=group.shares(sampler),
            collate_fn=self.collate_fn,
            num_workers=self.workers,
            worker_init_fn=self.worker_init_fn,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed((self.config.seed or 0) * 7919 + epoch),
        )


def _one_step_per_batch(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, refused when its step() needs a closure (LBFGS): it would evaluate the loss
    several times per step, and the engine's step computes the gradients once, then steps."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a readable signature takes no closure
        return optimizer
    if closure is None or closure.default is not inspect.Parameter.empty:
        return optimizer
    name = type(optimizer).__name__
    raise BadInputError(
        f"optimizer: {name}.step() needs a closure (it evaluates the loss several times per "
        "step); steadytrain computes the gradients of each batch once, then calls step() "
        "without one. Use an optimizer whose closure is optional (SGD, Adam, AdamW), or keep "
        f"your own loop for {name}: see docs/porting.md, 'Optimizers that need a closure'"
    )


_UNPLANNED_SHARDS = (
    "micro_batch_size auto under distributed: fsdp starts at each rank's whole share without "
    "trial passes (their all-gathers would need every rank to try the same sizes); an "
    "out-of-memory exits 76 and `steadytrain run` restarts the group at a smaller micro-batch"
)


def _checked(loss_fn: Callable[[torch.nn.Module, Any], Any]) -> Callable[..., Any]:
    """`loss_fn` whose output is refused as the step refuses it, before the plan measures it."""

    def checked(model: torch.nn.Module, batch: Any) -> Any:
        out = loss_fn(model, batch)
        check_loss_output(out)
        return out

    return checked


class RecordAtStart(Callback):
    """Events decided before the loop starts (the plan), recorded at fit_start: events.jsonl and
    the console open with the run's start, and the plan follows it."""

    def __init__(self, record: Callable[[str, dict], None]):
        self.record = record
        self.events: list[tuple[str, dict]] = []

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        for name, data in self.events:
            self.record(name, data)
        self.events = []


def _resolve_device(cfg: TrainConfig, group: Group) -> Device:
    """This rank's device, refusing what the config asks that it cannot do: offloaded
    checkpointing where host memory is the device's memory."""
    device = resolve_device(group.device_name(cfg.device), cfg.budget_bytes_or_fraction())
    if cfg.activation_checkpointing == "offload" and not device.discrete_memory:
        raise ConfigError([offload_problem(device.type)])
    return device


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


@dataclass
class _Run:
    """The parts of one `fit()`, built by `Trainer._set_up` and wired by the phases after it."""

    device: Device
    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: OptimizerBatchSampler
    state: TrainState
    savers: MemorySavers
    runner: StepRunner
    emit: Dispatcher
    group: Group
    scheduler: Any = None
    checkpoint: RunState | None = None  # set by `Trainer._run_state`, under the watchdog
    resumed: bool = False


def _recorder(files: RunFiles, console: Any) -> Callable[[str, dict], None]:
    def record(name: str, info: dict) -> None:
        """An event from outside the loop's dispatch: into events.jsonl and onto the console."""
        files.record(name, info)
        console.note(name, info)

    return record


def _chunked_method(loss_fn: Any, model: torch.nn.Module, device: torch.device) -> str | None:
    """How the loss's chunked mode computes on `device` ("fused", "chunked"), None for a loss
    without one."""
    method = getattr(loss_fn, "chunked_method", None)
    return method(model, device) if callable(method) else None


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


class BatchDependentModelWarning(UserWarning):
    """The model's forward depends on the batch, so splitting a batch changes the result."""


def _warn_if_batch_dependent(model: torch.nn.Module, cfg: TrainConfig) -> None:
    norms = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    if norms and cfg.micro_batch_size != cfg.effective_batch_size:
        warnings.warn(
            f"model: {len(norms)} BatchNorm layer(s) (first: {norms[0]}) compute statistics per "
            "micro-batch, so accumulation over micro-batches is not exactly the full batch. Set "
            "micro_batch_size equal to effective_batch_size if it fits, or use GroupNorm/LayerNorm.",
            BatchDependentModelWarning,
            stacklevel=3,
        )


def _result(
    state: TrainState, reason: str, code: int, run_dir: Path, store: CheckpointStore
) -> FitResult:
    committed = store.committed()
    checkpoint = str(committed[-1][1]) if committed else None
    return FitResult(
        state.step, state.last_loss, state.micro_batch_size, reason, code, str(run_dir),
        checkpoint, state.oom_count,
    )  # fmt: skip


def _signal_that_stopped(run: _Run, code: int) -> str | None:
    """The signal ("SIGTERM") whose stop ended the loop with that signal's exit code, or None."""
    signals = next(c for c in run.emit.callbacks if isinstance(c, SignalStop))
    if signals.stopping is not None and code == SIGNAL_EXITS[signals.stopping]:
        return signals.stopping
    return None


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
