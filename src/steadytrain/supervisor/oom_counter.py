"""The OS out-of-memory killer's counter, read by the supervisor before and after each attempt:
a rise says the kernel killed the child (or one of its workers) for memory."""

from __future__ import annotations

import os
from pathlib import Path


def read_oom_kill_count(
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
) -> int | None:
    """How many processes of our cgroup the kernel's OOM killer has killed, or None where no
    counter can be read (macOS, no cgroup, permissions). The child inherits our cgroup, and the
    counter includes descendant cgroups, so a kill of the child or its workers shows here.

    cgroup v2: ``oom_kill`` in ``<root>/<path>/memory.events`` (also under ``<root>/unified``,
    the hybrid layout). cgroup v1: ``oom_kill`` in ``<root>/memory/<path>/memory.oom_control``.
    Where the path from /proc/self/cgroup is not under the mount (a container without a cgroup
    namespace sees its own cgroup as the mount's root), the root is tried too.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    root = Path(cgroup_root)
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":
            for mount in (root, root / "unified"):
                candidates += [mount / relative / "memory.events", mount / "memory.events"]
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            candidates += [mount / relative / "memory.oom_control", mount / "memory.oom_control"]
    for candidate in dict.fromkeys(candidates):  # ordered, without repeats
        count = _oom_kill_field(candidate)
        if count is not None:
            return count
    return None


def _oom_kill_field(path: Path) -> int | None:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None
