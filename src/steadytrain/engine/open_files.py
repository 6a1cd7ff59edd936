"""The process's limit on open files (`ulimit -n`) reached while training: DataLoader workers
(each holds pipes and, for shared tensors, a descriptor per batch), the background checkpoint
writer and the run's logs all take descriptors. Python raises OSError EMFILE where a pipe or file
cannot be opened, torch a RuntimeError "Too many open files" where a worker's batch cannot be
received. Either is the environment's setting, not a bug and not the user's code: exit 2 with the
limit in force and the two ways out. A restart hits the same limit."""

from __future__ import annotations

import errno

from steadytrain.errors import BadInputError

TORCH_TEXT = "Too many open files"  # torch's text for a batch a worker could not pass over
LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE)


class OpenFilesLimitError(BadInputError):
    """The run needs more open files than the process (or the system) allows."""


def _soft_limit() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _reached(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain that says the open-files limit was reached."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in LIMIT_ERRNOS:
            return current
        if isinstance(current, RuntimeError) and TORCH_TEXT in str(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def open_files_limit_error(exc: BaseException, num_workers: int) -> OpenFilesLimitError | None:
    """The error to stop with when `exc` is the open-files limit reached; None otherwise."""
    if isinstance(exc, BadInputError) or _reached(exc) is None:
        return None
    limit = _soft_limit()
    system = isinstance(exc, OSError) and exc.errno == errno.ENFILE
    where = (
        "the system's table of open files is full"
        if system
        else f"this process may hold {limit} open files (`ulimit -n` {limit})"
        if limit is not None
        else "this process reached its limit on open files"
    )
    fewer = f"lower num_workers (now {num_workers})" if num_workers else "close files you hold"
    return OpenFilesLimitError(
        f"too many open files: {where}, and training needs more "
        f"(DataLoader workers, the checkpoint writer, the run's logs). Raise the limit in the "
        f"shell that starts the run (`ulimit -n 4096`) or {fewer}; the run resumes from its "
        "last checkpoint."
    )
