"""Exit codes for training scripts: a user's `python train.py` exits the way DESIGN.md promises
(2 bad input, 3 does not fit, 5 an error in your code, 130/143 stopped after saving, ...).

A plain script gets them from `install_exit_hook`, which importing steadytrain calls: an uncaught
`SteadytrainError` prints its one message and exits with its code. `@entrypoint` on `main` adds
what a hook cannot see: a returned `FitResult`'s code, a disk-full `OSError` of the script's own
writes, and a Ctrl-C while the model loads, each as one line."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import TracebackType
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


def install_exit_hook() -> None:
    """Make an uncaught `SteadytrainError` end a plain script (one without `@entrypoint`) as
    the documented exit: its message on stderr, no traceback, its `exit_code`. Anything else
    goes to the hook that was there before. Installed once; an interactive session keeps its
    tracebacks and is never ended by it."""
    if getattr(sys.excepthook, "_steadytrain_exit_hook", False):
        return
    previous = sys.excepthook

    def exit_hook(
        kind: type[BaseException], error: BaseException, trace: TracebackType | None
    ) -> None:
        interactive = sys.flags.interactive or hasattr(sys, "ps1")
        if not isinstance(error, SteadytrainError) or interactive:
            previous(kind, error, trace)
            return
        print(f"error: {error}", file=sys.stderr)
        # Python ends the process with this code, running atexit and joining threads as it
        # does for an uncaught SystemExit, when the hook itself raises one.
        raise SystemExit(error.exit_code)

    exit_hook._steadytrain_exit_hook = True  # type: ignore[attr-defined]
    sys.excepthook = exit_hook
