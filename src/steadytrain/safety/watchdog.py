# long-module: the watcher thread, its backstops and the hang report share one clock and state
"""Hang watchdog: a step that makes no progress for too long is caught, written down and ended.

The loop beats at every ``step_start``, ``micro_step_end`` and ``step_end``. A beat is one integer
increment on this object: no lock, no system call, nothing allocated but the int; the per
micro-batch beat is only that, and ``step_start`` / ``step_end`` add one monotonic clock read
each (the step time that ``"auto"`` needs). A daemon thread wakes every ``poll_s`` (the smaller of timeout / 8 and 5 s), looks whether
the counter moved, and measures how long it has stood still on its own monotonic clock.

That thread runs while the main thread is blocked in C code that released the GIL: a
``synchronize``, a lock, a pipe or a DataLoader queue (a worker that is alive but stuck). When the
stall passes the limit of the phase the run is in, it writes ``RUN_DIR/hangs/<time>.txt`` (every
thread's stack by faulthandler, the step, the last events, the memory reading), records a ``hang``
event, and with ``hang_action: exit`` ends the process with 75, so that ``steadytrain run``
restarts it from its last checkpoint. With ``hang_action: report`` the run goes on; one report per
stall.

Three layers, because each covers what the one before cannot:

1. the Python thread above: the full report, exit 75;
2. a hang that holds the GIL stops that thread too; for it, ``faulthandler.dump_traceback_later``
   (a C thread that needs no GIL) is kept armed a margin beyond the limit, so the stacks still
   land in ``hangs/backstop-<pid>.txt`` and the process ends (exit 1; the supervisor restarts on
   that too). The next start, or the supervisor, turns that file into a hang report and event;
3. a process that cannot run at all (a stuck Metal wait, mps.md §5, cannot be interrupted from
   inside): the thread rewrites ``RUN_DIR/heartbeat`` every few seconds; ``steadytrain run``
   reads it, and when it stops changing for longer than it says, asks for a stack dump
   (SIGUSR1, registered with faulthandler here) and SIGKILLs the child
   (`Supervisor._watch_heartbeat`).

The limit of a phase (`HangWatchdog.limit`):

* steps: ``hang_timeout`` seconds as configured; ``"auto"``: the larger of 300 s and 10 times
  the median step time once 5 steps have run in this process;
* the start-up of `fit()` (the data fingerprint, the checkpoint load, the plan, compilation)
  and the first step of each process (first allocations, data workers starting, a
  communicator's set-up in its first collective): with ``"auto"``, 600 s each; an explicit
  ``hang_timeout`` bounds them too, so a rank stuck in its first collective, or a data set that
  blocks, is caught within it. The set-up before them (model placement and the parameters'
  broadcast, the optimizer: `SET_UP`) keeps 600 s, but a collective in it is bounded by an
  explicit ``hang_timeout``. The console says which allowance holds when the watching starts;
* a checkpoint save (`allowance`, entered by `CheckpointWriter.on_step_end`): at least 300 s, and
  at least 4 times the longest save so far.

Under torchrun each rank runs its own watchdog, writing to its own folder; the report, the event
and the heartbeat name the rank, and, while the rank waits in a collective of the process group
(`waiting_in`, entered by `engine.distributed`), that collective: a rank stalled there is waiting
for another rank, which the other rank's own report explains.

This module imports neither torch nor the loop: the supervisor reads the heartbeat with it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from steadytrain import run_files
from steadytrain._durable import NOFOLLOW, make_folder, open_in_run, refuse_link, write_atomic
from steadytrain.errors import (
    RESTARTABLE_EXIT,
    BadInputError,
    RunDiskFullError,
    SteadytrainError,
)
from steadytrain.events import Callback, Control, TrainState

HANG_EXIT = RESTARTABLE_EXIT
FLOOR_S = 300.0
"""'auto' never declares a hang sooner: a step can legitimately stall this long (swap, a slow
disk, another process on the GPU), and a false restart costs the steps since the checkpoint."""
MEDIAN_FACTOR = 10.0
"""'auto' allows this many median steps: real steps vary by 2-3x, hangs last forever."""
WARMUP_STEPS = 5
"""Step times measured before the median is trusted (the first ones include warm-up)."""
STEP_WINDOW = 50
"""The median is over this many most recent steps, so a run that slows down is followed."""
FIRST_STEP_S = 600.0
"""With hang_timeout "auto": the first step of a process compiles kernels (MPS graphs,
torch.compile), makes the first allocations, starts data workers and sets up the communicators
of its first collectives; torchtitan gives its first step 300 s, nvidia-resiliency-ext 60 min.
An explicit hang_timeout is the limit here too: the user said how long a stall may last."""
STARTUP_S = 600.0
"""With hang_timeout "auto": each set-up and start-up phase of `fit()` (model placement,
optimizer, data fingerprint, checkpoint load, plan, compile) may go this long without a beat:
reading a large dataset's samples or a multi-GB checkpoint from a slow disk takes minutes, a
read that blocks takes forever. An explicit hang_timeout bounds these phases too."""
SAVE_FLOOR_S = 300.0
"""A checkpoint save writes the whole state to disk (seconds to minutes for large models)."""
SAVE_FACTOR = 4.0
"""A save may take this many times the longest save so far (the state grows, the disk varies)."""
MAX_POLL_S = 5.0
SET_UP = "set-up"
"""The phase of `fit()` that places the model (the parameters' broadcast) and builds the
optimizer: first imports (torch.optim, torch._dynamo) and a large model's move take their time
there, so it keeps STARTUP_S whatever hang_timeout says, but a collective in it (where a
communicator is set up) is bounded by an explicit hang_timeout like any other."""
EVENTS_TAIL = 20
"""Lines of events.jsonl copied into a hang report: what the run did just before."""
EVENTS_TAIL_BYTES = 64 * 1024
DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""What the supervisor sends for a stack dump before it kills a frozen child (no Windows)."""


def margin_s(poll: float) -> float:
    """How far beyond the limit the GIL backstop fires: the Python thread must win the race when
    it can run at all. It notices a stall up to two polls late, and the backstop is re-armed only
    when its deadline moved by a third of the margin, so the margin is six polls."""
    return max(1.0, 6.0 * poll)


def report_budget_s(limit: float) -> float:
    """How long writing the report may take before the backstop ends the process anyway (the
    memory reading, a stuck stderr); at most 10 s, less for short test timeouts."""
    return min(10.0, max(1.0, limit))


class HangWatchdog(Callback):
    """Declares a hang when no beat arrives within the phase's limit; see the module docstring.

    `record(name, info)` writes an event (events.jsonl and the console) from any thread. `device`
    gives the memory reading for the report (``device.memory().to_dict()``).
    """

    def __init__(
        self,
        run_dir: Path,
        timeout: float | str,
        action: str,
        device: Any,
        record: Callable[[str, dict], None],
        rank: int = 0,
        world_size: int = 1,
    ):
        if action not in ("exit", "report"):
            raise ValueError(f"hang_action: expected 'exit' or 'report', got {action!r}")
        if timeout != "auto" and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"hang_timeout: expected 'auto' or seconds > 0, got {timeout!r}")
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        self.action = action
        self.device = device
        self.record = record
        self.rank, self.world_size = rank, world_size
        self.beats = 0
        self.steps_done = 0
        self.step_times: list[float] = [0.0] * STEP_WINDOW
        self._step_started = 0.0
        self._saving: str | None = None
        self._startup: str | None = None  # the start-up phase of fit() running, if any
        self._waiting: str | None = None  # the collective this rank waits in, if any
        self._longest_save = 0.0
        self._save_started = 0.0
        self._state: TrainState | None = None
        self._fit_frame: FrameType | None = None
        self._fit_thread = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop: TextIO | None = None
        self._backstop_path = self.run_dir / run_files.HANGS / "backstop.txt"  # set at the start
        self._signal_registered = False
        self._armed_until = 0.0
        self.say: Callable[[str], None] | None = None
        """Where the allowance's line goes when the watching starts (the run's console)."""

    @classmethod
    def from_config(
        cls,
        cfg,
        run_dir: Path,
        device,
        record: Callable[[str, dict], None],
        rank: int = 0,
        world_size: int = 1,
    ) -> HangWatchdog:
        return cls(run_dir, cfg.hang_timeout, cfg.hang_action, device, record, rank, world_size)

    @property
    def rank_text(self) -> str | None:
        """ "rank 1 of 2" under torchrun; None for a single process."""
        return f"rank {self.rank} of {self.world_size}" if self.world_size > 1 else None

    # -- the limit ---------------------------------------------------------------------------

    @property
    def poll_s(self) -> float:
        base = FLOOR_S if self.timeout == "auto" else float(self.timeout)
        return max(0.05, min(base / 8, MAX_POLL_S))

    @property
    def heartbeat_every_s(self) -> float:
        return min(MAX_POLL_S, max(self.poll_s, 1.0))

    def steady_limit(self) -> float:
        """The limit for an ordinary step (see the module docstring)."""
        if self.timeout != "auto":
            return float(self.timeout)
        measured = min(self.steps_done, STEP_WINDOW)
        if measured < WARMUP_STEPS:
            return FLOOR_S
        return max(FLOOR_S, MEDIAN_FACTOR * statistics.median(self.step_times[:measured]))

    def first_allowance(self, auto_s: float) -> float:
        """The limit of a set-up or start-up phase and of the first step: `auto_s` with
        ``"auto"``, else the configured hang_timeout, which bounds every phase but a save."""
        return auto_s if self.timeout == "auto" else float(self.timeout)

    def allowance_text(self) -> str:
        """The console's line when the watching starts: what is a hang, phase by phase."""
        if self.timeout == "auto":
            return (
                f"set-up, start-up and the first step may each go "
                f"{STARTUP_S:.0f} s without progress; then a step "
                f"{FLOOR_S:.0f} s, or {MEDIAN_FACTOR:.0f} times the median step when longer "
                "(hang_timeout auto; a number bounds every phase but the set-up and saves)"
            )
        return (
            f"{float(self.timeout):g} s without progress is a hang, in start-up, the first step "
            f"and every collective too (hang_timeout); the set-up (model placement, optimizer) "
            f"may take {STARTUP_S:.0f} s, a checkpoint save {SAVE_FLOOR_S:.0f} s or "
            f"{SAVE_FACTOR:.0f} times the longest save"
        )

    def limit(self) -> tuple[float, str]:
        """(seconds, phase) for where the run is now; in a collective, the phase names it
        ("all-reduce (agreement) in step") under the limit of the phase it is part of."""
        steady = self.steady_limit()
        if self._saving is not None:
            seconds, phase = (
                max(steady, SAVE_FLOOR_S, SAVE_FACTOR * self._longest_save),
                self._saving,
            )
        elif self._startup == SET_UP and self._waiting is None:  # imports, a model's move
            seconds, phase = STARTUP_S, self._startup
        elif self._startup is not None:
            seconds, phase = self.first_allowance(STARTUP_S), self._startup
        elif self.steps_done == 0:
            seconds, phase = self.first_allowance(FIRST_STEP_S), "first step"
        else:
            seconds, phase = steady, "step"
        waiting = self._waiting
        return seconds, phase if waiting is None else f"{waiting} in {phase}"

    # -- heartbeats: the hot path ------------------------------------------------------------

    def on_step_start(self, state: TrainState, control: Control, info: dict) -> None:
        self.beats += 1
        self._step_started = time.monotonic()

    def on_micro_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.beats += 1

    def on_eval_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.beats += 1  # evaluation is progress, not a hang

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self.beats += 1
        self.step_times[self.steps_done % STEP_WINDOW] = time.monotonic() - self._step_started
        self.steps_done += 1

    # -- saves -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        """Run a long operation of the loop (a checkpoint save) under its own limit. The GIL
        backstop is re-armed here, from the main thread, because a save may hold the GIL (a
        serializer in C) and keep the watchdog thread from re-arming it in time."""
        self._saving = phase
        self.beats += 1
        self._save_started = time.monotonic()
        self._arm_backstop(self.limit()[0])
        try:
            yield
        finally:
            self._longest_save = max(self._longest_save, time.monotonic() - self._save_started)
            self._saving = None
            self.beats += 1
            self._arm_backstop(self.limit()[0])

    # -- collectives -------------------------------------------------------------------------

    @contextlib.contextmanager
    def waiting(self, collective: str) -> Iterator[None]:
        """This rank is in a collective of the process group: a stall here is named after it.
        An error raised in it (a peer that died) carries its name out (`steadytrain_collective`),
        for the rank's exit event."""
        self._waiting = collective
        try:
            yield
        except BaseException as exc:
            with contextlib.suppress(AttributeError):
                if getattr(exc, "steadytrain_collective", None) is None:
                    exc.steadytrain_collective = collective  # type: ignore[attr-defined]
            raise
        finally:
            self._waiting = None

    # -- start-up phases ---------------------------------------------------------------------

    @contextlib.contextmanager
    def startup(self, phase: str) -> Iterator[None]:
        """Run a start-up phase of fit() (before the loop) under the start-up limit, named in
        the heartbeat and in a hang report."""
        self._startup = phase
        self.beats += 1
        self._arm_backstop(self.limit()[0])
        try:
            yield
        finally:
            self.beats += 1

    def start(self, state: TrainState | None, phase: str) -> None:
        """Start watching before the loop (from `fit()`'s first line of work): the start-up
        phases get heartbeats and a limit too. The frame that calls this must stay on the stack
        for the whole fit; `stop` (or the loop's fit_end) ends the watching."""
        self._startup = phase
        self._begin(state, sys._getframe(1))

    def set_up_done(self, state: TrainState, device: Any, phase: str) -> None:
        """The set-up watched since `start(None, ...)` made the run's state and device: the
        step and the memory reading come from them now; `phase` is the next start-up phase."""
        self._state, self.device = state, device
        self._startup = phase
        self.beats += 1

    def stop(self) -> None:
        """End the watching of a fit that ends before its loop's fit_end (a refusal at start);
        nothing when it has ended already."""
        if self._thread is not None:
            self.on_fit_end(self._state, Control(), {})  # type: ignore[arg-type]

    # -- start and stop ----------------------------------------------------------------------

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        if self._thread is not None:  # started before the loop: the start-up is over
            self._state, self._startup = state, None
            self.beats += 1
            return
        # info["fit_frame"]: the frame whose return ends the fit, when the loop is another
        # library's (steadytrain.integrations); else the frame that emitted fit_start.
        self._begin(state, info.get("fit_frame") or _caller_of_dispatch())

    def _begin(self, state: TrainState | None, frame: FrameType | None) -> None:
        global _active
        self._state = state
        self._fit_frame, self._fit_thread = frame, threading.get_ident()
        stop_start_watch()  # watched from the process start until now: this watchdog takes over
        hangs = self.run_dir / run_files.HANGS
        root = run_files.top(self.run_dir)
        # A link planted at the heartbeat would switch the supervisor's hang backstop off
        # without a word: refused here (exit 2), like a link anywhere in the run directory.
        self._write_heartbeat(0.0, strict=True)
        make_folder(hangs, root=root)
        adopt_backstop_dumps(self.run_dir, self.record, skip_pid=os.getpid())
        path = hangs / f"backstop-{os.getpid()}.txt"
        self._backstop = os.fdopen(open_in_run(path, "new", root=root), "w")
        self._backstop_path = path
        if DUMP_SIGNAL is not None and signal.getsignal(DUMP_SIGNAL) == signal.SIG_DFL:
            faulthandler.register(DUMP_SIGNAL, file=self._backstop, all_threads=True)
            self._signal_registered = True
        self._stop.clear()
        self._arm_backstop(self.limit()[0])
        self._write_heartbeat(0.0)
        if self.say is not None:  # the console says how long a stall may last
            with contextlib.suppress(Exception):
                self.say(self.allowance_text())
        self._thread = threading.Thread(
            target=self._watch, name="steadytrain-hang-watchdog", daemon=True
        )
        with small_stacks():
            self._thread.start()
        _active = self

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        """Stop for good: after this nothing can fire, even if the process lives on."""
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5.0)
            self._thread = None
        self._release()

    def _release(self) -> None:
        """Disarm the backstops and tidy the files: the timer, the dump signal, the heartbeat,
        the backstop file (a dump in it, from report mode or a SIGUSR1, becomes a report)."""
        faulthandler.cancel_dump_traceback_later()
        if self._signal_registered:
            faulthandler.unregister(DUMP_SIGNAL)
            self._signal_registered = False
        with contextlib.suppress(OSError):
            (self.run_dir / run_files.HEARTBEAT).unlink()
        if self._backstop is not None:
            self._backstop.close()
            self._backstop = None
        adopt_backstop_dumps(self.run_dir, self.record, only_pid=os.getpid())

    # -- the watching thread -----------------------------------------------------------------

    def _watch(self) -> None:
        seen = self.beats
        since = written = time.monotonic()
        written_phase = self.limit()[1]
        fired = False
        while not self._stop.wait(self.poll_s):
            if not self._fit_running():
                self._stand_down()
                return
            now = time.monotonic()
            beats = self.beats
            if beats != seen:
                seen, since, fired = beats, now, False
            stalled = now - since
            limit, phase = self.limit()
            if not fired and stalled >= limit:
                fired = True
                self._fire(stalled, limit, phase)
            if not fired:
                self._arm_backstop(limit - stalled)
            if now - written >= self.heartbeat_every_s or phase != written_phase:
                self._write_heartbeat(stalled)
                written, written_phase = now, phase

    def _fit_running(self) -> bool:
        """Whether the loop that started us is still on its thread's stack. Normally `on_fit_end`
        stops us; this guards a fit that ended without it (an error before the loop's own
        error handling), so that nothing fires in a process that lives on (a notebook, tests)."""
        frame = sys._current_frames().get(self._fit_thread)
        while frame is not None:
            if frame is self._fit_frame:
                return True
            frame = frame.f_back
        return False

    def _stand_down(self) -> None:
        """Stop watching from the thread itself (see `_fit_running`)."""
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        self._release()

    def _arm_backstop(self, remaining: float) -> None:
        """Keep faulthandler's timer a margin beyond the limit. Re-arming starts a C thread, so
        it is done when the deadline moved by a third of the margin, not on every poll."""
        if self._backstop is None or self._stop.is_set():
            return
        margin = margin_s(self.poll_s)
        deadline = time.monotonic() + max(remaining, 0.0) + margin
        if abs(deadline - self._armed_until) < margin / 3:
            return
        self._armed_until = deadline
        with small_stacks():  # each arm starts a new timer thread
            faulthandler.dump_traceback_later(
                deadline - time.monotonic(), exit=self.action == "exit", file=self._backstop
            )

    def _write_heartbeat(self, stalled: float, strict: bool = False) -> None:
        """RUN_DIR/heartbeat for the supervisor, replaced atomically. `stale_after_s`: how long
        the file may stay unchanged before the supervisor may kill (limit + our own backstops).
        `strict` (the first one): a planted link is raised (exit 2), not passed over."""
        limit, phase = self.limit()
        poll = self.poll_s
        record = {
            "pid": os.getpid(),
            "step": self._state.step if self._state is not None else None,
            "phase": phase,
            "stalled_s": round(stalled, 3),
            "limit_s": limit,
            "stale_after_s": limit
            + margin_s(poll)
            + report_budget_s(limit)
            + 2 * self.heartbeat_every_s,
            "action": self.action,
            "dump_signal": DUMP_SIGNAL.name if self._signal_registered else None,
            "dump_file": f"{run_files.HANGS}/backstop-{os.getpid()}.txt",
            "written": time.time(),
        }
        # A full disk must not end the watching; a link planted later is refused, not followed.
        try:
            write_atomic(
                self.run_dir / run_files.HEARTBEAT,
                json.dumps(record),
                durable=False,
                root=run_files.top(self.run_dir),
            )
        except BadInputError:
            if strict:
                raise
        except (OSError, SteadytrainError):
            pass

    # -- firing ------------------------------------------------------------------------------

    def _fire(self, stalled: float, limit: float, phase: str) -> None:
        if self._stop.is_set():
            return
        budget = report_budget_s(limit)
        exiting = self.action == "exit"
        faulthandler.cancel_dump_traceback_later()
        self._armed_until = 0.0
        if exiting and self._backstop is not None:
            with small_stacks():
                faulthandler.dump_traceback_later(budget, exit=True, file=self._backstop)
        step = self._state.step if self._state is not None else None
        waiting = self._waiting
        path, memory = self._write_report(stalled, limit, phase, step, budget, waiting)
        info = {
            "step": step,
            "phase": phase,
            **({"rank": self.rank, "world_size": self.world_size} if self.world_size > 1 else {}),
            "collective": waiting,
            "stalled_s": round(stalled, 2),
            "limit_s": limit,
            "action": self.action,
            "file": str(path.relative_to(self.run_dir)) if path is not None else None,
            "detected_by": "watchdog",
            "exit_code": HANG_EXIT if exiting else None,
            "memory": memory.to_dict() if memory is not None else None,
        }
        with contextlib.suppress(Exception):
            self.record("hang", info)
        if exiting:
            self._exit(stalled, phase, step, path)

    def _write_report(
        self,
        stalled: float,
        limit: float,
        phase: str,
        step: int | None,
        budget: float,
        waiting: str | None = None,
    ) -> tuple[Path | None, Any]:
        """hangs/<time>.txt: the stacks first (they matter most and cannot block), then the
        events, then the memory reading (which can block on a stuck device, so it is last and
        bounded). Returns (the file or None when it could not be written, the reading or None)."""
        memory = None
        try:
            path, fd = _new_hang_file(self.run_dir / run_files.HANGS, run_files.top(self.run_dir))
            with os.fdopen(fd, "w") as out:
                out.write(self._report_header(stalled, limit, phase, step, waiting))
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
                out.write("\nLast events (events.jsonl):\n")
                out.writelines(_tail_lines(self.run_dir / run_files.EVENTS, EVENTS_TAIL))
                out.flush()
                memory, note = (
                    _read_with_timeout(self.device.memory, min(5.0, budget / 2))
                    if self.device is not None
                    else (None, "(none: the device is chosen in set-up)")
                )
                out.write("\nMemory reading:\n")
                out.write(json.dumps(memory.to_dict(), indent=1) if memory is not None else note)
                out.write("\n")
        except (OSError, SteadytrainError) as exc:  # a full disk, a planted link (refused)
            with contextlib.suppress(Exception):
                sys.stderr.write(f"steadytrain: could not write the hang report: {exc}\n")
            return None, memory
        return path, memory

    def _report_header(
        self, stalled: float, limit: float, phase: str, step: int | None, waiting: str | None
    ) -> str:
        lines = [
            "steadytrain hang report",
            f"time: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
            f"pid: {os.getpid()}",
            *([f"rank: {self.rank} of {self.world_size}"] if self.rank_text else []),
            f"steps done: {step} (stuck in step {None if step is None else step + 1})",
            f"phase: {phase}",
            *(
                [
                    f"waiting in: {waiting}, a collective of the process group: another rank "
                    "has not reached it (that rank's own hang report says where it is)"
                ]
                if waiting
                else []
            ),
            f"no progress for {stalled:.1f} s (limit {limit:.1f} s)",
            f"action: {self.action}"
            + (f" (exit {HANG_EXIT})" if self.action == "exit" else " (the run goes on)"),
        ]
        return "\n".join(lines) + "\n\nEvery thread's stack, most recent call first:\n"

    def _exit(self, stalled: float, phase: str, step: int | None, path: Path | None) -> None:
        for child in multiprocessing.active_children():  # a stuck data worker must not outlive us
            with contextlib.suppress(Exception):
                child.kill()
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"steadytrain: hang{f' ({self.rank_text})' if self.rank_text else ''}: no "
                f"progress for {stalled:.0f} s in {phase} after step "
                f"{step}; stacks in {path}; exiting {HANG_EXIT} (steadytrain run restarts it)\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
        if self._backstop is not None:
            with contextlib.suppress(OSError):
                self._backstop_path.unlink()
        os._exit(HANG_EXIT)


