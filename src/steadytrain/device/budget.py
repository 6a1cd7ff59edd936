"""How much memory a run may use, per device type.

"Usable" is what this process may reach in total before the real ceiling stops it; the budget is
an explicit byte count when the user gave one, else a fraction (default `DEFAULT_BUDGET_FRACTION`, 0.9) of usable:

* CUDA: device total, times the per-process memory fraction cap when one is set
  (`torch.cuda.set_per_process_memory_fraction`).
* MPS: `recommended_max_memory` (Metal's working-set recommendation, typically 75% of RAM); a
  `PYTORCH_MPS_HIGH_WATERMARK_RATIO` below 1.0 is a hard allocator limit below that, so it wins.
* CPU: resident memory now plus the smallest headroom of: RAM the OS can still hand out, the
  address space RLIMIT_AS leaves, and the cgroup memory limit minus the cgroup's usage. Containers
  and `ulimit -v` are the real ceiling, and available RAM does not show them.
"""

from __future__ import annotations

from steadytrain.device.system import SystemProbe
from steadytrain.errors import BadInputError


def check_budget_spec(spec: int | float) -> int | float:
    """An int is bytes; a float is a fraction of usable memory in (0, 1]."""
    if isinstance(spec, bool) or not isinstance(spec, int | float):
        raise BadInputError(
            f"memory_budget: {spec!r} is neither a byte count nor a fraction; write a size like "
            "'12GiB' or a fraction like 0.8"
        )
    if isinstance(spec, int) and spec <= 0:
        raise BadInputError(
            f"memory_budget: {spec} bytes is not positive; write a size like '12GiB'"
        )
    if isinstance(spec, float) and not 0.0 < spec <= 1.0:
        raise BadInputError(
            f"memory_budget: the fraction {spec} is outside (0, 1]; write a size like '12GiB' for bytes"
        )
    return spec


def budget_bytes(spec: int | float, usable: int | None) -> int | None:
    """An explicit byte count wins; a fraction multiplies usable memory (None when unknown)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec
    return int(usable * spec) if usable is not None else None


def capped(total: int | None, ratio: float | None) -> int | None:
    """`total` times a cap below 1.0 (CUDA memory fraction, MPS high watermark); caps of 1.0 or
    more, or none, leave it whole."""
    if total is None:
        return None
    if ratio is None or ratio <= 0.0 or ratio >= 1.0:
        return total
    return int(total * ratio)


def cpu_headroom(system: SystemProbe) -> int:
    """Bytes this process can still add before the tightest of RAM, RLIMIT_AS and cgroup stops it."""
    room = system.memory_available()
    rlimit = system.rlimit_as()
    if rlimit is not None:
        room = min(room, rlimit - system.process_vms())
    cgroup = system.cgroup_memory()
    if cgroup is not None:
        room = min(room, cgroup.headroom)
    return max(room, 0)


def cpu_usable(system: SystemProbe) -> int:
    return system.process_rss() + cpu_headroom(system)
