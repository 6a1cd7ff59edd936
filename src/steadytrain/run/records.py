"""The registries of record names and keys: every ``event`` a line of RUN_DIR/events.jsonl can
hold (`Record`), and every key of a line of RUN_DIR/metrics.jsonl (`Metric`).

Each writer names its record here (``record(Record.CHECKPOINT, info)``) and each reader compares
with the same member (``event.get("event") == Record.CHECKPOINT``), so a writer and a reader
cannot drift apart; `tests/test_records.py` fails on a record name written or compared as a bare
string anywhere in the package, and on a member here that nothing writes. docs/telemetry.md lists
the same records, in this order (a test checks that too).

A member is a `str`: ``Record.OOM == "oom"``, it hashes and formats as ``"oom"``, and
`json.dumps` writes ``"oom"``, so the files on disk are what they were before the registry. The
comment after each member says who writes it and the fields it adds to ``time`` and ``event``
(and ``step``, which most records carry). Standard library only: the supervisor, the report and
the trainer all import it.

`Metric` does the same for metrics.jsonl's keys: the step writes ``{Metric.LOSS: ...}``, the
report reads ``row.get(Metric.LOSS)``; `tests/test_metric_keys.py` fails on a key spelled as a
bare string where a metrics row is written or read, and on a key here that nothing writes, and
docs/telemetry.md's metrics table lists the same keys in this order. The keys on disk are
public (users' scripts read metrics.jsonl): a key's value never changes.
"""

from __future__ import annotations

import enum


class Record(str, enum.Enum):
    """The name of a record in events.jsonl (its ``event`` field)."""

    __str__ = str.__str__  # "oom", not "Record.OOM", in messages and f-strings
    __format__ = str.__format__

    # -- the loop's events, written by the run files (`telemetry.files.RunFiles`) ---------------
    FIT_START = "fit_start"  # device, precision, budget, micro_batch_size, resumed_from, config
    OOM = (
        "oom"  # phase, micro_batch_size, error, memory (rank under torchrun; an integration: kind)
    )
    SHRINK = "shrink"  # old, new, reason, memory (`events.HALVING.record`; an integration too)
    MEMORY_SAVER = "memory_saver"  # saver, reason, memory (also `safety.supervised` at a start)
    EPOCH_END = "epoch_end"  # epoch, memory
    FIT_END = "fit_end"  # reason ("finished", a stop reason or the error), exit_code

    # -- the start of a run, written by the Trainer --------------------------------------------
    PLAN = "plan"  # the planner's choice: micro_batch_size, accumulation, savers, reasons, ...
    ESTIMATE = "estimate"  # the planned figure: source, peak, total, micro_batch_size
    DATA_LENGTHS = "data_lengths"  # a fine-tune's tokenised training data: longest, p95, ...
    COMPILE = "compile"  # compiled (blocks), fused, message: torch.compile of the model
    NOTE = "note"  # message: a sentence for the user (dropout, budget, restored RNG streams)
    ARITHMETIC = "arithmetic"  # every setting that changes the arithmetic: clipping, order, ...
    RESUME = "resume"  # checkpoint, step, micro_batch_size (an integration: checkpoint, epoch)
    RESUME_OVERRIDE = "resume_override"  # change: a run identity change `resume_overrides` allows
    MICRO_BATCH_CAP = "micro_batch_cap"  # old, new, reason: the supervisor's smaller start
    MEMORY_SAVERS = "memory_savers"  # in_force, left, asked: under `steadytrain run`, each start
    PREFLIGHT = "preflight"  # `RunGuard`'s check before its first step: optimizer, budget, batch

    # -- the checkpoint package ----------------------------------------------------------------
    CHECKPOINT = "checkpoint"  # a committed save: step, mode, stall_s (integrations: checkpoint)
    BEST_CHECKPOINT = "best_checkpoint"  # keep_best: step, metric, stall_s
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # checkpoint, problems: failed its verification
    CHECKPOINT_DELETED = "checkpoint_deleted"  # checkpoint, reason: keep_last
    CHECKPOINT_DELETE_FAILED = "checkpoint_delete_failed"  # checkpoint, path, error
    CHECKPOINT_REPLACED = "checkpoint_replaced"  # checkpoint, problems: a broken one saved again
    CHECKPOINT_EXISTS = "checkpoint_exists"  # step, checkpoint: a verified one already there
    CHECKPOINT_POINTER_FAILED = "checkpoint_pointer_failed"  # checkpoint, error: latest not moved
    CHECKPOINT_POINTER_IGNORED = "checkpoint_pointer_ignored"  # pointer, reason (using)
    CHECKPOINT_LEFTOVER_REMOVED = "checkpoint_leftover_removed"  # path, kind: a killed save's
    CHECKPOINT_LEFTOVER_FAILED = "checkpoint_leftover_failed"  # path, error
    CONTINUITY = "continuity"  # the resume loss check: checked, loss, expected, equal, message

    # -- safety: signals, hangs, memory watch, failures ----------------------------------------
    SIGNAL = "signal"  # signal: SIGINT or SIGTERM received, the run saves and stops
    HANG = "hang"  # phase, stalled_s, limit_s, action, file, detected_by (watchdog, supervisor)
    LEAK = "leak"  # counter, rate_mib_per_epoch, readings, budget, eta_epochs, message
    SWAP = "swap"  # reason, slowdown, signal, micro_batch_size, action, message: thrashing
    CACHE = "cache"  # why, allocated, peak, reserved_before, ...: the allocator cache emptied
    CPU_CONTENTION = "cpu_contention"  # step_time, typical_step_time, threads, cores, message
    ERROR = "error"  # exit_code, error, where, signature, in_your_code: a failed fit()
    EXIT = "exit"  # a torchrun rank's failed fit(): rank, world_size, exit_code, reason

    # -- steadytrain run (the supervisor) ------------------------------------------------------
    RESTART = "restart"  # attempt, exit_code, signal, reason, delay_s, progressed, ...: restarted
    MEMORY_ESCALATION = "memory_escalation"  # saver, in_force, left, memory_savers: one more on
    SUPERVISOR_END = "supervisor_end"  # exit_code, restarts, reason
    SUPERVISOR_GAVE_UP = "supervisor_gave_up"  # exit_code, restarts, last_exit_code, reason

    # -- the report --------------------------------------------------------------------------
    KILLED = "killed"  # derived by the report, never on disk: an attempt that ended unrecorded