_active: HangWatchdog | None = None


@contextlib.contextmanager
def startup_phase(phase: str) -> Iterator[None]:
    """A start-up phase of the running fit (`HangWatchdog.startup`); a no-op when no watchdog
    runs."""
    watchdog = _active
    if watchdog is None:
        yield
        return
    with watchdog.startup(phase):
        yield


@contextlib.contextmanager
def waiting_in(collective: str) -> Iterator[None]:
    """This rank waits in a collective of the process group (`HangWatchdog.waiting`, when a
    watchdog runs). An error raised in it carries the collective's name out
    (`steadytrain_collective`) whether or not a watchdog runs: the rank's exit event says it
    failed waiting for a peer, so `steadytrain run` names the peer that failed first. Given to
    `engine.distributed.name_waits` by the trainer."""
    watchdog = _active
    try:
        if watchdog is None:
            yield
        else:
            with watchdog.waiting(collective):
                yield
    except BaseException as exc:
        with contextlib.suppress(AttributeError):
            if getattr(exc, "steadytrain_collective", None) is None:
                exc.steadytrain_collective = collective  # type: ignore[attr-defined]
        raise


@contextlib.contextmanager
def allowance(phase: str) -> Iterator[None]:
    """Give a long operation of the running fit (a checkpoint save) its own limit; a no-op when
    no watchdog runs. A function of the module so that `CheckpointWriter` needs no reference to the
    watchdog (the trainer builds both)."""
    watchdog = _active
    if watchdog is None:
        yield
        return
    with watchdog.allowance(phase):
        yield


