"""What `steadytrain run` reads about its child, with no torch and nothing of the loop: the run
directory's progress (the newest checkpoint, the last micro-batch size), the events it appends,
the OS out-of-memory killer's counter, and how the child ended (`ChildExit`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain import run_files, run_jsonl
from steadytrain.errors import (
    DISK_FULL_EXIT,
    RESTARTABLE_EXIT,
    SHRINK_EXIT,
    USER_CODE_EXIT,
    BadInputError,
)
from steadytrain.safety.failures import MemoryAtKill, RankEnd

HANG = RESTARTABLE_EXIT
SHRINK = SHRINK_EXIT
STOPPED = (130, 143)
# A torchrun group's failed rank's exit code that decides the restart as the child's would
# (torchrun itself exits 1 whichever rank failed and however).
RANK_CODES = (2, 3, USER_CODE_EXIT, DISK_FULL_EXIT, HANG, SHRINK)
NOT_RESTARTABLE = {
    2: "bad input",
    3: "does not fit even at micro-batch 1",
    DISK_FULL_EXIT: "disk full",  # a restart would fail on the same full disk
}
# Signals that mean "stop", not "crashed": the user (or the OS shutting down) asked for it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A shell or launcher between us and the trainer reports a process killed by signal N as exit
# 128 + N. Only these are read that way: for other values above 128 the guess would be wild.
SHELL_REPORTED = (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
METRICS_TAIL_BYTES = run_jsonl.TAIL_BYTES  # the last few metrics lines, however long the run
_STEP_NAME = re.compile(r"step-(\d+)")


# ---- what the run directory says -----------------------------------------------------------


def checkpoint_step(run_dir: Path | None) -> int | None:
    """The step of the newest committed checkpoint (RUN_DIR/checkpoints/latest holds its folder
    name, e.g. step-00000250); None when there is none or the pointer cannot be read."""
    if run_dir is None:
        return None
    try:
        name = (run_dir / run_files.CHECKPOINTS / run_files.LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def progress_step(run_dir: Path | None) -> int | None:
    """The step of the newest checkpoint the run says it committed and verified: the Trainer's
    `checkpoints/latest` pointer, or the newest `checkpoint` event in RUN_DIR/events.jsonl,
    which the Trainer and every integration (Hugging Face, Lightning, Keras, `RunGuard`'s
    `checkpoint_saved`) append after each save is committed and hashed. None when neither says
    one. Reads the whole file (a line per event, not per step)."""
    steps = [checkpoint_step(run_dir)]
    if run_dir is not None:
        for event in _events(run_dir, b'"checkpoint"'):
            step = event.get("step")
            if (
                event.get("event") == "checkpoint"
                and isinstance(step, int)
                and not isinstance(step, bool)
            ):
                steps.append(step)
    found = [s for s in steps if s is not None]
    return max(found) if found else None


def last_micro_batch_size(
    run_dir: Path | None, file: str = run_files.METRICS, event: str | None = None
) -> int | None:
    """micro_batch_size of the last complete line of RUN_DIR/metrics.jsonl, read from its tail
    (the file grows by a line per step). A torn last line (the child was killed mid-write) is
    skipped. With `file` events.jsonl and `event` "oom": that of the last out-of-memory event
    (a child that exits 76 records one before it has written any metrics line)."""
    if run_dir is None:
        return None
    for record in reversed(run_jsonl.tail(run_dir / file, METRICS_TAIL_BYTES)):
        if event is not None and record.get("event") != event:
            continue
        value = record.get("micro_batch_size")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def append_event(run_dir: Path, record: dict[str, Any]) -> None:
    """One line appended to RUN_DIR/events.jsonl with a single write in O_APPEND mode, so it
    cannot interleave with the child's own lines. A torn last line (the child was killed while
    writing it) is ended first, inside the same write (`steadytrain.run_jsonl.append`)."""
    run_jsonl.append(run_dir / run_files.EVENTS, record, root=run_files.top(run_dir))


def _events(run_dir: Path, containing: bytes) -> list[dict[str, Any]]:
    """The records of RUN_DIR/events.jsonl whose line holds `containing`, whole file ([] when
    it cannot be read)."""
    try:
        return run_jsonl.read(run_dir / run_files.EVENTS, containing)
    except OSError:
        return []


# ---- the OS out-of-memory killer's counter -------------------------------------------------


def read_oom_kill_count(
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
) -> int | None:
    """How many processes of our cgroup the kernel's OOM killer has killed, or None where no
    counter can be read (macOS, no cgroup, permissions). The child inherits our cgroup, and the
    counter includes descendant cgroups, so a kill of the child or its workers shows here.

    cgroup v2: ``oom_kill`` in ``<root>/<path>/memory.events`` (also under ``<root>/unified``,
    the hybrid layout). cgroup v1: ``oom_kill`` in ``<root>/memory/<path>/memory.oom_control``.
    Where the path from /proc/self/cgroup is not under the mount (a container without a cgroup
    namespace sees its own cgroup as the mount's root), the root is tried too.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    root = Path(cgroup_root)
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":
            for mount in (root, root / "unified"):
                candidates += [mount / relative / "memory.events", mount / "memory.events"]
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            candidates += [mount / relative / "memory.oom_control", mount / "memory.oom_control"]
    for candidate in dict.fromkeys(candidates):  # ordered, without repeats
        count = _oom_kill_field(candidate)
        if count is not None:
            return count
    return None


def _oom_kill_field(path: Path) -> int | None:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# ---- how a child ended ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChildExit:
    """A child's end as `Popen.returncode` gives it (negative: killed by that signal), how
    much the cgroup's oom_kill counter rose meanwhile (None: not readable), and the memory
    reading of its last step (None: no metrics line to tell).

    Under torchrun, `rank` is the rank that failed first (`failures.failed_rank`) and
    `launcher_code` what torchrun exited with (1 for any worker's failure); `returncode` is then
    the rank's own code where it says one that matters (`RANK_CODES`), so a rank's hang is
    restarted as a hang and its exit 76 as a smaller restart."""

    returncode: int
    oom_kill_delta: int | None = None
    memory: MemoryAtKill | None = None
    rank: RankEnd | None = None
    launcher_code: int | None = None
    hang_by: str | None = None
    """Who caught a hang when it was not the child's own watchdog (the supervisor killed it)."""

    @classmethod
    def of(
        cls,
        returncode: int,
        oom_kill_delta: int | None,
        memory: MemoryAtKill | None,
        rank: RankEnd | None,
    ) -> ChildExit:
        """The child's end, read through the rank that failed first when there is one."""
        if rank is None:
            return cls(returncode, oom_kill_delta, memory)
        code = rank.exit_code if rank.exit_code in RANK_CODES else returncode
        return cls(code, oom_kill_delta, memory, rank, returncode)

    @property
    def rank_fields(self) -> dict[str, Any]:
        """For the restart event under torchrun: the rank that failed first and its own code
        (None: it wrote none, killed); when several ranks ended without a word, none is named
        (`failed_rank` None) and `silent_ranks` lists them."""
        if self.rank is None:
            return {}
        if self.rank.silent_with:  # several ranks ended without a word: none is known first
            return {
                "failed_rank": None,
                "rank_exit": None,
                "silent_ranks": [*self.rank.silent_with],
            }
        return {"failed_rank": self.rank.rank, "rank_exit": self.rank.exit_code}

    @property
    def killed_by(self) -> signal.Signals | None:
        """The signal that killed the child, directly or as reported by a shell (128 + N)."""
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode)
            except ValueError:
                return None
        if self.returncode - 128 in SHELL_REPORTED:
            return signal.Signals(self.returncode - 128)
        return None

    @property
    def via_shell(self) -> bool:
        return self.returncode > 0 and self.killed_by is not None

    @property
    def kind(self) -> str:
        """One of finished, stopped, not_restartable, restart."""
        if self.returncode == 0:
            return "finished"
        if self.returncode in STOPPED or -self.returncode in STOP_SIGNALS:
            return "stopped"
        if self.returncode in NOT_RESTARTABLE:
            return "not_restartable"
        return "restart"

    @property
    def memory_kill_suspected(self) -> bool:
        """The kernel's counter rose; or a SIGKILL where no counter can be read (macOS jetsam);
        or a SIGKILL with an unchanged counter (a user-space killer such as systemd-oomd or
        earlyoom, or a plain kill -9) when memory was high at the last step. Exit 76: the
        child ran out of memory and asks for a smaller start itself."""
        if self.oom_kill_delta or self.returncode == SHRINK:
            return True
        if self.killed_by != signal.SIGKILL:
            return False
        return self.oom_kill_delta is None or (self.memory is not None and self.memory.high)

    @property
    def exit_code(self) -> int:
        """What a shell would report: the code, or 128 + the signal."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        rc, sig = self.returncode, self.killed_by
        if rc == 0:
            text = "child finished (exit 0)"
        elif self.kind == "stopped":
            name = sig.name if sig else signal.Signals(rc - 128).name
            text = (
                f"child stopped by {name} after saving (exit {rc})"
                if rc > 0
                else f"child stopped by {name} (exit {rc}); it did not handle the signal, so it "
                "saved nothing on the way out"
            )
        elif rc in NOT_RESTARTABLE:
            text = f"child exited {rc}: {NOT_RESTARTABLE[rc]}"
        elif rc == HANG and self.hang_by is not None:
            text = f"hang detected by {self.hang_by}"
        elif rc == HANG:
            text = f"hang detected by the watchdog (exit {HANG})"
        elif rc == SHRINK:
            text = f"out of memory; the child asks for a smaller micro-batch (exit {SHRINK})"
        elif rc == USER_CODE_EXIT:
            text = f"child exited {rc}: an error in your code (its message is above)"
        elif sig is None:
            text = f"child crashed with exit {rc}"
        else:
            text = self._describe_signal(sig)
        if self.oom_kill_delta:
            text += f"; cgroup oom_kill count +{self.oom_kill_delta}"
        if self.rank is not None:
            text += f"; {self.rank.describe()}"
            if self.launcher_code != self.returncode:
                text += f"; the launcher (torchrun) exited {self.launcher_code}"
        return text

    def _describe_signal(self, sig: signal.Signals) -> str:
        if self.via_shell:
            head = (
                f"child exited {self.returncode} = 128 + {sig.name} "
                "(a shell or launcher reporting a kill)"
            )
        elif sig == signal.SIGKILL:
            head = f"child killed by SIGKILL (exit {self.returncode}, shell {128 + sig})"
        elif sig == signal.SIGABRT:
            head = f"child aborted (exit {self.returncode}, SIGABRT)"
        else:
            head = f"child killed by {sig.name} (exit {self.returncode})"
        why = {
            signal.SIGKILL: _sigkill_cause(self.oom_kill_delta, self.memory),
            signal.SIGABRT: "on a Mac often a Metal assertion",
            signal.SIGSEGV: "a crash in native code",
            signal.SIGBUS: "a bad memory access; on a Mac, Metal state corrupted (e.g. by fork)",
        }.get(sig)
        return f"{head}: {why}" if why else head


def _sigkill_cause(oom_kill_delta: int | None, memory: MemoryAtKill | None) -> str:
    if oom_kill_delta is None:  # no counter (macOS, no cgroup): the usual sender is the OS
        return "most likely the OS out-of-memory killer (Linux) or macOS memory pressure (jetsam)"
    if oom_kill_delta > 0:
        return "the OS out-of-memory killer"
    text = (
        "not the kernel's out-of-memory killer (its cgroup oom_kill count is unchanged), so a "
        "user-space memory killer (systemd-oomd, earlyoom) or a kill -9"
    )
    if memory is None:
        return text + "; no memory reading in metrics.jsonl to tell which: no smaller micro-batch"
    if memory.high:
        return f"{text}; memory was high at the last step ({memory.text}): taken for a memory kill"
    return (
        f"{text}; memory was not high at the last step ({memory.text}): taken for a plain kill, "
        "no smaller micro-batch"
    )


def micro_cap_from_supervisor(environ: Mapping[str, str] = os.environ) -> int | None:
    """The child's side: `steadytrain run` sets this after a memory kill, to start the
    restarted run smaller."""
    value = environ.get(run_files.ENV_MAX_MICRO_BATCH)
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise BadInputError(
            f"{run_files.ENV_MAX_MICRO_BATCH}: {value!r} is not a whole number"
        ) from None


# ---- escalation: the memory savers the supervisor asks for --------------------------------

SAVERS_EVENT = "memory_savers"
"""The child's record, at each supervised start, of the savers in force and those left."""
SAVER_NAMES = {
    "activation_checkpointing": "activation checkpointing",
    "activation_offload": "activation checkpointing with its inputs offloaded to host memory",
    "chunked_loss": "the chunked loss",
}


