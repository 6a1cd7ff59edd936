"""How the supervisor's child ended (`ChildExit`): its exit code or signal read as finished,
stopped, not restartable or to be restarted, a memory kill suspected or not, and said in words
for the supervisor's lines and its restart event. Standard library only."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from steadytrain.errors import (
    DISK_FULL_EXIT,
    RESTARTABLE_EXIT,
    SHRINK_EXIT,
    SIGNAL_EXITS,
    USER_CODE_EXIT,
)
from steadytrain.supervisor.address_space import AddressSpace
from steadytrain.supervisor.attempt_end import MemoryAtKill, RankEnd

HANG = RESTARTABLE_EXIT
SHRINK = SHRINK_EXIT
STOPPED = tuple(SIGNAL_EXITS.values())  # 129 SIGHUP, 130 SIGINT, 143 SIGTERM: saved and stopped
# A torchrun group's failed rank's exit code that decides the restart as the child's would
# (torchrun itself exits 1 whichever rank failed and however).
RANK_CODES = (2, 3, USER_CODE_EXIT, DISK_FULL_EXIT, HANG, SHRINK)
NOT_RESTARTABLE = {
    2: "bad input",
    3: "does not fit even at micro-batch 1",
    DISK_FULL_EXIT: "disk full",  # a restart would fail on the same full disk
}
# Signals that mean "stop", not "crashed": the user (or the OS shutting down) asked for it.
STOP_SIGNALS = tuple(getattr(signal, name) for name in SIGNAL_EXITS if hasattr(signal, name))
# A shell or launcher between us and the trainer reports a process killed by signal N as exit
# 128 + N. Only these are read that way: for other values above 128 the guess would be wild.
SHELL_REPORTED = (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
# How native code ends when an allocation fails under an address-space cap instead of raising
# (`address_space`): oneDNN's kernels in TensorFlow dereference it (SIGSEGV); a C++ bad_alloc or
# a thread without a stack aborts (SIGABRT).
NATIVE_CRASHES = (signal.SIGSEGV, signal.SIGABRT)


@dataclass(frozen=True)
class ChildExit:
    """A child's end as `Popen.returncode` gives it (negative: killed by that signal), how
    much the cgroup's oom_kill counter rose meanwhile (None: not readable), and the memory
    reading of its last step (None: no metrics line to tell).

    Under torchrun, `rank` is the rank that failed first (`attempt_end.failed_rank`) and
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
    before_first_step: bool = False
    """Killed by SIGKILL before the run recorded any step, with no new checkpoint: taken for a
    memory kill whatever the counter says (`start_kill`: no reading can tell)."""
    while_starting: bool = False
    """Before the first step, and before the attempt wrote any record: it died before `fit()`
    began (loading the model)."""
    address_space: AddressSpace | None = None
    """The child's address space and its cap as last sampled (None: no cap, or no reading)."""

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
    def crashed_near_cap(self) -> bool:
        """Killed by SIGSEGV or SIGABRT with its address space near its cap (RLIMIT_AS): an
        allocation that failed in native code, taken for an out-of-memory (`address_space`)."""
        space = self.address_space
        return self.killed_by in NATIVE_CRASHES and space is not None and space.near

    @property
    def memory_kill_suspected(self) -> bool:
        """The kernel's counter rose; or a SIGKILL where no counter can be read (macOS jetsam);
        or a SIGKILL with an unchanged counter (a user-space killer such as systemd-oomd or
        earlyoom, or a plain kill -9) when memory was high at the last step; or a native crash
        near the address-space cap. Exit 76: the child ran out of memory and asks for a smaller
        start itself."""
        if self.oom_kill_delta or self.returncode == SHRINK or self.crashed_near_cap:
            return True
        if self.killed_by != signal.SIGKILL:
            return False
        if self.before_first_step:
            return True
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
            signal.SIGKILL: _sigkill_cause(self.oom_kill_delta, self.memory, self._start()),
            signal.SIGABRT: "on a Mac often a Metal assertion",
            signal.SIGSEGV: "a crash in native code",
            signal.SIGBUS: "a bad memory access; on a Mac, Metal state corrupted (e.g. by fork)",
        }.get(sig)
        if self.crashed_near_cap and self.address_space is not None:
            why = (
                f"a crash in native code, and {self.address_space.text}: taken for an "
                "allocation that failed there (out of memory)"
            )
        return f"{head}: {why}" if why else head

    def _start(self) -> str | None:
        """When the kill came, if before the run's first step: in words; else None."""
        if self.while_starting:
            return "while it started, before it wrote any record (loading the model)"
        if self.before_first_step:
            return "before the run recorded its first step"
        return None


def _sigkill_cause(
    oom_kill_delta: int | None, memory: MemoryAtKill | None, start: str | None = None
) -> str:
    when = f"; killed {start}" if start else ""
    if oom_kill_delta is None:  # no counter (macOS, no cgroup): the usual sender is the OS
        return (
            "most likely the OS out-of-memory killer (Linux) or macOS memory pressure (jetsam)"
            + when
        )
    if oom_kill_delta > 0:
        return "the OS out-of-memory killer" + when
    text = (
        "not the kernel's out-of-memory killer (its cgroup oom_kill count is unchanged), so a "
        "user-space memory killer (systemd-oomd, earlyoom) or a kill -9"
    )
    if start:
        return (
            f"{text}{when}, with no memory reading to tell which: taken for a memory kill (a "
            "model too large for this machine is killed while it loads)"
        )
    if memory is None:
        return text + "; no memory reading in metrics.jsonl to tell which: no smaller micro-batch"
    if memory.high:
        return f"{text}; memory was high at the last step ({memory.text}): taken for a memory kill"
    return (
        f"{text}; memory was not high at the last step ({memory.text}): taken for a plain kill, "
        "no smaller micro-batch"
    )
