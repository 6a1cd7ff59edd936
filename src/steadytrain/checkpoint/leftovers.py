"""What killed saves leave in the checkpoints folder (``.staging-*``, ``.deleting-*``,
``.latest-*.tmp``, each named with its process's pid), and their removal: never a name in flight
in this process (`remember` ... `forget`), nor one of another live process."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable

import psutil

from steadytrain.run.records import Record

LEFTOVER = re.compile(r"^\.(staging|deleting|latest)-(?:.*-)?(\d+)-[0-9a-f]+(?:\.tmp)?$")

# Names in flight in this process (staging, deleting, pointer temp): leftover cleaning skips them.
_active: set[str] = set()
_active_lock = threading.Lock()


def remember(name: str) -> None:
    """`name` is in flight in this process: never a leftover."""
    with _active_lock:
        _active.add(name)


def forget(name: str) -> None:
    with _active_lock:
        _active.discard(name)


def clean_leftovers(entries: Iterable[os.DirEntry], log: Callable[[str, dict], None]) -> None:
    """Remove the staging, deleting and pointer-temp leftovers of killed saves among `entries`
    (the checkpoints folder's); `log` says what was removed or could not be. Never one that is
    in flight in this process, nor one of another live process."""
    for entry in entries:
        match = LEFTOVER.match(entry.name)
        if match is None:
            continue
        kind, pid = match.group(1), int(match.group(2))
        with _active_lock:
            if entry.name in _active:
                continue
        if pid != os.getpid() and psutil.pid_exists(pid):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            continue  # removed meanwhile by another cleaner
        except OSError as exc:
            log(Record.CHECKPOINT_LEFTOVER_FAILED, {"path": entry.path, "error": str(exc)})
            continue
        log(
            Record.CHECKPOINT_LEFTOVER_REMOVED,
            {"path": entry.path, "kind": {"latest": "pointer-temp"}.get(kind, kind)},
        )
