"""Errors a user can cause, each carrying the process exit code DESIGN.md promises.

The CLI turns any `SteadytrainError` into its message and its `exit_code`, without a traceback.
Anything else that escapes is a bug (exit 1).
"""

from __future__ import annotations


class SteadytrainError(Exception):
    """Base of every error steadytrain raises on purpose."""

    exit_code: int = 1


class BadInputError(SteadytrainError):
    """Config, data, checkpoint or arguments are wrong; the message names the field or file."""

    exit_code = 2


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

    exit_code = 3
