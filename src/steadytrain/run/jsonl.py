"""The run directory's JSON-lines files (metrics.jsonl, events.jsonl): how a line is written and
how lines are read back, for every writer (the trainer's `RunFiles`, the supervisor, the
watchdog, the failure record) and every reader (the report, the supervisor's progress and
micro-batch readers). Standard library and `steadytrain.run.durable` only: the supervisor imports
it, and nothing of torch.

Writing. A record is one line, ``json.dumps(record, default=str)`` and a newline, written by one
``write`` system call on a descriptor opened in O_APPEND mode through `_durable.open_in_run`,
which refuses a symbolic link planted at the file or at a folder on the way (exit 2) and names a
full disk (exit 6). Lines of several processes (the trainer and the supervisor both append to
events.jsonl) therefore never interleave.

A torn last line. A process killed mid-write (SIGKILL, the OS out-of-memory killer) can leave
the last line without its end: the kernel stops copying a large write at a page boundary when a
fatal signal is pending. Every writer that opens the file looks at its last byte and, when it is
not a newline, puts one in front of its first line, inside the same write. So every record
starts on a line of its own, and a torn line ends in a newline and may sit mid-file after a
resume.

Reading. `read` gives every line that parses as a JSON object, whole file; `tail` the complete
ones in the last `TAIL_BYTES` (what the supervisor reads of a long run). A torn line, and a
tail's partial first line, are skipped; every other line is kept.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from steadytrain.run.durable import open_in_run, write_all

TAIL_BYTES = 64 * 1024  # enough for the last few lines, however long the run


def encode(record: dict[str, Any]) -> bytes:
    """One record as the bytes of its line."""
    return (json.dumps(record, default=str) + "\n").encode()


def _line_start(fd: int) -> bytes:
    """What the first write on `fd` puts before its line: a newline when the file ends in a torn
    line, else nothing."""
    size = os.fstat(fd).st_size
    return b"\n" if size > 0 and os.pread(fd, 1, size - 1) != b"\n" else b""


class JsonlFile:
    """One JSON-lines file held open for appending (the trainer writes a line per step); each
    record is one ``write`` of one line, unbuffered, so a failed write leaves nothing queued to
    fail again at close.

    The file is opened at the first record, so a run refused before it records anything (a bad
    config found while the callbacks are built) leaves no open file behind. `root` is the run
    directory (default: the file's folder): no link at the file or between them is followed."""

    def __init__(self, path: str | os.PathLike, root: str | os.PathLike | None = None):
        self.path = Path(path)
        self.root = Path(root) if root is not None else self.path.parent
        self._fd: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        data = encode(record)
        if self._fd is None:  # first, or late (after fit_end)
            self._fd = open_in_run(self.path, "append", root=self.root)
            data = _line_start(self._fd) + data
        write_all(self._fd, data, self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def append(path: str | os.PathLike, record: dict[str, Any], root: str | os.PathLike) -> None:
    """One line appended to `path` in the run directory `root` by a writer that does not hold
    the file open (the supervisor, the watchdog's last word, the failure record)."""
    fd = open_in_run(path, "append", root=root)
    try:
        write_all(fd, _line_start(fd) + encode(record), path)
    finally:
        os.close(fd)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except ValueError:
        return None  # torn by a kill mid-line; the line after it was started afresh
    return record if isinstance(record, dict) else None


def open_regular(path: str | os.PathLike):
    """`path` (a file of the run directory) opened for reading in binary, when it is a regular
    file: a named pipe planted there would block the reader (the report, the supervisor) for
    good, so it is opened without waiting and refused (OSError, as any file that cannot be
    read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a named pipe, a device or a socket)")
    return os.fdopen(fd, "rb")


def read(
    path: str | os.PathLike, containing: bytes | None = None, start: int = 0
) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, oldest first ([] when there is no file); a line that is
    not a JSON object (torn by a kill) is skipped. With `containing`, only lines holding those
    bytes are parsed (the supervisor's look for one event in a long file). With `start`, only the
    lines written past that size of the file (see `tail`). A path that is not a regular file is
    OSError."""
    records = []
    try:
        with open_regular(path) as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(_line_after(handle, start, size))
            for line in handle:
                if containing is not None and containing not in line:
                    continue
                record = _parse(line)
                if record is not None:
                    records.append(record)
    except FileNotFoundError:
        return []
    return records


def _line_after(handle, start: int, size: int) -> int:
    """Where the first line written past the size `start` begins: `start` itself, or one byte on
    when the file then ended in a torn line (the next writer put a newline first). 0 when the
    file is now shorter than `start`: it was replaced, and all of it is newer."""
    if start <= 0 or start > size:
        return 0
    handle.seek(start - 1)
    two = handle.read(2)
    return start + 1 if two[:1] != b"\n" and two[1:] == b"\n" else start


def tail(
    path: str | os.PathLike, tail_bytes: int = TAIL_BYTES, since: int = 0
) -> list[dict[str, Any]]:
    """The complete records in the last `tail_bytes` of a JSON-lines file, oldest first; [] when
    it cannot be read. The partial line the tail starts in, and torn lines, are skipped. With
    `since` (the file's size at some moment), only the lines written after it: the file only
    grows, so its size marks a moment as no clock can (see `steadytrain.supervisor.progress`)."""
    try:
        with open_regular(path) as handle:
            size = handle.seek(0, os.SEEK_END)
            after = _line_after(handle, since, size)
            start = max(after, size - tail_bytes)
            handle.seek(max(0, start - 1))
            data = handle.read()
    except OSError:
        return []
    if start > after:  # read from the byte before the tail: its line ends at the first newline
        cut = data.find(b"\n")  # 0: the tail starts with a whole line
        data = data[cut + 1 :] if cut >= 0 else b""
    elif start > 0:
        data = data[1:]  # the byte before a line's start
    return [r for r in map(_parse, data.split(b"\n")) if r is not None]
