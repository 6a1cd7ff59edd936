"""Errors a user can cause, each carrying the process exit code DESIGN.md promises; every error
class steadytrain raises on purpose lives here.

The CLI and `entrypoint` turn any `SteadytrainError` into its message and its `exit_code`,
without a traceback. Anything else that escapes is a bug (exit 1), so no `SteadytrainError`
exits 1: a stop that a restart from the last checkpoint fixes exits `RESTARTABLE_EXIT`, which
`steadytrain run` restarts.
"""

from __future__ import annotations

from pathlib import Path

BAD_INPUT_EXIT = 2
DOES_NOT_FIT_EXIT = 3
RESTARTABLE_EXIT = 75  # EX_TEMPFAIL: try again; also what a detected hang exits with
SHRINK_EXIT = 76
"""Out of memory in a loop steadytrain does not own (a Lightning or Keras callback, `RunGuard`):
restart me with half the micro-batch and twice the accumulation (`steadytrain run` does)."""


class SteadytrainError(Exception):
    """Base of every error steadytrain raises on purpose."""

    exit_code: int = BAD_INPUT_EXIT


class BadInputError(SteadytrainError):
    """Config, data, checkpoint or arguments are wrong; the message names the field or file."""

    exit_code = BAD_INPUT_EXIT


class ConfigError(BadInputError):
    """One or more config fields are invalid. `problems` holds one line per field."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config{where} ({len(self.problems)} problem(s)):\n{lines}")


class DeviceUnavailableError(BadInputError):
    """The requested device does not exist or does not work on this machine."""


class DoesNotFitError(SteadytrainError):
    """Even one sample per micro-batch, with every memory saver on, does not fit the memory budget."""

    exit_code = DOES_NOT_FIT_EXIT


class RestartableError(SteadytrainError):
    """The run stopped in a state it must not go on from, but its last checkpoint is good: a
    restart resumes exactly (`steadytrain run` restarts it)."""

    exit_code = RESTARTABLE_EXIT


class OptimizerStateTouched(RestartableError):
    """Out of memory inside optimizer.step after it had already changed parameters or state:
    redoing the step would apply part of the update twice, so the run stops (restartable)."""


class CheckpointError(BadInputError):
    """A checkpoint cannot be written, found or read; the message names the folder and file."""


class DiskFullError(CheckpointError):
    """The disk filled up during a save. The previous checkpoint is untouched."""

    def __init__(self, message: str, path: Path, needed: int, free: int):
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free


class StateNotRestoredError(BadInputError):
    """The first loss after a resume differs from the one the checkpoint recorded."""


class RNGStateError(BadInputError, RuntimeError):
    """A saved RNG snapshot cannot be restored on this machine."""


class DemoFailed(SteadytrainError):
    """A step of the demo ended with the code of the command it ran."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