# -- from process start, under `steadytrain run` ----------------------------------------------

ENV_START_WATCH = "STEADYTRAIN_START_WATCH"
"""Set by `steadytrain run` for its child when it knows the run directory: JSON
``{"run_dir": ..., "limit_s": ...}`` (limit_s: its --first-heartbeat-timeout). A process that
imports steadytrain with it set watches itself from then on (`watch_from_start`)."""
BEFORE_FIT = "before fit() (imports, model and data set-up)"


class StartWatch:
    """The watching of a process from its import of steadytrain until a fit's watchdog takes
    over (`HangWatchdog` start): a hang in model set-up or data loading before `fit()` is
    caught too. The same three layers as the fit's watchdog, with the supervisor's
    --first-heartbeat-timeout as the limit: a thread that writes the heartbeat and, past the
    limit, a hang report with every thread's stack, a ``hang`` event (detected_by "watchdog",
    phase `BEFORE_FIT`) and exit 75; faulthandler's timer a margin later for a process that
    holds the GIL; the heartbeat for the supervisor when the process cannot run at all."""

    def __init__(self, run_dir: Path, limit: float, rank: int = 0):
        self.run_dir, self.limit, self.rank = Path(run_dir), float(limit), rank
        self.poll = max(0.05, min(self.limit / 8, MAX_POLL_S))
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop: TextIO | None = None
        self._backstop_path = self.run_dir / run_files.HANGS / f"backstop-{os.getpid()}.txt"
        self._signal_registered = False

    def start(self) -> None:
        root = run_files.top(self.run_dir)
        make_folder(self.run_dir / run_files.HANGS, root=root)
        self._backstop = os.fdopen(open_in_run(self._backstop_path, "new", root=root), "w")
        if DUMP_SIGNAL is not None and signal.getsignal(DUMP_SIGNAL) == signal.SIG_DFL:
            faulthandler.register(DUMP_SIGNAL, file=self._backstop, all_threads=True)
            self._signal_registered = True
        with small_stacks():
            faulthandler.dump_traceback_later(
                self.limit + margin_s(self.poll), exit=True, file=self._backstop
            )
        self._write_heartbeat()
        self._thread = threading.Thread(
            target=self._watch, name="steadytrain-start-watch", daemon=True
        )
        with small_stacks():
            self._thread.start()

    def stop(self) -> None:
        """Hand over to a fit's watchdog: the thread ends, the timer and the dump signal are
        disarmed, the backstop file goes (a dump in it becomes a report first)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 5.0)
        faulthandler.cancel_dump_traceback_later()
        if self._signal_registered:
            faulthandler.unregister(DUMP_SIGNAL)
            self._signal_registered = False
        beat = read_heartbeat(self.run_dir)  # ours goes: a fit's watchdog writes its own
        if beat is not None and beat.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                (self.run_dir / run_files.HEARTBEAT).unlink()
        if self._backstop is not None:
            self._backstop.close()
            self._backstop = None
            with contextlib.suppress(Exception):
                adopt_backstop_dumps(
                    self.run_dir, _record_event(self.run_dir), only_pid=os.getpid()
                )

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            stalled = time.monotonic() - self.started
            if stalled >= self.limit:
                self._fire(stalled)
                return
            self._write_heartbeat()

    def _write_heartbeat(self) -> None:
        poll, stalled = self.poll, time.monotonic() - self.started
        every = min(MAX_POLL_S, max(poll, 1.0))
        record = {
            "pid": os.getpid(),
            "step": None,
            "phase": BEFORE_FIT,
            "stalled_s": round(stalled, 3),
            "limit_s": self.limit,
            "stale_after_s": self.limit + margin_s(poll) + report_budget_s(self.limit) + 2 * every,
            "action": "exit",
            "dump_signal": DUMP_SIGNAL.name if self._signal_registered else None,
            "dump_file": f"{run_files.HANGS}/backstop-{os.getpid()}.txt",
            "written": time.time(),
        }
        with contextlib.suppress(OSError, SteadytrainError):  # a link is refused, not followed
            write_atomic(
                self.run_dir / run_files.HEARTBEAT,
                json.dumps(record),
                durable=False,
                root=run_files.top(self.run_dir),
            )

    def _fire(self, stalled: float) -> None:
        if self._stop.is_set():
            return
        budget = report_budget_s(self.limit)
        faulthandler.cancel_dump_traceback_later()
        if self._backstop is not None:  # the report itself may not block forever
            with small_stacks():
                faulthandler.dump_traceback_later(budget, exit=True, file=self._backstop)
        path = None
        with contextlib.suppress(OSError, SteadytrainError):
            path, fd = _new_hang_file(self.run_dir / run_files.HANGS, run_files.top(self.run_dir))
            with os.fdopen(fd, "w") as out:
                out.write(
                    "steadytrain hang report\n"
                    f"time: {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n"
                    f"pid: {os.getpid()}\n"
                    + (f"rank: {self.rank}\n" if self.rank else "")
                    + f"phase: {BEFORE_FIT}: fit() has not started watching yet\n"
                    f"no progress for {stalled:.1f} s since the process imported steadytrain "
                    f"(limit {self.limit:.1f} s: steadytrain run --first-heartbeat-timeout)\n"
                    f"action: exit ({HANG_EXIT})\n\n"
                    "Every thread's stack, most recent call first:\n"
                )
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
        info = {
            "step": None,
            "phase": BEFORE_FIT,
            **({"rank": self.rank} if self.rank else {}),
            "stalled_s": round(stalled, 2),
            "limit_s": self.limit,
            "action": "exit",
            "file": str(path.relative_to(self.run_dir)) if path is not None else None,
            "detected_by": "watchdog",
            "exit_code": HANG_EXIT,
        }
        with contextlib.suppress(Exception):
            _record_event(self.run_dir)("hang", info)
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"steadytrain: hang {BEFORE_FIT}: no progress for {stalled:.0f} s since the "
                f"process imported steadytrain (limit {self.limit:.0f} s, steadytrain run "
                f"--first-heartbeat-timeout); stacks in {path}; exiting {HANG_EXIT} "
                "(steadytrain run restarts it)\n"
            )
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            self._backstop_path.unlink()
        os._exit(HANG_EXIT)


def _record_event(run_dir: Path) -> Callable[[str, dict], None]:
    def record(name: str, info: dict) -> None:
        from steadytrain.run_events import append_event

        append_event(run_dir, {"time": time.time(), "event": name, **info})

    return record


_start_watch: StartWatch | None = None


def watch_from_start(environ: Any = os.environ) -> StartWatch | None:
    """Called when steadytrain is imported: under `steadytrain run` (ENV_START_WATCH set), start
    watching this process before `fit()` (`StartWatch`); the variable is taken out of the
    environment, so that processes this one starts (data workers, tools) do not watch
    themselves. Nothing in a multiprocessing child or when the variable is not there."""
    global _start_watch
    text = environ.pop(ENV_START_WATCH, None)
    if not text or _start_watch is not None or multiprocessing.parent_process() is not None:
        return None
    try:
        spec = json.loads(text)
        run_dir, limit = Path(spec["run_dir"]), float(spec["limit_s"])
        rank = int(environ.get("RANK", "0") or 0)
    except (ValueError, KeyError, TypeError):
        return None
    own = run_dir if rank == 0 else run_dir / run_files.RANKS / f"rank-{rank}"
    watch = StartWatch(own, limit, rank)
    try:
        watch.start()
    except (OSError, SteadytrainError) as exc:  # a full disk, a planted link: said, not fatal
        with contextlib.suppress(Exception):
            sys.stderr.write(f"steadytrain: cannot watch this process before fit(): {exc}\n")
        watch.stop()
        return None
    _start_watch = watch
    return watch


def stop_start_watch() -> None:
    """A fit's watchdog takes over (or the process no longer needs the start-up watch)."""
    global _start_watch
    watch, _start_watch = _start_watch, None
    if watch is not None:
        watch.stop()


