"""How long the hang watching waits before it acts: the limit of each phase of a run, how often
the watching threads look, how far beyond the limit the GIL backstop fires, and the stack size of
those threads. `HangLimits` is the part of `HangWatchdog` that computes the limit from the state
the watchdog keeps; the numbers below carry their reasons.

The limit of a phase (`HangLimits.limit`):

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
"""

from __future__ import annotations

import contextlib
import statistics
import threading

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


def margin_s(poll: float) -> float:
    """How far beyond the limit the GIL backstop fires: the Python thread must win the race when
    it can run at all. It notices a stall up to two polls late, and the backstop is re-armed only
    when its deadline moved by a third of the margin, so the margin is six polls."""
    return max(1.0, 6.0 * poll)


def report_budget_s(limit: float) -> float:
    """How long writing the report may take before the backstop ends the process anyway (the
    memory reading, a stuck stderr); at most 10 s, less for short test timeouts."""
    return min(10.0, max(1.0, limit))


def heartbeat_every(poll: float) -> float:
    """How often a watching thread polling every `poll` seconds rewrites the heartbeat."""
    return min(MAX_POLL_S, max(poll, 1.0))


class HangLimits:
    """The limit of the phase a `HangWatchdog` is in (`limit`), computed from the state the
    watchdog keeps: the configured timeout, the steps done and their times, and the save, the
    start-up phase or the collective it is in. The watchdog's beats and phases set that state;
    nothing here but its start writes it."""

    def __init__(self, timeout: float | str):
        if timeout != "auto" and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"hang_timeout: expected 'auto' or seconds > 0, got {timeout!r}")
        self.timeout = timeout
        self.steps_done = 0
        self.step_times: list[float] = [0.0] * STEP_WINDOW
        self._saving: str | None = None
        self._startup: str | None = None  # the start-up phase of fit() running, if any
        self._waiting: str | None = None  # the collective this rank waits in, if any
        self._longest_save = 0.0

    @property
    def poll_s(self) -> float:
        base = FLOOR_S if self.timeout == "auto" else float(self.timeout)
        return max(0.05, min(base / 8, MAX_POLL_S))

    @property
    def heartbeat_every_s(self) -> float:
        return heartbeat_every(self.poll_s)

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