class Metric:
    """The keys of a line of metrics.jsonl (one line per optimizer step; an evaluation's line has
    ``kind: "eval"``): named constants, each a plain `str`, never instantiated. The comment
    after each says who writes it.

    Not an `enum.Enum` like `Record`: a row is written and read every step, and an enum
    member's lookup costs microseconds where a class attribute's costs nanoseconds."""

    __slots__ = ()

    # -- where and when: the loop (`engine.loop.StepLoop`), an integration's `RunGuard` -----------
    STEP = "step"  # optimizer steps completed, from 1 (an evaluation: the step it followed)
    EPOCH = "epoch"  # from 0
    TIME = "time"  # Unix time when the step ended

    # -- the step's values (`engine.step.StepRunner`; an integration: what it passes) -----------
    LOSS = "loss"  # the batch loss (token-weighted for (loss_sum, count) losses)
    LR = "lr"  # the first parameter group's, after the scheduler step
    GRAD_NORM = "grad_norm"  # before clipping; None without max_grad_norm
    MICRO_BATCH_SIZE = "micro_batch_size"  # the micro size in force
    MICRO_STEPS = "micro_steps"  # micro-batches in the step (accumulation)
    SAMPLES = "samples"  # samples in the batch
    TOKENS = "tokens"  # label tokens counted by (loss_sum, count) losses; 0 for mean losses
    SKIPPED = "skipped"  # fp16: the grad scaler skipped the step
    ACCUMULATION = "accumulation"  # the integrations: micro-batches per optimizer step

    # -- its time: the loop, the step's marks (`engine.step`), the checkpoint writer ------------
    DATA_TIME = "data_time"  # the loop: seconds waiting for the batch
    COMPUTE_TIME = "compute_time"  # the step: host seconds, first copy to last backward
    OPTIMIZER_TIME = "optimizer_time"  # the step: host seconds, unscale to zero grads
    STEP_TIME = "step_time"  # the loop: data + compute + optimizer (RunGuard: start to end)
    DEVICE_COMPUTE_TIME = "device_compute_time"  # timed steps: compute on the device's clock
    DEVICE_OPTIMIZER_TIME = "device_optimizer_time"  # timed steps: optimizer, device's clock
    CHECKPOINT_TIME = "checkpoint_time"  # save steps (`checkpoint.writer`): the loop held

    # -- the memory reading (`device.reading.MemoryReading`), one key per field -----------------
    MEM_ALLOCATED = "mem_allocated"  # the run files write every field as mem_<field>
    MEM_RESERVED = "mem_reserved"
    MEM_PEAK = "mem_peak"
    MEM_RSS = "mem_rss"
    MEM_TOTAL = "mem_total"
    MEM_BUDGET = "mem_budget"
    MEM_USABLE = "mem_usable"
    MEM_SYSTEM_AVAILABLE = "mem_system_available"
    MEM_SWAP_USED = "mem_swap_used"
    MEM_ALLOC_RETRIES = "mem_alloc_retries"
    MEM_PRESSURE = "mem_pressure"

    # -- an evaluation's line (`telemetry.files.RunFiles.on_eval_end`) ---------------------------
    KIND = "kind"  # "eval" (`EVAL`); a step's line has none
    EVAL_LOSS = "eval_loss"  # without an eval_fn: the mean loss (`engine.evaluation`)

    # -- the row in the process only (`events.StepMetrics`), never on disk ----------------------
    MEMORY = "memory"  # the `MemoryReading` as a dict; the run files write it as the mem_* keys

    @staticmethod
    def of_memory(field: str) -> str:
        """The key of a `MemoryReading` field on disk: ``peak`` -> ``Metric.MEM_PEAK``."""
        return MEMORY_PREFIX + field

    @staticmethod
    def keys() -> dict[str, str]:
        """Every key, by constant name (``{"LOSS": "loss", ...}``), in this order."""
        return {k: v for k, v in vars(Metric).items() if k.isupper()}


MEMORY_PREFIX = "mem_"
"""What the run files put before a memory reading's field name to make its key."""

EVAL = "eval"
"""The ``kind`` of an evaluation's line in metrics.jsonl."""

NEVER_ON_DISK = frozenset({Metric.MEMORY})
"""Keys of the row in the process (`events.StepMetrics`) that the run files write otherwise."""
