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
      0                       -> exit 0; but when the attempt's last fit_end says its run
                                 did not finish (the program caught what fit() raised): 130 /
                                 143 for a stop by a signal, else judged as that exit code
      129, 130, 143           -> the user stopped it (SIGHUP, SIGINT, SIGTERM; or killed by
      (or -1, -2, -15)           one of them): exit with that code (128 + signal)
      2, 3, 6                 -> bad input / does not fit / disk full: a restart fails the
                                 same way, so exit with that code
      anything else           -> a crash, a kill (SIGKILL: OS memory kill suspected), a hang
                                 (75), out of memory in a library's loop (76), a SIGSEGV or
                                 SIGABRT with the child's address space near its RLIMIT_AS
                                 (address_space: an allocation that failed in native code,
                                 judged as a memory kill), an error in the
                                 user's code (5): the same error as the attempt before, at the
                                 same step (the trainer's "error" event): exit with that code, a
                                 restart fails the same way; a memory kill (SIGKILL) at
                                 micro-batch 1: the next memory saver the attempt's
                                 "memory_savers" record says is left, or exit 3 when none
                                 is; a SIGKILL before the run recorded any step
                                 (start_kill: no metrics line, no new checkpoint) is
                                 taken for a memory kill; one before the attempt wrote any
                                 record (loading the model) for one at the smallest size:
                                 the next saver of the ladder, and exit 3 "killed by the
                                 OS while starting" when none is left; else read the
                                 checkpoint step
                                 again; a newer one is progress and resets the count and the
                                 backoff; after more than max_restarts failures in a row
                                 without progress, exit 4;
                                 else SIGKILL what is left of the child's group, append a
                                 "restart" event, sleep the backoff, go again
      a torchrun group (exit 1 whichever rank failed): read through the rank that failed
      first (its events under RUN_DIR/ranks/rank-N/, attempt_end.failed_rank): named in the line
      and the restart event, and its own code (75, 76, 2, ...) decides as the child's would

The child resumes from its checkpoint by itself; the supervisor only restarts it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from steadytrain._terminal import say
from steadytrain.errors import (
    DISK_FULL_EXIT,
    DOES_NOT_FIT_EXIT,
    SHRINK_EXIT,
    BadInputError,
    RunDiskFullError,
)
from steadytrain.run import env as run_env
from steadytrain.run.events import append_event
from steadytrain.run.files import ENV_FSDP_OFFLOAD, ENV_MAX_MICRO_BATCH, ENV_MEMORY_SAVERS
from steadytrain.run.records import Record
from steadytrain.supervisor.attempt_end import (
    ended_run,
    failed_rank,
    last_error,
    memory_at_kill,
    physical_memory,
    rank_ends,
    same_failure,
)
from steadytrain.supervisor.child_exit import STOPPED, ChildExit
from steadytrain.supervisor.child_process import ChildProcess
from steadytrain.supervisor.oom_counter import read_oom_kill_count
from steadytrain.supervisor.options import SupervisorOptions
from steadytrain.supervisor.progress import AttemptStart, progress_step
from steadytrain.supervisor.restart_size import (
    folder_of,
    halved_in_process,
    offload_left,
    saver_left,
    smaller_micro_batch,
    smallest_micro_batch,
)
from steadytrain.supervisor.start_kill import recorded_a_step, what_is_known, wrote_nothing
from steadytrain.supervisor.words import (
    START_ADVICE,
    fit_advice,
    group_advice,
    restarts,
    saver_name,
    seconds,
    short,
    start_advice,
)

GAVE_UP = 4
FSDP_OFFLOAD_WORDS = "the shards in host memory (FSDP2's offload policy, fsdp_offload)"
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
        self.environ = dict(os.environ if environ is None else environ)
        # A cap or a saver count set by hand is the first attempt's (refused here, exit 2, when
        # it is not a number the child would take: `run_env`, the child's reader too).
        self._first_cap = run_env.max_micro_batch(self.environ)
        self._first_savers = run_env.memory_savers(self.environ) or None
        self.out = out if out is not None else sys.stderr
        self.oom_kill_count = oom_kill_count
        self.restarts = 0
        self.child = ChildProcess(self.command, self.environ, options, self._say, self._record)
        self._escalations: list[str] = []  # each halving (in the process or by a cap) and saver
        # turned on, in order, for the last word's "Tried:"
        self._fsdp_offload = False  # asked of every start since a sharded group ran out with
        # every saver in force (ENV_FSDP_OFFLOAD)

    @property
    def options(self) -> SupervisorOptions:
        """The options, with the run directory the child announced once it did."""
        return self.child.options

    # -- the loop, top to bottom --

    def run(self) -> int:
        # SIGINT and SIGTERM are always ours, as the trainer's own handlers take them even where
        # they were ignored (a background job); SIGHUP ignored by nohup stays ignored.
        previous = {
            sig: signal.signal(sig, self.child.on_signal)
            for sig in _HANDLED
            if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN
        }
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.child.running():
                self.child.signal(signal.SIGTERM)  # we are failing: let the child save

    def _supervise(self) -> int:
        max_micro, savers_asked = self._first_cap, self._first_savers
        no_progress = 0  # failures in a row without a newer checkpoint
        delay = self.options.backoff_initial
        error_before: dict[str, Any] | None = None  # the error the attempt before recorded
        self._say_start()
        while True:
            step_before = progress_step(self.options.run_dir)
            started = AttemptStart.now(self.options.run_dir)  # a place, not a clock's time
            returncode, death, ran_s = self._attempt(max_micro, savers_asked, started)
            step = progress_step(self.options.run_dir)
            progressed = step is not None and (step_before is None or step > step_before)
            death = self._before_first_step(death, started, progressed)
            ended = ended_run(self.options.run_dir, started) if returncode == 0 else None
            if ended is not None and ended["exit_code"] not in STOPPED:
                returncode, death = self._caught(ended, death)  # judged by its run's end
                ended = None
            halved = halved_in_process(
                folder_of(self.options.run_dir, death), started, self.restarts + 1
            )
            if halved is not None:  # the last word's "Tried:" names the attempt's own halvings
                self._escalations.append(halved)
            error = self._recorded_error(death, started)
            final = self._final_code(death, step, error, error_before, ended)
            if final is not None:
                return final
            error_before = error

            savers = saver_left(self.options.run_dir, death, max_micro, started, savers_asked)
            offload = False  # the next start shards with FSDP2's offload policy
            if savers is not None and not savers["left"]:
                offload = not self._fsdp_offload and offload_left(death, started)
                if not offload:
                    return self._no_saver_left(death, step, savers, max_micro)
            smaller = self._smaller_start(death, max_micro) if savers is None else None
            # a restart with a smaller micro-batch or one more saver on is not the same restart
            # again: not counted (each ladder has an end: micro-batch 1, the last saver)
            same = savers is None and smaller is None
            no_progress = 0 if progressed else no_progress + same
            if progressed or ran_s >= self.options.healthy_run_s:
                delay = self.options.backoff_initial
            if no_progress > self.options.max_restarts:
                return self._give_up(death, step)
            if death.memory_kill_suspected and not death.while_starting:
                max_micro = smaller_micro_batch(self.options.run_dir, max_micro, death)
            if smaller is not None:  # a halving: the last word's "Tried:" names it
                self._escalations.append(f"micro-batch {smaller} (attempt {self.restarts + 2})")
            if offload:
                self._offload(savers, step, death)
            elif savers is not None:
                savers_asked = self._escalate(savers, step, death)
            self.child.kill_leftovers()

            self.restarts += 1
            self._announce_restart(
                death,
                returncode,
                step,
                delay,
                max_micro,
                savers_asked,
                progressed,
                no_progress,
                counted=same,
            )
            if not self.child.sleep(delay):
                return self._stopped_waiting(step)
            delay = min(delay * 2, self.options.backoff_max)

    def _attempt(
        self, max_micro: int | None, savers: int | None, mark: AttemptStart
    ) -> tuple[int, ChildExit, float]:
        """One attempt, start to end: its return code, how it ended, and how long it ran."""
        oom_before = self._oom_kill_count()
        started = time.monotonic()
        returncode = self.child.run(self.restarts, max_micro, savers, self._fsdp_offload)
        ran_s = time.monotonic() - started
        watch = self.child.heartbeat
        if watch.hang is not None:
            returncode = watch.record_frozen_child(returncode, self.options.run_dir)
        death = self._death(returncode, oom_before, mark)
        if watch.caught is not None:  # we killed it: say so, not "the watchdog"
            death = dataclasses.replace(death, hang_by=watch.caught)
            watch.caught = None
        return returncode, death, ran_s

    def _before_first_step(
        self, death: ChildExit, since: AttemptStart, progressed: bool
    ) -> ChildExit:
        """`death` marked when the OS killed the child (SIGKILL) before the run recorded any
        step (no metrics line, no new checkpoint), and whether before the attempt wrote any
        record at all (it was loading the model): such a kill is taken for a memory kill at
        the smallest size (`start_kill`)."""
        folder = folder_of(self.options.run_dir, death)
        if (
            death.killed_by != signal.SIGKILL
            or folder is None
            or progressed
            or recorded_a_step(folder)
        ):
            return death
        return dataclasses.replace(
            death, before_first_step=True, while_starting=wrote_nothing(folder, since)
        )

    def _smaller_start(self, death: ChildExit, cap: int | None) -> int | None:
        """The smaller micro-batch cap the next attempt gets after a memory kill or exit 76,
        when it is smaller than the micro-batch in force (the last metrics line's, no more than
        the cap); None when the next attempt would start as large as this one did."""
        if not death.memory_kill_suspected or death.while_starting:
            return None  # a kill while the model loads is at the smallest size already
        smaller = smaller_micro_batch(self.options.run_dir, cap, death)
        in_force = smallest_micro_batch(folder_of(self.options.run_dir, death), cap)
        if smaller is None or (in_force is not None and smaller >= in_force):
            return None
        return smaller

    def _stopped_waiting(self, step: int | None) -> int:
        name = signal.Signals(self.child.stop_signal).name
        self._say(f"{name} while waiting to restart: stopping")
        return self._end(
            128 + self.child.stop_signal, step, f"stopped by {name} while waiting to restart"
        )

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
        counted: bool = True,
    ) -> None:
        """The `restart` event and the two lines that say why and what the next attempt gets."""
        self._record(
            Record.RESTART,
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
            f"starting attempt {self.restarts + 1} in {seconds(delay)} s after "
            f"{short(death)}; {self._progress_note(progressed, step, no_progress, counted)}"
            + (f"; {ENV_MAX_MICRO_BATCH}={max_micro}" if max_micro else "")
            + (f"; {ENV_MEMORY_SAVERS}={savers_asked}" if savers_asked else "")
            + (f"; {ENV_FSDP_OFFLOAD}=1" if self._fsdp_offload else "")
        )

    def _death(self, returncode: int, oom_before: int | None, since: AttemptStart) -> ChildExit:
        """How the child ended: its code, the OOM killer's count since it started, and the
        memory reading of its last step. A torchrun group that failed (torchrun exits 1 for any
        rank's failure) is read through its ranks' events since `since`: the rank that failed
        first, its code, and its own last memory reading."""
        oom_after = self._oom_kill_count()
        delta = None if None in (oom_before, oom_after) else oom_after - oom_before
        rank = failed_rank(rank_ends(self.options.run_dir, since)) if returncode > 0 else None
        folder = rank.folder if rank is not None else self.options.run_dir
        death = ChildExit.of(returncode, delta, memory_at_kill(folder), rank)
        return dataclasses.replace(death, address_space=self.child.address_space)

    def _recorded_error(self, death: ChildExit, since: AttemptStart) -> dict[str, Any] | None:
        """The error event the attempt started at `since` recorded (under torchrun: the one of
        the rank that failed first, in its own folder)."""
        return last_error(death.rank.folder if death.rank else self.options.run_dir, since)

    def _final_code(
        self,
        death: ChildExit,
        step: int | None,
        error: dict[str, Any] | None = None,
        error_before: dict[str, Any] | None = None,
        stopped: dict[str, Any] | None = None,
    ) -> int | None:
        """The exit code when this child's end ends the supervision (asked to stop, finished,
        stopped by a signal, bad input, the same error as the attempt before at the same step);
        None when it is restarted. `stopped`: the attempt's fit_end of a run stopped by a
        signal (130 / 143), when the child then exited 0."""
        if stopped is not None:
            return self._stopped_then_0(stopped, step)
        if self.child.stop_signal is not None:
            how = (
                f"child killed by our SIGKILL (exit {death.returncode}): it did not stop within "
                f"{seconds(self.options.stop_timeout)} s"
                if self.child.sent_kill and death.returncode == -signal.SIGKILL
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

    def _caught(self, ended: dict[str, Any], death: ChildExit) -> tuple[int, ChildExit]:
        """The child exited 0 after its run ended by an error (the program caught what `fit()`
        raised): taken for the run's own exit code, so the rules for it apply (a hang or an
        error in the user's code is restarted, bad input is not)."""
        code = int(ended["exit_code"])
        self._say(
            f"child exited 0, but its run ended with exit {code} after step {ended.get('step')} "
            "(fit_end in events.jsonl): the program caught the error and ended as if training "
            f"had finished; taken as exit {code}"
        )
        return code, dataclasses.replace(death, returncode=code)

    def _stopped_then_0(self, stopped: dict[str, Any], step: int | None) -> int:
        """The child exited 0 after its run was stopped by a signal (it caught
        `steadytrain.Stopped`): a stop, not a finish. Not restarted (someone asked it to stop),
        and the stop's code, so that what follows `steadytrain run` does not take it for a
        finished run."""
        code = int(stopped["exit_code"])
        at = stopped.get("step")
        reason = (
            f"child exited 0, but its run was stopped by {signal.Signals(code - 128).name} at "
            f"step {at} (fit_end in events.jsonl): the program caught steadytrain.Stopped and "
            "ended as if training had finished"
        )
        resume = f"step {step}" if step is not None else "the start"
        self._say(
            f"{reason}; not restarting: it was asked to stop; exiting {code}, not 0. Run it "
            f"again to resume from {resume}"
        )
        return self._end(code, step, reason)

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

    # -- decisions and records --

    def _escalate(self, savers: dict[str, Any], step: int | None, death: ChildExit) -> int:
        """Ask the next attempt for one more saver than this one had in force; record it."""
        saver = str(savers["left"][0])
        asked = len(savers["in_force"]) + 1
        self._escalations.append(f"{saver_name(saver)} (attempt {self.restarts + 2})")
        self._record(
            Record.MEMORY_ESCALATION,
            step,
            saver=saver,
            in_force=savers["in_force"],
            left=savers["left"],
            memory_savers=asked,
        )
        if death.while_starting:
            why = (
                "the OS killed the child while it started (loading the model), most likely for "
                "memory: as after a kill at micro-batch 1, the next"
            )
        elif death.rank is not None:
            why = f"{_rank_ran_out(death)} with no smaller micro-batch left: the next"
        elif death.crashed_near_cap:
            why = (
                "the child crashed near its address-space cap (out of memory) with no smaller "
                "micro-batch left: the next"
            )
        else:
            why = "the OS killed the child for memory with no smaller micro-batch left: the next"
        self._say(f"{why} attempt turns on {saver_name(saver)} ({ENV_MEMORY_SAVERS}={asked})")
        return asked

    def _offload(self, savers: dict[str, Any], step: int | None, death: ChildExit) -> None:
        """A sharded group ran out at micro-batch 1 with every saver in force: every next start
        shards with FSDP2's offload policy (ENV_FSDP_OFFLOAD); record it and say so."""
        self._fsdp_offload = True
        self._escalations.append(f"{FSDP_OFFLOAD_WORDS} (attempt {self.restarts + 2})")
        self._record(
            Record.MEMORY_ESCALATION,
            step,
            saver="fsdp_offload",
            in_force=savers["in_force"],
            left=[],
            memory_savers=len(savers["in_force"]) or None,
        )
        self._say(
            f"{_rank_ran_out(death)} with no smaller micro-batch left and every memory saver in "
            f"force: the next attempt puts {FSDP_OFFLOAD_WORDS} ({ENV_FSDP_OFFLOAD}=1)"
        )

    def _no_saver_left(
        self, death: ChildExit, step: int | None, savers: dict[str, Any], cap: int | None
    ) -> int:
        """Killed for memory at micro-batch 1 with every saver it can use in force: a restart
        is killed the same way, so stop with exit 3 and say what was tried and what would
        help."""
        if death.while_starting:
            return self._not_loaded(death, step, savers)
        named = [saver_name(s) for s in savers["in_force"]]
        named += [FSDP_OFFLOAD_WORDS] if self._fsdp_offload else []
        in_force = ", ".join(named) or "none it can use"
        folder = folder_of(self.options.run_dir, death)
        smallest = smallest_micro_batch(folder, cap)
        micro = f"micro-batch {smallest}" if smallest is not None else "before its first step"
        halved = any(item.startswith("micro-batch") for item in self._escalations)
        tried = [*([] if halved else [micro]), *self._escalations]
        reason = (
            f"killed for memory at {micro} with no memory saver left to turn on (in force: "
            f"{in_force}): this machine's memory ran out"
        )
        advice = fit_advice(self.options.advice, folder, savers["in_force"])
        if death.rank is not None:  # a torchrun group: its memory is its GPUs'
            reason = (
                f"{_rank_ran_out(death)} at {micro} with no memory saver left to turn on (in "
                f"force: {in_force}): {death.rank.world_size} ranks' memory is too little"
            )
            advice = f"{group_advice(self.options.run_dir, death.rank.world_size)}; {advice}"
        return self._does_not_fit(death, step, savers, reason, tried, advice)

    def _not_loaded(self, death: ChildExit, step: int | None, savers: dict[str, Any]) -> int:
        """Killed while starting (before any record: loading the model) with every saver
        asked for, and no attempt ever recorded a step: the model does not fit this machine's
        memory as it is loaded. Stop with exit 3, saying what the run directory tells of its
        size and what would make it load."""
        asked = ", ".join(saver_name(s) for s in savers["in_force"]) or "none"
        folder = folder_of(self.options.run_dir, death)
        attempts = self.restarts + 1
        tried = ["as configured (attempt 1)", *self._escalations]
        reason = (
            f"the run was killed by the OS while starting (loading the model), most likely for "
            f"memory: {attempts} attempt{'' if attempts == 1 else 's'} killed before the first "
            f"step, the last with every memory saver asked for ({asked}); it does not fit this "
            "machine's memory as it loads"
        )
        known = what_is_known(folder, physical_memory())
        advice = start_advice(self.options.advice, folder, savers["in_force"])
        return self._does_not_fit(death, step, savers, reason, tried, advice, known)

    def _does_not_fit(
        self,
        death: ChildExit,
        step: int | None,
        savers: dict[str, Any],
        reason: str,
        tried: list[str],
        advice: str,
        known: tuple[str, ...] | list[str] = (),
    ) -> int:
        """Stop with exit 3: the last line (why, what was tried, what is known, what would help,
        where a rerun resumes) and the `supervisor_end` record."""
        resume = f"step {step}" if step is not None else "the start"
        self._say(
            f"{death.describe()}; {reason}; not restarting (exit {DOES_NOT_FIT_EXIT}). Tried: "
            f"{'; '.join(tried)}. "
            + (f"Known: {'; '.join(known)}. " if known else "")
            + f"What would help: {advice}. Run again to resume from {resume}"
        )
        self._record(
            Record.SUPERVISOR_END,
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
        reason = f"gave up after {restarts(n)} without a new checkpoint; last: {death.describe()}"
        where = (
            f"; see {run_dir / 'events.jsonl'}"
            if run_dir
            else " (no run dir, so progress could not be seen: pass --run-dir)"
        )
        if run_dir is None and death.killed_by == signal.SIGKILL:
            # a Trainer announces its run directory as fit() starts: this one never got there
            where += (
                ". The child was killed by SIGKILL before it announced a run directory (before "
                "fit() began): if it was loading a model, most likely the OS killed it for "
                "memory; with --run-dir the restarts turn on memory savers. What would help: "
                + START_ADVICE
            )
        self._say(reason + where)
        self._record(
            Record.SUPERVISOR_GAVE_UP,
            step,
            exit_code=GAVE_UP,
            restarts=self.restarts,
            last_exit_code=death.returncode,
            signal=death.killed_by.name if death.killed_by else None,
            reason=reason,
        )
        return GAVE_UP

    def _end(self, code: int, step: int | None, reason: str) -> int:
        self._record(
            Record.SUPERVISOR_END, step, exit_code=code, restarts=self.restarts, reason=reason
        )
        return code

    def _record(self, event: Record, step: int | None, **fields: Any) -> None:
        if self.options.run_dir is None:
            return
        try:
            append_event(
                self.options.run_dir, {"time": time.time(), "event": event, "step": step, **fields}
            )
        except (OSError, RunDiskFullError) as exc:  # a full disk must not stop the supervising
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            final = event in (Record.SUPERVISOR_END, Record.SUPERVISOR_GAVE_UP)  # the run has ended
            after = "it is not recorded" if final else "the run goes on without it"
            self._say(f"{first}; {after} (the {event} event)")

    def _oom_kill_count(self) -> int | None:
        try:
            return self.oom_kill_count()
        except Exception:  # noqa: BLE001 - a counter we cannot read is only a missing detail
            return None

    def _progress_note(
        self, progressed: bool, step: int | None, no_progress: int, counted: bool = True
    ) -> str:
        limit = self.options.max_restarts
        if progressed:
            return f"new checkpoint at step {step}, so the count without progress starts again"
        if not counted:
            return (
                f"it starts smaller, so it is not counted as the same failure again "
                f"({no_progress} of {limit} restarts without a new checkpoint)"
            )
        return f"restart {no_progress} of {limit} without a new checkpoint"

    def _say_start(self) -> None:
        opts = self.options
        self._say(
            f"starting attempt 1: {shlex.join(self.command)} (gives up after "
            f"{restarts(opts.max_restarts)} without a new checkpoint)"
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
        say(f"steadytrain run: {text}", self.out)  # a closed terminal does not end us


def _rank_ran_out(death: ChildExit) -> str:
    """How a torchrun group's rank ran out of memory, in words."""
    rank = death.rank
    which = f"rank {rank.rank} of {rank.world_size}" if rank is not None else "a rank"
    if death.returncode == SHRINK_EXIT:
        return f"{which} ran out of memory (exit {SHRINK_EXIT})"
    return f"the OS killed {which} for memory"
