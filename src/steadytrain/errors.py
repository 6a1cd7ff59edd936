"""Errors a user can cause, each carrying the process exit code DESIGN.md promises; every error
class steadytrain raises on purpose lives here.

The CLI and `entrypoint` turn any `SteadytrainError` into its message and its `exit_code`,
without a traceback. An exception raised in the user's own code (`UserCodeError`) exits
`USER_CODE_EXIT`. Anything else that escapes is a bug (exit 1), so no `SteadytrainError`
exits 1: a stop that a restart from the last checkpoint fixes exits `RESTARTABLE_EXIT`, which
`steadytrain run` restarts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import site
import sysconfig
import traceback
from pathlib import Path

from steadytrain._units import format_bytes

BAD_INPUT_EXIT = 2
DOES_NOT_FIT_EXIT = 3
USER_CODE_EXIT = 5  # an exception raised in the user's loss function, model, data or callback
DISK_FULL_EXIT = 6  # a file of the run could not be written; a restart fails the same way
RESTARTABLE_EXIT = 75  # EX_TEMPFAIL: try again; also what a detected hang exits with
SHRINK_EXIT = 76
"""Out of memory in a loop steadytrain does not own (a Lightning or Keras callback, `RunGuard`):
restart me with half the micro-batch and twice the accumulation (`steadytrain run` does)."""


_CAUGHT = re.compile(r"Caught (\w+) (in .+?)\.\nOriginal Traceback", re.DOTALL)
"""torch's text for an exception raised in a DataLoader worker (or its pin-memory thread), which
it raises again in the training process as ``exc_type(text)``."""


class _Rebuilt(type):
    """Metaclass of `SteadytrainError`: torch raises a worker's exception again in the training
    process by calling its class with one argument, "Caught ConfigError in DataLoader worker
    process 0.\nOriginal Traceback ...". Called so, a steadytrain error is built as the one the
    worker raised: its class and exit code, its own message (the traceback's last line), so
    the CLI and `entrypoint` print it as they print it from the training process."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        text = kwargs.get("message") if len(kwargs) == 1 and not args else None
        text = args[0] if len(args) == 1 and not kwargs else text
        if isinstance(text, str) and text.startswith("Caught "):
            found = _CAUGHT.match(text)
            if found is not None and found.group(1) == cls.__name__:
                return _from_worker(cls, text)
        return super().__call__(*args, **kwargs)


class SteadytrainError(Exception, metaclass=_Rebuilt):
    """Base of every error steadytrain raises on purpose."""

    exit_code: int = BAD_INPUT_EXIT


_FROM_WORKER: dict[type, type] = {}


def _from_worker(cls: type, text: str) -> SteadytrainError:
    """`cls` raised in a DataLoader worker, from torch's `text` of it: an instance of `cls`
    whose message is the worker's own (what follows "module.Class: " on the last line of the
    traceback, and the lines after it)."""
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    own = text.rsplit(f"\n{name}: ", 1)
    message = own[1].strip() if len(own) == 2 else text.strip()
    if cls not in _FROM_WORKER:
        _FROM_WORKER[cls] = type(
            cls.__name__,
            (cls,),
            {"__str__": _worker_message, "__reduce__": _reduce, "__module__": cls.__module__},
        )
    builtin = next(b for b in cls.__mro__ if b.__module__ == "builtins")  # OSError, ValueError
    made = builtin.__new__(_FROM_WORKER[cls], message)
    builtin.__init__(made, message)
    made.worker_message = message
    if isinstance(made, ConfigError):
        made.problems, made.source = [message], None
    if isinstance(made, UserCodeError):
        said = _USER_CODE.match(message)  # the worker's own str(): where, and the problem
        made.where = said.group(1) if said else None
        made.problem = message[said.end() :] if said else message
        made.step, made.frames = None, ""
        made.error = (made.problem.splitlines() or [""])[0]
    return made


_USER_CODE = re.compile(
    r"error in your code(?: \((.*?)\))?(?: at step \d+| before the first step): "
)
"""The start of `UserCodeError.__str__`: the place it names, if any."""


def _worker_message(self: SteadytrainError) -> str:
    """The worker's message; a `UserCodeError`'s at the step the training process knows (the
    worker knew none: "before the first step")."""
    step = getattr(self, "step", None)
    if isinstance(self, UserCodeError) and step is not None:
        return self.worker_message.replace(" before the first step: ", f" at step {step}: ", 1)
    return self.worker_message


def _reduce(self: SteadytrainError) -> tuple:
    return _from_worker, (type(self).__mro__[1], self.worker_message)


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


class RankOutOfMemory(SteadytrainError):
    """Out of memory on one rank of a sharded (FSDP) run: its collectives run inside the
    forward, so the ranks cannot agree on a redo; this rank exits `SHRINK_EXIT` and torchrun
    ends the group, which `steadytrain run` restarts smaller from the last checkpoint."""

    exit_code = SHRINK_EXIT


class FreshProcessOutOfMemory(SteadytrainError):
    """Out of memory again after a shrink, in a process whose freed memory may stay held (CPU
    under an address-space limit, `ulimit -v`, with glibc's default malloc): this process
    cannot tell what a smaller micro-batch needs, so it exits `SHRINK_EXIT` and
    `steadytrain run` restarts it smaller, in a fresh process, from the last checkpoint."""

    exit_code = SHRINK_EXIT


class CheckpointError(BadInputError):
    """A checkpoint cannot be written, found or read; the message names the folder and file."""


class DiskFullError(CheckpointError):
    """The disk filled up during a save. The previous checkpoint is untouched. A training run
    reports it as `RunDiskFullError` (exit 6), as a full disk anywhere."""

    def __init__(self, message: str, path: Path, needed: int, free: int):
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free


class StateNotRestoredError(BadInputError):
    """The first loss after a resume differs from the one the checkpoint recorded."""


class RNGStateError(BadInputError, RuntimeError):
    """A saved RNG snapshot cannot be restored on this machine."""


SIGNAL_EXITS = {"SIGHUP": 129, "SIGINT": 130, "SIGTERM": 143}
"""The stop signals and the codes a run they stopped ends with (128 + the signal's number): it
finished the optimizer step and committed a checkpoint first. SIGHUP is the terminal closing."""


class Stopped(SystemExit):
    """`fit()` (or an integration's loop) was stopped by SIGINT, SIGTERM or SIGHUP after
    committing a checkpoint (or by a Ctrl-C before its first step: nothing new to save). A
    `SystemExit` carrying the code (`code`: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP):
    uncaught, the process ends with it and without a traceback, so the lines after `fit()` (a
    final ``torch.save``) do not run as if training had finished, and `steadytrain run` or a
    cluster sees a stop, not a success. Catch it to do something first, then re-raise:
    ``except steadytrain.Stopped as stop: ...; raise``. `result` is fit()'s `FitResult` (None
    from an integration); `signal` the signal's name; `saved` whether it saved a checkpoint
    (False for a Ctrl-C outside the training steps)."""

    def __init__(self, signal: str, result: object = None, saved: bool = True):
        super().__init__(SIGNAL_EXITS[signal])
        self.signal, self.result, self.saved = signal, result, saved

    def __str__(self) -> str:
        done = "after saving a checkpoint" if self.saved else "outside the training steps"
        return f"stopped by {self.signal} {done} (exit {self.code})"


class DemoFailed(SteadytrainError):
    """A step of the demo ended with the code of the command it ran."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RunDiskFullError(SteadytrainError, OSError):
    """The disk that holds the run directory is full (ENOSPC or a quota, EDQUOT): the run stopped
    cleanly. Exit 6; `steadytrain run` does not restart it, since a restart fails the same way.
    The message names the file, the space left and what was kept."""

    exit_code = DISK_FULL_EXIT

    def __init__(
        self,
        path: str | os.PathLike | None,
        error: OSError | None = None,
        kept: str = "",
        detail: str = "",
    ):
        self.path = os.fspath(path) if path is not None else None
        self.error, self.kept, self.detail = error, kept, detail
        code = error.errno if error is not None else errno.ENOSPC
        super().__init__(code, os.strerror(code), self.path)  # still an OSError to old callers

    def __str__(self) -> str:
        if self.detail:  # a whole message already (a checkpoint save's, with sizes and advice)
            return self.detail
        what = f"could not write {self.path}" if self.path else "a write failed"
        reason = f" ({self.error.strerror})" if self.error is not None else ""
        free = free_space(self.path)
        left = f"; {free} free on that filesystem" if free else ""
        kept = f"\nKept: {self.kept}." if self.kept else ""
        return (
            f"disk full: {what}{reason}{left}.{kept}\nFree some space (or give run_dir a "
            "larger disk) and run the same command again: the run resumes from its last "
            "committed checkpoint."
        )


class RunNotWritableError(BadInputError, OSError):
    """A file of the run could not be written because its place is read-only (EROFS: a disk
    mounted or remounted read-only, as after an I/O error) or, for a write steadytrain names, not
    this user's (EACCES, EPERM). Exit 2; `steadytrain run` does not restart it, since a restart
    fails the same way. Still an OSError with its errno to callers that catch one. The message
    names the file and what was kept."""

    def __init__(self, path: str | os.PathLike | None, error: OSError, kept: str = ""):
        self.path = os.fspath(path) if path is not None else None
        self.error, self.kept = error, kept
        super().__init__(error.errno, error.strerror, self.path)

    def __str__(self) -> str:
        what = f"cannot write {self.path}" if self.path else "a write failed"
        kept = f"\nKept: {self.kept}." if self.kept else ""
        why, fix = (
            ("the disk there is read-only (mounted so, or remounted so after an error)",
             "remount it read-write")
            if self.error.errno == errno.EROFS
            else ("the folder is not this user's to write", "give this user the folder")
        )  # fmt: skip
        return (
            f"{what} ({self.error.strerror}): {why}.{kept}\nMake it writable ({fix}), or copy "
            "the run directory to a writable place and point run_dir there, then run the same "
            "command again: the run resumes from its last committed checkpoint."
        )


NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is an OSError saying the disk (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def free_space(path: str | os.PathLike | None) -> str:
    """'12.00 MiB' free on the filesystem holding `path` (its nearest existing folder); '' when
    that cannot be read."""
    if path is None:
        return ""
    folder = os.path.abspath(os.fspath(path))
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return ""
        folder = parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return format_bytes(free)


class UserCodeError(SteadytrainError):
    """An exception raised in code the user gave (loss function, model forward, dataset,
    collate function, callback), or a value it returned that cannot work. Its message names the
    function and the step and shows the user's own frames of the traceback. Exit 5."""

    exit_code = USER_CODE_EXIT
    resumes_at: int | None = None
    """Where a rerun starts, set by the `Trainer` that stopped from its run directory: the step
    of its newest checkpoint, 0 when none was saved yet; None when not known (the message then
    promises no checkpoint)."""

    def __init__(
        self,
        problem: str,
        *,
        where: str | None = None,
        step: int | None = None,
        frames: str = "",
        error: str | None = None,
    ):
        self.problem, self.where, self.step, self.frames = problem, where, step, frames
        self.error = error or problem.splitlines()[0]
        super().__init__(problem)

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        at = f" at step {self.step}" if self.step is not None else " before the first step"
        text = f"error in your code{where}{at}: {self.problem}"
        if self.frames:
            text += f"\nTraceback, your code only (most recent call last):\n{self.frames}"
        return text + f"\nFix it and {self.run_again()}."

    def run_again(self) -> str:
        """'run again', and where the rerun starts when the run directory said so."""
        if self.resumes_at is None:
            return "run again"
        if self.resumes_at == 0:
            return "run again: no checkpoint was saved yet, so the run starts from the beginning"
        return f"run again: the run resumes from its last checkpoint (step {self.resumes_at})"

    @property
    def signature(self) -> str:
        """The same error at the same place gives the same text (a restart would repeat it)."""
        return hashlib.sha256(f"{self.where}|{self.error}|{self.frames}".encode()).hexdigest()[:16]


class UnstackedSamplesError(UserCodeError, AttributeError, TypeError):
    """Samples of different shapes (token lists of different lengths) that the default
    collation could not stack, used as one tensor: the message names two samples, their shapes
    and the fix (a collate_fn that pads). An AttributeError and a TypeError too, as the error it
    replaces was, so that `hasattr` and `except TypeError` see what they saw before. Exit 5."""


class OutOfMemoryInYourCode(UserCodeError):
    """Out of memory in the user's code outside a training step (the optimizer or scheduler
    factory, a callback, the dataset before the first batch): the out-of-memory ladder only
    redoes a step's forward and backward smaller, so nothing steadytrain can shrink helps.
    Exit 3, as a run that does not fit; the message names the function and what does help."""

    exit_code = DOES_NOT_FIT_EXIT

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        at = f" at step {self.step}" if self.step is not None else " before the first step"
        text = f"out of memory in your code{where}{at}: {self.problem}"
        if self.frames:
            text += f"\nTraceback, your code only (most recent call last):\n{self.frames}"
        return text + (
            "\nThis ran out outside a training step's forward and backward, where a smaller "
            "micro-batch does not help: free memory (other programs, tensors your code keeps), "
            f"or make what this code builds smaller; then {self.run_again()}."
        )


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(AttributeError):  # site lacks these under some embedders
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


_OURS = os.path.realpath(Path(__file__).parent) + os.sep


def _owner(filename: str) -> str:
    """ "ours" (steadytrain), "library" (the standard library, installed packages) or "user"."""
    if filename.startswith("<") and filename != "<string>" and not filename.startswith("<ipy"):
        return "library"  # <frozen importlib._bootstrap> and the like
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    if path.startswith(_OURS):
        return "ours"
    return "library" if path.startswith(_library_dirs()) else "user"


def user_code_error(
    exc: BaseException, step: int | None = None, *, out_of_memory: bool = False
) -> UserCodeError | None:
    """`exc` as an error in the user's code, or None when it is not theirs. It is theirs when
    the traceback, after its last frame in steadytrain, passes through a file of theirs (not
    steadytrain, not the standard library or an installed package). With `out_of_memory` (the
    caller's `device.is_oom(exc)`) it is an `OutOfMemoryInYourCode`. An error already
    classified gets the step if it had none."""
    if isinstance(exc, UserCodeError):
        if exc.step is None:
            exc.step = step
        return exc
    if not isinstance(exc, Exception) or isinstance(exc, SteadytrainError):
        return None
    died = _worker_died(exc, step)
    if died is not None:
        return died
    frames = traceback.extract_tb(exc.__traceback__)
    owners = [_owner(f.filename) for f in frames]
    last_ours = max((i for i, o in enumerate(owners) if o == "ours"), default=-1)
    after = list(zip(frames[last_ours + 1 :], owners[last_ours + 1 :], strict=True))
    mine = [f for f, owner in after if owner == "user"]
    if not mine:
        return None
    shown = [f for f, owner in after if owner == "user" or f is after[-1][0]]
    called = mine[0]
    where = f"{called.name} ({Path(called.filename).name}:{called.lineno})"
    if mine[-1] is not called:
        deepest = mine[-1]
        where = (
            f"{deepest.name} ({Path(deepest.filename).name}:{deepest.lineno}), called from {where}"
        )
    error = f"{type(exc).__name__}: {str(exc).strip()}".strip().rstrip(":")
    text = "".join(traceback.format_list(shown)).rstrip()
    fields = {"where": where, "step": step, "frames": text, "error": error}
    base = OutOfMemoryInYourCode if out_of_memory else UserCodeError
    try:
        return _theirs_class(type(exc), base)(error, **fields)
    except TypeError:  # an exception class whose constructor wants more than a message
        return base(error, **fields)


_THEIRS: dict[tuple[type, type], type] = {}


def _theirs_class(original: type, base: type[UserCodeError] = UserCodeError) -> type:
    """`base` (a `UserCodeError`) that is also an instance of the user's exception type, so code
    around `fit()` that catches `ValueError` still catches the ValueError its loss function
    raised."""
    key = (original, base)
    if key not in _THEIRS:
        try:
            _THEIRS[key] = type(base.__name__, (base, original), {})
        except TypeError:  # a final class, or a layout that cannot be combined
            _THEIRS[key] = base
    return _THEIRS[key]


_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (.*?)\.?(?: Details .*)?")
"""torch's words for a DataLoader worker process that ended (from its SIGCHLD handler, which
raises wherever the main thread is, or from the loader's own check)."""


def is_worker_death(exc: BaseException) -> bool:
    """Whether `exc` (or an error it interrupted) is torch's word that a DataLoader worker
    process ended."""
    return _worker_died(exc, None) is not None


def _worker_died(exc: BaseException, step: int | None) -> UserCodeError | None:
    """A DataLoader worker that died (exited, or killed by a signal) in `exc` or the errors it
    interrupted, as one line naming the worker and how to see its error; else None."""
    seen: list[BaseException] = []
    while exc is not None and len(seen) < 8 and exc not in seen:
        seen.append(exc)
        found = _WORKER_DIED.fullmatch(str(exc).strip()) if isinstance(exc, RuntimeError) else None
        if found is not None:
            pids, how = found.groups()
            how = how.replace("is killed by signal:", "was killed by signal")
            oom = ""
            if how.endswith(("Killed", "unexpectedly")):  # SIGKILL, or not known
                oom = (
                    "; a worker killed by SIGKILL may have been ended by the kernel's "
                    "out-of-memory killer (`dmesg` says), where fewer num_workers help"
                )
            return UserCodeError(
                f"a DataLoader worker (pid {pids}) {how} while loading samples, and its own "
                f"error went with it: rerun with num_workers=0 to see that error{oom}",
                where="DataLoader worker",
                step=step,
            )
        exc = exc.__cause__ or exc.__context__
    return None
