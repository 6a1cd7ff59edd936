"""How an attempt ended, as the run directory tells the supervisor (standard library only, like
the supervisor; the child's side writes these records: `steadytrain.safety.failure_record`): the memory reading of the last step before a kill, and the
error the trainer recorded before it exited.

A SIGKILL whose cause the kernel's counter does not show (systemd-oomd, earlyoom, a `kill -9`)
is judged by the last metrics line: when the machine had little memory left at that step, the
kill is taken for a memory kill, so the next attempt starts with a smaller micro-batch. A smaller
start costs some speed if the guess is wrong; a wrong "no" costs the next attempt being killed
the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from steadytrain.run import files as run_files
from steadytrain.run import jsonl as run_jsonl
from steadytrain.run.records import Metric, Record
from steadytrain.supervisor.progress import Since, attempt_records

TAIL_BYTES = run_jsonl.TAIL_BYTES  # the last few lines of a JSON-lines file, however long
LOW_AVAILABLE = 0.20
"""Memory counts as high when less than this share of the machine's memory was available at the
last step. earlyoom kills below 10 %; the last line is up to a step old and a step's peak comes
after its reading, so twice that margin."""
PRESSURE_WARNING = 2  # macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical
GIB = 1024**3


def tail_lines(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete JSON lines at the end of a JSON-lines file, oldest first; a torn line (the
    writer was killed mid-write) and the partial first line of the tail are skipped."""
    return run_jsonl.tail(path, tail_bytes)


