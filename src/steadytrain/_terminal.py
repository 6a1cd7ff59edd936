"""Console writes that survive the terminal closing under them.

A terminal closed without nohup or tmux hangs up its tty (writes then fail with EIO) and, when
the output went through a pipe (``| tee log``), ends the reader (EPIPE). A run stopping on the
SIGHUP that follows still has lines to print ("finishing this optimizer step", "checkpoint at
step N") and the interpreter flushes stdout and stderr on its way out: any of these failing
would end the run before its checkpoint, or with exit 120 after it. So a stream found gone is
pointed at the null device (as nohup would have), and the line is dropped instead of raised.
Standard library only: the supervisor and the trainer's console both write through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import sys
from typing import Any, TextIO

GONE = (errno.EIO, errno.EPIPE, errno.ENXIO)
"""What a write to a hung-up terminal (EIO, ENXIO) or a pipe without a reader (EPIPE) fails
with."""


def is_gone(exc: BaseException) -> bool:
    """Whether `exc` is a write's failure because the terminal or pipe reader is gone."""
    return isinstance(exc, OSError) and exc.errno in GONE


def to_null(stream: Any) -> None:
    """Point `stream`'s file descriptor at the null device: what is still buffered and every
    later write (ours, the program's own prints, the interpreter's last flush) goes nowhere
    instead of failing. A stream without a descriptor is left as it is."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def detach_gone() -> list[str]:
    """Stdout and stderr whose terminal hung up or whose pipe lost its reader (poll says
    POLLHUP or POLLERR), pointed at the null device. Returns their names. Called when a stop
    signal arrives, before anything is printed for it."""
    if not hasattr(select, "poll"):
        return []
    detached = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            events = dict(poll.poll(0)).get(fd, 0)
        except (AttributeError, OSError, ValueError):
            continue
        if events & (select.POLLHUP | select.POLLERR):
            to_null(stream)
            detached.append(name)
    return detached


class Surviving:
    """`stream` (a text file) whose writes and flushes do not raise when its terminal or pipe
    reader is gone: the stream is pointed at the null device and the text dropped. Every other
    attribute is the stream's, so a rich Console given it still sees a terminal where there
    is one."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            if not is_gone(exc):
                raise
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if not is_gone(exc):
                raise
            self._gone()

    def _gone(self) -> None:
        to_null(self._stream)
        with contextlib.suppress(OSError):  # what was buffered now goes to the null device
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def say(text: str, stream: TextIO | None = None) -> None:
    """Print `text` as one line on `stream` (stderr when None) and flush it, surviving a
    closed terminal."""
    stream = stream if stream is not None else sys.stderr
    if stream is None:  # no console at all (pythonw)
        return
    out = Surviving(stream)
    out.write(text + "\n")
    out.flush()
