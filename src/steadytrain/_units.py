"""Byte sizes as people write them ("12GiB", "512 MB") and as we print them; the default share
of usable memory a run may take (the config, the device layer and doctor all read it here)."""

from __future__ import annotations

import re

DEFAULT_BUDGET_FRACTION = 0.9
"""`memory_budget: auto`: 10% of usable memory stays free for what the estimate cannot see
(allocator fragmentation, the CUDA context, other processes sharing unified memory)."""

_UNITS = {
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'12GiB' -> 12884901888. Decimal units (GB) are powers of 1000, binary (GiB) of 1024. A
    number without a unit ('16') is refused: it was meant as gigabytes, not as 16 bytes."""
    match = _SIZE.match(text)
    if match is not None and not match.group(2):
        n = match.group(1)
        raise ValueError(
            f"{text!r} has no unit; write it with one, like '{n}GiB' (GiB is 1024³ bytes) or "
            f"'{n}GB' (1000³); bytes are '{n}B'"
        )
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like '12GiB', '16GB' or '512MiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | float | None) -> str:
    """1536 MiB -> '1.50 GiB'; None -> 'n/a'."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_count(n: int | float) -> str:
    """A count in natural units: 436352 -> '436k', 1234567 -> '1.23M', 3.21e9 -> '3.21B'."""
    n = float(n)
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= 0.9995 * scale:  # 999,999 is 1M, not 1000k
            value = n / scale
            return f"{value:.3g}{unit}" if abs(value) < 99.95 else f"{value:.0f}{unit}"
    return f"{n:.0f}"
