"""Exit codes for training scripts: wrap `main` so that a user's `python train.py` exits the way
DESIGN.md promises (2 bad input, 3 does not fit, 130/143 stopped after saving, ...)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from steadytrain.errors import RunDiskFullError, SteadytrainError, is_disk_full

F = TypeVar("F", bound=Callable[..., Any])


def entrypoint(fn: F) -> F:
    """Run `fn`; a `SteadytrainError` prints its message (no traceback) and exits with its code;
    a returned `FitResult` exits with its `exit_code`; Ctrl-C outside `fit()` (while the model
    loads) exits 130 with one line, as the CLI does. A signal during training, or a Ctrl-C
    while `fit()` starts, ends `fit()` with `steadytrain.Stopped` (130 / 143), which passes
    through: the process exits with it, with or without this wrapper. Anything else returns as
    usual."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from steadytrain.trainer import FitResult

        try:
            result = fn(*args, **kwargs)
        except SteadytrainError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            print(
                "steadytrain: stopped by SIGINT (Ctrl-C) outside the training steps; rerun to "
                "resume from the last checkpoint",
                file=sys.stderr,
            )
            sys.exit(130)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            print(f"error: {RunDiskFullError(exc.filename, exc)}", file=sys.stderr)
            sys.exit(RunDiskFullError.exit_code)
        if isinstance(result, FitResult):
            sys.exit(result.exit_code)
        return result

    return wrapper  # type: ignore[return-value]
