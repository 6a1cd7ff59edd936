"""How big the next attempt starts after a memory kill, exit 76 or a native crash near the
address-space cap (`address_space`): half the micro-batch in force (the out-of-memory policy's
`HALVING`), or, at micro-batch 1, one more memory saver than the attempt had in force, as it
recorded them at its start (an attempt killed while it started, before it recorded them: the
ladder's next, `start_kill`). Under torchrun, a rank's exit 76 at micro-batch 1 climbs the same
ladder (`group_out_of_memory_at_one`), and past its last saver, where the group is sharded on
GPUs, asks for the shards in host memory (`offload_left`). What the attempt halved itself, in the process, is read
back for the last word's "Tried:" (`halved_in_process`)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from steadytrain.events import HALVING  # the out-of-memory policy (no torch)
from steadytrain.run import files as run_files
from steadytrain.run.records import Record
from steadytrain.supervisor.child_exit import SHRINK, ChildExit
from steadytrain.supervisor.progress import (
    Since,
    attempt_records,
    last_micro_batch_size,
    savers_record,
)
from steadytrain.supervisor.start_kill import start_ladder


def smaller_micro_batch(
    run_dir: Path | None, cap: int | None, death: ChildExit | None = None
) -> int | None:
    """Half the micro-batch in force when the child was killed: the last one metrics.jsonl
    shows (the child, or the rank that failed, exited 76: its last oom event's; it crashed
    near its address-space cap, often in its first step at that size: the one its last
    fit_start names), no more than the cap already set; None (no cap) when none is known."""
    known = [last_micro_batch_size(run_dir), cap]
    folder = death.rank.folder if death is not None and death.rank is not None else run_dir
    if death is not None and death.returncode == SHRINK:
        known.append(last_micro_batch_size(folder, run_files.EVENTS, Record.OOM))
    if death is not None and death.crashed_near_cap:
        known.append(last_micro_batch_size(folder, run_files.EVENTS, Record.FIT_START))
    known = [v for v in known if v is not None]
    return (HALVING.next(min(known)) or 1) if known else None


def saver_left(
    run_dir: Path | None,
    death: ChildExit,
    cap: int | None,
    since: Since,
    asked: int | None = None,
) -> dict[str, Any] | None:
    """After an OS memory kill (SIGKILL: the counter rose, or memory was high at the last
    step, or no counter and no reading to tell, or before the run's first step), or a native
    crash near the address-space cap, with no smaller micro-batch left (micro-batch 1 in force,
    or none known): the savers the attempt had in force and those left, as it recorded them at
    its start (`safety.supervised.savers_from_supervisor`);
    None when there is no escalation to decide: another end, a shrink is left, or the
    attempt recorded none (not a Trainer's run). An attempt killed while it started (before it
    wrote any record: loading the model) is at the smallest size whatever its cap, and its
    savers are the ladder's first `asked` (`start_kill.start_ladder`)."""
    if group_out_of_memory_at_one(run_dir, death, cap):
        folder = folder_of(run_dir, death)
        return savers_record(folder, since) or start_ladder(folder, asked)
    crashed = death.crashed_near_cap  # its own reading says memory: no counter needed
    if not crashed and (death.killed_by != signal.SIGKILL or not death.memory_kill_suspected):
        return None
    folder = folder_of(run_dir, death)
    if death.while_starting:
        return savers_record(folder, since) or start_ladder(folder, asked)
    if (
        not crashed
        and not death.oom_kill_delta
        and death.memory is not None
        and not death.memory.high
    ):
        return None  # no counter to tell, and memory was not high: maybe a plain kill -9
    if smallest_micro_batch(folder, cap) not in (None, 1):
        return None  # halving the micro-batch is the next step
    return savers_record(folder, since)


def group_out_of_memory_at_one(run_dir: Path | None, death: ChildExit, cap: int | None) -> bool:
    """A torchrun group whose rank that failed first ran out of memory at micro-batch 1: it
    exited 76 with its `oom` record (in a step, or in the plan's trial pass before the first
    step) at micro-batch 1, or the OS killed it (the cgroup's counter rose) with micro-batch 1
    in force. A restart at the same size would run out the same way: the next memory saver is
    the next start. (One process that exits 76 at micro-batch 1 has climbed its own ladder
    in place already, and is restarted fresh at 1.)"""
    if death.rank is None:
        return False
    folder = death.rank.folder
    if death.returncode == SHRINK:
        ran_out = last_micro_batch_size(folder, run_files.EVENTS, Record.OOM)
        known = [v for v in (ran_out, cap) if v is not None]
        return bool(known) and min(known) == 1
    if death.rank.exit_code is None and death.oom_kill_delta:
        return smallest_micro_batch(folder, cap) == 1
    return False


def offload_left(death: ChildExit, since: Since) -> bool:
    """A torchrun group sharded on GPUs (`distributed: fsdp`, a CUDA device) whose rank ran out
    of memory at micro-batch 1 with every saver in force, and whose shards were on the GPU (its
    `fit_start` says how it was placed): FSDP2's offload policy (`fsdp_offload`) is the rung
    left, which moves each rank's shards of parameters, gradients and optimizer state to host
    memory. It must be chosen before the model is sharded, so it is asked of the next start
    (ENV_FSDP_OFFLOAD), not climbed in the process as the savers are."""
    if death.rank is None:
        return False
    starts = [
        r
        for r in attempt_records(Path(death.rank.folder) / run_files.EVENTS, since)
        if r.get("event") == Record.FIT_START
    ]
    if not starts:
        return False
    placed = starts[-1].get("distributed") or {}
    on_gpu = str(starts[-1].get("device") or "").startswith("cuda")
    return on_gpu and placed.get("mode") == "fsdp" and placed.get("offload") is False


def folder_of(run_dir: Path | None, death: ChildExit) -> Path | None:
    """Where the attempt's records are: the run directory, or the folder of the rank that
    failed first."""
    return death.rank.folder if death.rank is not None else run_dir


def halved_in_process(folder: Path | None, since: Since, attempt: int) -> str | None:
    """The micro-batches the attempt started at `since` went through by halving itself on
    out-of-memory (its `shrink` records: the Trainer's, or an integration's), as "micro-batch
    8 → 4 → 2 (attempt 1, halved in the process on out-of-memory)"; None where it halved none."""
    if folder is None:
        return None
    shrinks = [
        r
        for r in attempt_records(Path(folder) / run_files.EVENTS, since)
        if r.get("event") == Record.SHRINK and r.get("old") is not None
    ]
    if not shrinks:
        return None
    sizes = [shrinks[0]["old"], *(r.get("new") for r in shrinks)]
    return (
        f"micro-batch {' → '.join(str(s) for s in sizes)} (attempt {attempt}, halved in the "
        "process on out-of-memory)"
    )


def smallest_micro_batch(folder: Path | None, cap: int | None) -> int | None:
    """The micro-batch in force at the last step: the last metrics line's, no more than the
    cap; None when neither is known."""
    known = [v for v in (last_micro_batch_size(folder), cap) if v is not None]
    return min(known) if known else None