# -- files shared with the supervisor (no torch here) ------------------------------------------


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/heartbeat as a dict, or None when missing or unreadable."""
    path = Path(run_dir) / run_files.HEARTBEAT
    try:  # a link planted there is not read: it could name a FIFO or a device
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            record = json.loads(handle.read(1 << 20))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def adopt_backstop_dumps(
    run_dir: Path,
    record: Callable[[str, dict], None],
    *,
    skip_pid: int | None = None,
    only_pid: int | None = None,
    detected_by: str = "faulthandler",
    extra: dict[str, Any] | None = None,
) -> list[Path]:
    """Turn the stack dumps the GIL backstop (or a supervisor's SIGUSR1) left in
    ``hangs/backstop-<pid>.txt`` into hang reports with a ``hang`` event; empty ones (a process
    that ended without a hang) are removed. `skip_pid`: a file still in use (this process's) is
    left alone; `only_pid`: only that process's file is looked at. Returns the reports made."""
    hangs = Path(run_dir) / run_files.HANGS
    made = []
    if hangs.is_symlink():
        refuse_link(hangs)
    for path in sorted(hangs.glob("backstop-*.txt")):
        pid_text = path.stem.removeprefix("backstop-")
        if pid_text == str(skip_pid) or (only_pid is not None and pid_text != str(only_pid)):
            continue
        refuse_link(path)  # never read (and copied into a report) through a planted link
        try:
            size = path.stat().st_size
            if size == 0:
                path.unlink()
                continue
            target, fd = _new_hang_file(
                hangs, run_files.top(run_dir), time.gmtime(path.stat().st_mtime)
            )
            beat = read_heartbeat(Path(run_dir))
            beat = beat if beat is not None and str(beat.get("pid")) == pid_text else {}
            header = (
                f"steadytrain hang report (stack dump of the {detected_by} backstop)\n"
                f"pid: {pid_text}\n"
                f"last heartbeat: steps done {beat.get('step')}, phase {beat.get('phase')}\n"
                "The Python watchdog thread could not write this report: the process held the "
                "GIL or could not run at all.\n\nEvery thread's stack, most recent call first:\n"
            )
            with os.fdopen(fd, "w") as out:
                out.write(header + path.read_text(errors="replace"))
            path.unlink()
        except (OSError, RunDiskFullError):
            continue
        made.append(target)
        info = {
            "step": beat.get("step"),
            "phase": beat.get("phase"),
            "pid": int(pid_text) if pid_text.isdigit() else pid_text,
            "file": str(target.relative_to(run_dir)),
            "detected_by": detected_by,
            **(extra or {}),
        }
        with contextlib.suppress(Exception):
            record("hang", info)
    return made


def _caller_of_dispatch() -> FrameType | None:
    """The frame that emitted the event being handled (the loop's), above the dispatcher."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "steadytrain.events":
        frame = frame.f_back
    return frame


def _new_hang_file(
    folder: Path, root: Path, when: time.struct_time | None = None
) -> tuple[Path, int]:
    """A new hangs/<time>.txt (hangs/<time>-N.txt when taken) and its write descriptor, made
    by the run's one writer: never through a link (BadInputError)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", when or time.gmtime())
    path, n = folder / f"{stamp}.txt", 1
    while True:
        try:
            return path, open_in_run(path, "exclusive", root=root)
        except FileExistsError:
            n += 1
            path = folder / f"{stamp}-{n}.txt"


def _tail_lines(path: Path, count: int) -> list[str]:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - EVENTS_TAIL_BYTES))
            lines = handle.read().decode(errors="replace").splitlines(keepends=True)
    except OSError as exc:
        return [f"(cannot read {path}: {exc})\n"]
    if len(lines) > count or size > EVENTS_TAIL_BYTES:
        lines = lines[1:][-count:]  # the first may be a partial line
    return [line if line.endswith("\n") else line + "\n" for line in lines] or ["(none)\n"]