def physical_memory() -> int | None:
    """The machine's memory in bytes (Linux and macOS), None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class MemoryAtKill:
    """The memory reading of the last step before a kill: whether it was high, and in words."""

    high: bool
    text: str


def memory_at_kill(run_dir: Path | None, total: int | None = None) -> MemoryAtKill | None:
    """Judge the last metrics line of RUN_DIR/metrics.jsonl (None: no line with a memory
    reading). `total` is the machine's memory (default: read here, where the child ran)."""
    if run_dir is None:
        return None
    lines = [r for r in tail_lines(Path(run_dir) / run_files.METRICS) if Metric.STEP in r]
    if not lines:
        return None
    line = lines[-1]
    total = physical_memory() if total is None else total
    available = _number(line.get(Metric.MEM_SYSTEM_AVAILABLE))
    pressure, rss = line.get(Metric.MEM_PRESSURE), _number(line.get(Metric.MEM_RSS))
    if available is None and pressure is None:
        return None
    parts = []
    if available is not None:
        parts.append(
            f"{available / GIB:.1f} GiB of {total / GIB:.1f} GiB available"
            if total
            else f"{available / GIB:.1f} GiB available"
        )
    if rss is not None:
        parts.append(f"{rss / GIB:.1f} GiB used by the trainer")
    if isinstance(pressure, int) and pressure >= PRESSURE_WARNING:
        parts.append("memory pressure " + ("critical" if pressure >= 4 else "warning"))
    high = (isinstance(pressure, int) and pressure >= PRESSURE_WARNING) or (
        available is not None and bool(total) and available < LOW_AVAILABLE * total
    )
    return MemoryAtKill(high, f"step {line.get(Metric.STEP)}: {', '.join(parts)}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ---- the error a trainer recorded before it exited -----------------------------------------


def last_error(run_dir: Path | None, since: Since) -> dict[str, Any] | None:
    """The newest "error" event in RUN_DIR/events.jsonl written by the attempt started at
    `since` (`progress.AttemptStart`); None when it recorded none."""
    if run_dir is None:
        return None
    for record in reversed(attempt_records(Path(run_dir) / run_files.EVENTS, since)):
        if record.get("event") == Record.ERROR:
            return record
    return None


def ended_run(run_dir: Path | None, since: Since) -> dict[str, Any] | None:
    """The "fit_end" event the attempt started at `since` wrote last, when it says its run did
    not finish (an `exit_code` other than 0: stopped by a signal, 130 / 143, or an error): a
    child that then exited 0 caught `steadytrain.Stopped` or the error and ended as if
    finished. None when the last one finished, or there is none of this attempt."""
    if run_dir is None:
        return None
    for record in reversed(attempt_records(Path(run_dir) / run_files.EVENTS, since)):
        if record.get("event") != Record.FIT_END:
            continue
        code = record.get("exit_code")
        return record if isinstance(code, int) and code != 0 else None
    return None


def same_failure(error: dict[str, Any] | None, before: dict[str, Any] | None) -> bool:
    """Two attempts failed identically: the same error (type, message, where) at the same step.
    A restart would fail the same way again."""
    if not error or not before or not error.get("signature"):
        return False
    return error.get("signature") == before.get("signature") and error.get("step") == before.get(
        "step"
    )


# ---- which rank of a torchrun group failed -------------------------------------------------

ENDS = (Record.OOM, Record.HANG, Record.ERROR, Record.EXIT, Record.FIT_END)
"""The records that say how a rank's attempt ended (the last one of the attempt counts)."""
RECOVERED = (Record.SHRINK,)
"""After an `oom`, the rank went on: that oom says nothing about how the attempt ended."""
STOPPED_CODES = (130, 143)  # torchrun stops the other ranks with SIGTERM when one fails
SHRINK_CODE = 76  # errors.SHRINK_EXIT: out of memory, restart with a smaller micro-batch


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a torchrun group ended an attempt, from its own events."""

    rank: int
    world_size: int
    folder: Path
    """Where its events, metrics and hang dumps are (RUN_DIR, or RUN_DIR/ranks/rank-N)."""
    record: dict[str, Any] | None
    """Its last oom / hang / error / exit / fit_end event of the attempt; None: it wrote none
    (killed by a signal, or it never started)."""
    started: bool
    silent_with: tuple[int, ...] = ()
    """When several ranks ended without a record, all of them (itself included): none of them
    can be told to have failed first. Empty otherwise."""

    @property
    def exit_code(self) -> int | None:
        """The code the rank ended with, where its record says it (an `oom` it did not recover
        from counts as 76: out of memory, restart smaller); None when unknown."""
        if self.record is None:
            return None
        if self.record.get("event") == Record.OOM:
            return SHRINK_CODE
        code = self.record.get("exit_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else None

    @property
    def failed(self) -> bool:
        return self.record is None or self.exit_code != 0

    @property
    def waiting(self) -> bool:
        """It failed because another rank did: stalled or broken in a collective (a peer that
        hung or died), stopped by the signal torchrun sends the others, or out of memory on
        another rank (its oom event's phase is "rank N")."""
        record = self.record or {}
        other_oom = record.get("event") == Record.OOM and str(record.get("phase")).startswith(
            "rank "
        )
        return bool(record.get("collective")) or self.exit_code in STOPPED_CODES or other_oom

    def describe(self) -> str:
        """How it ended, in words, for the supervisor's line."""
        who = f"rank {self.rank} of {self.world_size} failed first"
        record = self.record
        if record is None and self.silent_with:
            ranks = ", ".join(str(r) for r in self.silent_with)
            return (
                f"ranks {ranks} of {self.world_size} ended without an exit record in their "
                "events (killed by a signal: SIGKILL, the OS out-of-memory killer, or a crash "
                "in native code), so which failed first is not known"
            )
        if record is None:
            return (
                f"{who}: it ended without an exit record in its events (killed by a signal: "
                "SIGKILL, the OS out-of-memory killer, or a crash in native code)"
            )
        name, step = record.get("event"), record.get("step")
        at = f" after step {step}" if step is not None else ""
        if name == Record.HANG:
            where = record.get("collective") or record.get("phase")
            dump = record.get("file")
            stacks = f", stacks in {self._relative(dump)}" if dump else ""
            return f"{who}: hang in {where}{at} (exit {self.exit_code}){stacks}"
        if name == Record.OOM:  # its step is the one it happened in (events.oom_step)
            at = f" at step {step}" if step is not None else ""
            return f"{who}: out of memory{at} ({record.get('error') or 'no message'})"
        reason = record.get("reason") or record.get("error") or name
        waited = f" in {record['collective']}" if record.get("collective") else ""
        at = f" at step {step}" if step is not None else ""  # the step it was in
        return f"{who}: exit {self.exit_code}{waited}{at}: {reason}"

    def _relative(self, file: str) -> str:
        """A dump's path from RUN_DIR (the rank's folder holds it)."""
        if self.rank == 0:
            return file
        return f"{run_files.RANKS}/rank-{self.rank}/{file}"


def rank_ends(run_dir: Path | None, since: Since) -> list[RankEnd]:
    """Each rank's end of the attempt started at `since` (`progress.AttemptStart`), when that
    attempt ran several ranks (its fit_start events say so, or a rank folder has records of
    it); empty otherwise."""
    if run_dir is None:
        return []
    folders = {0: Path(run_dir)}
    for folder in (Path(run_dir) / run_files.RANKS).glob("rank-*"):
        suffix = folder.name.removeprefix("rank-")
        if suffix.isdigit():
            folders[int(suffix)] = folder
    records = {
        rank: attempt_records(folder / run_files.EVENTS, since) for rank, folder in folders.items()
    }
    world = max((rank + 1 for rank, found in records.items() if found), default=1)
    for found in records.values():
        for start in (r for r in found if r.get("event") == Record.FIT_START):
            group = start.get("process_group")
            if isinstance(group, dict) and isinstance(group.get("world_size"), int):
                world = max(world, group["world_size"])
    if world <= 1:
        return []
    ends = []
    for rank in range(world):
        found = records.get(rank, [])
        last = next((r for r in reversed(found) if r.get("event") in ENDS + RECOVERED), None)
        if last is not None and last.get("event") in RECOVERED:
            last = None
        folder = folders.get(rank, Path(run_dir) / run_files.RANKS / f"rank-{rank}")
        ends.append(RankEnd(rank, world, folder, last, bool(found)))
    return ends


def failed_rank(ends: list[RankEnd]) -> RankEnd | None:
    """The rank that failed first: the earliest failure of a rank that was not waiting for
    another (a hang in its own code, an error, an out-of-memory); else a started rank that wrote
    no end (killed: its peers' collectives then break), carrying `silent_with` when several
    did; else the earliest of those that failed waiting. None when no rank says it failed."""
    failed = [e for e in ends if e.failed and (e.record is not None or e.started)]
    own = [e for e in failed if e.record is not None and not e.waiting]
    if own:
        return min(own, key=lambda e: e.record.get("time") or 0.0)
    silent = [e for e in failed if e.record is None]
    if len(silent) > 1:
        return replace(silent[0], silent_with=tuple(e.rank for e in silent))
    if silent:
        return silent[0]
    return min(failed, key=lambda e: e.record.get("time") or 0.0) if failed else None