def savers_from_supervisor(
    savers: Any,
    record: Any,
    step: int,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """The child's side of the escalation: under `steadytrain run`, climb the memory savers'
    ladder (`memory.savers.MemorySavers`) until as many rungs are in force as
    ENV_MEMORY_SAVERS asks (the OS killed an earlier attempt at micro-batch 1), recording a
    `memory_saver` event for each one turned on; then record which are in force and which are
    left (`memory_savers`), which the supervisor reads when this attempt is killed too."""
    if environ.get(run_files.ENV_SUPERVISED) != "1":
        return
    asked = _count(environ.get(run_files.ENV_MEMORY_SAVERS))
    if asked:
        reason = (
            f"{run_files.ENV_MEMORY_SAVERS}={asked} (supervisor: the OS killed an earlier "
            "attempt with no smaller micro-batch left)"
        )
        for info in savers.climb_to(asked, reason):
            record("memory_saver", {"step": step, **info})
    record(
        SAVERS_EVENT,
        {"step": step, "in_force": savers.in_force(), "left": savers.left(), "asked": asked},
    )


def _count(text: str | None) -> int | None:
    try:
        value = int(text) if text else None
    except ValueError:
        return None
    return value if value and value >= 1 else None


def savers_record(run_dir: Path | None, since: float) -> dict[str, Any] | None:
    """The newest `memory_savers` record in RUN_DIR/events.jsonl written at or after `since`
    (the attempt started then): None when that attempt wrote none (it was killed before its
    start-up ended, or it does not train through the Trainer). Reads the whole file: a long
    attempt writes many events after its start."""
    if run_dir is None:
        return None
    found = None
    for event in _events(run_dir, SAVERS_EVENT.encode()):
        stamp = event.get("time")
        if (
            event.get("event") == SAVERS_EVENT
            and isinstance(stamp, (int, float))
            and stamp >= since
            and isinstance(event.get("in_force"), list)
            and isinstance(event.get("left"), list)
        ):
            found = event
    return found


def announce_run_dir(run_dir: str | os.PathLike, environ: Any = os.environ) -> None:
    """Tell a supervising `steadytrain run` where this run writes (the child's side of
    ENV_ANNOUNCE_FD); nothing happens when no supervisor asked."""
    text = environ.get(run_files.ENV_ANNOUNCE_FD, "")
    if not text.isdigit():
        return
    with contextlib.suppress(OSError):  # the supervisor went away: nobody to tell
        os.write(int(text), f"{os.path.abspath(run_dir)}\n".encode())
