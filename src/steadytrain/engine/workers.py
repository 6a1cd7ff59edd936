"""The stop path owns the DataLoader's worker processes.

A cluster's preemption, systemd's ``KillMode=control-group``, ``kill -TERM -PGID`` and a
terminal's Ctrl-C or hang-up signal the trainer's whole process group, its data workers too.
The trainer finishes its optimizer step and saves before it exits (`safety.signals`); a
worker that died of the same signal meanwhile would take the step's batch with it, and torch
would report the death as an error wherever the training process was. So:

* the workers ignore the stop signals (`OwnedWorkers`, their ``worker_init_fn``): the training
  process ends them when it is done with them, as it always does (torch asks them to exit when
  the iterator is shut down; `owned_batches` kills any that outlive that);
* they start with the stop signals blocked (`owned_batches`), so that none arrives in the
  moment between the fork and their ``worker_init_fn`` (where a worker would still run the
  training process's own handler, or torch's, which ends it);
* a worker that died anyway (a library in it put back its own handler) while the run stops
  for a signal ends the batches: the run saves the steps it finished and exits with the
  signal's code (`defer_worker_deaths` keeps torch from raising the death mid-step or
  mid-save meanwhile). It is not the user's error.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from steadytrain.errors import SIGNAL_EXITS, is_worker_death
from steadytrain.events import Control

STOP_SIGNALS = tuple(getattr(signal, name) for name in SIGNAL_EXITS if hasattr(signal, name))
"""The signals a run stops on (SIGHUP, SIGINT, SIGTERM), those this platform has."""


class OwnedWorkers:
    """A DataLoader's ``worker_init_fn``: the program's own `init` (when given), then the stop
    signals ignored and unblocked in the worker. A class, not a closure, so that it pickles for
    the spawn start method (macOS's default)."""

    def __init__(self, init: Callable[[int], Any] | None):
        self.init = init

    def __call__(self, worker_id: int) -> None:
        try:
            if self.init is not None:
                self.init(worker_id)
        finally:
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
            if hasattr(signal, "pthread_sigmask"):
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def owned_worker_init(init: Callable[[int], Any] | None) -> OwnedWorkers:
    """`init` (a DataLoader's ``worker_init_fn``, or None) wrapped so that the workers ignore
    the stop signals; one already wrapped is returned as it is."""
    return init if isinstance(init, OwnedWorkers) else OwnedWorkers(init)


@contextlib.contextmanager
def _stops_blocked() -> Iterator[None]:
    """The stop signals blocked in this thread (a process forked meanwhile starts with them
    blocked; `OwnedWorkers` unblocks them once it ignores them). Those that arrive meanwhile
    are delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stopping_for_signal(control: Control) -> bool:
    """Whether the run was asked to stop by a signal (its exit code is a signal's)."""
    return control.stop_requested and control.stop_exit_code in SIGNAL_EXITS.values()


def owned_batches(batches: Iterable[Any], control: Control) -> Iterator[Any]:
    """`batches` (a DataLoader) iterated with its workers started with the stop signals
    blocked; a worker's death while the run stops for a signal ends the batches instead of
    raising (the steps finished are saved). When the iteration ends, the workers torch's own
    shut-down left running (one stuck in the dataset's code: they ignore SIGTERM now) are
    killed, so that none holds the process's exit."""
    with _stops_blocked():
        iterator = iter(batches)
    try:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as exc:
                if stopping_for_signal(control) and is_worker_death(exc):
                    return
                raise
            yield batch
    finally:
        _end_workers(iterator)


def _end_workers(iterator: Any) -> None:
    """Shut down a multi-process DataLoader iterator's workers (torch's own shut-down: it asks
    them to exit, then waits), then SIGKILL those still alive."""
    workers = list(getattr(iterator, "_workers", ()))
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for worker in workers:
        with contextlib.suppress(Exception):
            if worker.is_alive():
                worker.kill()
                worker.join(1.0)


def defer_worker_deaths() -> Callable[[], None] | None:
    """From now on, torch's SIGCHLD handler (which raises a DataLoader worker's death wherever
    the training process is: inside a step, inside a save) lets such deaths pass: the
    iterator meets them itself when it next waits for a batch (`owned_batches` ends there).
    Called when the run starts stopping for a signal, from the main thread. Returns what puts
    the handler back, or None when there was none to wrap."""
    if not hasattr(signal, "SIGCHLD"):
        return None
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous):
        return None

    def handler(signum: int, frame: Any) -> None:
        try:
            previous(signum, frame)
        except RuntimeError as exc:
            if not is_worker_death(exc):
                raise

    signal.signal(signal.SIGCHLD, handler)
    return lambda: signal.signal(signal.SIGCHLD, previous)
