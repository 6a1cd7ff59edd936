"""What the workloads share. They run as `python tests/workloads/X.py` (or forked by
tests/forkserver.py as that script), so this folder is the first entry of `sys.path` and
`from _common import vm_size` finds this module."""

from __future__ import annotations

from pathlib import Path


def vm_size(field: str = "VmSize") -> int:
    """This process's virtual size in bytes (or another size `field` of /proc/self/status, such
    as VmRSS): what RLIMIT_AS is counted against, so a cap is set as this plus the room a test
    gives."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
