"""The child's side of `steadytrain run`: what a process the supervisor started reads from its
environment (the micro-batch cap after a memory kill, how many memory savers to turn on) and
what it tells the supervisor (its run directory, through ENV_ANNOUNCE_FD; the savers in force, as
a `memory_savers` event). The supervisor's side reads these back (`steadytrain.supervisor`); the
names both use are in `steadytrain.run.env` (which reads every variable) and
`steadytrain.run.events`."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from typing import Any

from steadytrain.run import env as run_env
from steadytrain.run import files as run_files
from steadytrain.run.records import Record


def micro_cap_from_supervisor(environ: Mapping[str, str] = os.environ) -> int | None:
    """The child's side: `steadytrain run` sets this after a memory kill, to start the
    restarted run smaller (`run_env.max_micro_batch`: a bad value is exit 2)."""
    return run_env.max_micro_batch(environ)


def savers_from_supervisor(
    savers: Any,
    record: Any,
    step: int,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """The child's side of the escalation: under `steadytrain run`, climb the memory savers'
    ladder (`memory.savers.MemorySavers`) until as many rungs are in force as
    ENV_MEMORY_SAVERS asks (the OS killed an earlier attempt at micro-batch 1, or a rank of
    its torchrun group exited 76 there), recording a `memory_saver` event for each one turned
    on; then record which are in force and which are left (`memory_savers`), which the
    supervisor reads when this attempt is killed too."""
    if not run_env.supervised(environ):
        return
    asked = run_env.memory_savers(environ) or None
    if asked:
        reason = (
            f"{run_files.ENV_MEMORY_SAVERS}={asked} (supervisor: an earlier attempt ran out of "
            "memory with no smaller micro-batch left: the OS killed it, or a rank exited 76)"
        )
        for info in savers.climb_to(asked, reason):
            record(Record.MEMORY_SAVER, {"step": step, **info})
    record(
        Record.MEMORY_SAVERS,
        {"step": step, "in_force": savers.in_force(), "left": savers.left(), "asked": asked},
    )


def announce_run_dir(run_dir: str | os.PathLike, environ: Any = os.environ) -> None:
    """Tell a supervising `steadytrain run` where this run writes (the child's side of
    ENV_ANNOUNCE_FD, "FD:INODE"); nothing happens when no supervisor asked, or where the file
    at that number is not the supervisor's pipe: a process that did not inherit it (a torchrun
    rank: torchrun closes it, the variable stays) may hold a file of its own there.

    The path goes as the file system's own bytes (a name that is not UTF-8 too), one line; a
    path holding a newline cannot be one line, so it is not announced (the supervisor then says
    so and asks for --run-dir) rather than announced cut short."""
    asked = run_env.announce_fd(environ)
    if asked is None:
        return
    fd, inode = asked
    path = os.fsencode(os.path.abspath(run_dir))
    if b"\n" in path:
        return
    with contextlib.suppress(OSError):  # closed, or the supervisor went away: nobody to tell
        found = os.fstat(fd)
        if stat.S_ISFIFO(found.st_mode) and found.st_ino == inode:
            os.write(fd, path + b"\n")
