# long-module: one class, the restart loop over its child's life (start, wait, kill, back off)
"""`steadytrain run -- CMD ...`: run a training command and restart it when it dies.

The supervisor is a separate process that imports nothing of the training loop (no torch): it
must outlive whatever kills the trainer. One pass of its loop::

    read the checkpoint step (RUN_DIR/checkpoints/latest, or the newest "checkpoint" event in
      RUN_DIR/events.jsonl: the integrations' verified saves) and the cgroup oom_kill counter
    start CMD in its own session (process group), with STEADYTRAIN_SUPERVISED=1,
      STEADYTRAIN_RESTART=k (and STEADYTRAIN_MAX_MICRO_BATCH=n after a memory kill or exit 76;
      STEADYTRAIN_MEMORY_SAVERS=m after a memory kill with no smaller micro-batch left)
    wait; SIGINT / SIGTERM (SIGHUP as SIGTERM) to us are forwarded to the child's group, and
      no restart follows; SIGKILL if the child is still there --stop-timeout later
    while waiting, RUN_DIR/heartbeat (rewritten every second or so by the child's hang watchdog)
      unchanged for longer than it allows: the child cannot run at all (a stuck Metal wait, a
      frozen process): SIGUSR1 for a stack dump, SIGKILL, a "hang" event, then as for exit 75
    child exit:
      0                       -> exit 0
      130, 143 (or -2, -15)   -> the user stopped it: exit with that code (128 + signal)
      2, 3, 6                 -> bad input / does not fit / disk full: a restart fails the
                                 same way, so exit with that code
      anything else           -> a crash, a kill (SIGKILL: OS memory kill suspected), a hang
                                 (75), out of memory in a library's loop (76), an error in the
                                 user's code (5): the same error as the attempt before, at the
                                 same step (the trainer's "error" event): exit with that code, a
                                 restart fails the same way; a memory kill (SIGKILL) at
                                 micro-batch 1: the next memory saver the attempt's
                                 "memory_savers" record says is left, or exit 3 when none
                                 is; else read the checkpoint step
                                 again; a newer one is progress and resets the count and the
                                 backoff; after more than max_restarts failures in a row
                                 without progress, exit 4;
                                 else SIGKILL what is left of the child's group, append a
                                 "restart" event, sleep the backoff, go again
      a torchrun group (exit 1 whichever rank failed): read through the rank that failed
      first (its events under RUN_DIR/ranks/rank-N/, failures.failed_rank): named in the line
      and the restart event, and its own code (75, 76, 2, ...) decides as the child's would

The child resumes from its checkpoint by itself; the supervisor only restarts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from steadytrain import run_files
from steadytrain.errors import DISK_FULL_EXIT, DOES_NOT_FIT_EXIT, BadInputError, RunDiskFullError
from steadytrain.events import HALVING  # the out-of-memory policy (no torch)
from steadytrain.run_files import (
    ENV_ANNOUNCE_FD,
    ENV_MAX_MICRO_BATCH,
    ENV_MEMORY_SAVERS,
    ENV_RESTART,
    ENV_RUN_DIR,
    ENV_SUPERVISED,
)
from steadytrain.safety.child import (
    HANG,
    SAVER_NAMES,
    SHRINK,
    ChildExit,
    append_event,
    last_micro_batch_size,
    progress_step,
    read_oom_kill_count,
    savers_record,
)
from steadytrain.safety.failures import (
    failed_rank,
    last_error,
    memory_at_kill,
    rank_ends,
    same_failure,
)
from steadytrain.safety.watchdog import (
    ENV_START_WATCH,
    adopt_backstop_dumps,
    read_heartbeat,
    stop_start_watch,
)

GAVE_UP = 4


POLL_S = 0.1  # how often the wait loop looks at forwarded signals and the stop deadline
LEFTOVER_WAIT_S = 2.0  # killed processes go in milliseconds; a zombie counts until it is reaped
HEARTBEAT_CHECK_S = 1.0  # how often the wait loop reads RUN_DIR/heartbeat
DUMP_WAIT_S = 2.0  # after SIGUSR1, the time a frozen child gets to dump its stacks before SIGKILL


@dataclass(frozen=True)
class SupervisorOptions:
    max_restarts: int = 5
    """Give up (exit 4) after this many restarts in a row without a new checkpoint. Five, as
    systemd's StartLimitBurst: enough for bad luck, few enough that a broken job stops soon."""
    backoff_initial: float = 1.0
    """Seconds before the first restart: quick, the usual crash is a one-off."""
    backoff_max: float = 60.0
    """The delay doubles on each failure in a row without progress, up to this many seconds."""
    stop_timeout: float = 120.0
    """After forwarding SIGINT/SIGTERM, how long the child may take to save and exit before it
    gets SIGKILL. Saving a large checkpoint takes a while; two minutes covers most."""
    healthy_run_s: float = 600.0
    """A child that ran this long before dying resets the backoff (not the no-progress count),
    as Kubernetes resets CrashLoopBackOff after 10 minutes of running."""
    run_dir: Path | None = None
    """Where the run writes checkpoints/latest, metrics.jsonl and events.jsonl; None: unknown."""
    first_heartbeat_s: float = 3600.0
    """An attempt of a steadytrain run that has written no heartbeat this long after it started
    is hung before its watchdog began (importing, building the model, a blocked read) and is
    killed and restarted. An hour, as nvidia-resiliency-ext's first-heartbeat default: a model
    download or a cold import on a slow disk must not look like a hang. Applies once the run
    directory holds a config.json or an earlier attempt wrote a heartbeat (a steadytrain run)."""

    advice: Callable[[Path, list[str]], list[str]] | None = field(default=None, repr=False)
    """What would make a run the OS killed with every memory saver on fit, from its run
    directory and the savers in force; None: the general list. The command line passes the
    fine-tune advisor (this module imports nothing of the training side)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_restarts < 0:
            problems.append(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.backoff_initial >= 0:
            problems.append(f"--backoff-initial must be 0 s or more, got {self.backoff_initial}")
        if not self.backoff_max >= self.backoff_initial:
            problems.append(
                f"--backoff-max ({self.backoff_max} s) must be at least --backoff-initial "
                f"({self.backoff_initial} s)"
            )
        if not self.stop_timeout > 0:
            problems.append(f"--stop-timeout must be more than 0 s, got {self.stop_timeout}")
        if not self.first_heartbeat_s > 0:
            problems.append(
                f"--first-heartbeat-timeout must be more than 0 s, got {self.first_heartbeat_s}"
            )
        if problems:
            raise BadInputError("; ".join(problems))


def resolve_run_dir(value: str | os.PathLike | None, environ: Mapping[str, str]) -> Path | None:
    """--run-dir, else $STEADYTRAIN_RUN_DIR, else None (progress cannot be seen)."""
    if value is None:
        value = environ.get(ENV_RUN_DIR) or None
    return None if value is None else Path(value)


# ---- the supervisor ------------------------------------------------------------------------


class Supervisor:
    """Runs `command` until it finishes, is stopped, cannot succeed, or keeps failing without
    progress. `run()` returns the exit code for the `steadytrain run` process.

    `environ` is the child's base environment, `out` where the supervisor's lines go,
    `oom_kill_count` reads the OS OOM killer's counter (injectable for tests).
    """

    def __init__(
        self,
        command: Sequence[str],
        options: SupervisorOptions,
        *,
        environ: Mapping[str, str] | None = None,
        out: TextIO | None = None,
        oom_kill_count: Callable[[], int | None] = read_oom_kill_count,
    ):
        if not command:
            raise BadInputError("give the command to supervise after --: steadytrain run -- CMD")
        self.command = list(command)
        self.options = options
        self.environ = dict(os.environ if environ is None else environ)
        self.out = out if out is not None else sys.stderr
        self.oom_kill_count = oom_kill_count
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._pending: list[int] = []  # signals received, not yet forwarded
        self._stop_signal: int | None = None
        self._forwarded = 0
        self._sent_kill = False  # the stop timeout ran out and we sent SIGKILL
        self._hang: _FrozenChild | None = None  # the heartbeat went stale and we are killing
        self._caught: str | None = None  # how we caught a hang we killed, for the lines
        self._beat_key: tuple[Any, Any] | None = None
        self._beat_seen = 0.0  # our monotonic time when the heartbeat last changed
        self._child_started = 0.0  # our monotonic time when the attempt started
        self._beats_known = False  # an attempt of ours wrote a heartbeat: the child writes them
        self._next_beat_check = 0.0
        self._announced: int | None = None  # read end of the ENV_ANNOUNCE_FD pipe
        self._said_unlocated = False
        self._escalations: list[str] = []  # what each escalation turned on, for the last word

    # -- the loop, top to bottom --

    def run(self) -> int:
        stop_start_watch()  # a supervisor started by another one trains nothing itself
        # SIGINT and SIGTERM are always ours, as the trainer's own handlers take them even where
        # they were ignored (a background job); SIGHUP ignored by nohup stays ignored.
        previous = {
            sig: signal.signal(sig, self._on_signal)
            for sig in _HANDLED
            if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN
        }
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._proc is not None and self._proc.poll() is None:
                self._signal_child(signal.SIGTERM)  # we are failing: let the child save

    def _supervise(self) -> int:
        max_micro = _positive_int(self.environ.get(ENV_MAX_MICRO_BATCH))
        savers_asked = _positive_int(self.environ.get(ENV_MEMORY_SAVERS))
        no_progress = 0  # failures in a row without a newer checkpoint
        delay = self.options.backoff_initial
        error_before: dict[str, Any] | None = None  # the error the attempt before recorded
        self._say_start()
        while True:
            step_before = progress_step(self.options.run_dir)
            oom_before = self._oom_kill_count()
            started, started_wall = time.monotonic(), time.time()
            returncode = self._run_child(max_micro, savers_asked)
            ran_s = time.monotonic() - started
            if self._hang is not None:
                returncode = self._record_frozen_child(returncode)
            death = self._death(returncode, oom_before, started_wall)
            if self._caught is not None:  # we killed it: say so, not "the watchdog"
                death = dataclasses.replace(death, hang_by=self._caught)
                self._caught = None
            step = progress_step(self.options.run_dir)
            error = self._recorded_error(death, started_wall)
            final = self._final_code(death, step, error, error_before)
            if final is not None:
                return final
            error_before = error

            progressed = step is not None and (step_before is None or step > step_before)
            savers = self._saver_left(death, max_micro, started_wall)
            if savers is not None and not savers["left"]:
                return self._no_saver_left(death, step, savers, max_micro)
            # a restart with one more saver on is not the same restart again: not counted
            no_progress = 0 if progressed else no_progress + (savers is None)
            if progressed or ran_s >= self.options.healthy_run_s:
                delay = self.options.backoff_initial
            if no_progress > self.options.max_restarts:
                return self._give_up(death, step)
            if death.memory_kill_suspected:
                max_micro = self._smaller_micro_batch(max_micro, death)
            if savers is not None:
                savers_asked = self._escalate(savers, step)
            self._kill_leftovers()

            self.restarts += 1
            self._announce_restart(
                death, returncode, step, delay, max_micro, savers_asked, progressed, no_progress
            )
            if not self._sleep(delay):
                name = signal.Signals(self._stop_signal).name
                self._say(f"{name} while waiting to restart: stopping")
                return self._end(
                    128 + self._stop_signal, step, f"stopped by {name} while waiting to restart"
                )
            delay = min(delay * 2, self.options.backoff_max)

    def _announce_restart(
        self,
        death: ChildExit,
        returncode: int,
        step: int | None,
        delay: float,
        max_micro: int | None,
        savers_asked: int | None,
        progressed: bool,
        no_progress: int,
    ) -> None:
        """The `restart` event and the two lines that say why and what the next attempt gets."""
        self._record(
            "restart",
            step,
            attempt=self.restarts,
            exit_code=returncode,
            signal=death.killed_by.name if death.killed_by else None,
            reason=death.describe(),
            oom_kill_delta=death.oom_kill_delta,
            delay_s=delay,
            max_micro_batch=max_micro,
            memory_savers=savers_asked,
            progressed=progressed,
            restarts_without_progress=no_progress,
            **death.rank_fields,
        )
        self._say(death.describe())
        self._say(
            f"starting attempt {self.restarts + 1} in {_seconds(delay)} s after "
            f"{_short(death)}; {self._progress_note(progressed, step, no_progress)}"
            + (f"; {ENV_MAX_MICRO_BATCH}={max_micro}" if max_micro else "")
            + (f"; {ENV_MEMORY_SAVERS}={savers_asked}" if savers_asked else "")
        )

    def _death(self, returncode: int, oom_before: int | None, since: float) -> ChildExit:
        """How the child ended: its code, the OOM killer's count since it started, and the
        memory reading of its last step. A torchrun group that failed (torchrun exits 1 for any
        rank's failure) is read through its ranks' events since `since`: the rank that failed
        first, its code, and its own last memory reading."""
        oom_after = self._oom_kill_count()
        delta = None if None in (oom_before, oom_after) else oom_after - oom_before
        rank = failed_rank(rank_ends(self.options.run_dir, since)) if returncode > 0 else None
        folder = rank.folder if rank is not None else self.options.run_dir
        return ChildExit.of(returncode, delta, memory_at_kill(folder), rank)

    def _recorded_error(self, death: ChildExit, since: float) -> dict[str, Any] | None:
        """The error event the attempt started at `since` recorded (under torchrun: the one of
        the rank that failed first, in its own folder)."""
        return last_error(death.rank.folder if death.rank else self.options.run_dir, since)

    def _final_code(
        self,
        death: ChildExit,
        step: int | None,
        error: dict[str, Any] | None = None,
        error_before: dict[str, Any] | None = None,
    ) -> int | None:
        """The exit code when this child's end ends the supervision (asked to stop, finished,
        stopped by a signal, bad input, the same error as the attempt before at the same step);
        None when it is restarted."""
        if self._stop_signal is not None:
            how = (
                f"child killed by our SIGKILL (exit {death.returncode}): it did not stop within "
                f"{_seconds(self.options.stop_timeout)} s"
                if self._sent_kill and death.returncode == -signal.SIGKILL
                else death.describe()
            )
            self._say(f"{how}; not restarting: we were asked to stop")
            return self._end(death.exit_code, step, f"stopped: {how}")
        if death.kind == "finished":
            return self._end(0, step, death.describe())
        if death.kind == "stopped":
            self._say(f"{death.describe()}; not restarting")
            return self._end(death.exit_code, step, death.describe())
        if death.kind == "not_restartable":
            why = (
                "a restart would fail on the same full disk; free some space, then run again "
                "to resume"
                if death.exit_code == DISK_FULL_EXIT
                else "the same input fails the same way"
            )
            self._say(f"{death.describe()}; not restarting: {why} (see the child's message above)")
            return self._end(death.exit_code, step, death.describe())
        if same_failure(error, error_before):
            return self._repeated(death, error, step)
        return None

    def _repeated(self, death: ChildExit, error: dict[str, Any], step: int | None) -> int:
        """The same error at the same step twice in a row: stop at once with its exit code."""
        at = error.get("step")
        where = f" in {error['where']}" if error.get("where") else ""
        reason = (
            f"the same error as the attempt before, at the same step "
            f"({'step ' + str(at) if at is not None else 'before the first step'}): "
            f"{error.get('error')}{where}"
        )
        resume = f"step {step}" if step is not None else "the start"
        self._say(
            f"{death.describe()}: {reason}; not restarting: a restart fails the same way. Fix it "
            f"and run again (the run resumes from {resume}); the traceback is above"
        )
        return self._end(death.exit_code, step, reason)

    # -- one child --

    def _run_child(self, max_micro: int | None, savers: int | None = None) -> int:
        env = {**self.environ, ENV_SUPERVISED: "1", ENV_RESTART: str(self.restarts)}
        if self.options.run_dir is not None:  # the child watches itself from its start
            start = {
                "run_dir": str(self.options.run_dir),
                "limit_s": self.options.first_heartbeat_s,
            }
            env[ENV_START_WATCH] = json.dumps(start)
        self._hang, self._beat_key = None, None
        self._child_started = time.monotonic()
        if max_micro is not None:
            env[ENV_MAX_MICRO_BATCH] = str(max_micro)
        if savers is not None:
            env[ENV_MEMORY_SAVERS] = str(savers)
        write_end = None
        if self._announced is not None:  # a grandchild of the last attempt kept it open
            os.close(self._announced)
            self._announced = None
        if self.options.run_dir is None:  # ask the child's Trainer where it writes
            self._announced, write_end = os.pipe()
            os.set_blocking(self._announced, False)
            env[ENV_ANNOUNCE_FD] = str(write_end)
        try:
            # Own session: a terminal's Ctrl-C reaches only us, and we forward it once.
            self._proc = subprocess.Popen(
                self.command,
                env=env,
                start_new_session=True,
                pass_fds=() if write_end is None else (write_end,),
            )
        except OSError as exc:
            raise BadInputError(f"cannot start {shlex.join(self.command)}: {exc}") from exc
        finally:
            if write_end is not None:
                os.close(write_end)
        self._say(f"attempt {self.restarts + 1} runs as pid {self._proc.pid}")
        returncode = self._wait(self._proc)
        self._learn_run_dir()  # what it said before it ended
        return returncode

    def _learn_run_dir(self) -> None:
        """Take the run directory the child announced (ENV_ANNOUNCE_FD), once it did or ended."""
        if self._announced is None:
            return
        try:
            text = os.read(self._announced, 65536).decode(errors="replace").strip()
        except BlockingIOError:
            return  # nothing yet, and the child is still there
        except OSError:
            text = ""
        os.close(self._announced)
        self._announced = None
        if text:
            line = text.splitlines()[0]
            self.options = dataclasses.replace(self.options, run_dir=Path(line))
            self._say(f"run dir {line} (announced by the child); counting progress there")
        elif not self._said_unlocated:
            self._said_unlocated = True
            self._say(
                "the child announced no run dir (it trains through neither steadytrain's "
                "Trainer nor an integration's RunGuard): pass --run-dir to count its "
                "checkpoints as progress (checkpoints/latest, or checkpoint events in "
                "events.jsonl)"
            )

    def _wait(self, proc: subprocess.Popen) -> int:
        deadline: float | None = None
        while True:
            self._forward_pending()
            if self._stop_signal is not None and deadline is None:
                deadline = time.monotonic() + self.options.stop_timeout
            if deadline is not None and not self._sent_kill and time.monotonic() >= deadline:
                name = signal.Signals(self._stop_signal).name
                self._say(
                    f"child still running {_seconds(self.options.stop_timeout)} s after {name}: "
                    "sending SIGKILL"
                )
                self._signal_child(signal.SIGKILL)
                self._sent_kill = True
            if self._stop_signal is None:
                self._learn_run_dir()
                self._watch_heartbeat(proc)
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                continue

    def _watch_heartbeat(self, proc: subprocess.Popen) -> None:
        """The out-of-process hang check (reliability P9, mps.md §5): a child that cannot run
        at all cannot end itself, so its heartbeat file stops changing. Staleness is measured on
        our own monotonic clock from when we last saw the file change, so a wall-clock jump or
        a laptop's sleep does not look like a hang. Only a heartbeat of the child's process
        group counts (a previous attempt's file is ignored), and `hang_action: report` means
        that nothing is killed."""
        now = time.monotonic()
        if self._hang is not None:
            if not self._hang.killed and now >= self._hang.kill_at:
                self._signal_child(signal.SIGKILL)
                self._hang.killed = True
            return
        if self.options.run_dir is None or now < self._next_beat_check:
            return
        self._next_beat_check = now + HEARTBEAT_CHECK_S
        beat = read_heartbeat(self.options.run_dir)
        if beat is None or not _in_group(beat.get("pid"), proc):
            self._check_first_heartbeat(proc, now)
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
        if unchanged <= allowed and stalled <= allowed:
            return
        pid = int(beat["pid"])
        self._hang = _FrozenChild(pid, beat, max(unchanged, stalled), now + DUMP_WAIT_S)
        self._caught = (
            f"the supervisor: the child's heartbeat file stood still {self._hang.stalled_s:.0f} s "
            f"in {beat.get('phase')}, past the {allowed:.0f} s its watchdog allows; killed"
        )
        dump = beat.get("dump_signal")
        self._say(
            f"no progress from the child (pid {pid}, step {beat.get('step')}, "
            f"{beat.get('phase')}) for {self._hang.stalled_s:.0f} s by its heartbeat file, past "
            f"the {allowed:.0f} s its watchdog allows: it cannot end itself, so treating it as "
            f"a hang: "
            + (f"{dump} for a stack dump, then " if dump else "")
            + f"SIGKILL in {_seconds(DUMP_WAIT_S)} s"
        )
        if dump and hasattr(signal, dump):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, getattr(signal, dump))

    def _check_first_heartbeat(self, proc: subprocess.Popen, now: float) -> None:
        """An attempt that never wrote a heartbeat (hung before its watchdog started) is
        killed after `first_heartbeat_s`, once we know the child writes heartbeats."""
        if self._beat_key is not None or now - self._child_started < self.options.first_heartbeat_s:
            return
        run_dir = self.options.run_dir
        if not (self._beats_known or (run_dir is not None and (run_dir / "config.json").exists())):
            return  # not (yet) known to be a steadytrain run: it may never write one
        waited = now - self._child_started
        beat = {"pid": proc.pid, "step": progress_step(run_dir), "phase": "start-up"}
        self._hang = _FrozenChild(proc.pid, beat, waited, now)
        self._caught = (
            f"the supervisor: no heartbeat {waited:.0f} s after the child started "
            f"(--first-heartbeat-timeout {self.options.first_heartbeat_s:.0f} s); killed"
        )
        self._say(
            f"no heartbeat from the child (pid {proc.pid}) {waited:.0f} s after it started, "
            f"past --first-heartbeat-timeout {self.options.first_heartbeat_s:.0f} s: it hung "
            "before its watchdog began; treating it as a hang: SIGKILL"
        )

    def _record_frozen_child(self, returncode: int) -> int:
        """After a kill for a stale heartbeat: turn the child's stack dump (if SIGUSR1 reached
        it) into a hang report, record one "hang" event, and answer as for exit 75 (a restart,
        and no smaller micro-batch: this SIGKILL was ours, not the OS's)."""
        hang, run_dir = self._hang, self.options.run_dir
        self._hang = None
        if hang is None or run_dir is None:
            return returncode
        extra = {"stalled_s": round(hang.stalled_s, 1), "exit_code": returncode}
        made = adopt_backstop_dumps(
            run_dir,
            lambda name, info: self._record(name, info.pop("step", None), **info),
            only_pid=hang.pid,
            detected_by="supervisor",
            extra=extra,
        )
        if not made:
            self._record(
                "hang",
                hang.beat.get("step"),
                phase=hang.beat.get("phase"),
                pid=hang.pid,
                file=None,
                detected_by="supervisor",
                **extra,
            )
        return HANG

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only record: the wait loop forwards within POLL_S (no race with starting a child).
        self._pending.append(signum)
        if self._stop_signal is None:
            self._stop_signal = signal.SIGTERM if signum == signal.SIGHUP else signum

    def _forward_pending(self) -> None:
        while self._pending:
            signum = self._pending.pop(0)
            forward = signal.SIGTERM if signum == signal.SIGHUP else signal.Signals(signum)
            self._forwarded += 1
            if self._forwarded == 1:
                self._say(
                    f"got {signal.Signals(signum).name}: forwarding {forward.name} to the child "
                    f"(pid {self._proc.pid if self._proc else '-'}) and not restarting it; "
                    f"waiting up to {_seconds(self.options.stop_timeout)} s for it to save and stop"
                )
            else:
                self._say(f"got {signal.Signals(signum).name} again: forwarding {forward.name}")
            self._signal_child(forward)

    def _signal_child(self, signum: int) -> None:
        """Send to the child's process group: the child and what it started (data workers,
        torchrun's workers), as a terminal's Ctrl-C would."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(self._proc.pid, signum)

    def _kill_leftovers(self) -> None:
        """Processes the dead child left in its group (data workers) would hold memory the next
        attempt needs, and inherited file descriptors such as the run directory's lock. The
        group id stays reserved while any member lives, so this cannot hit an unrelated
        process. Waits (briefly: members not yet reaped still count) until they are gone."""
        if self._proc is None:
            return
        self._signal_child(signal.SIGKILL)
        end = time.monotonic() + LEFTOVER_WAIT_S
        while time.monotonic() < end:
            try:
                os.killpg(self._proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.01)

    def _sleep(self, seconds: float) -> bool:
        """Sleep, unless a stop signal comes first (then False)."""
        end = time.monotonic() + seconds
        while self._stop_signal is None:
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, POLL_S))
        self._pending.clear()  # no child to forward to
        return False

    # -- decisions and records --

    def _smaller_micro_batch(self, cap: int | None, death: ChildExit | None = None) -> int | None:
        """Half the micro-batch in force when the child was killed: the last one metrics.jsonl
        shows (the child, or the rank that failed, exited 76: its last oom event's), no more
        than the cap already set; None (no cap) when none is known."""
        run_dir = self.options.run_dir
        known = [last_micro_batch_size(run_dir), cap]
        if death is not None and death.returncode == SHRINK:
            folder = death.rank.folder if death.rank is not None else run_dir
            known.append(last_micro_batch_size(folder, run_files.EVENTS, "oom"))
        known = [v for v in known if v is not None]
        return (HALVING.next(min(known)) or 1) if known else None

    def _saver_left(self, death: ChildExit, cap: int | None, since: float) -> dict[str, Any] | None:
        """After an OS memory kill (SIGKILL: the counter rose, or memory was high at the last
        step, or no counter and no reading to tell) with no smaller
        micro-batch left (micro-batch 1 in force, or none known): the savers the attempt had in
        force and those left, as it recorded them at its start (`child.savers_from_supervisor`);
        None when there is no escalation to decide: another end, a shrink is left, or the
        attempt recorded none (killed before its start-up ended, or not a Trainer's run)."""
        if death.killed_by != signal.SIGKILL or not death.memory_kill_suspected:
            return None
        if not death.oom_kill_delta and death.memory is not None and not death.memory.high:
            return None  # no counter to tell, and memory was not high: maybe a plain kill -9
        folder = death.rank.folder if death.rank is not None else self.options.run_dir
        known = [v for v in (last_micro_batch_size(folder), cap) if v is not None]
        if known and min(known) > 1:
            return None  # halving the micro-batch is the next step
        return savers_record(folder, since)

    def _escalate(self, savers: dict[str, Any], step: int | None) -> int:
        """Ask the next attempt for one more saver than this one had in force; record it."""
        saver = str(savers["left"][0])
        asked = len(savers["in_force"]) + 1
        self._escalations.append(f"{_saver_name(saver)} (attempt {self.restarts + 2})")
        self._record(
            "memory_escalation",
            step,
            saver=saver,
            in_force=savers["in_force"],
            left=savers["left"],
            memory_savers=asked,
        )
        self._say(
            "the OS killed the child for memory with no smaller micro-batch left: the next "
            f"attempt turns on {_saver_name(saver)} ({ENV_MEMORY_SAVERS}={asked})"
        )
        return asked

    def _no_saver_left(
        self, death: ChildExit, step: int | None, savers: dict[str, Any], cap: int | None
    ) -> int:
        """Killed for memory at micro-batch 1 with every saver it can use in force: a restart
        is killed the same way, so stop with exit 3 and say what was tried and what would
        help."""
        in_force = ", ".join(_saver_name(s) for s in savers["in_force"]) or "none it can use"
        folder = death.rank.folder if death.rank is not None else self.options.run_dir
        known = [v for v in (last_micro_batch_size(folder), cap) if v is not None]
        micro = f"micro-batch {min(known)}" if known else "before its first step"
        tried = [micro, *self._escalations]
        reason = (
            f"killed for memory at {micro} with no memory saver left to turn on (in force: "
            f"{in_force}): it does not fit this machine's memory"
        )
        resume = f"step {step}" if step is not None else "the start"
        self._say(
            f"{death.describe()}; {reason}; not restarting (exit {DOES_NOT_FIT_EXIT}). Tried: "
            f"{'; '.join(tried)}. What would help: {_advice(self.options.advice, folder, savers['in_force'])}. Run "
            f"again to resume from {resume}"
        )
        self._record(
            "supervisor_end",
            step,
            exit_code=DOES_NOT_FIT_EXIT,
            restarts=self.restarts,
            reason=reason,
            tried=tried,
            in_force=savers["in_force"],
        )
        return DOES_NOT_FIT_EXIT

    def _give_up(self, death: ChildExit, step: int | None) -> int:
        run_dir = self.options.run_dir
        n = self.options.max_restarts
        reason = f"gave up after {_restarts(n)} without a new checkpoint; last: {death.describe()}"
        where = (
            f"; see {run_dir / 'events.jsonl'}"
            if run_dir
            else " (no run dir, so progress could not be seen: pass --run-dir)"
        )
        self._say(reason + where)
        self._record(
            "supervisor_gave_up",
            step,
            exit_code=GAVE_UP,
            restarts=self.restarts,
            last_exit_code=death.returncode,
            signal=death.killed_by.name if death.killed_by else None,
            reason=reason,
        )
        return GAVE_UP

    def _end(self, code: int, step: int | None, reason: str) -> int:
        self._record("supervisor_end", step, exit_code=code, restarts=self.restarts, reason=reason)
        return code

    def _record(self, event: str, step: int | None, **fields: Any) -> None:
        if self.options.run_dir is None:
            return
        try:
            append_event(
                self.options.run_dir, {"time": time.time(), "event": event, "step": step, **fields}
            )
        except (OSError, RunDiskFullError) as exc:  # a full disk must not stop the supervising
            self._say(f"{exc}; the run goes on without this {event} event")

    def _oom_kill_count(self) -> int | None:
        try:
            return self.oom_kill_count()
        except Exception:  # noqa: BLE001 - a counter we cannot read is only a missing detail
            return None

    def _progress_note(self, progressed: bool, step: int | None, no_progress: int) -> str:
        limit = self.options.max_restarts
        if progressed:
            return f"new checkpoint at step {step}, so the count without progress starts again"
        return f"restart {no_progress} of {limit} without a new checkpoint"

    def _say_start(self) -> None:
        opts = self.options
        self._say(
            f"starting attempt 1: {shlex.join(self.command)} (gives up after "
            f"{_restarts(opts.max_restarts)} without a new checkpoint)"
        )
        if opts.run_dir is None:
            self._say(
                "run dir not known yet (no --run-dir, $STEADYTRAIN_RUN_DIR or fine-tune "
                "output_dir): a Trainer or an integration in the child announces its "
                "run_dir; until it does, checkpoints cannot be seen"
            )
        elif not opts.run_dir.exists():
            self._say(f"run dir {opts.run_dir} does not exist yet; watching it for checkpoints")

    def _say(self, text: str) -> None:
        print(f"steadytrain run: {text}", file=self.out, flush=True)


_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _FrozenChild:
    pid: int
    beat: dict[str, Any]
    stalled_s: float
    kill_at: float
    killed: bool = False


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


def _saver_name(name: str) -> str:
    return SAVER_NAMES.get(name, name)


def _short(death: ChildExit) -> str:
    if death.killed_by is not None:
        return f"{death.killed_by.name} (exit {death.returncode})"
    if death.returncode == HANG:
        return "a hang (exit 75)"
    return f"exit {death.returncode}"


def _restarts(n: int) -> str:
    return f"{n} restart{'' if n == 1 else 's'}"


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text else None
    except ValueError:
        return None
    return value if value and value >= 1 else None


GENERAL_ADVICE = (
    "shorter sequences, 16-bit weights (precision: bf16, or a fine-tune's bf16: true), a smaller "
    "model or LoRA rank, closing other programs that hold memory, or a machine with more memory; "
    "`steadytrain estimate` gives the peak of each"
)


def _advice(advice: Callable | None, run_dir: Path | None, in_force: list[str]) -> str:
    """What would make a killed run fit: `advice` (SupervisorOptions.advice: from the command
    line, the fine-tune advisor, each config key and value with the total it gives) on the run
    directory; for any other program, or where its model cannot be read, the general list."""
    if run_dir is None or advice is None:
        return GENERAL_ADVICE
    try:
        found = advice(run_dir, list(in_force))
    except Exception:  # noqa: BLE001 - advice must never stop the supervisor's last word
        return GENERAL_ADVICE
    return "; ".join(found) if found else GENERAL_ADVICE
