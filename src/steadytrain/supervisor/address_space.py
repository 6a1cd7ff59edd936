"""The child's address space against its cap (the soft RLIMIT_AS: `ulimit -v`, a job's limit, or
one the program set itself), sampled by the supervisor from /proc while the child runs (Linux;
elsewhere, or where /proc cannot be read, no reading). Standard library only.

Under such a cap an allocation fails instead of the OS killing the process, and native code that
does not check for it crashes: TensorFlow's oneDNN kernels with SIGSEGV, a C++ ``std::bad_alloc``
or a thread that cannot get its stack with SIGABRT. Neither leaves a word on what ran short, and
stderr is the terminal's, not the supervisor's. What tells it is the address space: a crash of
a process that had used most of its cap (`AddressSpace.near`) is taken for an out-of-memory, as a
SIGKILL with memory high is (`child_exit.ChildExit.crashed_near_cap`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NEAR_CAP = 0.80
"""A process whose address space reached this share of its cap counts as near it: the last
sample is up to a poll old and the allocation that failed is not in it (the share of the machine
left that makes memory count as high for a SIGKILL, `attempt_end.LOW_AVAILABLE`, is the same
20 %)."""
GIB = 1024**3
_LIMIT_ROW = "Max address space"


@dataclass(frozen=True)
class AddressSpace:
    """The most address space the child held (``VmPeak``) and its soft cap, in bytes."""

    peak: int
    limit: int

    @property
    def near(self) -> bool:
        return self.peak >= NEAR_CAP * self.limit

    @property
    def text(self) -> str:
        return (
            f"its address space reached {self.peak / GIB:.2f} GiB of its "
            f"{self.limit / GIB:.2f} GiB cap (RLIMIT_AS)"
        )


def read_address_space(pid: int, proc: Path = Path("/proc")) -> AddressSpace | None:
    """Process `pid`'s ``VmPeak`` and soft ``Max address space``; None when it has no cap, is
    gone, or /proc does not say (another OS)."""
    folder = proc / str(pid)
    try:
        limits = (folder / "limits").read_text()
        status = (folder / "status").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    limit = peak = None
    for row in limits.splitlines():
        fields = row.removeprefix(_LIMIT_ROW).split() if row.startswith(_LIMIT_ROW) else []
        if fields:
            limit = _bytes(fields[0])
    for row in status.splitlines():
        if row.startswith("VmPeak:"):
            peak = _kib(row.split()[1:])
    if limit is None or peak is None:
        return None
    return AddressSpace(peak, limit)


def _bytes(text: str) -> int | None:
    """A limit as /proc/PID/limits writes it: a number of bytes, or "unlimited" (None)."""
    return int(text) if text.isdigit() else None


def _kib(fields: list[str]) -> int | None:
    """A size as /proc/PID/status writes it ("12345 kB")."""
    if len(fields) == 2 and fields[0].isdigit() and fields[1] == "kB":
        return int(fields[0]) * 1024
    return None
