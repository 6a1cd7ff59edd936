"""What `Trainer.fit()` leaves in the run directory when it fails: the whole traceback in
RUN_DIR/errors/, and one "error" event that lets `steadytrain run` tell a failure that repeats
identically (a restart would fail the same way) from one that may pass."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from steadytrain.device import is_oom
from steadytrain.errors import UserCodeError, user_code_error
from steadytrain.run import files as run_files
from steadytrain.run.durable import open_in_run, write_all
from steadytrain.run.events import append_event
from steadytrain.run.records import Record


def record_failure(run_dir: Path, exc: BaseException) -> UserCodeError | None:
    """Keep the traceback and record the error event. Returns the error as the user's
    (`UserCodeError`: exit 5, or 3 when it ran out of memory) when it was raised in their code,
    else None (a bug: exit 1)."""
    theirs = user_code_error(exc, out_of_memory=is_oom(exc))
    keep_traceback(run_dir, exc)
    if theirs is not None:
        record_error(run_dir, theirs, theirs.step, theirs.where, theirs.signature)
        return theirs
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    step = getattr(exc, "steadytrain_step", None)  # set by the loop on its way out
    record_error(run_dir, exc, step, where, f"{type(exc).__name__}|{exc}|{where}")
    return None


def record_exit(run_dir: Path, exc: BaseException, process_group: dict | None = None) -> None:
    """Under torchrun, one "exit" event in the rank's own folder when its fit() ends by an
    error: the exit code and reason, the step, the rank, and the collective it was in (a peer
    that died ends the others' collectives with an error). `steadytrain run` reads these to tell
    the rank that failed first from the ranks that failed because of it. A single process
    writes none: its exit code reaches the supervisor itself (and fit_end / error say the
    rest)."""
    if not process_group or process_group.get("world_size", 1) <= 1:
        return
    cause = exc.__cause__
    collective = getattr(exc, "steadytrain_collective", None) or getattr(
        cause, "steadytrain_collective", None
    )
    code = 130 if isinstance(exc, KeyboardInterrupt) else getattr(exc, "exit_code", 1)
    text = str(exc).strip().splitlines()
    step = getattr(exc, "step", None)
    if step is None:
        step = getattr(exc, "steadytrain_step", getattr(cause, "steadytrain_step", None))
    record = {
        "time": time.time(),
        "event": Record.EXIT,
        "step": step,
        "exit_code": code if isinstance(code, int) else 1,
        "reason": f"{type(exc).__name__}: {text[0] if text else ''}"[:500],
        "collective": collective,
        "rank": process_group.get("rank"),
        "world_size": process_group["world_size"],
    }
    with contextlib.suppress(Exception):  # a full disk must not hide the error itself
        append_event(run_dir, record)


def keep_traceback(run_dir: Path, exc: BaseException) -> None:
    """The whole traceback (the chain included) in RUN_DIR/errors/, for the report and for
    whoever fixes it; the message on the console shows the user's frames only. A full disk
    is passed over (the error itself matters more); a planted link is refused (exit 2)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = run_dir / run_files.ERRORS / f"{stamp}-{os.getpid()}.txt"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        fd = open_in_run(path, "new", root=run_files.top(run_dir))
        try:
            write_all(fd, text.encode(errors="replace"), path)
        finally:
            os.close(fd)
    except OSError:
        pass


def record_error(
    run_dir: Path, exc: BaseException, step: int | None, where: str, signature: str
) -> None:
    error = exc.error if isinstance(exc, UserCodeError) else f"{type(exc).__name__}: {exc}"
    record = {
        "time": time.time(),
        "event": Record.ERROR,
        "step": step,
        "exit_code": getattr(exc, "exit_code", 1),
        "error": error.splitlines()[0][:500] if error else type(exc).__name__,
        "where": where,
        "signature": hashlib.sha256(signature.encode()).hexdigest()[:16],
        "in_your_code": isinstance(exc, UserCodeError),
    }
    with contextlib.suppress(OSError):  # a full disk must not hide the error itself
        append_event(run_dir, record)
