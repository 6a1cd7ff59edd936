"""What every integration shares: the options it is built with, the supervisor's environment read
the one way, and the one answer to an out-of-memory ("halve or give up").

`RunGuard` and the callbacks for Hugging Face, Lightning and Keras call these instead of each
keeping a copy, so that their defaults, their reading of ``STEADYTRAIN_MAX_MICRO_BATCH`` and their
exits after an out-of-memory (76: `steadytrain run` restarts at half; 3: it does not fit at
micro-batch 1) cannot drift apart. The halving itself is `events.HALVING`, the policy the Trainer's
step asks too. Imports no framework (a Keras run on TensorFlow has no torch).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from steadytrain.config import TrainConfig
from steadytrain.device.oom import oom_kind
from steadytrain.errors import DOES_NOT_FIT_EXIT, SHRINK_EXIT, BadInputError
from steadytrain.events import HALVING, divisor_at_most
from steadytrain.run import env as run_env
from steadytrain.run.records import Record

if TYPE_CHECKING:
    from steadytrain.integrations.guard import RunGuard

SHRINK = SHRINK_EXIT
DOES_NOT_FIT = DOES_NOT_FIT_EXIT
DEFAULTS = {
    name: TrainConfig.model_fields[name].default
    for name in ("hang_timeout", "hang_action", "memory_watch", "memory_budget")
}
"""The watch settings' defaults of `RunGuard` and the callbacks built on it: the Trainer's own
(`TrainConfig`), read from it, so a default changed there changes here too."""

T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    """The settings every callback takes (docs/integrations.md), with the Trainer's defaults.

    `hang_timeout`: seconds a step may go without a beat ("auto": 300 s, or 10 median steps).
    `hang_action`: "exit" (75) or "report". `memory_watch`: watch for leaks and swapping.
    `memory_budget`: "auto" (90 % of what this process may use), a size ("12GiB") or a fraction.
    `auto_resume`: resume from the newest verified checkpoint when the caller names none."""

    hang_timeout: float | str = DEFAULTS["hang_timeout"]
    hang_action: str = DEFAULTS["hang_action"]
    memory_watch: bool = DEFAULTS["memory_watch"]
    memory_budget: str | float = DEFAULTS["memory_budget"]
    auto_resume: bool = True

    def watch(self) -> dict[str, Any]:
        """The keyword arguments of `RunGuard` these options set (all but `auto_resume`)."""
        settings = asdict(self)
        del settings["auto_resume"]
        return settings


# -- the supervisor's environment -------------------------------------------------------------


def from_environment(read: Callable[[], T]) -> T:
    """`read()` (a `run_env` reader); a value it refuses ends the process with exit 2 and the
    reader's message, in the words `steadytrain.entrypoint` gives the Trainer's refusal: a
    program built on a callback has no entrypoint of steadytrain's around it."""
    try:
        return read()
    except BadInputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from exc


def max_micro_batch() -> int | None:
    """The micro-batch cap `steadytrain run` sets after an out-of-memory, or None (no cap); a
    value that is not a whole number of at least 1 is exit 2, as under the Trainer."""
    return from_environment(run_env.max_micro_batch)


def restart_count() -> int:
    """How many times `steadytrain run` restarted this command (0: first attempt or unsupervised)."""
    return from_environment(run_env.restart)


def capped_micro(batch: int, asked: int | None = None) -> int:
    """The micro-batch to start with: `asked` (default: the whole `batch`), no larger than the
    supervisor's cap, and a divisor of `batch` so that the pieces add up to it."""
    return divisor_at_most(batch, max_micro_batch() or asked or batch)


# -- after an out-of-memory -------------------------------------------------------------------


def halve_or_give_up(
    guard: RunGuard,
    exc: BaseException,
    micro: int,
    batch: int,
    *,
    redo_here: bool,
    reason: str = "out of memory",
) -> int:
    """After the out-of-memory `exc` at `micro` samples per pass of a `batch` (already recorded
    as an ``oom`` event): the next micro-batch (`events.HALVING`, a divisor of `batch`), recorded
    as a ``shrink`` event (with `reason`, and the accumulation that keeps `batch`) when the
    integration can redo the batch in this process (`redo_here`). Otherwise the process ends: exit 3 when no smaller
    micro-batch is left (it does not fit even one sample), else
    exit 76 for `steadytrain run` to restart at half from the newest verified checkpoint."""
    smaller = HALVING.next(micro, batch)
    if smaller is None:
        guard.finish("does not fit even at micro-batch 1", DOES_NOT_FIT)
        print(
            "steadytrain: out of memory at micro-batch 1: the model does not fit even one sample; "
            "shorter inputs, a smaller model or lower precision would help",
            file=sys.stderr,
        )
        raise SystemExit(DOES_NOT_FIT) from exc
    if not redo_here:
        restart_smaller(guard, exc)
    guard.state.micro_batch_size = smaller
    memory = guard.device.memory().to_dict()
    accumulation = batch // smaller
    guard.record(
        Record.SHRINK, HALVING.record(micro, smaller, reason, memory, accumulation=accumulation)
    )
    return smaller


def restart_smaller(guard: RunGuard, exc: BaseException, message: str | None = None) -> NoReturn:
    """End the run with exit 76 after the out-of-memory `exc` (already recorded), saying so
    (`message`, else the guard's own line), for `steadytrain run` to restart it with half the
    micro-batch from the newest verified checkpoint."""
    guard.finish(f"out of memory: {oom_kind(exc)}", SHRINK)
    print(message or guard.shrink_message(), file=sys.stderr, flush=True)
    raise SystemExit(SHRINK) from exc