def _read_with_timeout(read: Callable[[], Any], seconds: float) -> tuple[Any, str]:
    """Call `read` in a helper thread and wait at most `seconds`: on a stuck device a memory
    reading can block like the step did, and the report must still be finished."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(read())
        except Exception as exc:  # noqa: BLE001 - a failed reading is a line in the report
            box.append(exc)

    helper = threading.Thread(target=target, name="steadytrain-hang-memory", daemon=True)
    helper.start()
    helper.join(seconds)
    if not box:
        return None, f"(the memory reading did not return within {seconds:.1f} s)"
    if isinstance(box[0], Exception):
        return None, f"(the memory reading failed: {type(box[0]).__name__}: {box[0]})"
    return box[0], ""


WATCH_STACK_BYTES = 1024 * 1024


@contextlib.contextmanager
def small_stacks():
    """Start the watchdog's threads (and faulthandler's timer thread) with 1 MiB stacks instead of
    the default 8 MiB. A thread's stack is address space the moment it starts: a run held to a
    tight RLIMIT_AS (or a cgroup counting virtual memory) would lose 8 MiB of its headroom to each
    watching thread, and those threads run a few shallow Python frames."""
    previous = threading.stack_size(WATCH_STACK_BYTES)
    try:
        yield
    finally:
        threading.stack_size(previous)
