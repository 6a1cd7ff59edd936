"""The registry of record names: every ``event`` a line of RUN_DIR/events.jsonl can hold.

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
