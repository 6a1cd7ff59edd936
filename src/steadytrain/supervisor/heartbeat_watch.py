"""The supervisor's out-of-process hang check (reliability P9, mps.md §5): a child that cannot run
at all (a stuck Metal wait, a frozen process) cannot end itself, so its RUN_DIR/heartbeat, which
its hang watchdog rewrites every second or so, stops changing. Past what the heartbeat allows:
SIGUSR1 for a stack dump, SIGKILL, one "hang" event; an attempt that never wrote a heartbeat is
killed after --first-heartbeat-timeout once the child is known to write them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain.run.hangs import adopt_backstop_dumps, read_heartbeat
from steadytrain.run.records import Record
from steadytrain.supervisor.child_exit import HANG
from steadytrain.supervisor.options import SupervisorOptions
from steadytrain.supervisor.progress import progress_step
from steadytrain.supervisor.words import seconds

HEARTBEAT_CHECK_S = 1.0  # how often the wait loop reads RUN_DIR/heartbeat
DUMP_WAIT_S = 2.0  # after SIGUSR1, the time a frozen child gets to dump its stacks before SIGKILL


@dataclass
class FrozenChild:
    pid: int
    beat: dict[str, Any]
    stalled_s: float
    kill_at: float
    killed: bool = False


class HeartbeatWatch:
    """The heartbeat of one attempt at a time. `say` prints a supervisor line, `record` appends
    an event (name, step, fields), `kill` sends a signal to the child's process group."""

    def __init__(
        self,
        say: Callable[[str], None],
        record: Callable[..., None],
        kill: Callable[[int], None],
    ):
        self.say, self.record, self.kill = say, record, kill
        self.hang: FrozenChild | None = None  # the heartbeat went stale and we are killing
        self.caught: str | None = None  # how we caught a hang we killed, for the lines
        self._beat_key: tuple[Any, Any] | None = None
        self._beat_seen = 0.0  # our monotonic time when the heartbeat last changed
        self._child_started = 0.0  # our monotonic time when the attempt started
        self._beats_known = False  # an attempt of ours wrote a heartbeat: the child writes them
        self._next_beat_check = 0.0

    def new_attempt(self) -> None:
        self.hang, self._beat_key = None, None
        self._child_started = time.monotonic()

    def check(self, proc: subprocess.Popen, options: SupervisorOptions) -> None:
        """Staleness is measured on our own monotonic clock from when we last saw the file
        change, so a wall-clock jump or a laptop's sleep does not look like a hang. Only a
        heartbeat of the child's process group counts (a previous attempt's file is ignored),
        and `hang_action: report` means that nothing is killed."""
        now = time.monotonic()
        if self.hang is not None:
            if not self.hang.killed and now >= self.hang.kill_at:
                self.kill(signal.SIGKILL)
                self.hang.killed = True
            return
        if options.run_dir is None or now < self._next_beat_check:
            return
        self._next_beat_check = now + HEARTBEAT_CHECK_S
        beat = read_heartbeat(options.run_dir)
        if beat is None or not _in_group(beat.get("pid"), proc):
            self._check_first_heartbeat(proc, now, options)
            return
        self._beats_known = True
        if beat.get("action") != "exit":
            return
        key = (beat.get("pid"), beat.get("written"))
        if key != self._beat_key:
            self._beat_key, self._beat_seen = key, now
        try:
            allowed = float(beat["stale_after_s"])
            stalled = float(beat.get("stalled_s") or 0.0)
        except (KeyError, TypeError, ValueError):
            return
        unchanged = now - self._beat_seen
        if unchanged > allowed or stalled > allowed:
            self._frozen(beat, allowed, max(unchanged, stalled), now)

    def _frozen(self, beat: dict[str, Any], allowed: float, stalled: float, now: float) -> None:
        pid = int(beat["pid"])
        self.hang = FrozenChild(pid, beat, stalled, now + DUMP_WAIT_S)
        self.caught = (
            f"the supervisor: the child's heartbeat file stood still {stalled:.0f} s "
            f"in {beat.get('phase')}, past the {allowed:.0f} s its watchdog allows; killed"
        )
        dump = beat.get("dump_signal")
        self.say(
            f"no progress from the child (pid {pid}, step {beat.get('step')}, "
            f"{beat.get('phase')}) for {stalled:.0f} s by its heartbeat file, past "
            f"the {allowed:.0f} s its watchdog allows: it cannot end itself, so treating it as "
            f"a hang: "
            + (f"{dump} for a stack dump, then " if dump else "")
            + f"SIGKILL in {seconds(DUMP_WAIT_S)} s"
        )
        if dump and hasattr(signal, dump):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, getattr(signal, dump))

    def _check_first_heartbeat(
        self, proc: subprocess.Popen, now: float, options: SupervisorOptions
    ) -> None:
        """An attempt that never wrote a heartbeat (hung before its watchdog started) is
        killed after `first_heartbeat_s`, once we know the child writes heartbeats."""
        limit = options.first_heartbeat_s
        if self._beat_key is not None or now - self._child_started < limit:
            return
        run_dir = options.run_dir
        if not (self._beats_known or (run_dir is not None and (run_dir / "config.json").exists())):
            return  # not (yet) known to be a steadytrain run: it may never write one
        waited = now - self._child_started
        beat = {"pid": proc.pid, "step": progress_step(run_dir), "phase": "start-up"}
        self.hang = FrozenChild(proc.pid, beat, waited, now)
        self.caught = (
            f"the supervisor: no heartbeat {waited:.0f} s after the child started "
            f"(--first-heartbeat-timeout {limit:.0f} s); killed"
        )
        self.say(
            f"no heartbeat from the child (pid {proc.pid}) {waited:.0f} s after it started, "
            f"past --first-heartbeat-timeout {limit:.0f} s: it hung "
            "before its watchdog began; treating it as a hang: SIGKILL"
        )

    def record_frozen_child(self, returncode: int, run_dir: Path | None) -> int:
        """After a kill for a stale heartbeat: turn the child's stack dump (if SIGUSR1 reached
        it) into a hang report, record one "hang" event, and answer as for exit 75 (a restart,
        and no smaller micro-batch: this SIGKILL was ours, not the OS's)."""
        hang, self.hang = self.hang, None
        if hang is None or run_dir is None:
            return returncode
        extra = {"stalled_s": round(hang.stalled_s, 1), "exit_code": returncode}
        made = adopt_backstop_dumps(
            run_dir,
            lambda name, info: self.record(name, info.pop("step", None), **info),
            only_pid=hang.pid,
            detected_by="supervisor",
            extra=extra,
        )
        if not made:
            self.record(
                Record.HANG,
                hang.beat.get("step"),
                phase=hang.beat.get("phase"),
                pid=hang.pid,
                file=None,
                detected_by="supervisor",
                **extra,
            )
        return HANG


def _in_group(pid: Any, proc: subprocess.Popen) -> bool:
    """The heartbeat's writer is the child or runs in its process group (a shell or launcher
    between us and the trainer); a dead or unrelated pid is not ours."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == proc.pid:
        return True
    try:
        return os.getpgid(pid) == proc.pid
    except (ProcessLookupError, PermissionError):
        return False
